#include "kerf/runtime/tensor.h"

#include <algorithm>

#include "kerf/error.h"
#include "kerf/jit/ir.h"

namespace kerf {

std::string Device::str() const {
  // A CPU device other than 0 (only a caller's hand-built view) is named with its index,
  // so that a message about two devices never names them alike.
  if (kind == Kind::cpu) return index == 0 ? "cpu" : "cpu:" + std::to_string(index);
  return "cuda:" + std::to_string(index);
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  Device device) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) strides[i - 1] = strides[i] * shape[i];
  return strided(data, dtype, shape, strides, device);
}

TensorView TensorView::strided(void* data, DType dtype, const std::vector<int64_t>& shape,
                               const std::vector<int64_t>& strides, Device device) {
  if (shape.size() > size_t(kMaxRank))
    throw InvalidArgument("tensors of rank " + std::to_string(shape.size()) +
                          " are not supported (at most " + std::to_string(kMaxRank) + ")");
  if (shape.size() != strides.size())
    throw InvalidArgument("a tensor view needs one stride per dimension");
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.rank = int(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) throw InvalidArgument("tensor sizes must be non-negative");
    t.shape[i] = shape[i];
    t.strides[i] = strides[i];
  }
  t.device = device;
  return t;
}

bool TensorView::is_contiguous() const {
  int64_t expect = 1;
  for (int d = std::clamp(rank, 0, kMaxRank); d-- > 0;) {
    if (shape[size_t(d)] != 1 && strides[size_t(d)] != expect) return false;
    expect *= shape[size_t(d)];
  }
  return true;
}

std::string TensorView::describe() const {
  // A hand-built view may carry any rank: its arrays hold kMaxRank entries.
  if (rank < 0 || rank > kMaxRank)
    return std::string(dtype_name(dtype)) + " view of invalid rank " + std::to_string(rank) + " (at most " +
           std::to_string(kMaxRank) + ") on " + device.str();
  std::string s = std::string(dtype_name(dtype)) + "[";
  for (int d = 0; d < rank; ++d) s += (d ? "," : "") + std::to_string(shape[size_t(d)]);
  s += "] strides [";
  for (int d = 0; d < rank; ++d) s += (d ? "," : "") + std::to_string(strides[size_t(d)]);
  return s + "] on " + device.str();
}

}  // namespace kerf
