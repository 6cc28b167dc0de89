// f16 / bf16 <-> f32 conversions written as integer IR inside the module
// being generated. LLVM 14 lowers `half` conversions on x86 to compiler-rt or
// libgcc calls that a JIT cannot count on; these functions need nothing, have
// no branches (so loops that use them still vectorize) and are always inlined.
#pragma once

#include "kerf/dtype.h"

namespace llvm {
class Function;
class Module;
}  // namespace llvm

namespace kerf::jit::cpu {

class HalfFloatIR {
 public:
  explicit HalfFloatIR(llvm::Module& m) : m_(m) {}

  // (i16 bits) -> float, exact.
  llvm::Function* to_f32(DType half);
  // (float) -> i16 bits: round to nearest even, overflow to infinity, NaN stays a NaN.
  llvm::Function* from_f32(DType half);
  // (float) -> float: the float rounded to the nearest value of the half type.
  llvm::Function* round(DType half);

 private:
  llvm::Function* bf16_to_f32();
  llvm::Function* f16_to_f32();
  llvm::Function* f32_to_bf16();
  llvm::Function* f32_to_f16();
  llvm::Function* round_bf16();
  llvm::Function* round_f16();

  llvm::Module& m_;
};

}  // namespace kerf::jit::cpu
