// The per-element semantics shared by kerf's back ends, for the CPU:
//  - integer division and remainder truncate like C; a zero divisor, and
//    INT_MIN / -1, give 0 instead of trapping;
//  - shifts by the bit width or more give 0 (shl) or the sign fill (shr, which
//    is arithmetic), as the GPU's kerf_dev::shl/shr do;
//  - float min/max are fminf/fmaxf (a NaN operand yields the other one);
//  - float -> int truncates toward zero and saturates (NaN gives 0); x -> i1
//    is x != 0; i1 -> number gives 0 or 1.
#include "jit/cpu/element_ops.h"

#include <llvm/IR/Intrinsics.h>

#include <cmath>
#include <limits>

#include "jit/cpu/math_ir.h"
#include "kerf/error.h"

namespace kerf::jit::cpu {

using ir::OpKind;

llvm::Type* ElementOps::register_type(DType t) const {
  switch (t) {
    case DType::i1:
      return b_.getInt1Ty();
    case DType::i32:
    case DType::u8:  // held zero-extended
      return b_.getInt32Ty();
    case DType::i64:
      return b_.getInt64Ty();
    case DType::f16:
    case DType::bf16:
    case DType::f32:
      return b_.getFloatTy();
    case DType::f64:
      return b_.getDoubleTy();
  }
  return b_.getFloatTy();
}

llvm::Type* ElementOps::memory_type(DType t) const {
  switch (t) {
    case DType::i1:
    case DType::u8:
      return b_.getInt8Ty();
    case DType::f16:
    case DType::bf16:
      return b_.getInt16Ty();
    default:
      return register_type(t);
  }
}

llvm::Value* ElementOps::to_register(DType t, llvm::Value* stored) {
  if (t == DType::i1) return b_.CreateICmpNE(stored, b_.getInt8(0));
  if (t == DType::u8) return b_.CreateZExt(stored, b_.getInt32Ty());
  if (is_half(t)) return b_.CreateCall(half_.to_f32(t), {stored});
  return stored;
}

llvm::Value* ElementOps::to_memory(DType t, llvm::Value* reg) {
  if (t == DType::i1) return b_.CreateZExt(reg, b_.getInt8Ty());
  if (t == DType::u8) return b_.CreateTrunc(reg, b_.getInt8Ty());
  if (is_half(t)) return b_.CreateCall(half_.from_f32(t), {reg});
  return reg;
}

llvm::Value* ElementOps::constant(DType t, double fvalue, int64_t ivalue) {
  switch (t) {
    case DType::i1:
      return b_.getInt1(ivalue != 0);
    case DType::i32:
      return b_.getInt32(uint32_t(int32_t(ivalue)));
    case DType::u8:
      return b_.getInt32(uint32_t(ivalue & 255));
    case DType::i64:
      return b_.getInt64(uint64_t(ivalue));
    case DType::f16:
      return llvm::ConstantFP::get(b_.getFloatTy(), f16_to_float(float_to_f16(float(fvalue))));
    case DType::bf16:
      return llvm::ConstantFP::get(b_.getFloatTy(), bf16_to_float(float_to_bf16(float(fvalue))));
    case DType::f32:
      return llvm::ConstantFP::get(b_.getFloatTy(), double(float(fvalue)));
    case DType::f64:
      return llvm::ConstantFP::get(b_.getDoubleTy(), fvalue);
  }
  return nullptr;
}

llvm::Value* ElementOps::zero(DType t) {
  return llvm::Constant::getNullValue(register_type(t));
}

llvm::Value* ElementOps::round(DType t, llvm::Value* x) {
  return is_half(t) ? b_.CreateCall(half_.round(t), {x}) : x;
}

llvm::Value* ElementOps::unary(OpKind k, DType t, llvm::Value* x) {
  if (is_float(t)) {
    switch (k) {
      case OpKind::Neg:
        return b_.CreateFNeg(x);  // exact, no rounding needed
      case OpKind::Abs:
        return b_.CreateUnaryIntrinsic(llvm::Intrinsic::fabs, x);
      case OpKind::Sqrt:
        return round(t, b_.CreateUnaryIntrinsic(llvm::Intrinsic::sqrt, x));
      case OpKind::Rsqrt: {
        llvm::Value* root = b_.CreateUnaryIntrinsic(llvm::Intrinsic::sqrt, x);
        return round(t, b_.CreateFDiv(llvm::ConstantFP::get(x->getType(), 1.0), root));
      }
      case OpKind::Exp:
        if (t == DType::f64) return b_.CreateUnaryIntrinsic(llvm::Intrinsic::exp, x);
        return round(t, b_.CreateCall(exp_f32_function(*b_.GetInsertBlock()->getModule()), {x}));
      case OpKind::Log:
        return round(t, b_.CreateUnaryIntrinsic(llvm::Intrinsic::log, x));
      default:
        break;
    }
  } else if (t == DType::i1) {
    switch (k) {
      case OpKind::Not:
        return b_.CreateNot(x);
      case OpKind::Neg:  // -1 and 1 are the same bit; 0 stays 0
      case OpKind::Abs:
        return x;
      default:
        break;
    }
  } else {
    switch (k) {
      case OpKind::Neg:
        return b_.CreateNeg(x);
      case OpKind::Not:
        return b_.CreateNot(x);
      case OpKind::Abs:  // abs(INT_MIN) wraps to INT_MIN, as in two's complement hardware
        return b_.CreateBinaryIntrinsic(llvm::Intrinsic::abs, x, b_.getFalse());
      default:
        break;
    }
  }
  throw InternalError(std::string("CPU back end: op '") + ir::op_name(k) + "' does not apply to " +
                      dtype_name(t));
}

llvm::Value* ElementOps::safe_division(OpKind k, llvm::Value* n, llvm::Value* d) {
  auto* ty = llvm::cast<llvm::IntegerType>(n->getType());
  llvm::Value* zero = llvm::ConstantInt::get(ty, 0);
  llvm::Value* is_zero = b_.CreateICmpEQ(d, zero);
  llvm::Value* overflow = b_.CreateAnd(
      b_.CreateICmpEQ(
          n, llvm::ConstantInt::get(ty, llvm::APInt::getSignedMinValue(ty->getBitWidth()))),
      b_.CreateICmpEQ(d, llvm::ConstantInt::getSigned(ty, -1)));
  llvm::Value* bad = b_.CreateOr(is_zero, overflow);
  llvm::Value* safe_d = b_.CreateSelect(bad, llvm::ConstantInt::get(ty, 1), d);
  llvm::Value* q = k == OpKind::Div ? b_.CreateSDiv(n, safe_d) : b_.CreateSRem(n, safe_d);
  return b_.CreateSelect(bad, zero, q);
}

llvm::Value* ElementOps::int_binary(OpKind k, llvm::Value* a, llvm::Value* b) {
  const unsigned width = a->getType()->getIntegerBitWidth();
  switch (k) {
    case OpKind::Add:
      return b_.CreateAdd(a, b);
    case OpKind::Sub:
      return b_.CreateSub(a, b);
    case OpKind::Mul:
      return b_.CreateMul(a, b);
    case OpKind::Div:
    case OpKind::Rem:
      return safe_division(k, a, b);
    case OpKind::Min:
      return b_.CreateBinaryIntrinsic(llvm::Intrinsic::smin, a, b);
    case OpKind::Max:
      return b_.CreateBinaryIntrinsic(llvm::Intrinsic::smax, a, b);
    case OpKind::And:
      return b_.CreateAnd(a, b);
    case OpKind::Or:
      return b_.CreateOr(a, b);
    case OpKind::Xor:
      return b_.CreateXor(a, b);
    case OpKind::Shl:
    case OpKind::Shr: {
      llvm::Value* wide = b_.CreateICmpUGE(b, llvm::ConstantInt::get(a->getType(), width));
      llvm::Value* amount =
          b_.CreateSelect(wide, llvm::ConstantInt::get(a->getType(), width - 1), b);
      if (k == OpKind::Shr) return b_.CreateAShr(a, amount);
      return b_.CreateSelect(wide, llvm::ConstantInt::get(a->getType(), 0),
                             b_.CreateShl(a, amount));
    }
    case OpKind::Lt:
      return b_.CreateICmpSLT(a, b);
    case OpKind::Le:
      return b_.CreateICmpSLE(a, b);
    case OpKind::Gt:
      return b_.CreateICmpSGT(a, b);
    case OpKind::Ge:
      return b_.CreateICmpSGE(a, b);
    case OpKind::Eq:
      return b_.CreateICmpEQ(a, b);
    case OpKind::Ne:
      return b_.CreateICmpNE(a, b);
    default:
      break;
  }
  throw InternalError(std::string("CPU back end: op '") + ir::op_name(k) +
                      "' does not apply to integers");
}

// i1 as the numbers 0 and 1: arithmetic is modulo 2, order is false < true.
llvm::Value* ElementOps::bool_binary(OpKind k, llvm::Value* a, llvm::Value* b) {
  switch (k) {
    case OpKind::Add:
    case OpKind::Sub:
    case OpKind::Xor:
    case OpKind::Ne:
      return b_.CreateXor(a, b);
    case OpKind::Mul:
    case OpKind::And:
    case OpKind::Min:
    case OpKind::Div:
      return b_.CreateAnd(a, b);  // a / 0 is 0, a / 1 is a
    case OpKind::Or:
    case OpKind::Max:
      return b_.CreateOr(a, b);
    case OpKind::Rem:
      return b_.getFalse();
    case OpKind::Shl:
    case OpKind::Shr:
      return b_.CreateAnd(a, b_.CreateNot(b));  // any shift by 1 empties a bit
    case OpKind::Lt:
      return b_.CreateICmpULT(a, b);
    case OpKind::Le:
      return b_.CreateICmpULE(a, b);
    case OpKind::Gt:
      return b_.CreateICmpUGT(a, b);
    case OpKind::Ge:
      return b_.CreateICmpUGE(a, b);
    case OpKind::Eq:
      return b_.CreateICmpEQ(a, b);
    default:
      break;
  }
  throw InternalError(std::string("CPU back end: op '") + ir::op_name(k) +
                      "' does not apply to i1");
}

llvm::Value* ElementOps::float_binary(OpKind k, DType t, llvm::Value* a, llvm::Value* b) {
  switch (k) {
    case OpKind::Add:
      return round(t, b_.CreateFAdd(a, b));
    case OpKind::Sub:
      return round(t, b_.CreateFSub(a, b));
    case OpKind::Mul:
      return round(t, b_.CreateFMul(a, b));
    case OpKind::Div:
      return round(t, b_.CreateFDiv(a, b));
    case OpKind::Rem:
      return round(t, b_.CreateFRem(a, b));  // fmod
    case OpKind::Min:
      return b_.CreateBinaryIntrinsic(llvm::Intrinsic::minnum, a, b);
    case OpKind::Max:
      return b_.CreateBinaryIntrinsic(llvm::Intrinsic::maxnum, a, b);
    case OpKind::Lt:
      return b_.CreateFCmpOLT(a, b);
    case OpKind::Le:
      return b_.CreateFCmpOLE(a, b);
    case OpKind::Gt:
      return b_.CreateFCmpOGT(a, b);
    case OpKind::Ge:
      return b_.CreateFCmpOGE(a, b);
    case OpKind::Eq:
      return b_.CreateFCmpOEQ(a, b);
    case OpKind::Ne:
      return b_.CreateFCmpUNE(a, b);  // NaN != NaN, as in C
    default:
      break;
  }
  throw InternalError(std::string("CPU back end: op '") + ir::op_name(k) +
                      "' does not apply to floats");
}

llvm::Value* ElementOps::binary(OpKind k, DType t, llvm::Value* a, llvm::Value* b) {
  if (is_float(t)) return float_binary(k, t, a, b);
  if (t == DType::i1) return bool_binary(k, a, b);
  return int_binary(k, a, b);
}

// f64 -> f16/bf16 in one rounding: narrow to f32 rounding to odd (truncate, then
// set the last bit if anything was lost), which a second rounding cannot fool.
llvm::Value* ElementOps::f64_to_half(DType to, llvm::Value* x) {
  llvm::Value* nearest = b_.CreateFPTrunc(x, b_.getFloatTy());
  llvm::Value* back = b_.CreateFPExt(nearest, b_.getDoubleTy());
  llvm::Value* bits = b_.CreateBitCast(nearest, b_.getInt32Ty());
  llvm::Value* away = b_.CreateFCmpOGT(b_.CreateUnaryIntrinsic(llvm::Intrinsic::fabs, back),
                                       b_.CreateUnaryIntrinsic(llvm::Intrinsic::fabs, x));
  llvm::Value* truncated = b_.CreateSelect(away, b_.CreateSub(bits, b_.getInt32(1)), bits);
  llvm::Value* inexact = b_.CreateFCmpONE(back, x);
  llvm::Value* odd = b_.CreateSelect(inexact, b_.CreateOr(truncated, 1u), bits);
  return round(to, b_.CreateBitCast(odd, b_.getFloatTy()));
}

llvm::Value* ElementOps::cast(DType from, DType to, llvm::Value* x) {
  if (from == to) return x;
  llvm::Type* dst = register_type(to);
  if (to == DType::i1) {
    if (is_float(from)) return b_.CreateFCmpUNE(x, llvm::ConstantFP::get(x->getType(), 0.0));
    return b_.CreateICmpNE(x, llvm::ConstantInt::get(x->getType(), 0));
  }
  if (from == DType::i1) {
    return is_float(to) ? b_.CreateUIToFP(x, dst) : b_.CreateZExt(x, dst);
  }
  // u8 is held zero-extended in an i32: widening is a sign extension of a
  // non-negative value; narrowing to it keeps the low byte (floats saturate).
  if (to == DType::u8) {
    llvm::Value* byte =
        is_float(from) ? b_.CreateIntrinsic(llvm::Intrinsic::fptoui_sat, {b_.getInt8Ty(), x->getType()}, {x})
                       : b_.CreateTrunc(x, b_.getInt8Ty());
    return b_.CreateZExt(byte, dst);
  }
  if (from == DType::u8) {
    if (is_int(to)) return b_.CreateSExtOrTrunc(x, dst);
    return cast(DType::i32, to, x);
  }
  if (is_int(from) && is_int(to)) return b_.CreateSExtOrTrunc(x, dst);
  if (is_float(from) && is_int(to))
    return b_.CreateIntrinsic(llvm::Intrinsic::fptosi_sat, {dst, x->getType()}, {x});
  if (is_int(from)) {  // -> float
    if (to == DType::f32 || to == DType::f64) return b_.CreateSIToFP(x, dst);
    if (from != DType::i64) return f64_to_half(to, b_.CreateSIToFP(x, b_.getDoubleTy()));
    // An i64 of magnitude 2^53 or more would be rounded on its way to f64: its 12 lowest
    // bits are folded into one sticky bit (bit 11) first, which f64 then holds exactly
    // (52 bits at most) and which keeps the value on the same side of every tie of a
    // 16-bit float (those are multiples of 2^44 there), so the one rounding below decides.
    llvm::IntegerType* i64 = b_.getInt64Ty();
    llvm::Value* negative = b_.CreateICmpSLT(x, llvm::ConstantInt::get(i64, 0));
    llvm::Value* mag = b_.CreateSelect(negative, b_.CreateNeg(x), x);  // INT64_MIN stays 2^63 as unsigned
    llvm::Value* low = b_.CreateAnd(mag, llvm::ConstantInt::get(i64, 0xFFF));
    llvm::Value* folded = b_.CreateOr(
        b_.CreateAnd(mag, llvm::ConstantInt::get(i64, ~uint64_t(0xFFF))),
        b_.CreateSelect(b_.CreateICmpNE(low, llvm::ConstantInt::get(i64, 0)), llvm::ConstantInt::get(i64, 0x800),
                        llvm::ConstantInt::get(i64, 0)));
    llvm::Value* wide = b_.CreateICmpUGE(mag, llvm::ConstantInt::get(i64, uint64_t(1) << 53));
    llvm::Value* d = b_.CreateUIToFP(b_.CreateSelect(wide, folded, mag), b_.getDoubleTy());
    return f64_to_half(to, b_.CreateSelect(negative, b_.CreateFNeg(d), d));
  }
  // float -> float
  if (from == DType::f64) {
    if (to == DType::f32) return b_.CreateFPTrunc(x, dst);
    return f64_to_half(to, x);
  }
  if (to == DType::f64) return b_.CreateFPExt(x, dst);
  return round(to, x);  // between f32, f16 and bf16, all held as float
}

llvm::Value* ElementOps::reduce_identity(OpKind k, DType t) {
  if (is_float(t)) {
    if (k == OpKind::ReduceSum) return llvm::ConstantFP::get(register_type(t), 0.0);
    // maxnum/minnum ignore a NaN operand, so NaN is their identity.
    return llvm::ConstantFP::getNaN(register_type(t));
  }
  auto* ty = llvm::cast<llvm::IntegerType>(register_type(t));
  const unsigned w = ty->getBitWidth();
  if (t == DType::i1) return b_.getInt1(k == OpKind::ReduceMin);
  switch (k) {
    case OpKind::ReduceMax:
      return llvm::ConstantInt::get(ty, llvm::APInt::getSignedMinValue(w));
    case OpKind::ReduceMin:
      return llvm::ConstantInt::get(ty, llvm::APInt::getSignedMaxValue(w));
    default:
      return llvm::ConstantInt::get(ty, 0);
  }
}

llvm::Value* ElementOps::reduce_step(OpKind k, DType t, llvm::Value* acc, llvm::Value* x) {
  if (is_float(t) && k == OpKind::ReduceSum) {
    // Reassociation lets the vectorizer split the sum into lanes; a GPU sums in a tree anyway.
    llvm::Value* sum = b_.CreateFAdd(acc, x);
    llvm::FastMathFlags fmf;
    fmf.setAllowReassoc();
    if (auto* inst = llvm::dyn_cast<llvm::Instruction>(sum)) inst->setFastMathFlags(fmf);
    return sum;
  }
  const OpKind elementwise = k == OpKind::ReduceSum   ? OpKind::Add
                             : k == OpKind::ReduceMax ? OpKind::Max
                                                      : OpKind::Min;
  if (is_float(t)) return float_binary(elementwise, DType::f32, acc, x);  // no rounding in between
  return binary(elementwise, t, acc, x);
}

}  // namespace kerf::jit::cpu
