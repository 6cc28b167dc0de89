// Launch helpers for ops that accumulate with atomics: zero a strided output,
// or move an fp32 accumulator into an output of another dtype (zeroing it).
#pragma once

#include <vector>

#include "kerf/jit/autotune.h"
#include "kerf/jit/launch.h"
#include "kerf/ops/ops.h"
#include "kerf/runtime/tensor.h"

namespace kerf::ops::detail {

// t (rank 3, any strides) = value. Each returns whether it launched a kernel (nothing
// to fill: no launch); with `release` that kernel lets the next one start early
// (kernels.h, RELEASE), for a launch with LaunchOptions::overlap_prior. With
// `keep_in_l2` the fill's lines are written evict-last (kernels.h, EVICT_LAST): the
// kernel after it must put them back to normal priority (dsl::l2_evict_normal).
bool fill_3d(const TensorView& t, double value, const LaunchOptions& options, bool release = false,
             bool keep_in_l2 = false);
// a = value and b = value in one launch (both rank 3, any shapes and strides).
bool fill_pair_3d(const TensorView& a, const TensorView& b, double value, const LaunchOptions& options,
                  bool release = false, bool keep_in_l2 = false);
// Zeroes a when `zero_a` and b when `zero_b` (before atomics add into them), in one
// launch when both.
bool zero_fills(const TensorView& a, bool zero_a, const TensorView& b, bool zero_b, const LaunchOptions& options,
                bool release = false, bool keep_in_l2 = false);
// One launch that copies x into out (rank 3, one shape), rounded to out's dtype: with
// `flush`, kernels::flush_accumulator (x f32, left zero), else kernels::cast_3d, both
// tiled along dims 1 and 2; or, where x and out have their unit strides on different dims
// (a batched transpose, such as PEFT's flat lora_B and a contiguous copy of it),
// kernels::transpose_3d over permuted views, whose loads and stores then both move whole
// vectors (the plain kernels would gather or scatter one element per sector on one side).
struct CopyLaunch {
  autotune::KernelCall call;
  Grid grid;
};
CopyLaunch plan_copy_3d(const TensorView& x, const TensorView& out, bool flush);

// out = acc rounded to out's dtype, then acc = 0; both rank 3 with one shape.
// With overlap (GPUs), the flush is launched to overlap the end of the kernel before
// it (LaunchOptions::overlap_prior) and waits for it before reading.
void flush_accumulator(const TensorView& acc, const TensorView& out, const LaunchOptions& options,
                       bool overlap = false);

// A contiguous f32 [d0, d1, d2] view at `*cursor` in a workspace, which moves
// past it (16-byte aligned).
TensorView carve_f32(char** cursor, int64_t d0, int64_t d1, int64_t d2, const Device& dev);
// The bytes carve_f32 takes for such a view.
size_t carved_bytes(int64_t d0, int64_t d1, int64_t d2);

// A rank-2 view as rank 3 with a leading dim of 1.
TensorView as_3d(const TensorView& t);

// The MoE backward's launches on rank-3 views (dW [E, N, K], A [E, r, K],
// B [E, N, r], dA [E, r, K], dB [E, N, r]) with `config`: no checks, no
// tuning. Ops built on it (the embedding backward with Config.meta GATHER)
// pass f32 dA and dB, so that it takes no workspace of its own; `db_is_zero`
// says an f32 dB is zero already (no fill before atomics).
void run_moe_backward(const TensorView& dW, const TensorView& A, const TensorView& B, double s,
                      const TensorView& dA, const TensorView& dB, const LaunchOptions& options,
                      const Config& config, bool db_is_zero = false);
// The kernel a call with `config` launches (for compile lists).
autotune::KernelCall moe_backward_kernel(const TensorView& dW, const TensorView& A, const TensorView& B, double s,
                                         const TensorView& dA, const TensorView& dB, int64_t programs,
                                         const Config& config);

}  // namespace kerf::ops::detail
