// What kerf's elementwise ops mean on one element, written as LLVM IR.
//
// Elements are held in registers as: i1, i32, i64, double for f64, and float
// for f32, f16 and bf16. A half-typed element is a float that is exactly
// representable in its type: every op computes in f32 and rounds back (to
// nearest even) right away, so results match a device that computes in f32
// and stores halves after each op. In tensors, i1 is one byte and the half
// types are their 16-bit patterns.
#pragma once

#include <llvm/IR/IRBuilder.h>

#include <cstdint>

#include "jit/cpu/half_float_ir.h"
#include "kerf/dtype.h"
#include "kerf/jit/ir.h"

namespace kerf::jit::cpu {

class ElementOps {
 public:
  ElementOps(llvm::IRBuilder<>& b, HalfFloatIR& half) : b_(b), half_(half) {}

  llvm::Type* register_type(DType t) const;
  llvm::Type* memory_type(DType t) const;
  llvm::Value* to_register(DType t, llvm::Value* stored);
  llvm::Value* to_memory(DType t, llvm::Value* reg);

  llvm::Value* constant(DType t, double fvalue, int64_t ivalue);
  llvm::Value* zero(DType t);

  llvm::Value* unary(ir::OpKind k, DType t, llvm::Value* x);
  // `t` is the operands' dtype (comparisons give i1).
  llvm::Value* binary(ir::OpKind k, DType t, llvm::Value* a, llvm::Value* b);
  llvm::Value* cast(DType from, DType to, llvm::Value* x);
  // Rounds an f32 register value to t's precision; identity unless t is a half type.
  llvm::Value* round(DType t, llvm::Value* x);

  // Reductions accumulate in register form without rounding (halves in f32).
  llvm::Value* reduce_identity(ir::OpKind k, DType t);
  llvm::Value* reduce_step(ir::OpKind k, DType t, llvm::Value* acc, llvm::Value* x);

 private:
  llvm::Value* int_binary(ir::OpKind k, llvm::Value* a, llvm::Value* b);
  llvm::Value* bool_binary(ir::OpKind k, llvm::Value* a, llvm::Value* b);
  llvm::Value* float_binary(ir::OpKind k, DType t, llvm::Value* a, llvm::Value* b);
  llvm::Value* safe_division(ir::OpKind k, llvm::Value* n, llvm::Value* d);
  llvm::Value* f64_to_half(DType to, llvm::Value* x);

  llvm::IRBuilder<>& b_;
  HalfFloatIR& half_;
};

}  // namespace kerf::jit::cpu
