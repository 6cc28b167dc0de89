// Calling a DSL kernel: the JIT's one entry point.
//
// The first call for a specialization (meta-parameters, argument dtypes,
// ranks, alignment and contiguity facts, device) traces the kernel, generates
// code for the device the tensors live on (CUDA C++ -> NVRTC -> cubin for a
// GPU, LLVM -> native code for the CPU) and loads it; later calls find it in
// an in-process map and go straight to the launch. Between the two, the kernel
// cache (include/kerf/cache/) is asked first: mounted bundles, then the disk
// tier; a kernel compiled here is stored there for later processes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kerf/dsl/dsl.h"
#include "kerf/runtime/tensor.h"

namespace kerf {

// Where a call found its kernel.
enum class KernelSource : uint8_t {
  memory,    // already loaded in this process (the hot path)
  bundle,    // a mounted bundle
  disk,      // the on-disk cache, from an earlier process
  compiled,  // compiled by this call (NVRTC or LLVM), then stored
};
const char* kernel_source_name(KernelSource s);  // "memory", "bundle", "disk", "compiled"

struct LaunchInfo {
  bool compiled = false;     // this call generated and compiled the kernel
  double compile_ms = 0.0;   // when the kernel was not in memory: trace, code generation,
                             // cache lookup, compilation (if any) and load
  std::string backend;       // "cpu" or the CUDA architecture, e.g. "sm_90a"
  KernelSource source = KernelSource::memory;
};

// The kernels one caller's launches resolved to, by the arguments' specialization
// facts, device and layout, for a caller that launches one kernel with one meta
// map over and over: an op's plan keeps one next to its meta map. A launch given
// the memo (LaunchOptions::memo) finds its kernel there without the kernel
// cache's lookup (hashing the meta map, a process-wide lock). The memo finds a
// kernel for the same meta map object holding the same contents as when it was
// remembered (a temporary map at a reused address, or a changed one, misses). It holds
// a few kernels, forgets them when clear_kernel_cache() runs, and is
// thread-safe. Copies start empty.
class LaunchMemo {
 public:
  LaunchMemo();
  ~LaunchMemo();
  LaunchMemo(const LaunchMemo&);
  LaunchMemo& operator=(const LaunchMemo&);

  struct Impl;
  Impl& impl() const { return *impl_; }

 private:
  Impl* impl_;
};

struct CompiledKernel;  // a loaded specialization (jit/launcher.cpp)

// The kernel one launch resolved to, kept by a caller that knows its later
// launches share that launch's kernel, meta-parameters, layout, device and
// specialization facts (dtypes, ranks, 16-byte alignment, which sizes and
// strides are multiples of 8 and 16, unit last strides): an op that compares
// each call's shapes, strides, dtypes, devices and the low four bits of its
// pointers with those of the call that resolved it. launch() given it skips the
// kernel lookup. It lapses when clear_kernel_cache() runs; launching a lapsed
// one throws.
class ResolvedKernel {
 public:
  ResolvedKernel();
  ~ResolvedKernel();
  ResolvedKernel(const ResolvedKernel&);
  ResolvedKernel& operator=(const ResolvedKernel&);
  // Set, and clear_kernel_cache() has not run since.
  bool usable() const;
  void reset();

 private:
  friend struct ResolvedAccess;
  std::shared_ptr<const CompiledKernel> compiled_;
  uint64_t epoch_ = 0;
};

// Optional parts of a launch.
struct LaunchOptions {
  void* stream = nullptr;  // a CUstream (nullptr: the default stream)
  // Canonical text of the sharding layout the calling op uses ("" when unsharded).
  // It is part of the kernel's cache key; it must outlive the call.
  std::string_view layout;
  // Programmatic dependent launch: the grid may start before the kernel launched
  // just before it on `stream` ends, and until the kernel's dsl::wait_prior_grid()
  // it runs alongside that kernel's last programs. Taken on sm_90 and later, for
  // kernels that call wait_prior_grid(); elsewhere (and with the environment's
  // KERF_OVERLAP_LAUNCHES=0) the launch waits for the previous kernel as usual.
  bool overlap_prior = false;
  // Where to remember the kernel this launch resolves to (see LaunchMemo); null: none.
  LaunchMemo* memo = nullptr;
  // Where to put the kernel this launch resolves to, for launches of it later
  // (see ResolvedKernel); null: nowhere. Left as it was when the grid is empty.
  ResolvedKernel* resolved = nullptr;
};

// Runs `kernel` over `grid` with `args` (tensors and scalars in the order the
// kernel declares them). All tensors must live on one device; CPU tensors run
// on the CPU back end. `stream` is a CUstream (nullptr: the default stream);
// GPU launches are asynchronous, CPU launches return when done.
LaunchInfo launch(const dsl::Kernel& kernel, const std::vector<Arg>& args, Grid grid,
                  const dsl::MetaMap& meta = {}, void* stream = nullptr);
LaunchInfo launch(const dsl::Kernel& kernel, const std::vector<Arg>& args, Grid grid,
                  const dsl::MetaMap& meta, const LaunchOptions& options);

// Runs the kernel `kernel` holds (see ResolvedKernel) over `grid` with `args`,
// which must match its specialization; options.layout, memo and resolved are
// not read. Its checks: the argument count and kinds, each tensor's dtype, rank and
// device, its data pointer, and that it has every fact the kernel was resolved for
// (16-byte alignment, a stride-1 last dimension, sizes and strides divisible by 16 or 8;
// having more is fine), and the grid.
LaunchInfo launch(const ResolvedKernel& kernel, const std::vector<Arg>& args, Grid grid,
                  const LaunchOptions& options);

// Makes the kernel for such a call ready (from memory, a bundle, the disk tier, or
// compiled) without running it: the autotuner compiles candidates with it.
LaunchInfo prepare(const dsl::Kernel& kernel, const std::vector<Arg>& args,
                   const dsl::MetaMap& meta = {}, const LaunchOptions& options = {});

// The specialization facts kerf derives from arguments (dtype, rank, contiguity, alignment).
std::vector<dsl::ArgSpec> arg_specs(const std::vector<Arg>& args);

// The generated CUDA C++ for a call, without compiling or running it.
std::string cuda_source(const dsl::Kernel& kernel, const std::vector<Arg>& args,
                        const dsl::MetaMap& meta, const std::string& arch);

// The architecture kerf compiles for on CUDA device `device` ("sm_90a"); asked once per device.
std::string device_arch(int device);

// Drops every compiled kernel of this process (tests, benchmarks of cold starts).
void clear_kernel_cache();

}  // namespace kerf
