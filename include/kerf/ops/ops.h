// kerf's operations: validated, dispatched calls of the kernel library.
// Tensors are views (TensorView); all of one call must share a device. GPU
// calls are asynchronous on `stream`; CPU calls return when done.
#pragma once

#include <cstdint>

#include "kerf/runtime/tensor.h"

namespace kerf::ops {

// Block sizes and launch shape; 0 lets kerf choose.
struct Config {
  int64_t block_m = 0;   // rows per program (block_n for MoE)
  int64_t block_k = 0;   // columns per step
  int64_t split_k = 0;   // programs sharing one row block (DoRA norm)
  int64_t num_warps = 0;
  int64_t num_stages = 0;
};

// DoRA weight norm and magnitude scale, without materializing B@A:
//   norm[i]  = sqrt(sum_j (W[i,j] + s * (B@A)[i,j])^2 + eps)
//   scale[i] = m[i] / norm[i]
// W [out, in] bf16/f16/f32; A [r, in] and B [out, r] any float dtype (fp32
// adapters with bf16 W are fine: the product runs in W's dtype on tensor
// cores, accumulating in fp32); m [out] any float dtype; norm and scale [out]
// f32 outputs. eps = 0 reproduces PEFT (a zero row then gives norm 0 and an
// infinite scale); a small eps keeps it finite.
void dora_norm(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& m,
               double s, const TensorView& norm, const TensorView& scale, double eps = 0.0,
               void* stream = nullptr, const Config& config = {});

// W_eff[e] = W[e] + s * B[e] @ A[e] for the experts of a MoE layer.
// W, W_eff [E, N, K]; A [E, r, K]; B [E, N, r]; any strides.
void moe_lora_materialize(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                          const TensorView& W_eff, void* stream = nullptr, const Config& config = {});

}  // namespace kerf::ops
