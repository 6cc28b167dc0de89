// The CPU back end's machine code as bytes, so that the kernel cache can keep
// it on disk: compile once to a relocatable object, load it in any later
// process on the same host CPU (the cache key holds the CPU and its features).
// Only built with LLVM (KERF_HAVE_LLVM).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kerf/jit/cpu_backend.h"

namespace kerf::jit::cpu {

struct ObjectCode {
  std::vector<char> bytes;  // an ELF relocatable object for this host
  std::string entry;        // the symbol of the program entry point
  int64_t stack_bytes = 0;  // as CpuKernel::stack_bytes
  double compile_ms = 0.0;
};

// Optimises `f` as compile() does and emits the machine code instead of loading it.
// Throws kerf::CompileError as compile() does.
ObjectCode emit_object(const ir::Function& f);

// Loads an object made by emit_object (in this process or an earlier one). Each
// object gets its own symbol namespace, so the same object may be loaded twice.
// Throws kerf::CompileError when the object cannot be linked.
std::unique_ptr<CpuKernel> load_object(const ObjectCode& object);

}  // namespace kerf::jit::cpu
