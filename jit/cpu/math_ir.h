// Math functions written as branch-free IR inside the generated module, so
// that loops calling them vectorize (a call to libm's expf keeps a loop scalar).
#pragma once

namespace llvm {
class Function;
class Module;
}  // namespace llvm

namespace kerf::jit::cpu {

// (float) -> float: e^x within 2 ulp over the whole range; overflow gives +inf,
// underflow gradual subnormals then 0, NaN stays NaN.
llvm::Function* exp_f32_function(llvm::Module& m);

}  // namespace kerf::jit::cpu
