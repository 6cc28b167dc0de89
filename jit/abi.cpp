#include "kerf/jit/abi.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "kerf/dtype.h"
#include "kerf/error.h"

namespace kerf::jit {

size_t slot_count(const std::vector<ir::Param>& params) {
  size_t n = 0;
  for (const auto& p : params) n += p.kind == ir::ParamKind::Tensor ? 1 + 2 * size_t(p.rank) : 1;
  return n;
}

std::vector<size_t> slot_offsets(const std::vector<ir::Param>& params) {
  std::vector<size_t> out;
  size_t n = 0;
  for (const auto& p : params) {
    out.push_back(n);
    n += p.kind == ir::ParamKind::Tensor ? 1 + 2 * size_t(p.rank) : 1;
  }
  return out;
}

namespace {

// The integer a scalar gives an integer parameter of dtype `t`; refuses fractions, NaN and
// values out of the parameter's range.
int64_t integer_value(DType t, const Scalar& s, const ir::Param& p, const char* kernel) {
  const int64_t lo = t == DType::i32 ? INT32_MIN : INT64_MIN;
  const int64_t hi = t == DType::i32 ? INT32_MAX : INT64_MAX;
  const auto refuse = [&](const std::string& value, const char* why) {
    throw InvalidArgument(std::string(kernel ? "kernel '" + std::string(kernel) + "': " : std::string()) +
                          "scalar argument '" + p.name + "' is " + dtype_name(t) + ", and " + value + " " + why);
  };
  if (s.is_int) {
    if (s.i < lo || s.i > hi) refuse(std::to_string(s.i), "does not fit it");
    return s.i;
  }
  char text[40];
  std::snprintf(text, sizeof text, "%.17g", s.f);
  if (!(s.f == std::trunc(s.f))) refuse(text, "is not a whole number");  // NaN and inf too
  // 2^63 is the first double past INT64_MAX; INT64_MIN is exact.
  if (s.f < double(lo) || s.f >= (t == DType::i32 ? double(hi) + 1 : 9223372036854775808.0))
    refuse(text, "does not fit it");
  return int64_t(s.f);
}

// The scalar as a double that rounds to any 16-bit float as the exact value would: an
// integer of magnitude 2^53 or more has its 12 lowest bits folded into one sticky bit
// (bit 11), which f64 holds exactly (16-bit floats' ties there are multiples of 2^44).
double half_source(const Scalar& s) {
  if (!s.is_int) return s.f;
  const uint64_t mag = s.i < 0 ? uint64_t(0) - uint64_t(s.i) : uint64_t(s.i);
  const uint64_t folded = mag < (uint64_t(1) << 53) ? mag : (mag & ~uint64_t(0xFFF)) | ((mag & 0xFFF) ? 0x800 : 0);
  const double d = double(folded);
  return s.i < 0 ? -d : d;
}

// d narrowed to f32 rounding to odd (toward zero, the last bit set when inexact): a
// second rounding, to a 16-bit float, then gives what rounding d once would.
float f32_round_to_odd(double d) {
  float f = float(d);
  if (std::isnan(d) || double(f) == d) return f;
  if (std::fabs(double(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);  // toward zero (inf -> FLT_MAX)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits |= 1u;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

Slot scalar_slot(const ir::Param& p, const Scalar& s, const char* kernel) {
  const DType t = p.dtype;
  Slot slot = 0;
  switch (t) {
    case DType::f32: {
      const float v = s.is_int ? float(s.i) : float(s.f);  // each rounded once
      std::memcpy(&slot, &v, sizeof v);
      break;
    }
    case DType::f64: {
      const double v = s.is_int ? double(s.i) : s.f;
      std::memcpy(&slot, &v, sizeof v);
      break;
    }
    case DType::f16:
    case DType::bf16: {
      const float v = f32_round_to_odd(half_source(s));
      const uint16_t h = t == DType::f16 ? float_to_f16(v) : float_to_bf16(v);
      std::memcpy(&slot, &h, sizeof h);
      break;
    }
    case DType::i32: {
      const int32_t v = int32_t(integer_value(t, s, p, kernel));
      std::memcpy(&slot, &v, sizeof v);
      break;
    }
    case DType::i64:
    case DType::i1:
    case DType::u8: {  // i1 and u8 scalars are not declared (the DSL refuses them)
      const int64_t v = integer_value(DType::i64, s, p, kernel);
      std::memcpy(&slot, &v, sizeof v);
      break;
    }
  }
  return slot;
}

}  // namespace

void pack_args(const std::vector<ir::Param>& params, const std::vector<Arg>& args, Slot* slots,
               const char* kernel) {
  size_t n = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const ir::Param& p = params[i];
    if (p.kind == ir::ParamKind::Tensor) {
      const TensorView& t = std::get<TensorView>(args[i]);
      slots[n++] = reinterpret_cast<uintptr_t>(t.data);
      for (int d = 0; d < p.rank; ++d) slots[n++] = Slot(t.shape[size_t(d)]);
      for (int d = 0; d < p.rank; ++d) slots[n++] = Slot(t.strides[size_t(d)]);
    } else {
      slots[n++] = scalar_slot(p, std::get<Scalar>(args[i]), kernel);
    }
  }
}

}  // namespace kerf::jit
