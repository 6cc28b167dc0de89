// The CUDA back end's code generator: kerf IR -> readable CUDA C++ with one
// extern "C" __global__ entry, over kerf's embedded device library.
#pragma once

#include <string>

#include "kerf/jit/ir.h"

namespace kerf::jit::cuda {

struct KernelCode {
  std::string source;  // complete CUDA C++ translation unit for NVRTC
  std::string entry;   // the extern "C" kernel symbol
  int threads = 0;     // threads per CTA (32 * num_warps)
  int smem_bytes = 0;  // dynamic shared memory per CTA
  int num_slots = 0;   // 8-byte argument slots (abi.h)
};

// Whether `arch` names a GPU target: sm_ and a compute capability's digits (at least
// two), optionally followed by a or f (sm_80, sm_90a, sm_100f).
bool is_gpu_arch(const std::string& arch);

// The compute capability's digits of a target as one number ("sm_90a" -> 90, "sm_100f" -> 100).
int arch_number(const std::string& arch);

// `arch` is the NVRTC target ("sm_90a", "sm_80", ...); it selects instructions. Anything
// else is an InvalidArgument.
KernelCode generate(const ir::Function& f, const std::string& arch);

}  // namespace kerf::jit::cuda
