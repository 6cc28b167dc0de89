// Tensor views and kernel arguments: what a call hands to a kernel.
// A TensorView does not own memory; it describes it the way DLPack does
// (data pointer, dtype, sizes, strides in elements, device).
#pragma once

#include <array>
#include <cstdint>
#include <type_traits>
#include <string>
#include <variant>
#include <vector>

#include "kerf/dtype.h"

namespace kerf {

struct Device {
  enum class Kind : uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static Device cpu() { return Device{Kind::cpu, 0}; }
  static Device cuda(int i = 0) { return Device{Kind::cuda, i}; }
  bool is_cuda() const { return kind == Kind::cuda; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;  // "cpu", "cuda:0"
};

inline constexpr int kMaxRank = 8;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> strides{};  // in elements
  Device device;

  // A row-major contiguous view.
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                               Device device = Device::cpu());
  // A view with explicit strides (in elements).
  static TensorView strided(void* data, DType dtype, const std::vector<int64_t>& shape,
                            const std::vector<int64_t>& strides, Device device = Device::cpu());

  // The product of the sizes (wrapped modulo 2^64 where it overflows: the ops refuse such
  // views before counting on it).
  int64_t numel() const {
    uint64_t n = 1;
    for (int d = 0; d < rank && d < kMaxRank; ++d) n *= uint64_t(shape[size_t(d)]);
    return int64_t(n);
  }
  int64_t size(int d) const { return shape[size_t(d)]; }
  int64_t stride(int d) const { return strides[size_t(d)]; }
  bool is_contiguous() const;
  std::string describe() const;  // "bf16[4096,4096] strides [4096,1] on cuda:0"
};

// A scalar kernel argument; converted to the dtype the kernel declares.
struct Scalar {
  double f = 0.0;
  int64_t i = 0;  // the value when is_int; 0 otherwise (a double's integer value is checked at launch)
  bool is_int = false;
  Scalar(double v) : f(v), is_int(false) {}  // NOLINT(google-explicit-constructor)
  Scalar(float v) : Scalar(double(v)) {}     // NOLINT
  // Any integer type (int, long long, size_t, ...); an unsigned one past INT64_MAX keeps
  // its double value only, and a launch refuses it for an integer parameter.
  template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
  Scalar(T v) : f(double(v)), i(int64_t(v)), is_int(true) {  // NOLINT
    if constexpr (std::is_unsigned_v<T> && sizeof(T) >= sizeof(int64_t))
      if (v > T(INT64_MAX)) {
        i = 0;
        is_int = false;
      }
  }
};

using Arg = std::variant<TensorView, Scalar>;

// A launch grid: the number of programs along each axis.
struct Grid {
  uint32_t x = 1, y = 1, z = 1;
  uint64_t count() const { return uint64_t(x) * y * z; }
};

}  // namespace kerf
