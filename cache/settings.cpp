// The cache's settings, from the environment (see settings.h).
#include "kerf/cache/settings.h"

#include <cstdlib>
#include <sstream>

#include "kerf/cache/log.h"

namespace kerf::cache {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::string default_dir() {
  if (const std::string xdg = env("XDG_CACHE_HOME"); !xdg.empty()) return xdg + "/kerf";
  if (const std::string home = env("HOME"); !home.empty()) return home + "/.cache/kerf";
  // No home (a service account): a per-user directory under /tmp is better than nothing.
  return "/tmp/kerf-cache-" + env("USER");
}

}  // namespace

const char* disk_mode_name(DiskMode m) {
  switch (m) {
    case DiskMode::off:
      return "off";
    case DiskMode::readonly:
      return "readonly";
    case DiskMode::on:
      return "on";
  }
  return "?";
}

Settings settings_from_env() {
  Settings s;
  const std::string mode = env("KERF_CACHE");
  if (mode.empty() || mode == "on" || mode == "1") {
    s.disk = DiskMode::on;
  } else if (mode == "readonly" || mode == "ro") {
    s.disk = DiskMode::readonly;
  } else if (mode == "off" || mode == "0") {
    s.disk = DiskMode::off;
  } else {
    log::once(log::Level::warn, "settings:KERF_CACHE",
              "KERF_CACHE='" + mode + "' is not one of on, readonly, off; using on");
  }
  s.dir = env("KERF_CACHE_DIR");
  if (s.dir.empty()) s.dir = default_dir();

  std::istringstream bundles(env("KERF_CACHE_BUNDLES"));
  for (std::string path; std::getline(bundles, path, ':');)
    if (!path.empty()) s.bundles.push_back(path);

  const std::string tune = env("KERF_AUTOTUNE");
  if (tune.empty()) {
    s.autotune = AutotuneMode::gpu_only;
  } else if (tune == "0" || tune == "off") {
    s.autotune = AutotuneMode::off;
  } else if (tune == "1" || tune == "on") {
    s.autotune = AutotuneMode::on;
  } else if (tune == "force") {
    s.autotune = AutotuneMode::force;
  } else {
    log::once(log::Level::warn, "settings:KERF_AUTOTUNE",
              "KERF_AUTOTUNE='" + tune + "' is not one of 0, 1, force; tuning on GPUs only");
  }
  return s;
}

}  // namespace kerf::cache
