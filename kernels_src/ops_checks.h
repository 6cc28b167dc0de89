// Argument checks the LoRA ops share beyond ops_common.h: memory overlap,
// element alignment, integer ids, and collapsing strided dimensions.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kerf/error.h"
#include "kerf/runtime/tensor.h"

namespace kerf::ops::detail {

inline const std::vector<DType>& float_dtypes() {
  static const std::vector<DType> f = {DType::bf16, DType::f16, DType::f32};
  return f;
}

// Throws InvalidArgument unless t's rank is within [0, kMaxRank], no size is
// negative and its element count fits in 64 bits (checked before any "no
// elements, nothing to do" shortcut: sizes whose product wraps to 0 are not
// empty). Returns whether t has no elements.
bool expect_valid_view(const char* op, const char* name, const TensorView& t);
// Throws InvalidArgument unless t is a valid view (expect_valid_view) and, with
// elements, has memory (a non-null pointer), starts at a multiple of its
// element size (a GPU cannot load a misaligned element; kerf never tries) and
// reaches every element at a byte offset that fits in 64 bits (so no address
// computed for it wraps around).
void expect_addressable(const char* op, const char* name, const TensorView& t);

// Throws InvalidArgument when two distinct indices of output `t` reach one
// element (a zero or overlapping stride): writes would race.
void expect_no_self_overlap(const char* op, const char* name, const TensorView& t);

// [first byte, one past the last byte] a (non-empty) view may touch.
std::pair<intptr_t, intptr_t> byte_span(const TensorView& t);

// Whether the bytes two views may touch overlap (false when either is empty).
bool may_overlap(const TensorView& a, const TensorView& b);

// Throws InvalidArgument when output `out` shares memory with `in`.
void expect_disjoint(const char* op, const char* out_name, const TensorView& out,
                     const char* in_name, const TensorView& in);

// A view and the bytes it may touch, found once for the checks of several pairs.
struct NamedSpan {
  const char* name = nullptr;
  const TensorView* t = nullptr;
  intptr_t lo = 0, hi = 0;  // [lo, hi); empty (lo == hi) for a view with no elements
  NamedSpan() = default;
  NamedSpan(const char* n, const TensorView& v);
};
// expect_disjoint for every output of `outs` and every view of `ins`, and for
// every two of `outs`.
void expect_disjoint(const char* op, const NamedSpan* outs, size_t n_outs, const NamedSpan* ins, size_t n_ins);

// Throws InvalidArgument unless every element count and stride fits the
// kernels' 32-bit sizes (dims < 2^31).
void expect_int32_dims(const char* op, const char* name, const TensorView& t);

// Groups of dimensions of several views, merged where every view allows it:
// dims d and d+1 merge when, in each view, stride[d] == stride[d+1] * size[d+1].
// Returns, per view, the sizes and strides of the merged dims (all views share
// the sizes). Dims of size 1 are dropped first; an empty group gives one dim
// of size 1. Dims whose merged size would pass `max_size` stay apart.
struct MergedDims {
  std::vector<int64_t> sizes;
  std::vector<std::vector<int64_t>> strides;  // [view][dim]
};
MergedDims merge_dims(const std::vector<int64_t>& sizes,
                      const std::vector<std::vector<int64_t>>& strides,
                      int64_t max_size = INT64_MAX);

// A view of `t` with other sizes and strides (same data, dtype, device).
TensorView restride(const TensorView& t, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides);

}  // namespace kerf::ops::detail
