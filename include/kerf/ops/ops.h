// kerf's operations: validated, dispatched calls of the kernel library.
// Tensors are views (TensorView); all of one call must share a device. GPU
// calls are asynchronous on `stream`; CPU calls return when done.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "kerf/ops/layout.h"
#include "kerf/runtime/tensor.h"

namespace kerf::ops {

// Block sizes and launch shape. An empty Config lets the autotuner choose; one
// with any field or meta entry set is not tuned, its zero fields taking the
// op's own values (docs/ops.md). block_m is the rows per
// program (BLOCK_N for MoE, tokens for the embedding), block_k the columns
// (embedding dims) per step, split_k the programs sharing one row block's
// columns (DoRA norm, merge, MoE materialize and its backward, embedding).
// `meta`: further meta-parameters of an op's kernels, by name; an op refuses a
// name it does not take.
//   EVICT (0-2; DoRA norm, 4-bit DoRA norm, merge, MoE materialize): L2 hints, 1 the streamed
//     weight evicted first, 2 also the adapters kept.
//   CAST_A (0 or 1; DoRA norm, 4-bit DoRA norm, merge, MoE materialize): with f32 A
//     and a bf16/f16 product, one launch first rounds A into scratch memory,
//     and the op's kernel reads that copy (the same rounding it does per step).
//   ROTATE (0 or 1; MoE backward, embedding backward): each row block walks its
//     column steps starting at a different step, so that the programs adding
//     into the same gradient rows do not all add to the same addresses at once.
//   BY_COLUMNS (0 or 1; MoE backward): each program owns a block of columns and
//     walks the rows (dA in registers, dB added atomically) instead of owning
//     rows (dB in registers, dA added atomically); block_m is then the rows per
//     step, block_k the columns per program.
//   TF32 (0 or 1, default 1; DoRA norm and partial, merge, MoE materialize and its
//     backward, embedding forward and backward): with an f16 base (or gradient)
//     and fp32/bf16 adapters the GPU multiplies them as TF32 (fp32's range, each
//     term within 2^-11 of itself); 0 multiplies them exactly in fp32 FMA, as PEFT
//     does, several times slower at large ranks (docs/ops.md). Like any Config, it
//     turns the autotuner off for the call.
struct Config {
  int64_t block_m = 0;
  int64_t block_k = 0;
  int64_t split_k = 0;
  int64_t num_warps = 0;
  int64_t num_stages = 0;
  std::map<std::string, int64_t> meta;
};

// DoRA weight norm and magnitude scale, without materializing B@A:
//   norm[i]  = sqrt(sum_j (W[i,j] + s * (B@A)[i,j])^2 + eps)
//   scale[i] = m[i] / norm[i]
// W [out, in] bf16/f16/f32; A [r, in] and B [out, r] any float dtype (fp32
// adapters with bf16 W are fine: the product runs in W's dtype on tensor
// cores, accumulating in fp32; with f16 W, in TF32 on the GPU, f16's precision
// at fp32's range; docs/ops.md); m [out] any float dtype; norm and scale [out]
// f32 outputs. eps = 0 reproduces PEFT (a zero row then gives norm 0 and an
// infinite scale); a small eps keeps it finite.
void dora_norm(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& m,
               double s, const TensorView& norm, const TensorView& scale, double eps = 0.0,
               void* stream = nullptr, const Config& config = {});

// A weight stored as 4-bit codes in blocks, as bitsandbytes keeps a
// Linear4bit weight (NF4 or FP4): element f = i*in + j of the row-major
// [out, in] weight is code[q] * absmax[f / blocksize], q the high nibble of
// byte f/2 of `packed` for even f and its low nibble for odd f.
struct Weight4bit {
  TensorView packed;       // u8, contiguous, out*in/2 bytes (bitsandbytes: weight.data, [out*in/2, 1])
  TensorView absmax;       // f32, contiguous, cdiv(out*in, blocksize) scales (quant_state.absmax,
                           // dequantized first when the state is nested)
  TensorView code;         // f32 [16]: each code's value (quant_state.code, or nf4_code_tensor(device))
  int64_t blocksize = 64;  // a power of two >= 2 (quant_state.blocksize)
};
// The values of QLoRA's 4-bit NormalFloat codes, for Weight4bit::code.
const std::array<float, 16>& nf4_code();
// nf4_code() as an f32 [16] tensor on `device`, owned by kerf: made on first
// use per device and kept for the life of the process (read-only).
TensorView nf4_code_tensor(const Device& device);

// dora_norm of a 4-bit weight, dequantized in registers and never written
// out: W is [B.shape[0], A.shape[1]] (in even). The LoRA term is formed on
// tensor cores in f16 when A and B are both f16 (s applied in fp32 after the
// product), else in bf16 (s*B and A
// rounded once: 2^-9 of the LoRA term, well below the 4-bit weight's own
// error), accumulating in fp32; other arguments as dora_norm.
void dora_norm_4bit(const Weight4bit& W, const TensorView& A, const TensorView& B, const TensorView& m, double s,
                    const TensorView& norm, const TensorView& scale, double eps = 0.0, void* stream = nullptr,
                    const Config& config = {});

// W_eff[e] = W[e] + s * B[e] @ A[e] for the experts of a MoE layer.
// W, W_eff [E, N, K]; A [E, r, K]; B [E, N, r]; any strides.
void moe_lora_materialize(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                          const TensorView& W_eff, void* stream = nullptr,
                          const Config& config = {});

// ---------------------------------------------------------------- sharded DoRA norm
// Layout operands: W [out, in], A [r, in], B [out, r], m, norm, scale [out]
// (logical dims "out", "in", "r"). W split on out (B, m, norm and scale alike)
// is purely local: the shards are computed as by dora_norm. W split on in
// needs every column of a row and is rejected here with a message pointing at
// dora_norm_partial -> sum over the axis -> dora_norm_finish. r cannot be split.
void dora_norm(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& m,
               double s, const TensorView& norm, const TensorView& scale, double eps, void* stream,
               const Config& config, const Layout& layout);

// The partial sums of squares of the DoRA norm over this shard's columns:
//   sumsq[i] = sum_{j local} (W[i,j] + s * (B@A)[i,j])^2       (f32 [out], overwritten)
// With W and A split on in over an axis, the sum of sumsq over that axis
// (all-reduce) is the whole row's sum; dora_norm_finish then gives norm and
// scale. Layout operands: W [out, in], A [r, in], B [out, r], sumsq [out];
// out may be split too (local). Unsharded, it is the whole sum.
void dora_norm_partial(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                       const TensorView& sumsq, void* stream = nullptr, const Config& config = {},
                       const Layout& layout = {});

// norm[i] = sqrt(sumsq[i] + eps), scale[i] = m[i] / norm[i]. sumsq [out] f32;
// m [out] any float dtype; norm, scale [out] f32. Elementwise: any split of
// "out" (operands sumsq, m, norm, scale) is local. eps as in dora_norm.
void dora_norm_finish(const TensorView& sumsq, const TensorView& m, double eps,
                      const TensorView& norm, const TensorView& scale, void* stream = nullptr,
                      const Layout& layout = {});

// Backward of scale = m / norm with the norm a constant (DoRA detaches it):
//   grad_m[i] = grad_scale[i] / norm[i]
// norm [out] (f32 as dora_norm writes it, or any float dtype), grad_scale and grad_m [out] any
// float dtypes. A zero norm gives inf/NaN as the division does (see eps).
// Layout operands norm, grad_scale, grad_m (dim "out"): local.
void dora_norm_backward(const TensorView& norm, const TensorView& grad_scale,
                        const TensorView& grad_m, void* stream = nullptr,
                        const Layout& layout = {});

// ---------------------------------------------------------------- LoRA merge / unmerge
// In place, one pass over W, the sum formed in fp32 and rounded once:
//   lora_merge:   W <- W + s * B @ A
//   lora_unmerge: W <- W - s * B @ A
// W [out, in] bf16/f16/f32; A [r, in], B [out, r] bf16/f16/f32 (fp32 adapters
// with a bf16 W included); any strides (PEFT's fan_in_fan_out weight is the
// strided view W.T). A and B must not overlap W. r = 0 or an empty W: nothing
// to do. Merge then unmerge gives W back within rounding of its dtype.
void lora_merge(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                void* stream = nullptr, const Config& config = {});
void lora_unmerge(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                  void* stream = nullptr, const Config& config = {});

// The JAX/Flax layout (MaxText): kernel [in..., out...], lora_a [in..., r],
// lora_b [r, out...] (e.g. query: kernel [emb, heads, head_dim], lora_a
// [emb, r], lora_b [r, heads, head_dim]); the in dims are those lora_a has:
//   kernel <- kernel +/- s * einsum("i...r,r o... -> i... o...", lora_a, lora_b)
// Through strides, no copies; dimensions that cannot be flattened are looped.
void lora_merge_flax(const TensorView& kernel, const TensorView& lora_a, const TensorView& lora_b,
                     double s, void* stream = nullptr, const Config& config = {});
void lora_unmerge_flax(const TensorView& kernel, const TensorView& lora_a, const TensorView& lora_b,
                       double s, void* stream = nullptr, const Config& config = {});

// ---------------------------------------------------------------- MoE LoRA
// moe_lora_materialize with a layout. Operands W, W_eff [E, N, K], A [E, r, K],
// B [E, N, r] (logical dims "E", "N", "K", "r"). Experts split (expert
// parallel), and N or K split alike on every operand, are local; r cannot be split.
void moe_lora_materialize(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                          const TensorView& W_eff, void* stream, const Config& config,
                          const Layout& layout);

// Backward of W_eff[e] = W[e] + s * B[e] @ A[e], one pass over dW_eff; no gradient for W:
//   dA[e] = s * B[e]^T @ dW_eff[e]      [E, r, K]
//   dB[e] = s * dW_eff[e] @ A[e]^T      [E, N, r]
// dW_eff [E, N, K] bf16/f16/f32; A, B, dA, dB any float dtypes and any strides
// (PEFT's flat layouts through peft_moe_lora_views, for the gradients too).
// dA and dB are overwritten; fp32 accumulation. Outputs must not overlap inputs
// or each other. Layout: operands dW_eff, A, B, dA, dB as in
// moe_lora_materialize; E split is local; N split makes dA a partial sum
// over that axis, K split makes dB one (the caller sums them).
void moe_lora_materialize_backward(const TensorView& dW_eff, const TensorView& A,
                                   const TensorView& B, double s, const TensorView& dA,
                                   const TensorView& dB, void* stream = nullptr,
                                   const Config& config = {}, const Layout& layout = {});

// The [E, r, K] and [E, N, r] views of PEFT's (>= 0.19) flat expert adapters,
// for a base weight W [E, d1, d2] (or its gradient), without copies:
//   is_transposed = false (W[e] is [out=d1, in=d2]): lora_A [r*E, d2],
//     lora_B [d1, r*E];  A_e[k, i] = lora_A[e*r + k, i], B_e[o, k] = lora_B[o, k*E + e]
//   is_transposed = true (W[e] is [in=d1, out=d2]; PEFT does not swap in/out):
//     lora_A [r*E, d1], lora_B [d2, r*E]; W_eff[e] = W[e] + s * (B_e @ A_e)^T,
//     given to the ops as B'[e] = A_e^T [d1, r] and A'[e] = B_e^T [r, d2].
// Throws InvalidArgument when the shapes do not fit the chosen layout (with
// d1 == d2 both fit: the flag must say which one the model uses).
struct MoeLoraViews {
  TensorView A;  // [E, r, d2]: the ops' A
  TensorView B;  // [E, d1, r]: the ops' B
};
MoeLoraViews peft_moe_lora_views(const TensorView& W, const TensorView& lora_A,
                                 const TensorView& lora_B, bool is_transposed = false);

// ---------------------------------------------------------------- LoRA embedding
// How a GPU call reports an id outside [0, vocab).
// A call captured into a CUDA graph cannot wait: it checks as `deferred` does,
// into a record of the device's own that every later check reads too.
enum class IdCheck : uint8_t {
  sync,      // wait for the kernel and throw InvalidArgument (the default)
  deferred,  // record it on the device; check_embedding_ids() throws later
};

struct EmbeddingOptions {
  // Backward: tokens with this id give no gradient to A (as F.embedding's
  // padding_idx; negative values count from the end of the vocabulary).
  std::optional<int64_t> padding_idx;
  // Backward: each id's gradient divided by its number of occurrences in x.
  bool scale_grad_by_freq = false;
  IdCheck id_check = IdCheck::sync;
  // The LoRA activations A[:, x[t]]^T, [..., r] (x's shape + r, any float dtype;
  // PEFT's `after_A`). Forward: written too (an output; zeros for ids outside the
  // shard or out of range). Backward: read by token instead of gathered from A's
  // columns by id (on an H100 that gather is ~2 us of a 40 us call at 8192 tokens:
  // the ids' load and r scattered reads a token before the first step); they must
  // be what A held at the forward (a token whose id is out of range, an error the
  // call reports either way, still reads its row). In a sharding layout it is the
  // operand "after_a", split as x's token dims are; a vocab shard's backward counts
  // the rows of ids outside its range as zeros (its own forward's, or every shard's sum).
  std::optional<TensorView> after_a;
  // A vocab shard of its own size (torch.chunk's, np.array_split's uneven shards): the
  // first id it holds and the whole vocabulary's size, given together with a layout
  // that splits vocab. Unset, shard c of n holds ids [c*V, (c+1)*V) of n*V (V: its
  // rows), which only even splits satisfy; set, it holds [vocab_start, vocab_start + V)
  // of vocab_size (no Layout::coords needed).
  std::optional<int64_t> vocab_start, vocab_size;
};

// out[t, :] = weight[x[t], :] + s * A[:, x[t]] @ B^T    (PEFT's layout)
// x [...] i32/i64 token ids (any shape of rank >= 1, flattened); weight [vocab, dim]
// bf16/f16/f32; A = lora_embedding_A [r, vocab]; B = lora_embedding_B [dim, r];
// out [..., dim] (x's shape + dim) bf16/f16/f32, fp32 sum rounded once.
// An id outside [0, vocab) is an error (InvalidArgument) and is never read: on
// the CPU the ids are checked before the launch; on a GPU the kernel masks it,
// writes zeros for that token, and records it for the op to throw (see IdCheck).
// Layout operands x, weight, A, B, out (dims "vocab", "dim", "r", and "x0",
// "x1", ... for x's dims): vocab split (vocab parallel, needs Layout::coords):
// shard c holds ids [c*V, (c+1)*V) of a vocabulary of V*n, looks up only those
// and writes zeros for the rest, so out is a partial sum over that axis. dim
// and token splits are local; r cannot be split.
void lora_embedding(const TensorView& x, const TensorView& weight, const TensorView& A,
                    const TensorView& B, double s, const TensorView& out,
                    const EmbeddingOptions& options = {}, void* stream = nullptr,
                    const Config& config = {}, const Layout& layout = {});

// Its backward given grad_out [..., dim]: the gradients of A and B (the base
// weight gets none), overwritten:
//   grad_A[:, v] = s * w(v) * sum_{t: x[t] = v} grad_out[t, :] @ B   (no gradient at padding_idx)
//   grad_B       = s * sum_t grad_out[t, :]^T A[:, x[t]]^T
//   w(v) = 1 / (occurrences of v in x) with scale_grad_by_freq, else 1
// grad_A [r, vocab], grad_B [dim, r] any float dtypes, fp32 accumulation. With
// a layout (operands x, A, B, grad_out, grad_A, grad_B): vocab split makes
// grad_B a partial sum over that axis; token splits make both partial; a dim
// split makes grad_A partial.
void lora_embedding_backward(const TensorView& x, const TensorView& A, const TensorView& B,
                             const TensorView& grad_out, double s, const TensorView& grad_A,
                             const TensorView& grad_B, const EmbeddingOptions& options = {},
                             void* stream = nullptr, const Config& config = {},
                             const Layout& layout = {});

// Waits for `stream` and throws InvalidArgument when an embedding call with
// IdCheck::deferred on it saw an id out of range since the last check (the
// record is then cleared); then the same for launches of captured CUDA graphs
// on the device (synchronize the stream they ran on first). A no-op for CPU
// devices; during a capture of `stream` it throws (nothing may wait then).
void check_embedding_ids(const Device& device, void* stream = nullptr);

}  // namespace kerf::ops
