// Helpers the ops share: argument checks with messages that name the op and
// the argument, and the choices that depend on the device.
#pragma once

#include <string>
#include <vector>

#include "kerf/error.h"
#include "kerf/runtime/tensor.h"

namespace kerf::ops::detail {

inline int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string shape_str(const TensorView& t);

// Throws InvalidArgument unless `t` has `rank` and, where want[d] >= 0, that size.
void expect_shape(const char* op, const char* name, const TensorView& t,
                  const std::vector<int64_t>& want);
// Throws TypeError unless t.dtype is one of `allowed`.
void expect_dtype(const char* op, const char* name, const TensorView& t,
                  const std::vector<DType>& allowed);
// Throws InvalidArgument unless every tensor is on `dev`.
void expect_device(const char* op, const std::vector<std::pair<const char*, const TensorView*>>& ts);

// Multiprocessors of the tensors' device (the number of CPU threads on the CPU).
int parallelism(const Device& dev);

// Scratch memory for kernels that accumulate across programs: at least `bytes`,
// zero, on `dev`, private to `stream` (to the calling thread on the CPU).
// Kernels using it must leave it zero when they finish.
void* workspace(const Device& dev, void* stream, size_t bytes);

}  // namespace kerf::ops::detail
