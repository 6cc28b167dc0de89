// Lowers kerf IR to an LLVM module for the CPU back end.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kerf/jit/ir.h"

namespace llvm {
class LLVMContext;
class Module;
}  // namespace llvm

namespace kerf::jit::cpu {

struct GeneratedModule {
  std::unique_ptr<llvm::Module> module;
  int64_t stack_bytes = 0;  // the tiles one program keeps on its stack
};

// Builds a module holding one external function named `entry_name`,
//   void entry(const i64* slots, const i32* pid, const i32* nprog)
// that runs one program of `f` (slot ABI: kerf/jit/abi.h). The module has no
// target triple or data layout yet. Throws kerf::CompileError if LLVM's
// verifier rejects it, kerf::InternalError if `f` is malformed.
GeneratedModule generate_llvm_module(const ir::Function& f, llvm::LLVMContext& ctx,
                                     const std::string& entry_name);

}  // namespace kerf::jit::cpu
