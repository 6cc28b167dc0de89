// KERF_LOG: leveled messages on stderr, each topic reported once when asked.
#include "kerf/cache/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

#include "common/env_switch.h"
#include "common/never_destroyed.h"

namespace kerf::log {
namespace {

constexpr int kUnread = -1;

// `known` is false for a value that is not a level name (it reads as warn).
Level parse(const char* text, bool* known) {
  *known = true;
  if (!text || !*text) return Level::warn;
  const std::string v = kerf::detail::switch_word(text);  // any case, blanks around dropped
  if (v.empty()) return Level::warn;
  if (kerf::detail::is_off_word(v) || v == "none") return Level::off;
  if (v == "info") return Level::info;
  if (v == "debug") return Level::debug;
  *known = v == "warn" || v == "warning";
  return Level::warn;  // "warn", and anything unknown: never hide warnings by mistake
}

// One registry with a lock: the sink and the topics already reported.
struct Registry {
  std::atomic<int> level{kUnread};
  std::mutex mu;
  std::function<void(Level, const std::string&)> sink;
  std::set<std::string> reported;
};

Registry& registry() {
  // Never destroyed: messages written during static destruction still find it.
  static kerf::detail::NeverDestroyed<Registry> r;
  return r.value;
}

const char* tag(Level l) {
  switch (l) {
    case Level::warn:
      return "warning";
    case Level::info:
      return "info";
    case Level::debug:
      return "debug";
    case Level::off:
      break;
  }
  return "";
}

}  // namespace

Level level() {
  Registry& r = registry();
  int v = r.level.load(std::memory_order_relaxed);
  if (v == kUnread) {
    bool known = true;
    const char* text = std::getenv("KERF_LOG");
    v = int(parse(text, &known));
    r.level.store(v, std::memory_order_relaxed);
    // As KERF_CACHE and KERF_AUTOTUNE report a value they do not know.
    if (!known)
      once(Level::warn, "settings:KERF_LOG",
           std::string("KERF_LOG='") + text + "' is not one of off, warn, info, debug; using warn");
  }
  return Level(v);
}

void write(Level l, const std::string& message) {
  if (!enabled(l)) return;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.sink) {
    r.sink(l, message);
    return;
  }
  std::fprintf(stderr, "kerf %s: %s\n", tag(l), message.c_str());
}

void once(Level l, const std::string& topic, const std::string& message) {
  if (!enabled(l)) return;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    if (!r.reported.insert(topic).second) return;
  }
  write(l, message);
}

void set_sink(std::function<void(Level, const std::string&)> sink) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.sink = std::move(sink);
}

void reload() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.level.store(kUnread, std::memory_order_relaxed);
  r.reported.clear();
}

}  // namespace kerf::log
