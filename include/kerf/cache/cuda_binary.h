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
#include "kerf/jit/cuda_codegen.h"
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

// The compiler the cache calls on a miss (nvrtc::compile unless a test gives another),
// with compile_kernel's extra NVRTC options.
using CudaCompiler = std::function<nvrtc::Output(const std::string& source, const std::string& name,
                                                 const std::string& arch,
                                                 const std::vector<std::string>& options)>;

// A kernel's compile: the image, what ptxas said of it, and the retry's choice.
struct CompiledKernel {
  nvrtc::Output out;
  nvrtc::PtxasUsage usage;   // of `out` (-1s for PTX targets)
  int min_programs = 0;      // the KERF_MIN_PROGRAMS `out` was compiled with; 0: none
  nvrtc::PtxasUsage first;   // the first compile's, where it was retried (else == usage)
};

// Programs of `threads` threads and `smem_bytes` of dynamic shared memory that one
// multiprocessor of `arch`'s usual part holds at most, by shared memory and threads
// alone (0: the shared memory does not fit).
int programs_per_multiprocessor(int threads, int smem_bytes, const std::string& arch);

// Compiles generated `code` for `arch` (through `compile`, nvrtc::compile by default).
// A kernel that ptxas made spill registers while leaving room for more programs a
// multiprocessor than its shared memory lets run is compiled once more with
// KERF_MIN_PROGRAMS set to that number (launch bounds whose registers cost no
// occupancy), and the second image is kept where it spills fewer bytes. PTX
// targets are compiled once.
CompiledKernel compile_kernel(const jit::cuda::KernelCode& code, const std::string& arch,
                              const CudaCompiler& compile = {});

// `fn` for `arch`: code generation, then the first of a mounted bundle, the disk
// tier, `compile` (a fresh binary is stored). A failed compile throws and stores
// nothing. Without NVRTC, an entry built by another NVRTC version is accepted,
// and a kernel found nowhere throws NotAvailable saying so.
CudaBinary cuda_binary(const ir::Function& fn, const std::string& arch, std::string_view layout,
                       const CudaCompiler& compile = {});

// The target part of CUDA keys: backend "cuda", `arch`, and this NVRTC's version.
Target cuda_target(const std::string& arch);

}  // namespace kerf::cache
