// The bit manipulations behind HalfFloatIR (see half_float_ir.h). They follow
// the same rules as kerf::float_to_f16 / float_to_bf16 in common/dtype.cpp.
#include "jit/cpu/half_float_ir.h"

#include "jit/cpu/module_function.h"

namespace kerf::jit::cpu {

llvm::Function* HalfFloatIR::to_f32(DType half) {
  return half == DType::bf16 ? bf16_to_f32() : f16_to_f32();
}
llvm::Function* HalfFloatIR::from_f32(DType half) {
  return half == DType::bf16 ? f32_to_bf16() : f32_to_f16();
}
llvm::Function* HalfFloatIR::round(DType half) {
  return half == DType::bf16 ? round_bf16() : round_f16();
}

// bf16 is the upper half of an f32.
llvm::Function* HalfFloatIR::bf16_to_f32() {
  llvm::LLVMContext& c = m_.getContext();
  return unary_module_function(m_, "kerf.bf16_to_f32", llvm::Type::getFloatTy(c),
                               llvm::Type::getInt16Ty(c), [](llvm::IRBuilder<>& b, llvm::Value* h) {
                                 llvm::Value* u = b.CreateShl(b.CreateZExt(h, b.getInt32Ty()), 16);
                                 return b.CreateBitCast(u, b.getFloatTy());
                               });
}

// f16: sign, 5 exponent bits (bias 15), 10 mantissa bits.
llvm::Function* HalfFloatIR::f16_to_f32() {
  llvm::LLVMContext& c = m_.getContext();
  return unary_module_function(
      m_, "kerf.f16_to_f32", llvm::Type::getFloatTy(c), llvm::Type::getInt16Ty(c),
      [](llvm::IRBuilder<>& b, llvm::Value* h) {
        llvm::Value* u = b.CreateZExt(h, b.getInt32Ty());
        llvm::Value* sign = b.CreateShl(b.CreateAnd(u, 0x8000u), 16);
        llvm::Value* em = b.CreateAnd(u, 0x7FFFu);  // exponent and mantissa
        llvm::Value* shifted = b.CreateShl(em, 13);
        // Normal numbers: rebias the exponent (127 - 15 = 112); inf/NaN: exponent 255.
        llvm::Value* normal = b.CreateAdd(shifted, b.getInt32(112u << 23));
        llvm::Value* special = b.CreateAdd(shifted, b.getInt32(224u << 23));
        // Subnormals (and zero) are em * 2^-24, exact in f32.
        llvm::Value* sub_f = b.CreateFMul(b.CreateUIToFP(em, b.getFloatTy()),
                                          llvm::ConstantFP::get(b.getFloatTy(), 0x1p-24));
        llvm::Value* sub = b.CreateBitCast(sub_f, b.getInt32Ty());
        llvm::Value* bits =
            b.CreateSelect(b.CreateICmpUGE(em, b.getInt32(0x7C00)), special, normal);
        bits = b.CreateSelect(b.CreateICmpULT(em, b.getInt32(0x400)), sub, bits);
        return b.CreateBitCast(b.CreateOr(bits, sign), b.getFloatTy());
      });
}

llvm::Function* HalfFloatIR::f32_to_bf16() {
  llvm::LLVMContext& c = m_.getContext();
  return unary_module_function(
      m_, "kerf.f32_to_bf16", llvm::Type::getInt16Ty(c), llvm::Type::getFloatTy(c),
      [](llvm::IRBuilder<>& b, llvm::Value* x) {
        llvm::Value* u = b.CreateBitCast(x, b.getInt32Ty());
        llvm::Value* upper = b.CreateLShr(u, 16);
        // Round to nearest even: add 0x7FFF plus the lowest kept bit.
        llvm::Value* bias = b.CreateAdd(b.CreateAnd(upper, 1u), b.getInt32(0x7FFF));
        llvm::Value* rounded = b.CreateLShr(b.CreateAdd(u, bias), 16);
        llvm::Value* quiet_nan = b.CreateOr(upper, 0x40u);
        llvm::Value* is_nan = b.CreateFCmpUNO(x, x);
        return b.CreateTrunc(b.CreateSelect(is_nan, quiet_nan, rounded), b.getInt16Ty());
      });
}

llvm::Function* HalfFloatIR::f32_to_f16() {
  llvm::LLVMContext& c = m_.getContext();
  return unary_module_function(
      m_, "kerf.f32_to_f16", llvm::Type::getInt16Ty(c), llvm::Type::getFloatTy(c),
      [](llvm::IRBuilder<>& b, llvm::Value* x) {
        llvm::Value* u = b.CreateBitCast(x, b.getInt32Ty());
        llvm::Value* sign = b.CreateAnd(b.CreateLShr(u, 16), 0x8000u);
        llvm::Value* a = b.CreateAnd(u, 0x7FFFFFFFu);
        // Normal range: rebias the exponent (subtract 112 << 23) and round to nearest even
        // on the 13 dropped bits; a carry out of the mantissa bumps the exponent correctly.
        llvm::Value* lsb = b.CreateAnd(b.CreateLShr(a, 13), 1u);
        llvm::Value* normal = b.CreateAdd(a, b.getInt32(0xFFF - (112u << 23)));
        normal = b.CreateLShr(b.CreateAdd(normal, lsb), 13);
        // Below 2^-14 the result is subnormal: adding 0.5 makes the FPU round |x| to a
        // multiple of 2^-24 (nearest even), which then sits in the low mantissa bits.
        llvm::Value* abs_f = b.CreateBitCast(a, b.getFloatTy());
        llvm::Value* sum = b.CreateFAdd(abs_f, llvm::ConstantFP::get(b.getFloatTy(), 0.5));
        llvm::Value* sub =
            b.CreateSub(b.CreateBitCast(sum, b.getInt32Ty()), b.getInt32(0x3F000000));
        llvm::Value* bits = b.CreateSelect(b.CreateICmpULT(a, b.getInt32(0x38800000)), sub, normal);
        // From 65520 up everything rounds to infinity; NaN stays a (quiet) NaN.
        bits = b.CreateSelect(b.CreateICmpUGE(a, b.getInt32(0x477FF000)), b.getInt32(0x7C00), bits);
        llvm::Value* nan = b.CreateOr(b.CreateAnd(b.CreateLShr(a, 13), 0x3FFu), 0x7E00u);
        bits = b.CreateSelect(b.CreateICmpUGT(a, b.getInt32(0x7F800000)), nan, bits);
        return b.CreateTrunc(b.CreateOr(bits, sign), b.getInt16Ty());
      });
}

llvm::Function* HalfFloatIR::round_bf16() {
  llvm::LLVMContext& c = m_.getContext();
  return unary_module_function(
      m_, "kerf.round_bf16", llvm::Type::getFloatTy(c), llvm::Type::getFloatTy(c),
      [](llvm::IRBuilder<>& b, llvm::Value* x) {
        llvm::Value* u = b.CreateBitCast(x, b.getInt32Ty());
        llvm::Value* lsb = b.CreateAnd(b.CreateLShr(u, 16), 1u);
        llvm::Value* bias = b.CreateAdd(lsb, b.getInt32(0x7FFF));
        llvm::Value* rounded = b.CreateAnd(b.CreateAdd(u, bias), 0xFFFF0000u);
        llvm::Value* quiet_nan = b.CreateOr(u, 0x00400000u);
        llvm::Value* is_nan = b.CreateFCmpUNO(x, x);
        return b.CreateBitCast(b.CreateSelect(is_nan, quiet_nan, rounded), b.getFloatTy());
      });
}

llvm::Function* HalfFloatIR::round_f16() {
  llvm::Function* to_half = f32_to_f16();
  llvm::Function* to_float = f16_to_f32();
  llvm::LLVMContext& c = m_.getContext();
  return unary_module_function(m_, "kerf.round_f16", llvm::Type::getFloatTy(c),
                               llvm::Type::getFloatTy(c),
                               [&](llvm::IRBuilder<>& b, llvm::Value* x) {
                                 return b.CreateCall(to_float, {b.CreateCall(to_half, {x})});
                               });
}

}  // namespace kerf::jit::cpu
