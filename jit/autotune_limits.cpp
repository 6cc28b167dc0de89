// What pruning rules compare candidates against: the shared memory a kernel
// needs (from the code generator, without compiling) and what a device allows.
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "kerf/jit/autotune.h"
#include "kerf/jit/cuda_codegen.h"
#include "kerf/jit/launch.h"
#include "kerf/runtime/cuda.h"

namespace kerf::autotune {

using jit::cuda::arch_number;

int shared_memory_bytes(const dsl::Kernel& kernel, const std::vector<Arg>& args, const Config& meta,
                        const std::string& arch) {
  // The trace sees only the arguments' kinds, dtypes, ranks and facts (never sizes) and
  // the meta: one code generation per distinct set, remembered for the process (the
  // untuned and pruning checks ask again for every call shape).
  const std::vector<dsl::ArgSpec> specs = arg_specs(args);
  std::string key = kernel.name() + "@" + std::to_string(reinterpret_cast<uintptr_t>(&kernel)) + "|" + arch + "|";
  for (const auto& [name, value] : meta) key += name + "=" + std::to_string(value) + ",";
  for (const dsl::ArgSpec& a : specs) {
    const ir::TensorFacts& f = a.facts;
    key += "|" + std::to_string(int(a.kind)) + ":" + std::to_string(int(a.dtype)) + ":" + std::to_string(a.rank) +
           ":" + std::to_string(f.contiguous_last) + std::to_string(f.aligned16) + ":" +
           std::to_string(f.dims_div16) + ":" + std::to_string(f.strides_div16) + ":" + std::to_string(f.dims_div8) +
           ":" + std::to_string(f.strides_div8);
  }
  static std::mutex mu;
  static std::map<std::string, int> known;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = known.find(key);
    if (it != known.end()) return it->second;
  }
  const int bytes = jit::cuda::generate(kernel.trace(specs, meta), arch).smem_bytes;
  std::lock_guard<std::mutex> lock(mu);
  known.emplace(std::move(key), bytes);
  return bytes;
}

int max_shared_memory(int device) {
  static std::mutex mu;
  static std::map<int, int> limits;
  std::lock_guard<std::mutex> lock(mu);
  auto it = limits.find(device);
  if (it != limits.end()) return it->second;
  return limits[device] = cuda::device_info(device).max_smem_per_block_optin;
}

// The figures of each generation's data-center part (A100, H100, B200); the
// consumer parts of sm_86/89/120 have less shared memory.
int typical_max_shared_memory(const std::string& arch) {
  const int n = arch_number(arch);
  if (n == 80 || n == 87) return 163 * 1024;
  if (n == 90 || n == 100 || n == 103) return 227 * 1024;
  return 99 * 1024;  // sm_75 (64 KiB is less, but kerf's NVRTC starts there), 86, 89, 120
}

int typical_max_threads_per_multiprocessor(const std::string& arch) {
  const int n = arch_number(arch);
  if (n < 80) return 1024;
  if (n == 86 || n == 89 || n >= 120) return 1536;
  return 2048;
}

int typical_sm_count(const std::string& arch) {
  const int n = arch_number(arch);
  if (n == 80) return 108;
  if (n == 90) return 132;
  if (n == 100 || n == 103) return 148;
  if (n == 86 || n == 89) return 84;
  return 128;
}

}  // namespace kerf::autotune
