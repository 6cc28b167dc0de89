// kerf's kernel library, written in the DSL (sources in kernels_src/).
// Each kernel's comment gives its formula, argument order and meta-parameters.
// The `ops` API (include/kerf/ops/) validates arguments, picks the variant and
// its configuration, and launches these.
#pragma once

#include "kerf/dsl/dsl.h"

namespace kerf::kernels {

// DoRA weight norm, one pass over W without materializing B@A:
//   sumsq[i] = sum_j (W[i,j] + s * sum_k B[i,k] A[k,j])^2        (fp32 accumulation)
//   norm[i]  = sqrt(sumsq[i] + eps),  scale[i] = m[i] / norm[i]
// W [out, in] (bf16/f16/f32), A [r, in], B [out, r] (any float dtype; cast to
// DOT dtype for the product), m [out]; norm and scale [out] f32.
// Grid: (cdiv(out, BLOCK_M), SPLIT_K). Meta: BLOCK_M, BLOCK_K, R_PAD (power of
// two >= r), SPLIT_K, DOT (dtype code of the product: the DType enum value).
//
// dora_norm_fused   (SPLIT_K == 1): args W, A, B, m, s, eps, norm, scale
// dora_norm_split  (SPLIT_K >= 1, one launch): args W, A, B, m, s, eps, norm, scale,
//                   sumsq (f32 [out]), tickets (i32 [cdiv(out, BLOCK_M)]); both
//                   workspaces must be zero on entry and are zero again on exit:
//                   each split adds its partial sums into sumsq, and the split that
//                   arrives last at a row block's ticket finishes norm and scale.
// dora_norm_partial (SPLIT_K >= 1): args W, A, B, s, sumsq; adds each split's
//                   partial sum of squares into sumsq (zeroed by the caller)
// dora_norm_finish:                 args sumsq, m, eps, norm, scale; grid cdiv(out, BLOCK)
const dsl::Kernel& dora_norm_fused();
const dsl::Kernel& dora_norm_split();
const dsl::Kernel& dora_norm_partial();
const dsl::Kernel& dora_norm_finish();

// MoE LoRA weight materialization, one pass over W:
//   W_eff[e] = W[e] + s * B[e] @ A[e]
// W, W_eff [E, N, K]; A [E, r, K]; B [E, N, r]; any strides (PEFT's flat
// lora_A [r*E, K] and lora_B [N, r*E] are such views). fp32 accumulation,
// rounded once to W_eff's dtype.
// Grid: (cdiv(N, BLOCK_N), E). Meta: BLOCK_N, BLOCK_K, R_PAD, DOT.
// Args: W, A, B, s, W_eff.
const dsl::Kernel& moe_lora_materialize();

}  // namespace kerf::kernels

namespace kerf::kernels {

// out[i] = value for i < out.dim(0). Grid cdiv(n, BLOCK). Args: out, value.
const dsl::Kernel& fill();

}  // namespace kerf::kernels
