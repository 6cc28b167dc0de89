// Calling a DSL kernel: the JIT's one entry point.
//
// The first call for a specialization (meta-parameters, argument dtypes,
// ranks, alignment and contiguity facts, device) traces the kernel, generates
// code for the device the tensors live on (CUDA C++ -> NVRTC -> cubin for a
// GPU, LLVM -> native code for the CPU) and loads it; later calls find it in
// an in-process map and go straight to the launch.
#pragma once

#include <string>
#include <vector>

#include "kerf/dsl/dsl.h"
#include "kerf/runtime/tensor.h"

namespace kerf {

struct LaunchInfo {
  bool compiled = false;     // this call generated and compiled the kernel
  double compile_ms = 0.0;   // trace + code generation + compilation + load, when compiled
  std::string backend;       // "cpu" or the CUDA architecture, e.g. "sm_90a"
};

// Runs `kernel` over `grid` with `args` (tensors and scalars in the order the
// kernel declares them). All tensors must live on one device; CPU tensors run
// on the CPU back end. `stream` is a CUstream (nullptr: the default stream);
// GPU launches are asynchronous, CPU launches return when done.
LaunchInfo launch(const dsl::Kernel& kernel, const std::vector<Arg>& args, Grid grid,
                  const dsl::MetaMap& meta = {}, void* stream = nullptr);

// The specialization facts kerf derives from arguments (dtype, rank, contiguity, alignment).
std::vector<dsl::ArgSpec> arg_specs(const std::vector<Arg>& args);

// The generated CUDA C++ for a call, without compiling or running it.
std::string cuda_source(const dsl::Kernel& kernel, const std::vector<Arg>& args,
                        const dsl::MetaMap& meta, const std::string& arch);

// Drops every compiled kernel of this process (tests, benchmarks of cold starts).
void clear_kernel_cache();

}  // namespace kerf
