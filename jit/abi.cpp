#include "kerf/jit/abi.h"

#include <cstring>

#include "kerf/dtype.h"

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

Slot scalar_slot(DType t, const Scalar& s) {
  Slot slot = 0;
  switch (t) {
    case DType::f32: {
      const float v = float(s.is_int ? double(s.i) : s.f);
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
      const float v = float(s.is_int ? double(s.i) : s.f);
      const uint16_t h = t == DType::f16 ? float_to_f16(v) : float_to_bf16(v);
      std::memcpy(&slot, &h, sizeof h);
      break;
    }
    case DType::i32: {
      const int32_t v = int32_t(s.is_int ? s.i : int64_t(s.f));
      std::memcpy(&slot, &v, sizeof v);
      break;
    }
    case DType::i64:
    case DType::i1:
    case DType::u8: {
      const int64_t v = s.is_int ? s.i : int64_t(s.f);
      std::memcpy(&slot, &v, sizeof v);
      break;
    }
  }
  return slot;
}

}  // namespace

void pack_args(const std::vector<ir::Param>& params, const std::vector<Arg>& args, Slot* slots) {
  size_t n = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const ir::Param& p = params[i];
    if (p.kind == ir::ParamKind::Tensor) {
      const TensorView& t = std::get<TensorView>(args[i]);
      slots[n++] = reinterpret_cast<uintptr_t>(t.data);
      for (int d = 0; d < p.rank; ++d) slots[n++] = Slot(t.shape[size_t(d)]);
      for (int d = 0; d < p.rank; ++d) slots[n++] = Slot(t.strides[size_t(d)]);
    } else {
      slots[n++] = scalar_slot(p.dtype, std::get<Scalar>(args[i]));
    }
  }
}

}  // namespace kerf::jit
