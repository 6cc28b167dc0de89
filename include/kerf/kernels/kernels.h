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
// Grid: (cdiv(out, BLOCK_M), splits): the programs of grid axis 1 share the
// in-features in whole BLOCK_K steps. Meta: BLOCK_M, BLOCK_K, R_PAD (power of
// two >= r), DOT (dtype code of the product: the DType enum value).
//
// dora_norm_fused   (one split): args W, A, B, m, s, eps, norm, scale
// dora_norm_split   (any number of splits, one launch): args W, A, B, m, s, eps, norm, scale,
//                   sumsq (f32 [out]), tickets (i32 [cdiv(out, BLOCK_M)]); both
//                   workspaces must be zero on entry and are zero again on exit:
//                   each split adds its partial sums into sumsq, and the split that
//                   arrives last at a row block's ticket finishes norm and scale.
// dora_norm_partial (any number of splits): args W, A, B, s, sumsq; adds each split's
//                   partial sum of squares into sumsq (zeroed by the caller)
// dora_norm_finish:                 args sumsq, m, eps, norm, scale; grid cdiv(out, BLOCK)
const dsl::Kernel& dora_norm_fused();
const dsl::Kernel& dora_norm_split();
const dsl::Kernel& dora_norm_partial();
const dsl::Kernel& dora_norm_finish();

// The DoRA norm of a weight stored as 4-bit codes in blocks (bitsandbytes'
// NF4/FP4 layout), dequantized in registers, never in memory:
//   W[i,j] = code[q(f)] * absmax[f >> block_shift],  f = i*in + j,
//   q(f) = high nibble of byte f/2 for even f, low nibble for odd f.
// packed u8 [out, in/2] (in even), absmax f32 [>= cdiv(out*in, blocksize)],
// code f32 [16], block_shift = log2(blocksize) (an i32 scalar; blocksize even).
// The product runs in DOT (bf16 or f16: tensor cores), accumulating in fp32;
// meta as dora_norm_fused, BLOCK_K counting weight columns (two per byte).
// dora_norm_4bit:       args packed, absmax, code, A, B, m, s, eps, block_shift, norm, scale
// dora_norm_4bit_split: the same, then sumsq and tickets as dora_norm_split
const dsl::Kernel& dora_norm_4bit();
const dsl::Kernel& dora_norm_4bit_split();

// MoE LoRA weight materialization, one pass over W:
//   W_eff[e] = W[e] + s * B[e] @ A[e]
// W, W_eff [E, N, K]; A [E, r, K]; B [E, N, r]; any strides (PEFT's flat
// lora_A [r*E, K] and lora_B [N, r*E] are such views). fp32 accumulation,
// rounded once to W_eff's dtype.
// Grid (cdiv(N, BLOCK_N), splits, E): the programs of grid axis 1 share K in
// whole BLOCK_K steps (COLS_FIRST 1 swaps the first two axes; ONE_TILE 1, as
// lora_merge's: one tile a program, one slice per column block). WALK_ROWS,
// PERSISTENT and EXPERT_GROUP lay the grid out otherwise (kernels_src/moe_lora.cpp).
// Meta: BLOCK_N, BLOCK_K, R_PAD, DOT, SCALE_AFTER (as lora_merge's), COLS_FIRST,
// ONE_TILE, WALK_ROWS, PERSISTENT, EXPERT_GROUP, EXPERTS_LAST.
// Args: W, A, B, s, W_eff.
const dsl::Kernel& moe_lora_materialize();

// grad_m[i] = grad_scale[i] / norm[i]: the backward of scale = m / norm with
// the norm a constant (as DoRA treats it). norm, grad_scale, grad_m [out], any
// float dtypes. Grid cdiv(out, BLOCK). Args: norm, grad_scale, grad_m.
const dsl::Kernel& dora_norm_backward();

// Backward of moe_lora_materialize, one pass over dW (= dW_eff):
//   dA[e] += s * B[e]^T @ dW[e]      (fp32 atomics: dA must be zero on entry)
//   dB[e]  = s * dW[e] @ A[e]^T      (stored; added atomically when DB_ATOMIC)
// dW [E, N, K]; A [E, r, K]; B [E, N, r]; dA [E, r, K] f32; dB [E, N, r] (f32
// when DB_ATOMIC); any strides. fp32 accumulation.
// Grid (cdiv(N, BLOCK_N), splits, E): the programs of grid axis 1 share K in
// whole BLOCK_K steps. Meta: BLOCK_N, BLOCK_K, R_PAD, DOT, DB_ATOMIC (needed
// with several splits; dB is then f32 and zero on entry), ROTATE, WAIT_PRIOR
// (its writes wait for the grid launched before it, as the embedding's).
// Args: dW, A, B, s, dA, dB.
const dsl::Kernel& moe_lora_backward();
// The same with rows and columns swapped: each program owns BLOCK_K columns of
// one expert and walks rows BLOCK_N at a time, accumulating dA's columns in
// registers and adding dB with fp32 atomics (dB f32, zero on entry).
//   dA[e]  = s * B[e]^T @ dW[e]      (stored; added atomically when DA_ATOMIC:
//                                     dA is then f32 and zero on entry)
//   dB[e] += s * dW[e] @ A[e]^T
// Grid (cdiv(K, BLOCK_K), splits, E): the programs of grid axis 1 share N in
// whole BLOCK_N steps. Meta: BLOCK_N, BLOCK_K, R_PAD, DOT, DA_ATOMIC, ROTATE,
// WAIT_PRIOR. Args: dW, A, B, s, dA, dB.
const dsl::Kernel& moe_lora_backward_by_columns();

// LoRA merge in place, one pass over W (unmerge: the op passes -s):
//   W[g] <- W[g] + s * B[g] @ A[g]
// W [G, out, in] bf16/f16/f32; A [G, r, in]; B [G, out, r]; any strides. fp32
// sum, rounded once to W's dtype.
// Grid (cdiv(out, BLOCK_M), splits, G): the programs of grid axis 1 share the
// in-features in whole BLOCK_K steps; with WALK_ROWS 1, (cdiv(in, BLOCK_K),
// splits, G): the programs of grid axis 1 share the rows in whole BLOCK_M steps,
// each keeping its A columns. With COLS_FIRST 1 the first two axes swap. With
// ONE_TILE 1 a program owns one BLOCK_M x BLOCK_K tile, its column block the
// slice index (the grid must have one slice per column block), and asks for
// W's tile before A's and B's; with WAIT_PRIOR too it waits for the grid
// launched before it (A's cast, LaunchOptions::overlap_prior) after asking for
// W's and B's tiles and before reading A. Meta: BLOCK_M, BLOCK_K, R_PAD, DOT,
// SCALE_AFTER (1: B is exact in DOT and s is applied in fp32 after the
// product; 0: s*B is rounded once to DOT), WALK_ROWS, COLS_FIRST, ONE_TILE,
// WAIT_PRIOR.
// Args: W, A, B, s.
const dsl::Kernel& lora_merge();

// LoRA embedding, PEFT layout (A = lora_embedding_A [r, V], B =
// lora_embedding_B [D, r]); ids global, this shard holding [start, start + V):
//   out[t, :] = weight[x[t] - start, :] + s * A[:, x[t] - start] @ B^T
//   (zeros for ids outside the shard)
// x [T] i32/i64; weight [V, D]; out [T, D]; err i64 [4]: an id outside
// [0, total) adds 1 to err[0], and the first such leaves its position in
// err[1], its value in err[2] and total in err[3]; nothing is read at such an id.
// Grid (cdiv(T, BLOCK_T), splits): the programs of grid axis 1 share D in
// whole BLOCK_D steps. Meta: BLOCK_T, BLOCK_D, R_PAD, DOT, SCALE_AFTER (as
// lora_merge's, for A).
// Args: x, weight, A, B, s, out, err, start, total.
const dsl::Kernel& lora_embedding();

// Its backward, one pass over g = grad_out [T, D]:
//   dA[:, v] += s * w(v) * sum_{t: x[t] = v + start, x[t] != padding} g[t, :] @ B
//   dB       += s * sum_t g[t, :]^T A[:, x[t] - start]^T
// w(v) = 1 / counts[v] when BY_FREQ (counts [V] i32 from embedding_count_ids),
// else 1. dA [r, V] and dB [D, r] f32, added to atomically (zero on entry).
// Grid (cdiv(T, BLOCK_T), splits), sharing D as above. Meta: BLOCK_T,
// BLOCK_D, R_PAD, DOT, BY_FREQ, ROTATE, WAIT_PRIOR (every atomic waits for the
// grid launched before it: the zero-fill of dA and dB, which it may overlap
// when launched with LaunchOptions::overlap_prior), L2_KEEP (dA and dB were
// zeroed with EVICT_LAST: once its atomics are issued, each program puts the
// L2 lines of its share of dA and dB back to normal priority; dA's and dB's
// last dimension must have stride 1), GROUP_BY_ID (dA is instead the [T, r]
// f32 sums by id: each token adds into row first[x[t] - start] - 1, first [V]
// i32 from lora_embedding_group, whose grid is the one before it (WAIT_PRIOR)
// or complete before it starts; counts come from there too).
// Args: x, A, B, g, s, dA, dB, counts, first, err, start, total, padding (-1: none).
const dsl::Kernel& lora_embedding_backward();

// The backward with GROUP_BY_ID, around lora_embedding_backward:
// lora_embedding_group counts the ids inside [start, start + V) (counts [V]
// i32, zero on entry) and leaves in first[v] (i32 [V], zero on entry) the
// position + 1 of a token of id v, the one that found its count at 0; with
// FILL_B, the programs after cdiv(T, BLOCK_T) zero dB [D, r] in [BLOCK_M,
// BLOCK_K] tiles (EVICT_LAST: evict-last stores); RELEASE as fill_3d's. Then
// lora_embedding_dense_a writes every column of dA [r, V] (any float dtype):
// sums[first[v] - 1, :] where first[v] > 0, else zeros, and sets the sums it
// read, and first and counts of every id of its block, back to zero
// (WAIT_PRIOR: launched to overlap the kernel before it, it waits for that
// grid first); with FLUSH_B, the programs
// after its column blocks write dB [D, r] (any float dtype) from its f32
// accumulator db_acc in [BLOCK_M, BLOCK_K] tiles and zero db_acc again.
// Grids: cdiv(T, BLOCK_T) (+ dB's tiles) and cdiv(V, BLOCK_V) (+ dB's
// tiles). Meta: BLOCK_T, BLOCK_M, BLOCK_K, FILL_B, EVICT_LAST, RELEASE /
// BLOCK_V, R_PAD, WAIT_PRIOR, FLUSH_B (and then BLOCK_M, BLOCK_K).
// Args: x, counts, first, dB, start / first, counts, sums (f32 [T, r]), dA,
// db_acc, dB.
const dsl::Kernel& lora_embedding_group();
const dsl::Kernel& lora_embedding_dense_a();

// The backward as one kernel whose programs wait for each other once
// (dsl::grid_sync; a cooperative launch, so its grid must fit on the GPU at once;
// CUDA only). Each token is counted by id in counts by one of the programs of its
// block (the one whose grid axis 1 index is the token's position modulo the grid's
// axis 1); the token that finds its id's count at zero owns the id. Every program makes its
// pass over g (as lora_embedding_backward's: dB's shares into db_acc), adds each
// token's sums over its slice of D into the id's row of sums (not for padding), and
// zeroes its share of dA's columns. After the grid_sync each owner writes its id's
// column of dA from the row (times 1 / count with BY_FREQ), each program its share
// of dB's rows from db_acc. sums, counts, db_acc and sync (i32 [1]) are zero on
// entry and left zero. Grid and D slices as lora_embedding_backward's. Meta:
// BLOCK_T, BLOCK_D, R_PAD, DOT, BY_FREQ, ROTATE, BLOCK_V (dA's columns zeroed a step),
// BLOCK_M (dB's rows a program: BLOCK_M * programs >= D).
// DIRECT_A (dA f32): no owners and no sums (the argument is not read); each program
// zeroes its share of dA and counts its tokens (BY_FREQ) before the pass, arrives
// (grid_arrive), and after the pass waits for every arrival (grid_await) and adds its
// tokens' sums times s / count straight into dA; a grid_sync, then dB's rows.
// Args: x, A, B, g, s, sums (f32 [V, r]), db_acc (f32 [D, r]), counts, err, start,
// total, padding, dA, dB (any float dtype), sync.
const dsl::Kernel& lora_embedding_backward_fused();

// The backward in three launches, for when grad_out is best read by column
// blocks (ops: Config.meta GATHER): lora_embedding_gather writes each token's
// LoRA activations act[t, :] = A[:, x[t] - start] (zeros outside the shard;
// records bad ids in err as lora_embedding does), moe_lora_backward_by_columns
// with E = 1 forms gB = s * g @ B [T, r] and dB in one pass over g, and
// lora_embedding_scatter adds w(v) * gB[t, :] into dA[:, x[t] - start] (not for
// padding) and sets gB and act back to zero. Grid cdiv(T, BLOCK_T).
// Meta: BLOCK_T, R_PAD (and BY_FREQ for the scatter).
// Args: x, A, act, err, start, total / x, gB (f32), act, dA (f32), counts, start, padding.
const dsl::Kernel& lora_embedding_gather();
const dsl::Kernel& lora_embedding_scatter();

// counts[x[t] - start] += 1 for the ids inside [start, start + counts.dim(0));
// with CLEAR, sets those counts back to 0. Grid cdiv(T, BLOCK_T).
// Args: x, counts (i32), start.
const dsl::Kernel& embedding_count_ids();

// out[g, i, j] = value over a rank-3 view (any strides).
// Grid (cdiv(d2, BLOCK_K), cdiv(d1, BLOCK_M), d0). Args: out, value. With the
// meta-parameter RELEASE (fill_pair too) each program first lets the kernel
// launched after it start (dsl::release_dependents), for a kernel launched with
// LaunchOptions::overlap_prior that waits for the fill before its atomics. With
// EVICT_LAST the stores ask L2 to keep their lines (dsl::Evict::last), for
// atomics that follow a long stream of other reads: the kernel after the fill
// puts them back to normal priority (dsl::l2_evict_normal).
const dsl::Kernel& fill_3d();
// Two rank-3 views set to value in one launch: grid (n0 + n1), n_i the number of
// [BLOCK_Mi, BLOCK_Ki] tiles of out_i (d0 * row blocks * column blocks).
// Args: out0, out1, value.
const dsl::Kernel& fill_pair();
// out[g, i, j] = acc[g, i, j] rounded to out's dtype, then acc[g, i, j] = 0:
// an fp32 accumulator moved to its output and left zero. Same grid as fill_3d.
// Args: acc (f32), out.
const dsl::Kernel& flush_accumulator();
// out[g, i, j] = x[g, i, j] rounded to out's dtype (fp32 adapters rounded once
// to a product's dtype). Same grid as fill_3d. With RELEASE, as fill_3d's: each
// program first lets the kernel launched after it start (one that waits for the
// cast before it reads the copy). Args: x, out (same shape).
const dsl::Kernel& cast_3d();
// out[g, j, i] = x[g, i, j] rounded to out's dtype (x [d0, d1, d2], out [d0, d2, d1]):
// a batched transpose whose loads and stores both run along a unit-stride last dim
// (through shared memory), for an operand whose unit stride is not on the dim a kernel
// reads along. With FLUSH, x (f32) is left zero (a transposing flush_accumulator); with
// WAIT_PRIOR, as flush_accumulator; with RELEASE, as cast_3d.
// Grid (cdiv(d2, BLOCK_K) * d0, cdiv(d1, BLOCK_M)). Args: x, out.
const dsl::Kernel& transpose_3d();

}  // namespace kerf::kernels

namespace kerf::kernels {

// out[i] = value for i < out.dim(0). Grid cdiv(n, BLOCK). Args: out, value.
const dsl::Kernel& fill();

}  // namespace kerf::kernels
