// How the kernel cache behaves, from the environment:
//   KERF_CACHE=on|readonly|off   the on-disk tier (default on; bundles are used in every mode)
//   KERF_CACHE_DIR=path          default ${XDG_CACHE_HOME:-~/.cache}/kerf
//   KERF_CACHE_BUNDLES=a:b       bundles mounted when the cache first starts
//   KERF_AUTOTUNE=0|1|force      0: each op's default config; 1: tune on every back end;
//                                force: tune again even when a choice is stored;
//                                unset: tune on GPUs, defaults on the CPU back end
#pragma once

#include <string>
#include <vector>

namespace kerf::cache {

enum class DiskMode { off, readonly, on };
enum class AutotuneMode { gpu_only, off, on, force };

struct Settings {
  DiskMode disk = DiskMode::on;
  std::string dir;                   // the disk tier's root
  std::string dir_refused;           // why `dir` is not used (disk off), "" when it is fine
  std::vector<std::string> bundles;  // from KERF_CACHE_BUNDLES
  AutotuneMode autotune = AutotuneMode::gpu_only;
};

// Reads the variables above now. Unknown values are reported (KERF_LOG=warn)
// and replaced by the default.
Settings settings_from_env();

const char* disk_mode_name(DiskMode m);

}  // namespace kerf::cache
