// A CPU back-end kernel from the cache tiers or compiled: LLVM's object code is
// stored like a cubin, keyed by the LLVM version and the host CPU and features.
#pragma once

#include <memory>
#include <string_view>

#include "kerf/cache/key.h"
#include "kerf/jit/cpu_backend.h"
#include "kerf/jit/launch.h"

namespace kerf::cache {

struct CpuLoaded {
  std::unique_ptr<jit::cpu::CpuKernel> kernel;
  KernelSource source = KernelSource::compiled;
  CacheKey key;
};

// Loads `fn` from a bundle or the disk tier, or compiles (and stores) it.
// Without LLVM this throws NotAvailable, as jit::cpu::compile does.
CpuLoaded cpu_kernel(const ir::Function& fn, std::string_view layout);

// The target part of CPU keys: backend "cpu", the host CPU, LLVM's version, the CPU features.
Target cpu_target();

}  // namespace kerf::cache
