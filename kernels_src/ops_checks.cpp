#include "ops_checks.h"

#include <array>
#include <climits>
#include <cstdint>
#include <tuple>
#include <utility>

#include "ops_common.h"

namespace kerf::ops::detail {

bool expect_valid_view(const char* op, const char* name, const TensorView& t) {
  if (t.rank < 0 || t.rank > kMaxRank)
    throw InvalidArgument(std::string(op) + ": " + name + " is a " + t.describe());
  bool empty = false, overflows = false;
  int64_t count = 1;
  for (int d = 0; d < t.rank; ++d) {
    const int64_t n = t.shape[size_t(d)];
    if (n < 0)
      throw InvalidArgument(std::string(op) + ": " + name + " (" + t.describe() +
                            ") has a negative size (" + std::to_string(n) + ") along dim " +
                            std::to_string(d));
    empty = empty || n == 0;
    overflows = overflows || __builtin_mul_overflow(count, n, &count);
  }
  if (!empty && overflows)
    throw InvalidArgument(std::string(op) + ": " + name + " (" + t.describe() +
                          ") has more elements than a 64-bit count holds");
  return empty;
}

void expect_addressable(const char* op, const char* name, const TensorView& t) {
  if (expect_valid_view(op, name, t)) return;
  const auto addr = reinterpret_cast<uintptr_t>(t.data);
  const int size = dtype_size_bytes(t.dtype);
  if (t.data == nullptr)
    throw InvalidArgument(std::string(op) + ": " + name + " (" + t.describe() +
                          ") has a null data pointer; a tensor with elements needs memory");
  // Every element's byte offset from t.data, and the sum of the reaches of all
  // dims, must fit in int64: no address kerf computes from t may wrap.
  int64_t lo = 0, hi = 0;
  bool wraps = false;
  for (int d = 0; d < t.rank && !wraps; ++d) {
    int64_t reach = 0;
    wraps = __builtin_mul_overflow(t.shape[size_t(d)] - 1, t.strides[size_t(d)], &reach) ||
            __builtin_mul_overflow(reach, int64_t(size), &reach) ||
            __builtin_add_overflow(reach < 0 ? lo : hi, reach, reach < 0 ? &lo : &hi);
  }
  if (wraps || hi > INT64_MAX - size || uintptr_t(hi) + uintptr_t(size) > UINTPTR_MAX - addr ||
      uintptr_t(0) - uintptr_t(lo) > addr)
    throw InvalidArgument(std::string(op) + ": " + name + " (" + t.describe() +
                          ") has strides that reach beyond the address space from address " +
                          std::to_string(addr));
  if (addr % uintptr_t(size) == 0) return;
  throw InvalidArgument(std::string(op) + ": " + name +
                        " must start at a multiple of its element size (" + std::to_string(size) +
                        " bytes for " + dtype_name(t.dtype) + "), got address " +
                        std::to_string(addr));
}

void expect_no_self_overlap(const char* op, const char* name, const TensorView& t) {
  if (t.numel() == 0) return;
  std::array<std::pair<int64_t, int64_t>, kMaxRank> dims;  // |stride|, size (no allocation: every call checks)
  size_t n = 0;
  for (int d = 0; d < t.rank; ++d)
    if (t.shape[size_t(d)] > 1) dims[n++] = {std::abs(t.strides[size_t(d)]), t.shape[size_t(d)]};
  for (size_t i = 1; i < n; ++i)  // insertion sort of at most kMaxRank entries
    for (size_t j = i; j > 0 && dims[j] < dims[j - 1]; --j) std::swap(dims[j], dims[j - 1]);
  int64_t reach = 0;  // the furthest element the smaller strides reach
  for (size_t i = 0; i < n; ++i) {
    const auto [stride, size] = dims[i];
    if (stride <= reach)
      throw InvalidArgument(
          std::string(op) + ": output " + name + " (" + t.describe() +
          ") has strides under which two indices may reach one element; outputs need strides "
          "that nest (sorted, each beyond the reach of the smaller ones: no zero or overlapping "
          "strides)");
    reach += stride * (size - 1);
  }
}

// [first byte, one past the last byte] a view may touch.
std::pair<intptr_t, intptr_t> byte_span(const TensorView& t) {
  int64_t lo = 0, hi = 0;
  for (int d = 0; d < t.rank; ++d) {
    const int64_t reach = (t.shape[size_t(d)] - 1) * t.strides[size_t(d)];
    (reach < 0 ? lo : hi) += reach;
  }
  const int64_t es = dtype_size_bytes(t.dtype);
  const auto base = reinterpret_cast<intptr_t>(t.data);
  return {base + intptr_t(lo * es), base + intptr_t((hi + 1) * es)};
}

NamedSpan::NamedSpan(const char* n, const TensorView& v) : name(n), t(&v) {
  if (v.numel() > 0) std::tie(lo, hi) = byte_span(v);
}

namespace {

// Views on different devices, or with no elements, never overlap.
bool spans_overlap(const NamedSpan& a, const NamedSpan& b) {
  return a.lo != a.hi && b.lo != b.hi && a.lo < b.hi && b.lo < a.hi && a.t->device == b.t->device;
}

}  // namespace

bool may_overlap(const TensorView& a, const TensorView& b) {
  return spans_overlap(NamedSpan(nullptr, a), NamedSpan(nullptr, b));
}

void expect_disjoint(const char* op, const char* out_name, const TensorView& out,
                     const char* in_name, const TensorView& in) {
  if (!may_overlap(out, in)) return;
  throw InvalidArgument(std::string(op) + ": output " + out_name + " overlaps " + in_name +
                        " in memory (" + out_name + " " + out.describe() + ", " + in_name + " " +
                        in.describe() + "); give it memory of its own");
}

void expect_disjoint(const char* op, const NamedSpan* outs, size_t n_outs, const NamedSpan* ins, size_t n_ins) {
  // The spans decide; the message is expect_disjoint's.
  const auto check = [&](const NamedSpan& o, const NamedSpan& i) {
    if (spans_overlap(o, i)) expect_disjoint(op, o.name, *o.t, i.name, *i.t);
  };
  for (size_t k = 0; k < n_outs; ++k)
    for (size_t i = 0; i < n_ins; ++i) check(outs[k], ins[i]);
  for (size_t k = 0; k < n_outs; ++k)
    for (size_t j = k + 1; j < n_outs; ++j) check(outs[j], outs[k]);
}

void expect_int32_dims(const char* op, const char* name, const TensorView& t) {
  for (int d = 0; d < t.rank; ++d)
    if (t.shape[size_t(d)] > INT32_MAX)
      throw InvalidArgument(std::string(op) + ": " + name + " dimension " + std::to_string(d) +
                            " has " + std::to_string(t.shape[size_t(d)]) +
                            " elements; at most 2^31 - 1 are supported");
}

MergedDims merge_dims(const std::vector<int64_t>& sizes,
                      const std::vector<std::vector<int64_t>>& strides, int64_t max_size) {
  MergedDims m;
  m.strides.resize(strides.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 1) continue;
    bool merge = !m.sizes.empty() && m.sizes.back() <= max_size / sizes[d];
    for (size_t v = 0; merge && v < strides.size(); ++v)
      merge = m.strides[v].back() == strides[v][d] * sizes[d];
    if (merge) {
      m.sizes.back() *= sizes[d];
      for (size_t v = 0; v < strides.size(); ++v) m.strides[v].back() = strides[v][d];
      continue;
    }
    m.sizes.push_back(sizes[d]);
    for (size_t v = 0; v < strides.size(); ++v) m.strides[v].push_back(strides[v][d]);
  }
  if (m.sizes.empty()) {
    // Every size is 1 (or there are no dims): one dim of size 1 and stride 1.
    m.sizes.push_back(1);
    for (auto& s : m.strides) s.push_back(1);
  }
  return m;
}

TensorView restride(const TensorView& t, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides) {
  return TensorView::strided(t.data, t.dtype, shape, strides, t.device);
}

}  // namespace kerf::ops::detail
