// ops::moe_lora_materialize_backward (dA, dB in one pass over dW_eff) and
// ops::peft_moe_lora_views, against float64 references written in PEFT's own
// index formulas: the plain batched layout, PEFT's flat layout, and PEFT's
// layout for transposed expert weights (forward and backward).
#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <tuple>

#include "catch.h"
#include "cpu_test_util.h"
#include "device_tensor.h"
#include "gpu_test_util.h"
#include "kerf/error.h"
#include "kerf/jit/autotune.h"
#include "kerf/jit/cuda_codegen.h"
#include "kerf/jit/launch.h"
#include "kerf/kernels/kernels.h"
#include "kerf/ops/ops.h"
#include "kernels_src/ops_accumulate.h"
#include "kernels_src/ops_common.h"
#include "smem_fit_util.h"
#include "test_cache_util.h"

using namespace kerf;
using kerf::test::TestTensor;
using kerf::test::sm90a_smem_bytes;

namespace {

enum class MoeLayout { plain, peft, peft_transposed };

const char* layout_name(MoeLayout l) {
  return l == MoeLayout::plain ? "plain" : l == MoeLayout::peft ? "peft" : "peft_transposed";
}

// Errors relative to the root-mean-square of the reference's non-zero entries
// (gradients are sums with cancellation, and sparse: elements near zero are
// judged on the tensor's scale).
double scaled_error(const std::vector<double>& got, const std::vector<double>& ref) {
  double ss = 0;
  size_t n = 0;
  for (double r : ref)
    if (r != 0) {
      ss += r * r;
      ++n;
    }
  const double rms = std::sqrt(ss / double(std::max<size_t>(n, 1)));
  return test::max_relative_error(got, ref, std::max(rms, 1e-30));
}

struct BackwardCase {
  int64_t E, d1, d2, r;
  DType w, ab, grads;
  MoeLayout layout;
  int64_t split = 0;  // 0: kerf chooses; 1: dB stored directly; > 1: dB accumulated too
  bool rotate = false;  // Config.meta ROTATE: row blocks start their column steps apart
  bool by_columns = false;  // Config.meta BY_COLUMNS: the column-owning kernel (split: of the rows)
  int64_t l2_prefetch = 0;  // Config.meta L2_PREFETCH (a hint: the same answer)
  bool wgmma = false;  // Config.meta WGMMA: Hopper's warpgroup dots, 128-row blocks of 8 warps
  int64_t cluster = 0;  // Config.meta CLUSTER: each step's atomics summed over clusters of blocks first
  bool staged = false;  // Config.meta STAGED_ADDS: each step's atomics through shared memory, whole rows
  bool wgmma_ss = false;  // Config.meta WGMMA_SS: with WGMMA, A from shared memory too
  bool wide = false;  // with WGMMA and by_columns: 512 columns per program on two stages
  bool db_workspace = false;  // Config.meta DB_WORKSPACE: an f32 dB summed in the workspace, then flushed
  int64_t pack = -1;  // Config.meta PACK (-1: unset, on for GPUs): strided adapters copied, gradients via workspace
};

// The Config a case asks for.
ops::Config backward_config(const BackwardCase& c) {
  ops::Config cfg;
  cfg.split_k = c.split;
  if (c.rotate) {
    cfg.block_m = 16;  // several row blocks per expert, so that they do start apart
    cfg.block_k = 32;
    cfg.meta["ROTATE"] = 1;
  }
  if (c.by_columns) {
    cfg.block_m = 16;  // rows per step
    cfg.block_k = 32;  // columns per program
    cfg.meta["BY_COLUMNS"] = 1;
  }
  if (c.l2_prefetch) cfg.meta["L2_PREFETCH"] = c.l2_prefetch;
  if (c.wgmma) {
    cfg.block_m = c.by_columns ? 64 : 128;  // the column-owning kernel: 64 rows per step, 256 columns
    cfg.block_k = c.by_columns ? 256 : 64;
    // An f16 gradient with fp32 adapters multiplies in TF32 (mma.sync, f32 tiles): 128
    // columns, for 256 with staged adds take 272384 bytes of shared memory, over an H100's.
    if (c.by_columns && c.w == DType::f16 && c.ab != DType::f16) cfg.block_k = 128;
    cfg.num_warps = 8;
    cfg.num_stages = 3;
    cfg.meta["WGMMA"] = 1;
    if (c.wgmma_ss) cfg.meta["WGMMA_SS"] = 1;
    if (c.wide) {
      cfg.block_k = 512;
      cfg.num_stages = 2;
    }
  }
  if (c.staged) cfg.meta["STAGED_ADDS"] = 1;
  if (c.db_workspace) cfg.meta["DB_WORKSPACE"] = 1;
  if (c.pack >= 0) cfg.meta["PACK"] = c.pack;
  if (c.cluster) {
    cfg.meta["CLUSTER"] = c.cluster;
    if (!c.wgmma && !c.rotate && !c.by_columns) {
      cfg.block_m = 16;  // several row blocks per expert, the last cluster part past the rows
      cfg.block_k = 32;
    }
  }
  return cfg;
}

// The shapes of a case's adapters (and their gradients) as stored: PEFT's flat tensors
// (lora_A [r*E, in], lora_B [out, r*E]), or plain [E, r, d2] / [E, d1, r].
std::pair<std::vector<int64_t>, std::vector<int64_t>> adapter_shapes(const BackwardCase& c) {
  const int64_t E = c.E, d1 = c.d1, d2 = c.d2, r = c.r;
  if (c.layout == MoeLayout::plain) return {{E, r, d2}, {E, d1, r}};
  const bool transposed = c.layout == MoeLayout::peft_transposed;  // W[e] is [in, out]
  return {{r * E, transposed ? d1 : d2}, {transposed ? d2 : d1, r * E}};
}

// The op's operands for a case: dW [E, d1, d2] and the adapters and gradients as stored
// (adapter_shapes) seen through the views it takes.
struct BackwardViews {
  TensorView A, B, dA, dB;
};
BackwardViews backward_views(const BackwardCase& c, const TensorView& dW, const TensorView& A, const TensorView& B,
                             const TensorView& dA, const TensorView& dB) {
  if (c.layout == MoeLayout::plain) return {A, B, dA, dB};
  const bool transposed = c.layout == MoeLayout::peft_transposed;
  const ops::MoeLoraViews v = ops::peft_moe_lora_views(dW, A, B, transposed);
  const ops::MoeLoraViews g = ops::peft_moe_lora_views(dW, dA, dB, transposed);
  return {v.A, v.B, g.A, g.B};
}

void check_backward(const BackwardCase& c, Device dev, uint64_t seed) {
  CAPTURE(c.E, c.d1, c.d2, c.r, dtype_name(c.w), dtype_name(c.ab), dtype_name(c.grads),
          layout_name(c.layout), c.split, seed, dev.str(), c.rotate, c.by_columns, c.l2_prefetch, c.wgmma,
          c.cluster, c.staged, c.wgmma_ss, c.wide, c.db_workspace, c.pack);
  std::mt19937_64 rng(seed);
  const int64_t E = c.E, d1 = c.d1, d2 = c.d2, r = c.r;
  TestTensor dW(c.w, {E, d1, d2}, dev);
  dW.randomize(rng);
  const std::vector<uint8_t> dw_before = dW.bytes();
  // in/out of each expert's matrix W[e] [d1, d2]: PEFT's names.
  const bool transposed = c.layout == MoeLayout::peft_transposed;
  const int64_t in = transposed ? d1 : d2, out = transposed ? d2 : d1;
  const bool flat = c.layout != MoeLayout::plain;
  TestTensor A(c.ab, adapter_shapes(c).first, dev), B(c.ab, adapter_shapes(c).second, dev);
  TestTensor dA(c.grads, A.shape(), dev), dB(c.grads, B.shape(), dev);
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  const BackwardViews v = backward_views(c, dW.view(), A.view(), B.view(), dA.view(), dB.view());
  const TensorView &a = v.A, &b = v.B, &da = v.dA, &db = v.dB;
  const double s = 0.75;
  const ops::Config cfg = backward_config(c);

  // References in each layout's own terms.
  const auto w = [&](int64_t e, int64_t i, int64_t j) { return dW.get((e * d1 + i) * d2 + j); };
  std::vector<double> ga, ra, gb, rb;
  if (!flat) {
    for (int64_t e = 0; e < E; ++e)
      for (int64_t k = 0; k < r; ++k)
        for (int64_t j = 0; j < d2; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < d1; ++i) acc += B.get((e * d1 + i) * r + k) * w(e, i, j);
          ra.push_back(s * acc);
        }
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < d1; ++i)
        for (int64_t k = 0; k < r; ++k) {
          double acc = 0;
          for (int64_t j = 0; j < d2; ++j) acc += w(e, i, j) * A.get((e * r + k) * d2 + j);
          rb.push_back(s * acc);
        }
  } else {
    // PEFT: A_e[k, x] = lora_A[e*r + k, x] (x over in), B_e[o, k] = lora_B[o, k*E + e] (o over
    // out); delta[e] = s * B_e @ A_e laid out as W[e] [out, in], or its transpose [in, out].
    const auto wt = [&](int64_t e, int64_t o, int64_t x) {
      return transposed ? w(e, x, o) : w(e, o, x);
    };
    const auto la = [&](int64_t e, int64_t k, int64_t x) { return A.get((e * r + k) * in + x); };
    const auto lb = [&](int64_t e, int64_t o, int64_t k) { return B.get(o * r * E + k * E + e); };
    for (int64_t e = 0; e < E; ++e)
      for (int64_t k = 0; k < r; ++k)
        for (int64_t x = 0; x < in; ++x) {
          double acc = 0;
          for (int64_t o = 0; o < out; ++o) acc += lb(e, o, k) * wt(e, o, x);
          ra.push_back(s * acc);
        }
    for (int64_t e = 0; e < E; ++e)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t k = 0; k < r; ++k) {
          double acc = 0;
          for (int64_t x = 0; x < in; ++x) acc += wt(e, o, x) * la(e, k, x);
          rb.push_back(s * acc);
        }
  }
  const bool half = is_half(c.w) || is_half(c.grads);
  const double tol = half ? test::tolerance(DType::bf16) : test::tolerance(DType::f32);
  // Twice into poisoned gradients: a call must leave its fp32 workspace (the
  // flushed accumulators of bf16/f16 gradients) zero for the next one.
  for (int call = 0; call < 2; ++call) {
    CAPTURE(call);
    dA.poison();
    dB.poison();
    ops::moe_lora_materialize_backward(dW.view(), a, b, s, da, db, nullptr, cfg);
    test::sync(dev);
    dA.download();
    dB.download();
    CHECK(dW.bytes() == dw_before);  // no gradient for W: dW_eff is only read
    // The results in the order of the references above: dA's own order in both
    // layouts ([E, r, d2], or lora_A's expert-major rows), dB's unless it is PEFT's
    // rank-major lora_B.
    ga.clear();
    gb.clear();
    for (int64_t i = 0; i < dA.numel(); ++i) ga.push_back(dA.get(i));
    if (!flat) {
      for (int64_t i = 0; i < dB.numel(); ++i) gb.push_back(dB.get(i));
    } else {
      for (int64_t e = 0; e < E; ++e)
        for (int64_t o = 0; o < out; ++o)
          for (int64_t k = 0; k < r; ++k) gb.push_back(dB.get(o * r * E + k * E + e));
    }
    CHECK(scaled_error(ga, ra) <= tol);
    CHECK(scaled_error(gb, rb) <= tol);
  }
}

// The float64 cases run on `dev`: each case, each WGMMA case again with both operands of its
// warpgroup dots in shared memory, and each case in PEFT's layouts (adapters and gradients
// strided along their last dims) again the other way round as to PACK: copied and through
// the workspace on the CPU too, read and written in place on the GPU (not the 64x512 tile
// with fp32 adapters: lora_B read in place as fp32 needs 258048 bytes of shared memory
// there, over an H100's, and the call refuses it with that message; the tuner measures and
// leaves it out).
std::vector<BackwardCase> backward_runs(Device dev) {
  const std::vector<BackwardCase> cases = {
      {3, 100, 130, 5, DType::f32, DType::f32, DType::f32, MoeLayout::plain},
      {3, 100, 130, 5, DType::bf16, DType::f32, DType::f32, MoeLayout::peft},
      {3, 100, 130, 5, DType::bf16, DType::bf16, DType::bf16, MoeLayout::peft, 1},
      {2, 64, 256, 16, DType::bf16, DType::bf16, DType::f32, MoeLayout::plain, 1},
      {2, 64, 256, 16, DType::bf16, DType::bf16, DType::bf16, MoeLayout::plain, 3},
      {2, 64, 256, 16, DType::f16, DType::f32, DType::f16, MoeLayout::peft, 2},
      {4, 48, 40, 8, DType::f32, DType::bf16, DType::f32, MoeLayout::peft_transposed},
      {3, 70, 33, 4, DType::bf16, DType::f32, DType::bf16, MoeLayout::peft_transposed, 2},
      {5, 17, 29, 1, DType::f32, DType::f32, DType::f32, MoeLayout::peft, 4},
      {3, 100, 130, 5, DType::bf16, DType::f32, DType::f32, MoeLayout::peft, 1, true},
      {2, 64, 300, 16, DType::bf16, DType::bf16, DType::bf16, MoeLayout::plain, 3, true},
      {3, 70, 33, 4, DType::f32, DType::f32, DType::f32, MoeLayout::peft_transposed, 0, true},
      // The column-owning kernel: dA stored (split 1) or added (rows split), dB added
      // in place (f32) or through the workspace (bf16/f16), rotated or not.
      {3, 100, 130, 5, DType::f32, DType::f32, DType::f32, MoeLayout::plain, 1, false, true},
      {3, 100, 130, 5, DType::bf16, DType::f32, DType::bf16, MoeLayout::peft, 1, true, true},
      {2, 64, 256, 16, DType::bf16, DType::bf16, DType::f32, MoeLayout::plain, 3, true, true},
      {2, 90, 70, 33, DType::f16, DType::f32, DType::f16, MoeLayout::peft_transposed, 2, false, true},
      {5, 17, 29, 1, DType::f32, DType::f32, DType::bf16, MoeLayout::peft, 0, false, true},
      // L2 prefetch size hints on the pipelined copies.
      {2, 64, 300, 16, DType::bf16, DType::bf16, DType::bf16, MoeLayout::plain, 3, true, false, 256},
      {3, 100, 130, 5, DType::bf16, DType::f32, DType::bf16, MoeLayout::peft, 1, true, true, 128},
      // Warpgroup dots (WGMMA): both products, rows not a multiple of the block, rank 64 and 5.
      {2, 300, 200, 64, DType::bf16, DType::bf16, DType::f32, MoeLayout::plain, 0, true, false, 0, true},
      {3, 150, 130, 5, DType::bf16, DType::f32, DType::bf16, MoeLayout::peft, 2, true, false, 0, true},
      {2, 130, 64, 32, DType::f16, DType::f16, DType::f16, MoeLayout::peft_transposed, 1, false, false, 0, true},
      // Atomics summed over clusters of 2-4 blocks first (7 row blocks of 16 in 2s and 4s,
      // 3 of 128 with WGMMA in 2s, 5 column blocks of 32 in 3s), gradients in place or
      // through the workspace, rotated by cluster or not.
      {3, 100, 130, 5, DType::f32, DType::f32, DType::f32, MoeLayout::plain, 1, false, false, 0, false, 2},
      {3, 100, 130, 5, DType::bf16, DType::f32, DType::bf16, MoeLayout::peft, 2, false, false, 0, false, 4},
      {2, 64, 300, 16, DType::bf16, DType::bf16, DType::bf16, MoeLayout::plain, 3, true, false, 0, false, 2},
      {2, 300, 200, 64, DType::bf16, DType::bf16, DType::f32, MoeLayout::plain, 0, true, false, 0, true, 2},
      {3, 150, 130, 5, DType::bf16, DType::f32, DType::bf16, MoeLayout::peft, 2, false, false, 0, true, 4},
      {3, 100, 130, 5, DType::bf16, DType::f32, DType::bf16, MoeLayout::peft, 1, true, true, 0, false, 3},
      {2, 90, 150, 33, DType::f16, DType::f32, DType::f32, MoeLayout::peft_transposed, 2, false, true, 0, false, 2},
      // Each step's atomics staged through shared memory: the column-owning kernel's 64x256
      // WGMMA tile (rows and columns not multiples of it, rank 64 and 33, rotated or not, dB
      // in place or through the workspace, rows split), without WGMMA (mma.sync, fp32 dots),
      // and the row-owning kernel's dA share.
      {2, 300, 600, 64, DType::bf16, DType::bf16, DType::f32, MoeLayout::plain, 0, false, true, 0, true, 0, true},
      {2, 90, 300, 33, DType::f16, DType::f32, DType::f16, MoeLayout::peft_transposed, 2, true, true, 0, true, 0, true},
      {3, 100, 130, 5, DType::bf16, DType::bf16, DType::bf16, MoeLayout::peft, 1, false, true, 0, false, 0, true},
      {3, 100, 130, 5, DType::f32, DType::f32, DType::f32, MoeLayout::plain, 1, true, true, 0, false, 0, true},
      {3, 150, 130, 5, DType::bf16, DType::f32, DType::bf16, MoeLayout::peft, 2, false, false, 0, true, 0, true},
      {2, 64, 300, 16, DType::bf16, DType::bf16, DType::f32, MoeLayout::plain, 3, true, false, 0, false, 0, true},
      // The column-owning 64x512 tile on two stages, the dW tile read by both products
      // from shared memory (the tuner's wide candidate; over an H100's shared memory where
      // a tile cannot be copied whole, see below): columns past the last whole block of
      // 512, dB through the workspace or in place, rotated, rows split or whole.
      {2, 300, 1104, 64, DType::bf16, DType::bf16, DType::bf16, MoeLayout::plain, 0, false, true, 0, true, 0, true,
       true, true},
      {2, 150, 600, 16, DType::bf16, DType::bf16, DType::f32, MoeLayout::plain, 2, true, true, 0, true, 0, true, true,
       true},
      {2, 150, 1104, 64, DType::bf16, DType::bf16, DType::bf16, MoeLayout::plain, 1, false, true, 0, true, 0, true, true,
       true},
      // The tuner's choice for PEFT's usual fp32 adapters and gradients on a bf16 base: lora_A
      // read as fp32 in place, lora_B copied into bf16, dB summed in the workspace and
      // flushed into PEFT's flat gradient, rows whole.
      {3, 130, 1104, 64, DType::bf16, DType::f32, DType::f32, MoeLayout::peft, 1, false, true, 0, true, 0, true, true,
       true},
      // An f32 dB summed in the fp32 workspace and flushed into it (DB_WORKSPACE): PEFT's
      // flat gradient (rank columns E apart) from the column-owning kernel, with and
      // without WGMMA and staged adds; the row-owning kernel's split rows; PEFT's transposed
      // experts.
      {3, 100, 130, 5, DType::bf16, DType::f32, DType::f32, MoeLayout::peft, 1, false, true, 0, false, 0, false, false,
       false, true},
      {2, 300, 600, 64, DType::bf16, DType::f32, DType::f32, MoeLayout::peft, 0, false, true, 0, true, 0, true, false,
       false, true},
      {2, 64, 300, 16, DType::bf16, DType::bf16, DType::f32, MoeLayout::plain, 3, true, false, 0, false, 0, false, false,
       false, true},
      {2, 90, 150, 33, DType::f16, DType::f32, DType::f32, MoeLayout::peft_transposed, 2, false, true, 0, false, 0, true,
       false, false, true},
  };
  std::vector<BackwardCase> runs = cases;
  for (BackwardCase c : cases)
    if (c.wgmma && !c.wgmma_ss) {
      c.wgmma_ss = true;
      runs.push_back(c);
    }
  for (BackwardCase c : cases)
    if (c.layout != MoeLayout::plain && !c.cluster && !(dev.is_cuda() && c.wide && c.ab == DType::f32)) {
      c.pack = dev.is_cuda() ? 0 : 1;
      runs.push_back(c);
    }
  return runs;
}

void run_backward_cases(Device dev) {
  uint64_t seed = 5100;
  for (const BackwardCase& c : backward_runs(dev)) check_backward(c, dev, seed++);
}

// The forward through PEFT's layouts. Not transposed: W_eff[e][o, i] = W[e][o, i] +
// s * sum_k lora_B[o, k*E + e] * lora_A[e*r + k, i]; transposed experts: W_eff[e][i, o] =
// W[e][i, o] + s * sum_k lora_A[e*r + k, i] * lora_B[o, k*E + e]. `pack`: Config.meta PACK
// (-1: unset, on for GPUs), the strided adapters copied contiguous first or read in place.
void check_forward_peft(Device dev, uint64_t seed, bool transposed, int64_t pack, DType ab, int64_t E, int64_t d1,
                        int64_t d2, int64_t r, ops::Config cfg = {}) {
  std::string meta;
  for (const auto& [name, value] : cfg.meta) meta += name + "=" + std::to_string(value) + " ";
  CAPTURE(seed, dev.str(), transposed, pack, dtype_name(ab), E, d1, d2, r, cfg.block_m, cfg.block_k, cfg.split_k, meta);
  std::mt19937_64 rng(seed);
  const int64_t in = transposed ? d1 : d2, out_dim = transposed ? d2 : d1;
  TestTensor W(DType::bf16, {E, d1, d2}, dev), out(DType::bf16, {E, d1, d2}, dev);
  TestTensor lA(ab, {r * E, in}, dev), lB(ab, {out_dim, r * E}, dev);
  W.randomize(rng);
  lA.randomize(rng, -0.5, 0.5);
  lB.randomize(rng, -0.5, 0.5);
  out.poison();
  if (pack >= 0) cfg.meta["PACK"] = pack;
  const ops::MoeLoraViews v = ops::peft_moe_lora_views(W.view(), lA.view(), lB.view(), transposed);
  ops::moe_lora_materialize(W.view(), v.A, v.B, 0.5, out.view(), nullptr, cfg);
  test::sync(dev);
  out.download();
  std::vector<double> got, ref;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < d1; ++i)
      for (int64_t j = 0; j < d2; ++j) {
        const int64_t x = transposed ? i : j, o = transposed ? j : i;  // in and out indices
        double d = 0;
        for (int64_t k = 0; k < r; ++k) d += lA.get((e * r + k) * in + x) * lB.get(o * r * E + k * E + e);
        ref.push_back(W.get((e * d1 + i) * d2 + j) + 0.5 * d);
        got.push_back(out.get((e * d1 + i) * d2 + j));
      }
  CHECK(test::max_relative_error(got, ref, 1.0) <= test::tolerance(DType::bf16));
}

// The forward's PEFT-layout cases on `dev`: each layout, PACK unset and the other way
// round from the device's default, fp32 and bf16 adapters; transposed experts (both
// adapters strided) with PACK 2 too (A copied, B read in place).
struct ForwardPeftCase {
  bool transposed;
  int64_t pack;
  DType ab;
  int64_t E, d1, d2, r;
};
std::vector<ForwardPeftCase> forward_peft_cases(Device dev) {
  std::vector<ForwardPeftCase> cases;
  for (const bool transposed : {true, false})
    for (const int64_t pack : {int64_t(-1), dev.is_cuda() ? int64_t(0) : int64_t(1)}) {
      cases.push_back({transposed, pack, DType::f32, 3, 40, 56, 4});
      cases.push_back({transposed, pack, DType::bf16, 5, 70, 150, 16});
    }
  cases.push_back({true, 2, DType::f32, 3, 40, 56, 4});
  cases.push_back({true, 2, DType::bf16, 5, 70, 150, 16});
  return cases;
}

void check_forward_peft_layouts(Device dev) {
  uint64_t seed = 5200;
  for (const ForwardPeftCase& c : forward_peft_cases(dev))
    check_forward_peft(dev, seed++, c.transposed, c.pack, c.ab, c.E, c.d1, c.d2, c.r);
}

// PEFT's flat lora_B read in place by clusters of neighbouring experts (EXPERT_GROUP G
// experts along grid axis 0, CLUSTER C of them sharing each sector: EXPERTS_LAST), for
// groups of 8 and 16 at clusters of 2, 4 and 8, fp32 and bf16 adapters, ranks below and
// at their padding, rows and columns that are not multiples of the tiles, the column split
// over several programs, and an expert count of several groups; a GPU tile on one
// warpgroup through W's ring as the op's own (WGMMA on sm_90a) and a plain one. E = G + 4
// leaves programs past the last expert in the last group's clusters (they hand the others
// their values and write nothing). On CPUs the same grid reads B per program.
void check_forward_peft_clusters(Device dev) {
  uint64_t seed = 5300;
  struct Tile {
    int64_t bm, bk, warps, stages;
    std::map<std::string, int64_t> meta;
  };
  const std::vector<Tile> tiles =
      dev.is_cuda() ? std::vector<Tile>{{64, 128, 4, 3, {{"WGMMA", 1}, {"STORE_IN_RING", 1}, {"L2_PREFETCH", 128}}},
                                        {32, 64, 4, 2, {}}}
                    : std::vector<Tile>{{16, 32, 0, 0, {}}};
  for (const Tile& t : tiles)
    // Cluster 0: the group's programs read B in place (PACK 0), each its own expert's.
    for (const auto& [G, C] : {std::pair<int64_t, int64_t>{16, 8}, {8, 4}, {8, 2}, {16, 0}})
      for (const auto& [E, r, ab] : {std::tuple{int64_t(16), int64_t(16), DType::bf16},
                                     {G == 16 ? 48 : 24, 5, DType::f32}, {32, 64, DType::bf16}, {G + 4, 16, DType::bf16}})
        for (const int64_t split : {1, 3}) {
          ops::Config cfg{t.bm, t.bk, split, t.warps, t.stages, t.meta};
          cfg.meta["EXPERT_GROUP"] = G;
          if (C) {
            cfg.meta["CLUSTER"] = C;
            cfg.meta["EXPERTS_LAST"] = 1;
          } else {
            cfg.meta["PACK"] = 0;
          }
          check_forward_peft(dev, seed++, false, -1, ab, E, 70, 150, r, cfg);
        }
}

void check_backward_edges(Device dev) {
  // N = 0: dA is a sum over nothing (zeros); dB is empty.
  TestTensor dW(DType::bf16, {2, 0, 8}, dev), A(DType::f32, {2, 3, 8}, dev),
      B(DType::f32, {2, 0, 3}, dev);
  TestTensor dA(DType::f32, {2, 3, 8}, dev), dB(DType::f32, {2, 0, 3}, dev);
  dA.poison();
  ops::moe_lora_materialize_backward(dW.view(), A.view(), B.view(), 1.0, dA.view(), dB.view());
  test::sync(dev);
  dA.download();
  for (int64_t i = 0; i < dA.numel(); ++i) CHECK(dA.get(i) == 0.0);
  // E = 0 and r = 0: nothing to do.
  TestTensor z(DType::f32, {0, 4, 4}, dev), za(DType::f32, {0, 2, 4}, dev),
      zb(DType::f32, {0, 4, 2}, dev);
  CHECK_NOTHROW(ops::moe_lora_materialize_backward(z.view(), za.view(), zb.view(), 1.0, za.view(),
                                                   zb.view()));
  TestTensor w(DType::f32, {2, 4, 4}, dev), ra(DType::f32, {2, 0, 4}, dev),
      rb(DType::f32, {2, 4, 0}, dev);
  CHECK_NOTHROW(ops::moe_lora_materialize_backward(w.view(), ra.view(), rb.view(), 1.0, ra.view(),
                                                   rb.view()));
}

}  // namespace

TEST_CASE("moe_lora_materialize_backward matches a float64 reference in every layout on the CPU",
          "[cpu][ops][moe]") {
  KERF_REQUIRE_CPU_BACKEND();
  run_backward_cases(Device::cpu());
}

TEST_CASE("moe_lora_materialize_backward matches a float64 reference in every layout on the GPU",
          "[gpu][ops][moe]") {
  KERF_REQUIRE_GPU();
  run_backward_cases(Device::cuda(0));
}

// Every kernel the GPU cases above launch fits an H100's shared memory (a case over it is
// refused at launch, which only a GPU run would show): each case as planned for sm_90a, on
// the adapters PACK copies where it copies them.
TEST_CASE("the tiles of moe_lora_materialize_backward's GPU float64 cases fit an H100's shared memory",
          "[cuda][codegen][ops][moe]") {
  const Device dev = Device::cuda(0);
  void* const p = test::planning_address();
  int planned = 0;
  for (const BackwardCase& c : backward_runs(dev)) {
    CAPTURE(c.E, c.d1, c.d2, c.r, dtype_name(c.w), dtype_name(c.ab), dtype_name(c.grads), layout_name(c.layout),
            c.split, c.rotate, c.by_columns, c.wgmma, c.cluster, c.staged, c.wgmma_ss, c.wide, c.db_workspace, c.pack);
    const auto [a_shape, b_shape] = adapter_shapes(c);
    const auto t = [&](DType d, const std::vector<int64_t>& shape) { return TensorView::contiguous(p, d, shape, dev); };
    const TensorView dW = t(c.w, {c.E, c.d1, c.d2});
    const BackwardViews v =
        backward_views(c, dW, t(c.ab, a_shape), t(c.ab, b_shape), t(c.grads, a_shape), t(c.grads, b_shape));
    test::check_fits_h100("moe_lora_materialize_backward", {dW, v.A, v.B, v.dA, v.dB}, backward_config(c));
    ++planned;
  }
  CHECK(planned >= 40);
}

// Untuned (KERF_AUTOTUNE=0, or a first call in a capture): the op's own tiles, narrowed at
// ranks >= 128 to fit the shared memory, on every product.
TEST_CASE("moe_lora_materialize_backward with its untuned tiles at ranks 128 and 256 matches a float64 reference "
          "on the GPU",
          "[gpu][ops][moe][large_rank]") {
  KERF_REQUIRE_GPU();
  test::ScopedEnv env({{"KERF_AUTOTUNE", "0"}});
  const std::vector<BackwardCase> cases = {
      {2, 100, 130, 128, DType::bf16, DType::bf16, DType::f32, MoeLayout::peft},
      {2, 90, 150, 256, DType::f16, DType::f32, DType::f16, MoeLayout::peft_transposed},
      {2, 64, 200, 256, DType::f32, DType::f32, DType::f32, MoeLayout::plain},
      {2, 130, 300, 256, DType::bf16, DType::bf16, DType::bf16, MoeLayout::plain},
      // PEFT's fp32 adapters on bf16 (a bf16 product, the adapters staged as fp32).
      {2, 100, 130, 256, DType::bf16, DType::f32, DType::bf16, MoeLayout::peft},
      {2, 64, 200, 128, DType::bf16, DType::f32, DType::f32, MoeLayout::plain},
  };
  uint64_t seed = 4700;
  for (const BackwardCase& c : cases) check_backward(c, Device::cuda(0), seed++);
}

// An untuned call at ranks up to 64 with a 16-bit product runs the column-owning kernel
// (64x256, staged dB adds, warpgroup dots on sm_90a): sizes its tile does not divide, the
// PEFT layouts, fp32 adapters and gradients of every float dtype.
TEST_CASE("moe_lora_materialize_backward with its untuned tiles at ranks up to 64 matches a float64 reference "
          "on the GPU",
          "[gpu][ops][moe]") {
  KERF_REQUIRE_GPU();
  test::ScopedEnv env({{"KERF_AUTOTUNE", "0"}});
  const std::vector<BackwardCase> cases = {
      {3, 100, 300, 16, DType::bf16, DType::bf16, DType::bf16, MoeLayout::peft},
      {2, 130, 520, 64, DType::bf16, DType::f32, DType::f32, MoeLayout::plain},
      {2, 72, 260, 48, DType::f16, DType::f16, DType::f16, MoeLayout::peft_transposed},
      {1, 257, 250, 64, DType::bf16, DType::bf16, DType::f32, MoeLayout::peft},
      {2, 64, 72, 7, DType::f16, DType::f16, DType::bf16, MoeLayout::plain},
  };
  uint64_t seed = 4800;
  for (const BackwardCase& c : cases) check_backward(c, Device::cuda(0), seed++);
  // One 512-column block per multiprocessor, rank 33-64, 16-bit adapters: on sm_90a the
  // 64x512 tile with rows whole (the last block partly past K, rows not a multiple of 64).
  const int64_t E = ops::detail::parallelism(Device::cuda(0));
  for (const BackwardCase& c : {BackwardCase{E, 70, 504, 64, DType::bf16, DType::bf16, DType::bf16, MoeLayout::plain},
                                BackwardCase{E, 70, 504, 40, DType::bf16, DType::bf16, DType::f32, MoeLayout::peft}})
    check_backward(c, Device::cuda(0), seed++);
}

// What an untuned GPU call plans (nothing is launched): the column-owning kernel's own
// tile for 16-bit products up to rank 64; the row-owning kernel otherwise, or when the
// Config names tiles or the kernel.
TEST_CASE("the MoE backward's own GPU config is the column-owning kernel for 16-bit products up to rank 64, 64x256 "
          "at few column blocks",
          "[ops][moe]") {
  const Device dev = Device::cuda(0);
  void* const p = test::planning_address();
  const auto planned = [&](DType w, DType ab, int64_t r, const ops::Config& c) {
    const auto t = [&](DType d, std::initializer_list<int64_t> shape) { return TensorView::contiguous(p, d, shape, dev); };
    return ops::detail::moe_backward_kernel(t(w, {4, 512, 1024}), t(ab, {4, r, 1024}), t(ab, {4, 512, r}), 1.0,
                                            t(w, {4, r, 1024}), t(w, {4, 512, r}), 132, c);
  };
  const auto by_columns = [](const autotune::KernelCall& k) {
    return k.kernel->name() == std::string("moe_lora_backward_by_columns");
  };
  for (const auto& [w, ab] : {std::pair{DType::bf16, DType::bf16}, {DType::bf16, DType::f32}, {DType::f16, DType::f16}})
    for (const int64_t r : {1, 16, 64}) {
      CAPTURE(dtype_name(w), dtype_name(ab), r);
      const autotune::KernelCall k = planned(w, ab, r, {});
      CHECK(by_columns(k));
      CHECK(k.meta.at("BLOCK_N") == 64);
      CHECK(k.meta.at("BLOCK_K") == 256);
      CHECK(k.meta.at("num_warps") == 8);
      CHECK(k.meta.at("wgmma") == 1);
      CHECK(k.meta.at("staged_adds") == 1);
    }
  CHECK_FALSE(by_columns(planned(DType::bf16, DType::bf16, 128, {})));  // large ranks: the tiles that fit
  CHECK_FALSE(by_columns(planned(DType::f32, DType::f32, 16, {})));     // fp32 products
  CHECK_FALSE(by_columns(planned(DType::f16, DType::f32, 16, {})));     // TF32
  ops::Config rows;
  rows.meta["BY_COLUMNS"] = 0;
  CHECK_FALSE(by_columns(planned(DType::bf16, DType::bf16, 16, rows)));
  CHECK_FALSE(by_columns(planned(DType::bf16, DType::bf16, 16, ops::Config{128, 64, 0, 8, 3})));
  ops::Config rotate;  // other meta keep the own tile
  rotate.meta["ROTATE"] = 1;
  const autotune::KernelCall k = planned(DType::bf16, DType::bf16, 16, rotate);
  CHECK(by_columns(k));
  CHECK(k.meta.at("ROTATE") == 1);
}

namespace {

// The tile an untuned GPU call at E x N x K and rank r plans (nothing is launched).
autotune::KernelCall planned_backward(int64_t E, int64_t N, int64_t K, int64_t r, DType ab, int64_t programs,
                                      DType w = DType::bf16) {
  const Device dev = Device::cuda(0);
  void* const p = test::planning_address();
  const auto t = [&](DType d, std::initializer_list<int64_t> shape) { return TensorView::contiguous(p, d, shape, dev); };
  return ops::detail::moe_backward_kernel(t(w, {E, N, K}), t(ab, {E, r, K}), t(ab, {E, N, r}), 1.0, t(w, {E, r, K}),
                                          t(w, {E, N, r}), programs, {});
}

bool wide_whole(const autotune::KernelCall& k) {
  return k.meta.at("BLOCK_K") == 512 && k.meta.at("DA_ATOMIC") == 0 && k.meta.at("num_stages") == 2 &&
         k.meta.count("wgmma_ss") && k.meta.at("wgmma_ss") == 1;
}

}  // namespace

// At ranks 33-64 with 16-bit adapters, where 512-column blocks fill their waves to at least
// 90%, an untuned call on sm_90a takes the 64x512 tile with rows whole; elsewhere 64x256.
TEST_CASE("the MoE backward's own config on sm_90a is 64x512 with rows whole where its blocks fill whole waves",
          "[ops][moe]") {
  const ops::detail::PlanningArch h100("sm_90a");  // planned for an H100 on any machine
  CHECK(wide_whole(planned_backward(64, 2816, 2048, 64, DType::bf16, 132)));  // 256 blocks: two waves of 132
  CHECK(wide_whole(planned_backward(132, 70, 504, 40, DType::f16, 132, DType::f16)));  // one; 8 columns past K
  CHECK(planned_backward(64, 2816, 2048, 64, DType::bf16, 132).meta.at("BLOCK_N") == 64);
  const auto narrow = [](const autotune::KernelCall& k) { return k.meta.at("BLOCK_K") == 256; };
  CHECK(narrow(planned_backward(64, 2816, 2048, 32, DType::bf16, 132)));  // rank 32
  CHECK(narrow(planned_backward(64, 2816, 2048, 64, DType::f32, 132)));   // fp32 adapters do not fit beside it
  CHECK(narrow(planned_backward(64, 2816, 2048, 64, DType::f16, 132)));   // nor f16 ones converted for bf16
  CHECK(narrow(planned_backward(35, 2816, 2048, 64, DType::bf16, 132)));  // 140 blocks: a second wave of 8
  CHECK(narrow(planned_backward(64, 2816, 1100, 64, DType::bf16, 132)));  // 436 of 1536 columns past K
  CHECK(narrow(planned_backward(16, 2816, 2048, 64, DType::bf16, 132)));  // 64 blocks: half a wave
  // Rows not of 16-byte multiples: some tile outside the copy ring, over the shared memory.
  CHECK(narrow(planned_backward(132, 70, 500, 40, DType::bf16, 132)));
  CHECK(narrow(planned_backward(132, 70, 512, 36, DType::bf16, 132)));
  // Where it is chosen, it fits.
  for (const autotune::KernelCall& k : {planned_backward(64, 2816, 2048, 64, DType::bf16, 132),
                                        planned_backward(132, 70, 504, 40, DType::f16, 132, DType::f16),
                                        planned_backward(132, 77, 1528, 56, DType::bf16, 132)}) {
    REQUIRE(wide_whole(k));
    const int bytes = sm90a_smem_bytes(k);
    CAPTURE(bytes);
    CHECK(bytes <= autotune::typical_max_shared_memory("sm_90a"));
  }
}

TEST_CASE("the MoE backward's own config is 64x256 on GPUs other than sm_90a", "[ops][moe]") {
  for (const char* arch : {"sm_80", "sm_89"}) {
    CAPTURE(arch);
    const ops::detail::PlanningArch other(arch);
    const autotune::KernelCall k = planned_backward(64, 2816, 2048, 64, DType::bf16, 132);
    CHECK(k.meta.at("BLOCK_K") == 256);
    CHECK(k.meta.at("num_stages") == 3);
  }
}

// An untuned MoE forward on sm_90a (nothing is launched): 64x128 on one warpgroup, three
// stages, W_eff through W's ring, for 16-bit products at ranks 33 to 64 (and up to 32 with
// ONE_TILE=0, or W's rows strided); one tile a program in its one-tile form at ranks up to 32
// (64x64 up to 16; 32x128 above, 128x64 on 8 warps with fp32 adapters); elsewhere, and for
// larger ranks, fp32 or TF32 products, or STREAM / PERSISTENT calls, the tiles before it.
TEST_CASE("the MoE forward's own config on sm_90a is 64x128 on three stages through W's ring, one tile a "
          "program at ranks up to 32",
          "[ops][moe]") {
  const autotune::TunableOp op = test::registered_op("moe_lora_materialize");
  void* const p = test::planning_address();
  const auto planned = [&](const char* arch, DType w, DType ab, int64_t r, const autotune::Config& c,
                           bool w_strided = false) {
    const ops::detail::PlanningArch target(arch);
    const auto t = [&](DType d, std::initializer_list<int64_t> shape) {
      return TensorView::contiguous(p, d, shape, Device::cuda(0));
    };
    // Strided: W's experts [2816, 2048] as views of [2048, 2816] buffers (their rows strided).
    const TensorView W =
        w_strided ? TensorView::strided(p, w, {64, 2816, 2048}, {2816 * 2048, 1, 2816}, Device::cuda(0))
                  : t(w, {64, 2816, 2048});
    const std::vector<autotune::KernelCall> calls =
        op.kernels({W, t(ab, {64, r, 2048}), t(ab, {64, 2816, r}), t(w, {64, 2816, 2048})}, c, 132);
    REQUIRE(calls.size() == 1);
    return calls[0].meta;
  };
  const auto ring_tile = [](const autotune::Config& m) { return test::is_ring_tile(m, "BLOCK_N"); };
  for (const auto& [w, ab] : {std::pair{DType::bf16, DType::bf16}, {DType::bf16, DType::f32}, {DType::f16, DType::f16}})
    for (const int64_t r : {1, 16, 17, 32, 33, 64}) {
      CAPTURE(dtype_name(w), dtype_name(ab), r);
      const autotune::Config own = planned("sm_90a", w, ab, r, {});
      if (r <= 32) {
        if (r <= 16)
          CHECK(test::is_one_tile(own, "BLOCK_N", 64, 64));
        else if (ab == DType::f32)
          CHECK(test::is_one_tile(own, "BLOCK_N", 128, 64, 8));
        else
          CHECK(test::is_one_tile(own, "BLOCK_N", 32, 128));
        CHECK(ring_tile(planned("sm_90a", w, ab, r, {{"ONE_TILE", 0}})));
        CHECK(ring_tile(planned("sm_90a", w, ab, r, {{"STREAM", 0}})));
        CHECK(ring_tile(planned("sm_90a", w, ab, r, {}, true)));
      } else {
        CHECK(ring_tile(own));
        CHECK_FALSE(own.count("ONE_TILE"));
      }
      const autotune::Config off = planned("sm_80", w, ab, r, {});
      CHECK_FALSE(ring_tile(off));
      CHECK_FALSE(off.count("ONE_TILE"));
    }
  // EXPERT_GROUP keeps the ring tile.
  CHECK(ring_tile(planned("sm_90a", DType::bf16, DType::bf16, 16, {{"EXPERT_GROUP", 4}})));
  CHECK_FALSE(ring_tile(planned("sm_90a", DType::bf16, DType::bf16, 128, {})));  // large ranks
  for (const auto& [w, ab] : {std::pair{DType::f32, DType::f32}, {DType::f16, DType::f32}}) {
    const autotune::Config own = planned("sm_90a", w, ab, 16, {});  // fp32 products, TF32
    CHECK_FALSE(ring_tile(own));
    CHECK_FALSE(own.count("ONE_TILE"));
  }
  CHECK_FALSE(ring_tile(planned("sm_90a", DType::bf16, DType::bf16, 64, {{"STREAM", 1}})));
  CHECK_FALSE(ring_tile(planned("sm_90a", DType::bf16, DType::bf16, 64, {{"PERSISTENT", 2}})));
  // A caller's fields win; the rest is the own tile's.
  const autotune::Config deeper = planned("sm_90a", DType::bf16, DType::bf16, 64, {{"num_stages", 4}});
  CHECK(deeper.at("num_stages") == 4);
  CHECK(deeper.count("store_in_ring"));
  CHECK(planned("sm_90a", DType::bf16, DType::bf16, 64, {{"BLOCK_N", 128}}).at("BLOCK_N") == 128);
  CHECK_FALSE(planned("sm_90a", DType::bf16, DType::bf16, 64, {}).count("WALK_ROWS"));  // 2816 row blocks
}

// A few large experts (their 64-row blocks at most four programs a multiprocessor) walk the
// rows on the same tile, on two stages, unless the Config says WALK_ROWS=0 or groups experts;
// at ranks 17 to 32 only where those blocks are at most one a multiprocessor (one large expert;
// more run one tile a program), and up to 16 never: one large expert runs one 32x256 tile a
// program, more 64x64.
TEST_CASE("the MoE forward's own config on sm_90a walks the rows of a few large experts on two stages", "[ops][moe]") {
  const autotune::TunableOp op = test::registered_op("moe_lora_materialize");
  void* const p = test::planning_address();
  const ops::detail::PlanningArch target("sm_90a");
  const auto planned = [&](int64_t E, int64_t N, int64_t r, const autotune::Config& c) {
    const auto t = [&](std::initializer_list<int64_t> shape) {
      return TensorView::contiguous(p, DType::bf16, shape, Device::cuda(0));
    };
    const std::vector<autotune::KernelCall> calls =
        op.kernels({t({E, N, 4096}), t({E, r, 4096}), t({E, N, r}), t({E, N, 4096})}, c, 132);
    REQUIRE(calls.size() == 1);
    return calls[0].meta;
  };
  for (const int64_t r : {16, 32, 64}) {
    CAPTURE(r);
    const autotune::Config one = planned(1, 8192, r, {});  // 128 row blocks
    const autotune::Config wave = planned(1, 8448, r, {});  // 132: one a multiprocessor
    if (r > 16) {
      CHECK(test::is_ring_tile(one, "BLOCK_N", 2));
      CHECK(one.at("WALK_ROWS") == 1);
      CHECK(wave.at("WALK_ROWS") == 1);
    } else {
      for (const autotune::Config& m : {one, wave}) CHECK(test::is_one_tile(m, "BLOCK_N", 32, 256));
      // Asked for, the rows walked as at larger ranks.
      CHECK(planned(1, 8192, r, {{"WALK_ROWS", 1}}).at("WALK_ROWS") == 1);
      CHECK(test::is_ring_tile(planned(1, 8192, r, {{"ONE_TILE", 0}}), "BLOCK_N", 2));
    }
    const autotune::Config four = planned(4, 8448, r, {});  // 528 row blocks: 4 x 132
    const autotune::Config more = planned(4, 8512, r, {});  // 532
    CHECK_FALSE(more.count("WALK_ROWS"));
    if (r > 32) {
      CHECK(four.at("WALK_ROWS") == 1);
      CHECK(test::is_ring_tile(more, "BLOCK_N", 3));
    } else {
      for (const autotune::Config& m : {four, more, planned(1, 8512, r, {})})
        CHECK(test::is_one_tile(m, "BLOCK_N", r <= 16 ? 64 : 32, r <= 16 ? 64 : 128));
    }
  }
  const autotune::Config by_columns = planned(1, 8192, 64, {{"WALK_ROWS", 0}});
  CHECK(test::is_ring_tile(by_columns, "BLOCK_N", 3));
  CHECK_FALSE(by_columns.count("WALK_ROWS"));
  const autotune::Config grouped = planned(1, 8192, 64, {{"EXPERT_GROUP", 1}});
  CHECK(test::is_ring_tile(grouped, "BLOCK_N", 3));
  CHECK_FALSE(grouped.count("WALK_ROWS"));
  CHECK(planned(1, 8192, 64, {{"num_stages", 3}}).at("num_stages") == 3);
}

// WALK_ROWS on the MoE forward (nothing is launched): programs that own an expert's columns
// and walk its rows, where a Config asks; STREAM, PERSISTENT and EXPERT_GROUP turn it off.
TEST_CASE("the MoE forward walks an expert's rows where a Config asks, not with STREAM, PERSISTENT or EXPERT_GROUP",
          "[ops][moe]") {
  const autotune::TunableOp op = test::registered_op("moe_lora_materialize");
  void* const p = test::planning_address();
  const ops::detail::PlanningArch target("sm_90a");
  const auto planned = [&](autotune::Config c) {
    const auto t = [&](std::initializer_list<int64_t> shape) {
      return TensorView::contiguous(p, DType::bf16, shape, Device::cuda(0));
    };
    for (const auto& [k, v] : std::map<std::string, int64_t>{
             {"BLOCK_N", 64}, {"BLOCK_K", 128}, {"num_warps", 4}, {"num_stages", 3}, {"WGMMA", 1}, {"WALK_ROWS", 1}})
      c.emplace(k, v);
    const std::vector<autotune::KernelCall> calls =
        op.kernels({t({64, 2816, 2048}), t({64, 64, 2048}), t({64, 2816, 64}), t({64, 2816, 2048})}, c, 132);
    REQUIRE(calls.size() == 1);
    return calls[0].meta;
  };
  const autotune::Config walk = planned({});
  CHECK(walk.at("WALK_ROWS") == 1);
  CHECK_FALSE(walk.count("COLS_FIRST"));
  CHECK(planned({{"COLS_FIRST", 1}}).count("COLS_FIRST") == 0);  // no meaning with WALK_ROWS
  CHECK(planned({{"WALK_ROWS", 0}}).count("WALK_ROWS") == 0);
  CHECK(planned({{"STREAM", 1}}).count("WALK_ROWS") == 0);
  CHECK(planned({{"PERSISTENT", 2}}).count("WALK_ROWS") == 0);
  CHECK(planned({{"EXPERT_GROUP", 8}}).count("WALK_ROWS") == 0);
}

TEST_CASE("moe_lora_materialize follows PEFT's layouts, adapters copied or read in place, on the CPU",
          "[cpu][ops][moe]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_forward_peft_layouts(Device::cpu());
}

TEST_CASE("moe_lora_materialize follows PEFT's layouts, adapters copied or read in place, on the GPU",
          "[gpu][ops][moe]") {
  KERF_REQUIRE_GPU();
  check_forward_peft_layouts(Device::cuda(0));
}

TEST_CASE("moe_lora_materialize reads PEFT's flat lora_B by clusters of experts on the CPU", "[cpu][ops][moe]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_forward_peft_clusters(Device::cpu());
}

TEST_CASE("moe_lora_materialize reads PEFT's flat lora_B by clusters of experts on the GPU", "[gpu][ops][moe]") {
  KERF_REQUIRE_GPU();
  check_forward_peft_clusters(Device::cuda(0));
}

// Their kernels as an untuned call plans them for sm_90a (the op's own tile where PACK is
// named, the tuner's choice otherwise, which fits by construction) fit an H100.
TEST_CASE("the tiles of moe_lora_materialize's GPU cases in PEFT's layouts fit an H100's shared memory",
          "[cuda][codegen][ops][moe]") {
  const Device dev = Device::cuda(0);
  void* const p = test::planning_address();
  for (const ForwardPeftCase& c : forward_peft_cases(dev)) {
    CAPTURE(c.transposed, c.pack, dtype_name(c.ab), c.E, c.d1, c.d2, c.r);
    const int64_t in = c.transposed ? c.d1 : c.d2, out = c.transposed ? c.d2 : c.d1;
    const TensorView W = TensorView::contiguous(p, DType::bf16, {c.E, c.d1, c.d2}, dev);
    const ops::MoeLoraViews v =
        ops::peft_moe_lora_views(W, TensorView::contiguous(p, c.ab, {c.r * c.E, in}, dev),
                                 TensorView::contiguous(p, c.ab, {out, c.r * c.E}, dev), c.transposed);
    ops::Config cfg;
    if (c.pack >= 0) cfg.meta["PACK"] = c.pack;
    test::check_fits_h100("moe_lora_materialize", {W, v.A, v.B, W}, cfg);
  }
}

// PEFT's flat lora_B read by clusters (EXPERTS_LAST): the exchange's buffer is a later
// region's afterwards (at r=64 the B operand's staging: no byte more than the kernel that
// reads B copied), so as many programs share a multiprocessor as without it.
TEST_CASE("the MoE forward's clustered read of PEFT's flat lora_B keeps its programs a multiprocessor",
          "[cuda][codegen][ops][moe]") {
  const autotune::TunableOp op = test::registered_op("moe_lora_materialize");
  void* const p = test::planning_address();
  const Device dev = Device::cuda(0);
  const int64_t E = 64, N = 2816, K = 2048;
  for (const int64_t r : {16, 64}) {
    CAPTURE(r);
    const TensorView W = TensorView::contiguous(p, DType::bf16, {E, N, K}, dev);
    const ops::MoeLoraViews v =
        ops::peft_moe_lora_views(W, TensorView::contiguous(p, DType::bf16, {r * E, K}, dev),
                                 TensorView::contiguous(p, DType::bf16, {N, r * E}, dev));
    const autotune::Config tile = {{"BLOCK_N", 64}, {"BLOCK_K", 128}, {"num_warps", 4}, {"num_stages", 3},
                                   {"split_k", 2}, {"WGMMA", 1}, {"STORE_IN_RING", 1}, {"L2_PREFETCH", 128}};
    autotune::Config clustered = tile;
    clustered.insert({{"EXPERT_GROUP", 16}, {"CLUSTER", 8}, {"EXPERTS_LAST", 1}});
    const ops::detail::PlanningArch target("sm_90a");
    const std::vector<autotune::KernelCall> copied = op.kernels({W, v.A, v.B, W}, tile, 132);
    const std::vector<autotune::KernelCall> shared = op.kernels({W, v.A, v.B, W}, clustered, 132);
    REQUIRE(copied.size() == 2);  // B's copy, then the kernel
    REQUIRE(shared.size() == 1);  // the kernel alone
    CHECK(shared[0].meta.at("EXPERTS_LAST") == 1);
    CHECK(shared[0].meta.at("cluster_size") == 8);
    const int with = test::sm90a_smem_bytes(shared[0]), without = test::sm90a_smem_bytes(copied.back());
    CAPTURE(with, without);
    const auto per_sm = [](int bytes) { return 233472 / (bytes + 1024); };  // an H100's, 1 KB reserved each
    CHECK(per_sm(with) == per_sm(without));
    CHECK(per_sm(with) >= 2);
    if (r == 64) CHECK(with == without);
  }
}

TEST_CASE(
    "moe_lora_materialize_backward of empty experts, rows or rank writes what it must on the CPU",
    "[cpu][ops][moe]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_backward_edges(Device::cpu());
}

TEST_CASE(
    "moe_lora_materialize_backward of empty experts, rows or rank writes what it must on the GPU",
    "[gpu][ops][moe]") {
  KERF_REQUIRE_GPU();
  check_backward_edges(Device::cuda(0));
}

TEST_CASE("peft_moe_lora_views follows PEFT's index formulas and rejects mismatched shapes",
          "[ops][moe]") {
  const int64_t E = 4, d1 = 6, d2 = 10, r = 3;
  int dummy = 0;
  const TensorView W = TensorView::contiguous(&dummy, DType::f32, {E, d1, d2});
  const TensorView lA = TensorView::contiguous(&dummy, DType::f32, {r * E, d2});
  const TensorView lB = TensorView::contiguous(&dummy, DType::f32, {d1, r * E});
  const ops::MoeLoraViews v = ops::peft_moe_lora_views(W, lA, lB);
  // A_e[k, i] = lora_A[e*r + k, i]: offset (e*r + k) * d2 + i.
  CHECK(v.A.shape[0] == E);
  CHECK(v.A.shape[1] == r);
  CHECK(v.A.shape[2] == d2);
  CHECK(v.A.strides[0] == r * d2);
  CHECK(v.A.strides[1] == d2);
  CHECK(v.A.strides[2] == 1);
  // B_e[o, k] = lora_B[o, k*E + e]: offset o * r*E + k*E + e.
  CHECK(v.B.shape[1] == d1);
  CHECK(v.B.strides[0] == 1);
  CHECK(v.B.strides[1] == r * E);
  CHECK(v.B.strides[2] == E);
  // Non-transposed adapters given for a transposed base (d1 != d2): rejected, naming the layout.
  try {
    ops::peft_moe_lora_views(W, lA, lB, true);
    FAIL("expected InvalidArgument");
  } catch (const InvalidArgument& e) {
    CHECK_THAT(e.what(), Catch::Contains("lora_A must have shape [r*E, 6]"));
    CHECK_THAT(e.what(), Catch::Contains("is_transposed"));
  }
  const TensorView odd = TensorView::contiguous(&dummy, DType::f32, {r * E + 1, d2});
  CHECK_THROWS_WITH(ops::peft_moe_lora_views(W, odd, lB),
                    Catch::Contains("not a multiple of the 4 experts"));
  const TensorView badB = TensorView::contiguous(&dummy, DType::f32, {d1, r * E + 2});
  CHECK_THROWS_WITH(ops::peft_moe_lora_views(W, lA, badB),
                    Catch::Contains("lora_B must have shape [6, 12]"));
}

// The tuner's wide column tile (64x512 on two stages, warpgroup dots reading dW's tile
// from shared memory, staged adds) fits an H100's shared memory where every tile goes
// through the copy ring (rows of dW, A and B a multiple of 16 bytes), with its rows split
// (dA added at the end) or not, either gradient dtype. Elsewhere (PEFT's flat B, whose
// rank columns are E apart; odd ranks; other row lengths) some tile is loaded outside the
// ring, which then stays in use after the loop, and the tile takes 289792 to 355328 bytes:
// the tuner measures the shared memory of each candidate and leaves such ones out.
TEST_CASE("the MoE backward's 64x512 column tile fits an H100's shared memory where its tiles are copied whole",
          "[ops][moe]") {
  const Device dev = Device::cuda(0);  // planned and generated only
  void* const p = test::planning_address();
  const int64_t E = 4, d1 = 300, d2 = 1104;  // a last column block of 80
  ops::Config wide{64, 512, 0, 8, 2};
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"BY_COLUMNS", 1}, {"WGMMA", 1}, {"WGMMA_SS", 1},
                                    {"STAGED_ADDS", 1}})
    wide.meta[name] = value;
  const auto t = [&](DType d, std::vector<int64_t> shape) { return TensorView::contiguous(p, d, shape, dev); };
  for (const DType grads : {DType::bf16, DType::f32})
    for (const int64_t r : {16, 64})
      for (const int64_t split : {1, 3}) {
        CAPTURE(dtype_name(grads), r, split);
        ops::Config c = wide;
        c.split_k = split;
        const autotune::KernelCall k =
            ops::detail::moe_backward_kernel(t(DType::bf16, {E, d1, d2}), t(DType::bf16, {E, r, d2}),
                                             t(DType::bf16, {E, d1, r}), 1.0, t(grads, {E, r, d2}),
                                             t(grads, {E, d1, r}), 132, c);
        CHECK(k.meta.at("BLOCK_K") == 512);
        const int bytes = sm90a_smem_bytes(k);
        CAPTURE(bytes);
        CHECK(bytes <= autotune::typical_max_shared_memory("sm_90a"));
      }
  // PEFT's fp32 adapters and gradients (the tuner's choice there): lora_A read as fp32,
  // lora_B copied into bf16, dB in the fp32 workspace. The plain fp32 layout does not fit.
  for (const int64_t r : {40, 64}) {
    CAPTURE(r);
    ops::Config c = wide;
    c.split_k = 1;
    const TensorView dW = t(DType::bf16, {E, d1, d2});
    const ops::MoeLoraViews v = ops::peft_moe_lora_views(dW, t(DType::f32, {r * E, d2}), t(DType::f32, {d1, r * E}));
    const ops::MoeLoraViews g = ops::peft_moe_lora_views(dW, t(DType::f32, {r * E, d2}), t(DType::f32, {d1, r * E}));
    const autotune::KernelCall k = ops::detail::moe_backward_kernel(dW, v.A, v.B, 1.0, g.A, g.B, 132, c);
    REQUIRE(std::get<TensorView>(k.args[1]).dtype == DType::f32);
    REQUIRE(std::get<TensorView>(k.args[2]).dtype == DType::bf16);
    const int bytes = sm90a_smem_bytes(k);
    CAPTURE(bytes);
    CHECK(bytes <= autotune::typical_max_shared_memory("sm_90a"));
  }
  const autotune::KernelCall plain =
      ops::detail::moe_backward_kernel(t(DType::bf16, {E, d1, d2}), t(DType::f32, {E, 64, d2}),
                                       t(DType::f32, {E, d1, 64}), 1.0, t(DType::f32, {E, 64, d2}),
                                       t(DType::f32, {E, d1, 64}), 132, wide);
  CHECK(sm90a_smem_bytes(plain) > autotune::typical_max_shared_memory("sm_90a"));
}

// PACK (on GPUs by default): PEFT's flat B (rank columns E apart) reaches the kernel as a
// contiguous copy, and a gradient strided so is summed in the contiguous fp32 workspace (the
// kernel's dB argument) and flushed into it; PACK 0 reads and writes them in place.
// DB_WORKSPACE sends an f32 dB's atomics to the workspace whatever its strides.
TEST_CASE("PACK gives the MoE backward contiguous adapters and workspace gradients for PEFT's flat layout",
          "[ops][moe]") {
  const Device dev = Device::cuda(0);  // planned only
  void* const p = test::planning_address();
  const int64_t E = 4, N = 256, K = 512, r = 16;
  const auto t = [&](DType d, std::vector<int64_t> shape) { return TensorView::contiguous(p, d, shape, dev); };
  const TensorView dW = t(DType::bf16, {E, N, K});
  const ops::MoeLoraViews v = ops::peft_moe_lora_views(dW, t(DType::f32, {r * E, K}), t(DType::f32, {N, r * E}));
  const ops::MoeLoraViews g = ops::peft_moe_lora_views(dW, t(DType::f32, {r * E, K}), t(DType::f32, {N, r * E}));
  REQUIRE(g.B.strides[2] == E);  // PEFT's flat gradient: rank columns E apart
  REQUIRE(v.A.strides[2] == 1);  // lora_A's expert-major rows: A[e] row-major
  ops::Config c{64, 256, 1, 8, 3, {{"BY_COLUMNS", 1}}};
  const auto arg = [&](const ops::Config& cfg, size_t i) {
    const autotune::KernelCall k = ops::detail::moe_backward_kernel(dW, v.A, v.B, 1.0, g.A, g.B, 132, cfg);
    return std::get<TensorView>(k.args[i]);
  };
  // Default on a GPU: B copied contiguous, rounded to the bf16 product; A read in place.
  CHECK(arg(c, 2).strides[2] == 1);
  CHECK(arg(c, 2).strides[1] == r);
  CHECK(arg(c, 2).dtype == DType::bf16);
  CHECK(arg(c, 1).data == v.A.data);
  CHECK(arg(c, 5).dtype == DType::f32);
  CHECK(arg(c, 5).strides[2] == 1);
  CHECK(arg(c, 5).strides[1] == r);
  c.meta["PACK"] = 0;
  CHECK(arg(c, 2).data == v.B.data);
  CHECK(arg(c, 5).strides[2] == E);  // the gradient itself
  c.meta["DB_WORKSPACE"] = 1;
  const TensorView ws = arg(c, 5);
  CHECK(ws.dtype == DType::f32);
  CHECK(ws.strides[2] == 1);
  CHECK(ws.strides[1] == r);
  // PEFT's transposed experts: both adapters strided along their last dims, both copied.
  const ops::MoeLoraViews vt =
      ops::peft_moe_lora_views(dW, t(DType::bf16, {r * E, N}), t(DType::bf16, {K, r * E}), true);
  const ops::MoeLoraViews gt =
      ops::peft_moe_lora_views(dW, t(DType::bf16, {r * E, N}), t(DType::bf16, {K, r * E}), true);
  REQUIRE(vt.A.strides[2] != 1);
  REQUIRE(vt.B.strides[2] != 1);
  const autotune::KernelCall kt =
      ops::detail::moe_backward_kernel(dW, vt.A, vt.B, 1.0, gt.A, gt.B, 132, ops::Config{64, 256, 1, 8, 3, {{"BY_COLUMNS", 1}}});
  for (size_t i : {size_t(1), size_t(2), size_t(4), size_t(5)}) {
    CAPTURE(i);
    CHECK(std::get<TensorView>(kt.args[i]).strides[2] == 1);
  }
  // Checked like the other meta.
  std::vector<float> host(size_t(E * N * K));
  const auto h = [&](std::vector<int64_t> shape) { return TensorView::contiguous(host.data(), DType::f32, shape); };
  for (const char* name : {"DB_WORKSPACE", "PACK"}) {
    ops::Config bad;
    bad.meta[name] = 2;
    CHECK_THROWS_WITH(ops::moe_lora_materialize_backward(h({E, N, K}), h({E, r, K}), h({E, N, r}), 1.0,
                                                         h({E, r, K}), h({E, N, r}), nullptr, bad),
                      Catch::Contains(name));
  }
}

// The forward likewise (its compile list, as kerf-cache warm plans it for a GPU): PEFT's
// transposed experts give it two strided adapters, each copied by a transpose first;
// PACK 0 reads them in place.
TEST_CASE("PACK copies the MoE forward's strided adapters first on GPUs", "[ops][moe]") {
  const Device dev = Device::cuda(0);  // planned only
  void* const p = test::planning_address();
  const int64_t E = 4, d1 = 256, d2 = 512, r = 16;
  const auto t = [&](DType d, std::vector<int64_t> shape) { return TensorView::contiguous(p, d, shape, dev); };
  const TensorView W = t(DType::bf16, {E, d1, d2});
  const ops::MoeLoraViews v = ops::peft_moe_lora_views(W, t(DType::bf16, {r * E, d1}), t(DType::bf16, {d2, r * E}), true);
  const autotune::TunableOp op = test::registered_op("moe_lora_materialize");
  const std::vector<autotune::KernelCall> packed = op.kernels({W, v.A, v.B, W}, {}, 132);
  REQUIRE(packed.size() == 3);
  CHECK(packed[0].kernel == &kernels::transpose_3d());
  CHECK(packed[1].kernel == &kernels::transpose_3d());
  for (size_t i : {size_t(1), size_t(2)}) CHECK(std::get<TensorView>(packed[2].args[i]).strides[2] == 1);
  autotune::Config in_place;
  in_place["PACK"] = 0;
  const std::vector<autotune::KernelCall> direct = op.kernels({W, v.A, v.B, W}, in_place, 132);
  REQUIRE(direct.size() == 1);
  CHECK(std::get<TensorView>(direct[0].args[1]).strides[2] == r * E);  // lora_B read in place
  // PACK 2: A (read every column step) copied, B (read once a program) in place.
  autotune::Config a_only;
  a_only["PACK"] = 2;
  const std::vector<autotune::KernelCall> half = op.kernels({W, v.A, v.B, W}, a_only, 132);
  REQUIRE(half.size() == 2);
  CHECK(half[0].kernel == &kernels::transpose_3d());
  CHECK(std::get<TensorView>(half[1].args[1]).strides[2] == 1);
  CHECK(std::get<TensorView>(half[1].args[2]).strides[2] == v.B.strides[2]);
}

namespace {

// A copy between PEFT's flat [d1, r*E] (seen as [E, d1, r], rank columns E apart) and a
// contiguous [E, d1, r], either way, with a cast; `flush`: from an f32 accumulator, left
// zero. It must take kernels::transpose_3d, and give every element rounded once.
void check_transposing_copy(Device dev, int64_t E, int64_t d1, int64_t r, DType from, DType to, bool to_flat,
                            bool flush, uint64_t seed) {
  CAPTURE(dev.str(), E, d1, r, dtype_name(from), dtype_name(to), to_flat, flush);
  std::mt19937_64 rng(seed);
  const std::vector<int64_t> flat_shape = {d1, r * E}, plain_shape = {E, d1, r};
  TestTensor x(from, to_flat ? plain_shape : flat_shape, dev), out(to, to_flat ? flat_shape : plain_shape, dev);
  x.randomize(rng);
  std::vector<double> before;
  for (int64_t i = 0; i < x.numel(); ++i) before.push_back(x.get(i));
  out.poison();
  const auto flat_view = [&](TestTensor& t) { return t.view({E, d1, r}, {1, r * E, E}); };
  const TensorView xv = to_flat ? x.view() : flat_view(x), ov = to_flat ? flat_view(out) : out.view();
  CHECK(ops::detail::plan_copy_3d(xv, ov, flush).call.kernel == &kernels::transpose_3d());
  if (flush)
    ops::detail::flush_accumulator(xv, ov, {});
  else
    ops::detail::run_cast_3d(xv, ov, {});
  test::sync(dev);
  out.download();
  TestTensor rounded(to, {1}, Device::cpu());
  int64_t wrong = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < d1; ++i)
      for (int64_t k = 0; k < r; ++k) {
        const int64_t flat = i * r * E + k * E + e, plain = (e * d1 + i) * r + k;
        rounded.set(0, before[size_t(to_flat ? plain : flat)]);
        if (out.get(to_flat ? flat : plain) != rounded.get(0)) ++wrong;
      }
  CHECK(wrong == 0);
  if (flush) {
    x.download();
    int64_t left = 0;
    for (int64_t i = 0; i < x.numel(); ++i) left += x.get(i) != 0.0;
    CHECK(left == 0);
  }
}

void run_transposing_copies(Device dev) {
  uint64_t seed = 7700;
  // Shapes not multiples of the tiles (E and r past 64, d1 odd), down to one element per row.
  for (const auto& [E, d1, r] : {std::tuple<int64_t, int64_t, int64_t>{5, 37, 13}, {3, 100, 70}, {70, 9, 3},
                                 {2, 3, 1}})
    for (const bool to_flat : {false, true}) {
      check_transposing_copy(dev, E, d1, r, DType::f32, DType::bf16, to_flat, false, seed++);
      check_transposing_copy(dev, E, d1, r, DType::bf16, DType::bf16, to_flat, false, seed++);
      check_transposing_copy(dev, E, d1, r, DType::f32, to_flat ? DType::f16 : DType::f32, to_flat, true, seed++);
    }
}

}  // namespace

TEST_CASE("copies between views with their unit strides on different dims transpose through shared memory on the CPU",
          "[cpu][ops][moe]") {
  KERF_REQUIRE_CPU_BACKEND();
  run_transposing_copies(Device::cpu());
}

TEST_CASE("copies between views with their unit strides on different dims transpose through shared memory on the GPU",
          "[gpu][ops][moe]") {
  KERF_REQUIRE_GPU();
  run_transposing_copies(Device::cuda(0));
}
