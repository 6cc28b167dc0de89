// Running DSL kernels on the CPU back end from tests: trace -> compile -> pack
// the arguments -> run the grid. (The official launcher in jit/ may replace
// `run_on_cpu` later; this stays small on purpose.)
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include "kerf/dsl/dsl.h"
#include "kerf/jit/abi.h"
#include "kerf/jit/cpu_backend.h"
#include "kerf/jit/launch.h"
#include "kerf/runtime/tensor.h"

// Ends the current test early, with a line saying why, when there is no CPU back end.
#define KERF_REQUIRE_CPU_BACKEND()                                     \
  do {                                                                 \
    if (!kerf::jit::cpu::available()) {                                \
      std::printf("KERF-SKIPPED: CPU back end not built (no LLVM)\n"); \
      return;                                                          \
    }                                                                  \
  } while (0)

namespace kerf::testing {

// The facts the specialization records for a tensor argument (the launcher's own).
inline ir::TensorFacts facts_of(const TensorView& t) {
  return kerf::arg_specs({Arg(t)})[0].facts;
}

// A kernel compiled for one set of arguments' specialization.
struct CompiledCpuKernel {
  ir::Function function;
  std::unique_ptr<jit::cpu::CpuKernel> kernel;

  void run(const std::vector<Arg>& args, Grid grid) const {
    std::vector<jit::Slot> slots(jit::slot_count(function.params));
    jit::pack_args(function.params, args, slots.data());
    jit::cpu::run_grid(*kernel, grid, slots.data());
  }
};

inline CompiledCpuKernel compile_for(const dsl::Kernel& k, const std::vector<Arg>& args,
                                     const dsl::MetaMap& meta) {
  CompiledCpuKernel c;
  c.function = k.trace(kerf::arg_specs(args), meta);
  c.kernel = jit::cpu::compile(c.function);
  return c;
}

// Traces, compiles and runs `k` once; returns the compile time in milliseconds.
inline double run_on_cpu(const dsl::Kernel& k, const std::vector<Arg>& args,
                         const dsl::MetaMap& meta, Grid grid) {
  CompiledCpuKernel c = compile_for(k, args, meta);
  c.run(args, grid);
  return c.kernel->compile_ms;
}

inline uint32_t cdiv(int64_t a, int64_t b) {
  return uint32_t((a + b - 1) / b);
}

}  // namespace kerf::testing
