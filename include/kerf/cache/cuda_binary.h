// A CUDA kernel's binary, from the cache tiers or compiled: what the launcher
// loads on an in-memory miss, and what `kerf-cache warm` builds for machines it
// cannot see. Needs no GPU: only NVRTC, and not even that when a bundle or the
// disk tier holds the kernel.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "kerf/cache/key.h"
#include "kerf/jit/ir.h"
#include "kerf/jit/launch.h"
#include "kerf/jit/nvrtc.h"

namespace kerf::cache {

struct CudaBinary {
  std::vector<char> image;  // cubin, or PTX for compute_XX targets
  bool is_cubin = true;
  std::string entry;   // the extern "C" kernel symbol
  int threads = 0;     // per CTA
  int smem_bytes = 0;  // dynamic shared memory per CTA
  KernelSource source = KernelSource::compiled;
  CacheKey key;
};

// The compiler the cache calls on a miss (nvrtc::compile unless a test gives another).
using CudaCompiler = std::function<nvrtc::Output(const std::string& source, const std::string& name,
                                                 const std::string& arch)>;

// `fn` for `arch`: code generation, then the first of a mounted bundle, the disk
// tier, `compile` (a fresh binary is stored). A failed compile throws and stores
// nothing. Without NVRTC, an entry built by another NVRTC version is accepted,
// and a kernel found nowhere throws NotAvailable saying so.
CudaBinary cuda_binary(const ir::Function& fn, const std::string& arch, std::string_view layout,
                       const CudaCompiler& compile = {});

// The target part of CUDA keys: backend "cuda", `arch`, and this NVRTC's version.
Target cuda_target(const std::string& arch);

}  // namespace kerf::cache
