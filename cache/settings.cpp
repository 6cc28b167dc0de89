// The cache's settings, from the environment (see settings.h).
#include "kerf/cache/settings.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <sstream>

#include "common/env_switch.h"
#include "kerf/cache/log.h"

namespace kerf::cache {
namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// The directory when KERF_CACHE_DIR is not set; `shared_tmp`: it is the fallback under
// /tmp, which other users can reach.
using detail::is_off_word;
using detail::is_on_word;
using detail::switch_word;

std::string default_dir(bool* shared_tmp) {
  *shared_tmp = false;
  if (const std::string xdg = env("XDG_CACHE_HOME"); !xdg.empty()) return xdg + "/kerf";
  if (const std::string home = env("HOME"); !home.empty()) return home + "/.cache/kerf";
  // No home (a service account): a per-user directory under /tmp is better than nothing.
  *shared_tmp = true;
  return "/tmp/kerf-cache-" + std::to_string(::getuid());
}

// Whether the /tmp fallback `dir` is this user's alone: made here with mode 0700, or
// found owned by this user and writable by no one else. A directory another user
// made first could hold entries kerf would load (CPU entries are machine code), so
// anything else is not used.
bool private_tmp_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return true;  // the disk tier reports it
  struct stat st {};
  return ::lstat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == ::getuid() &&
         (st.st_mode & 022) == 0;
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
  const std::string cache_word = switch_word(mode);
  if (cache_word.empty() || is_on_word(cache_word)) {
    s.disk = DiskMode::on;
  } else if (cache_word == "readonly" || cache_word == "ro") {
    s.disk = DiskMode::readonly;
  } else if (is_off_word(cache_word)) {
    s.disk = DiskMode::off;
  } else {
    log::once(log::Level::warn, "settings:KERF_CACHE",
              "KERF_CACHE='" + mode + "' is not one of on (1), readonly (ro), off (0); using on");
  }
  s.dir = env("KERF_CACHE_DIR");
  if (s.dir.empty()) {
    bool shared_tmp = false;
    s.dir = default_dir(&shared_tmp);
    if (shared_tmp && s.disk != DiskMode::off && !private_tmp_dir(s.dir)) {
      s.dir_refused = "the kernel cache's fallback directory " + s.dir +
                      " is not this user's alone (another owner, or writable by others)";
      log::once(log::Level::warn, "settings:tmp-dir:" + s.dir,
                s.dir_refused + ": the disk cache is off; set KERF_CACHE_DIR or HOME");
      s.disk = DiskMode::off;
    }
  }

  std::istringstream bundles(env("KERF_CACHE_BUNDLES"));
  for (std::string path; std::getline(bundles, path, ':');)
    if (!path.empty()) s.bundles.push_back(path);

  const std::string tune = env("KERF_AUTOTUNE");
  const std::string tune_word = switch_word(tune);
  if (tune_word.empty()) {
    s.autotune = AutotuneMode::gpu_only;
  } else if (is_off_word(tune_word)) {
    s.autotune = AutotuneMode::off;
  } else if (is_on_word(tune_word)) {
    s.autotune = AutotuneMode::on;
  } else if (tune_word == "force") {
    s.autotune = AutotuneMode::force;
  } else {
    log::once(log::Level::warn, "settings:KERF_AUTOTUNE",
              "KERF_AUTOTUNE='" + tune + "' is not one of 0 (off), 1 (on), force; tuning on GPUs only (the default)");
  }
  return s;
}

}  // namespace kerf::cache
