// Launch helpers for ops that accumulate with atomics: zero a strided output,
// or move an fp32 accumulator into an output of another dtype (zeroing it).
#pragma once

#include "kerf/jit/launch.h"
#include "kerf/runtime/tensor.h"

namespace kerf::ops::detail {

// t (rank 3, any strides) = value.
void fill_3d(const TensorView& t, double value, const LaunchOptions& options);
// out = acc rounded to out's dtype, then acc = 0; both rank 3 with one shape.
void flush_accumulator(const TensorView& acc, const TensorView& out, const LaunchOptions& options);

// A contiguous f32 [d0, d1, d2] view at `*cursor` in a workspace, which moves
// past it (16-byte aligned).
TensorView carve_f32(char** cursor, int64_t d0, int64_t d1, int64_t d2, const Device& dev);
// The bytes carve_f32 takes for such a view.
size_t carved_bytes(int64_t d0, int64_t d1, int64_t d2);

// A rank-2 view as rank 3 with a leading dim of 1.
TensorView as_3d(const TensorView& t);

}  // namespace kerf::ops::detail
