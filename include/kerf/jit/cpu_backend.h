// The CPU back end: kerf IR -> LLVM IR -> native code through ORC LLJIT, and a
// thread pool that runs a grid of programs on all cores.
//
// Built only when LLVM is found (KERF_HAVE_LLVM); without it `available()` is
// false and `compile` throws kerf::NotAvailable saying how to get it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kerf/jit/abi.h"
#include "kerf/jit/ir.h"
#include "kerf/runtime/tensor.h"

namespace kerf::jit::cpu {

bool available();
std::string llvm_version();     // "14.0.6", or "" when not built with LLVM
std::string host_cpu();         // LLVM's name of the host CPU, e.g. "znver3"
std::string host_features();    // canonical, sorted feature string of the host (part of cache keys)

// One compiled program: the native entry point
//   void entry(const Slot* args, const int32_t* pid /*[3]*/, const int32_t* nprog /*[3]*/)
// runs one program of the grid.
class CpuKernel {
 public:
  using Entry = void (*)(const Slot* args, const int32_t* pid, const int32_t* nprog);
  virtual ~CpuKernel() = default;
  virtual Entry entry() const = 0;
  double compile_ms = 0.0;  // IR generation + optimisation + machine code
  int64_t stack_bytes = 0;  // stack the tiles of one program need (run_grid picks threads by it)
};

// Compiles a verified Function. Throws kerf::CompileError if LLVM rejects it.
std::unique_ptr<CpuKernel> compile(const ir::Function& f);

// The LLVM IR text kerf generates for `f` (before optimisation), for debugging.
std::string emit_llvm_ir(const ir::Function& f);

// Runs every program of `grid` on the process's thread pool (all cores) and
// returns when all are done. `args` follows the slot ABI (abi.h).
void run_grid(const CpuKernel& k, Grid grid, const Slot* args);

// Number of worker threads in the pool (hardware concurrency unless
// KERF_CPU_THREADS is set; 0 when kerf was built without LLVM).
int thread_count();

}  // namespace kerf::jit::cpu
