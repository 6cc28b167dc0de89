// e^x = 2^n * e^r with n = round(x / ln 2) and r = x - n ln 2 (ln 2 split in
// two parts so that n ln 2 is exact, Cody & Waite), |r| <= ln(2)/2, and e^r
// from Cephes' degree-7 minimax polynomial for expf. 2^n is applied as two
// exponent-field multiplications so that results near overflow and in the
// subnormal range round once, like the real thing.
#include "jit/cpu/math_ir.h"

#include <llvm/IR/Intrinsics.h>

#include "jit/cpu/module_function.h"

namespace kerf::jit::cpu {

llvm::Function* exp_f32_function(llvm::Module& m) {
  llvm::Type* f32 = llvm::Type::getFloatTy(m.getContext());
  return unary_module_function(
      m, "kerf.exp_f32", f32, f32, [&](llvm::IRBuilder<>& b, llvm::Value* x) {
        auto c = [&](double v) { return llvm::ConstantFP::get(f32, v); };
        // Beyond these bounds the result is +inf or 0 anyway; clamping keeps n small.
        llvm::Value* xc = b.CreateBinaryIntrinsic(llvm::Intrinsic::maxnum, x, c(-104.0));
        xc = b.CreateBinaryIntrinsic(llvm::Intrinsic::minnum, xc, c(89.0));
        // Round x / ln 2 to nearest: adding and subtracting 1.5 * 2^23 drops the fraction.
        llvm::Value* magic = c(12582912.0);
        llvm::Value* fn =
            b.CreateFSub(b.CreateFAdd(b.CreateFMul(xc, c(1.44269504088896341)), magic), magic);
        llvm::Value* r = b.CreateFSub(xc, b.CreateFMul(fn, c(0.693359375)));
        r = b.CreateFSub(r, b.CreateFMul(fn, c(-2.12194440e-4)));
        llvm::Value* p = c(1.9875691500e-4);
        for (double coeff :
             {1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1})
          p = b.CreateFAdd(b.CreateFMul(p, r), c(coeff));
        p = b.CreateFAdd(b.CreateFAdd(b.CreateFMul(p, b.CreateFMul(r, r)), r), c(1.0));
        // 2^n = 2^(n/2) * 2^(n - n/2): both factors are normal floats for |n| <= 150.
        llvm::Value* n = b.CreateFPToSI(fn, b.getInt32Ty());
        llvm::Value* n1 = b.CreateAShr(n, 1);
        llvm::Value* n2 = b.CreateSub(n, n1);
        auto pow2 = [&](llvm::Value* e) {
          return b.CreateBitCast(b.CreateShl(b.CreateAdd(e, b.getInt32(127)), 23), f32);
        };
        llvm::Value* y = b.CreateFMul(b.CreateFMul(p, pow2(n1)), pow2(n2));
        return b.CreateSelect(b.CreateFCmpUNO(x, x), x, y);
      });
}

}  // namespace kerf::jit::cpu
