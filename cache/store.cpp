// The process's bundle and disk tiers (see store.h): one registry, one lock.
#include "kerf/cache/store.h"

#include <atomic>
#include <memory>
#include <mutex>

#include "common/never_destroyed.h"
#include "kerf/cache/bundle.h"
#include "kerf/cache/disk_cache.h"
#include "kerf/cache/log.h"
#include "kerf/error.h"

namespace kerf::cache {
namespace {

// One configuration of the tiers. Lookups work on a snapshot (shared_ptr), so a
// reload never pulls a bundle or directory from under a reader.
struct Tiers {
  Settings settings;
  std::shared_ptr<DiskCache> disk;
  std::vector<std::shared_ptr<const Bundle>> bundles;
};

struct Counters {
  std::atomic<uint64_t> bundle_hits{0}, disk_hits{0}, misses{0}, compiles{0}, compile_failures{0},
      stores{0}, store_failures{0}, bad_base{0};
};

class Registry {
 public:
  std::shared_ptr<const Tiers> tiers() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!tiers_) install(from_env());
    return tiers_;
  }

  AutotuneMode autotune_mode() {
    const int mode = autotune_mode_.load(std::memory_order_acquire);
    return mode >= 0 ? AutotuneMode(mode) : tiers()->settings.autotune;
  }

  void reload() {
    std::shared_ptr<const Tiers> fresh = from_env();
    std::lock_guard<std::mutex> lock(mu_);
    if (tiers_) counters.bad_base += tiers_->disk->bad_entries();
    install(std::move(fresh));
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }

  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

  void mount(std::shared_ptr<const Bundle> b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!tiers_) install(from_env());
    auto next = std::make_shared<Tiers>(*tiers_);
    next->bundles.push_back(std::move(b));
    tiers_ = std::move(next);
  }

  void unmount_all() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!tiers_) return;
    auto next = std::make_shared<Tiers>(*tiers_);
    next->bundles.clear();
    tiers_ = std::move(next);
  }

  Counters counters;

 private:
  static std::shared_ptr<const Tiers> from_env() {
    auto t = std::make_shared<Tiers>();
    t->settings = settings_from_env();
    t->disk = std::make_shared<DiskCache>(t->settings.dir, t->settings.disk);
    for (const std::string& path : t->settings.bundles) {
      try {
        t->bundles.push_back(std::make_shared<const Bundle>(path));
      } catch (const CacheError& e) {
        // A launch must not fail because a listed bundle is missing: say so and go on.
        log::once(log::Level::warn, "bundle:" + path,
                  std::string(e.what()) + " (from KERF_CACHE_BUNDLES)");
      }
    }
    log::write(log::Level::debug, std::string("kernel cache: disk tier ") +
                                      disk_mode_name(t->settings.disk) + " at " + t->settings.dir +
                                      ", " + std::to_string(t->bundles.size()) +
                                      " bundle(s) mounted");
    return t;
  }

  // With mu_ held.
  void install(std::shared_ptr<const Tiers> t) {
    autotune_mode_.store(int(t->settings.autotune), std::memory_order_release);
    tiers_ = std::move(t);
  }

  std::mutex mu_;
  std::shared_ptr<const Tiers> tiers_;
  std::atomic<int> autotune_mode_{-1};  // -1 until the settings are read
  std::atomic<uint64_t> generation_{0};
};

Registry& registry() {
  static kerf::detail::NeverDestroyed<Registry> r;
  return r.value;
}

}  // namespace

std::optional<Found> lookup(const CacheKey& key, bool any_compiler) {
  Registry& reg = registry();
  const std::shared_ptr<const Tiers> t = reg.tiers();
  for (const auto& b : t->bundles) {
    if (std::optional<Entry> e = b->find(key, any_compiler)) {
      ++reg.counters.bundle_hits;
      return Found{std::move(*e), Tier::bundle, b->path()};
    }
  }
  if (std::optional<Entry> e = t->disk->find(key, any_compiler)) {
    ++reg.counters.disk_hits;
    return Found{std::move(*e), Tier::disk, t->settings.dir};
  }
  ++reg.counters.misses;
  return std::nullopt;
}

bool remember(const CacheKey& key, const Entry& entry) {
  Registry& reg = registry();
  const std::shared_ptr<const Tiers> t = reg.tiers();
  const bool stored = t->disk->store(key, entry);
  if (stored)
    ++reg.counters.stores;
  else if (t->disk->mode() == DiskMode::on)
    ++reg.counters.store_failures;
  return stored;
}

void mount_bundle(const std::string& path) {
  auto b = std::make_shared<const Bundle>(path);
  log::write(log::Level::info, "mounted kernel bundle " + path + " (" +
                                   std::to_string(b->records().size()) + " entries)");
  registry().mount(std::move(b));
}

void unmount_bundles() {
  registry().unmount_all();
}

std::vector<std::string> mounted_bundles() {
  std::vector<std::string> paths;
  for (const auto& b : registry().tiers()->bundles) paths.push_back(b->path());
  return paths;
}

Settings current_settings() {
  return registry().tiers()->settings;
}

AutotuneMode autotune_mode() {
  return registry().autotune_mode();
}

void reload_settings() {
  registry().reload();
}

uint64_t settings_generation() {
  return registry().generation();
}

Stats stats() {
  Registry& reg = registry();
  Stats s;
  s.bundle_hits = reg.counters.bundle_hits;
  s.disk_hits = reg.counters.disk_hits;
  s.misses = reg.counters.misses;
  s.compiles = reg.counters.compiles;
  s.compile_failures = reg.counters.compile_failures;
  s.stores = reg.counters.stores;
  s.store_failures = reg.counters.store_failures;
  s.bad_entries = reg.counters.bad_base + reg.tiers()->disk->bad_entries();
  return s;
}

void reset_stats() {
  Registry& reg = registry();
  Counters& c = reg.counters;
  c.bundle_hits = c.disk_hits = c.misses = c.compiles = c.compile_failures = c.stores = c.store_failures = 0;
  c.bad_base =
      0 - reg.tiers()->disk->bad_entries();  // so that stats() starts from 0 (unsigned wrap)
}

void count_compile(bool succeeded) {
  Counters& c = registry().counters;
  ++(succeeded ? c.compiles : c.compile_failures);
}

}  // namespace kerf::cache
