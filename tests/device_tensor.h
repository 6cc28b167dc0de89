// Test helper: a tensor with a host copy and, on a GPU, a device copy, filled
// from fresh random data and compared against float64 references.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kerf/dtype.h"
#include "kerf/runtime/cuda.h"
#include "kerf/runtime/tensor.h"

namespace kerf::test {

inline double load_as_double(DType t, const uint8_t* p) {
  switch (t) {
    case DType::bf16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return bf16_to_float(h);
    }
    case DType::f16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return f16_to_float(h);
    }
    case DType::f32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::f64: {
      double d;
      std::memcpy(&d, p, 8);
      return d;
    }
    case DType::i32: {
      int32_t i;
      std::memcpy(&i, p, 4);
      return i;
    }
    case DType::i64: {
      int64_t i;
      std::memcpy(&i, p, 8);
      return double(i);
    }
    case DType::i1: return *p ? 1.0 : 0.0;
    case DType::u8: return *p;
  }
  return 0.0;
}

inline void store_from_double(DType t, uint8_t* p, double v) {
  switch (t) {
    case DType::bf16: {
      const uint16_t h = float_to_bf16(float(v));
      std::memcpy(p, &h, 2);
      break;
    }
    case DType::f16: {
      const uint16_t h = float_to_f16(float(v));
      std::memcpy(p, &h, 2);
      break;
    }
    case DType::f32: {
      const float f = float(v);
      std::memcpy(p, &f, 4);
      break;
    }
    case DType::f64: std::memcpy(p, &v, 8); break;
    case DType::i32: {
      const int32_t i = int32_t(v);
      std::memcpy(p, &i, 4);
      break;
    }
    case DType::i64: {
      const int64_t i = int64_t(v);
      std::memcpy(p, &i, 8);
      break;
    }
    case DType::i1: *p = v != 0.0; break;
    case DType::u8: *p = uint8_t(v); break;
  }
}

// A dense row-major tensor (optionally a strided view into a larger buffer).
class TestTensor {
 public:
  TestTensor(DType dtype, std::vector<int64_t> shape, Device device)
      : dtype_(dtype), shape_(std::move(shape)), device_(device) {
    int64_t n = 1;
    for (int64_t d : shape_) n *= d;
    numel_ = n;
    host_.assign(size_t(std::max<int64_t>(n, 1)) * size_t(dtype_size_bytes(dtype)), 0);
    if (device.is_cuda()) dev_ = cuda::DeviceBuffer(host_.size(), device.index);
  }

  int64_t numel() const { return numel_; }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }

  double get(int64_t i) const { return load_as_double(dtype_, &host_[size_t(i) * esize()]); }
  void set(int64_t i, double v) { store_from_double(dtype_, &host_[size_t(i) * esize()], v); }
  // An element from its exact bits (an i64 beyond 2^53, which a double cannot carry).
  void set_i64(int64_t i, int64_t v) { std::memcpy(&host_[size_t(i) * esize()], &v, sizeof v); }

  // Uniform in [lo, hi), rounded to the dtype; the host copy keeps the rounded values.
  void randomize(std::mt19937_64& rng, double lo = -1.0, double hi = 1.0) {
    std::uniform_real_distribution<double> d(lo, hi);
    for (int64_t i = 0; i < numel_; ++i) set(i, d(rng));
    upload();
  }
  // Every byte 0xFF: a NaN for floats, so an unwritten output shows.
  void poison() {
    std::fill(host_.begin(), host_.end(), uint8_t(0xFF));
    upload();
  }
  void upload() {
    if (device_.is_cuda()) dev_.copy_from_host(host_.data(), host_.size());
  }
  void download() {
    if (device_.is_cuda()) dev_.copy_to_host(host_.data(), host_.size());
  }
  void* data() { return device_.is_cuda() ? dev_.data() : static_cast<void*>(host_.data()); }

  TensorView view() { return TensorView::contiguous(data(), dtype_, shape_, device_); }
  TensorView view(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
    return TensorView::strided(data(), dtype_, shape, strides, device_);
  }
  // A view starting `offset` elements in (sub-tensors, misaligned starts).
  TensorView view_at(int64_t offset, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
    return TensorView::strided(static_cast<uint8_t*>(data()) + size_t(offset) * esize(), dtype_, shape, strides,
                               device_);
  }
  // The host copy's bytes (compare outputs bit for bit).
  const std::vector<uint8_t>& bytes() const { return host_; }

 private:
  size_t esize() const { return size_t(dtype_size_bytes(dtype_)); }
  DType dtype_;
  std::vector<int64_t> shape_;
  Device device_;
  int64_t numel_ = 0;
  std::vector<uint8_t> host_;
  cuda::DeviceBuffer dev_;
};

// Relative error of `got` against `ref`: max over elements of |g - r| / max(|r|, floor).
inline double max_relative_error(const std::vector<double>& got, const std::vector<double>& ref,
                                 double floor = 1e-6) {
  double worst = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(ref[i])) return INFINITY;
    if (std::isnan(ref[i])) continue;
    if (std::isinf(ref[i]) || std::isinf(got[i])) {
      if (got[i] != ref[i]) return INFINITY;
      continue;
    }
    worst = std::max(worst, std::abs(got[i] - ref[i]) / std::max(std::abs(ref[i]), floor));
  }
  return worst;
}

// Errors relative to the reference's root-mean-square: sums taken in another order
// differ by rounding of the tensor's scale, not of each element.
inline double rms_scaled_error(const std::vector<double>& got, const std::vector<double>& ref) {
  double ss = 0;
  for (double r : ref) ss += r * r;
  const double rms = ref.empty() ? 0.0 : std::sqrt(ss / double(ref.size()));
  return max_relative_error(got, ref, std::max(rms, 1e-30));
}

// Every element of `t` (downloaded first) as doubles, in order.
inline std::vector<double> values(TestTensor& t) {
  t.download();
  std::vector<double> v;
  for (int64_t i = 0; i < t.numel(); ++i) v.push_back(t.get(i));
  return v;
}

// Waits for a GPU's work (a no-op for the CPU, whose launches are synchronous).
inline void sync(const Device& dev) {
  if (dev.is_cuda()) cuda::device_synchronize(dev.index);
}

// Tolerance by the lowest-precision dtype involved.
inline double tolerance(DType t) { return is_half(t) ? 1e-2 : 1e-5; }

// `v` rounded once to `t` (to nearest even) where t is bf16 or f16; as it is otherwise.
inline double round_to(DType t, double v) {
  if (t == DType::bf16) return bf16_to_float(float_to_bf16(float(v)));
  if (t == DType::f16) return f16_to_float(float_to_f16(float(v)));
  return v;
}

// What the GPU's tensor cores take an f32 operand of a TF32 dot as: rounded to 10
// mantissa bits, to nearest with ties away from zero (cvt.rna.tf32.f32).
inline double tf32(double x) {
  float f = float(x);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace kerf::test
