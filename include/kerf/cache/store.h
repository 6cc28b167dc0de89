// The process's cache tiers below memory: the mounted bundles (read-only) and
// the disk tier, behind one lock. Settings come from the environment the
// first time anything here is used (settings.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kerf/cache/entry.h"
#include "kerf/cache/settings.h"

namespace kerf::cache {

enum class Tier : uint8_t { bundle, disk };

struct Found {
  Entry entry;
  Tier tier = Tier::disk;
  std::string where;  // the bundle's path or the disk tier's directory
};

// Bundles first (in mount order), then the disk tier. With `any_compiler`, an
// entry built by another compiler version answers too (used when the compiler
// that the key names is not on this machine).
std::optional<Found> lookup(const CacheKey& key, bool any_compiler = false);
// Writes to the disk tier when it is on and writable; false otherwise.
bool remember(const CacheKey& key, const Entry& entry);

// Mounts a bundle for this process (after those of KERF_CACHE_BUNDLES). Throws
// CacheError when the file is not a readable bundle.
void mount_bundle(const std::string& path);
void unmount_bundles();
std::vector<std::string> mounted_bundles();

Settings current_settings();
// The autotune mode of current_settings(), without copying them (read on every op call).
AutotuneMode autotune_mode();
// Reads the environment again and starts over: new disk tier, bundles of
// KERF_CACHE_BUNDLES only, counters kept. For tests and tools.
void reload_settings();
// Changes with every reload_settings(): what was derived from the settings is stale.
uint64_t settings_generation();

// What the tiers did in this process, for tests, tools and logs.
struct Stats {
  uint64_t bundle_hits = 0;
  uint64_t disk_hits = 0;
  uint64_t misses = 0;
  uint64_t compiles = 0;          // back-end compilations (NVRTC or LLVM) that succeeded
  uint64_t compile_failures = 0;  // ... that failed (never stored)
  uint64_t stores = 0;            // entries written to disk
  uint64_t store_failures = 0;    // entries the disk tier (on) could not write
  uint64_t bad_entries = 0;       // damaged or foreign disk-tier entries ignored (a bundle's are
                                  // checked when it is mounted and reported when met)
};
Stats stats();
void reset_stats();
void count_compile(bool succeeded);

// Runs a back-end compile and counts it; a failure is counted and passed on (and,
// since nothing follows, never stored).
template <class Compile>
auto counted_compile(Compile&& compile) -> decltype(compile()) {
  try {
    auto result = compile();
    count_compile(true);
    return result;
  } catch (...) {
    count_compile(false);
    throw;
  }
}

}  // namespace kerf::cache
