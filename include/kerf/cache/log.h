// kerf's diagnostics on stderr, by level: KERF_LOG=off|warn|info|debug
// (default warn). The cache says here when it ignores a damaged entry or cannot
// write, and the autotuner which configuration it chose.
#pragma once

#include <functional>
#include <string>

namespace kerf::log {

enum class Level : int { off = 0, warn = 1, info = 2, debug = 3 };

// The level KERF_LOG asks for; read once per process (reload() reads it again).
Level level();
inline bool enabled(Level l) {
  return l != Level::off && int(l) <= int(level());
}

void write(Level l, const std::string& message);
// Writes `message` only the first time this process sees `topic` (one line per
// damaged file, one for an unwritable cache directory, ...).
void once(Level l, const std::string& topic, const std::string& message);

// Tests: route messages to `sink` instead of stderr (an empty function restores
// stderr), and forget KERF_LOG and the topics already reported.
void set_sink(std::function<void(Level, const std::string&)> sink);
void reload();

}  // namespace kerf::log
