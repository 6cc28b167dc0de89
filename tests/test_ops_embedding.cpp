// ops::lora_embedding and lora_embedding_backward against float64 references
// (PEFT's layout: A = lora_embedding_A [r, vocab], B = lora_embedding_B
// [dim, r]); padding_idx, scale_grad_by_freq, ids out of range.
#include <cmath>
#include <random>

#include "catch.h"
#include "cpu_test_util.h"
#include "device_tensor.h"
#include "gpu_test_util.h"
#include "kerf/cache/store.h"
#include "kerf/error.h"
#include "kerf/jit/autotune.h"
#include "kerf/jit/launch.h"
#include "kerf/ops/ops.h"
#include "smem_fit_util.h"
#include "test_cache_util.h"

using namespace kerf;
using kerf::test::TestTensor;

namespace {

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

struct EmbCase {
  std::vector<int64_t> x_shape;
  int64_t V, D, r;
  DType ids, w, ab, out;
  bool strided_x = false;  // x is every other element of a buffer twice as long
  ops::Config config{};  // tiles and meta (WARPS_N); zero: kerf's choice
};

// Random ids in [0, V), with a few repeats forced.
void fill_ids(TestTensor& buf, int64_t n, int64_t stride, int64_t V, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> d(0, V - 1);
  for (int64_t t = 0; t < n; ++t) buf.set(t * stride, double(t % 7 == 3 ? 5 : d(rng)));
  buf.upload();
}

void check_forward(const EmbCase& c, Device dev, uint64_t seed) {
  CAPTURE(c.x_shape, c.V, c.D, c.r, dtype_name(c.ids), dtype_name(c.w), dtype_name(c.ab),
          dtype_name(c.out), c.strided_x, c.config.block_m, c.config.block_k, c.config.num_warps,
          c.config.meta.count("WARPS_N"), seed, dev.str());
  std::mt19937_64 rng(seed);
  int64_t T = 1;
  for (int64_t d : c.x_shape) T *= d;
  const int64_t xs = c.strided_x ? 2 : 1;
  TestTensor X(c.ids, {T * xs}, dev), Wt(c.w, {c.V, c.D}, dev), A(c.ab, {c.r, c.V}, dev),
      B(c.ab, {c.D, c.r}, dev);
  fill_ids(X, T, xs, c.V, rng);
  Wt.randomize(rng);
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  std::vector<int64_t> out_shape = c.x_shape, xstrides(c.x_shape.size());
  out_shape.push_back(c.D);
  int64_t st = xs;
  for (size_t d = c.x_shape.size(); d-- > 0;) {
    xstrides[d] = st;
    st *= c.x_shape[d];
  }
  TestTensor out(c.out, out_shape, dev);
  out.poison();
  const double s = 1.25;
  ops::lora_embedding(X.view(c.x_shape, xstrides), Wt.view(), A.view(), B.view(), s, out.view(), {}, nullptr,
                      c.config);
  test::sync(dev);
  out.download();
  // Again with the activations written (after_a, in the adapters' dtype): the same out,
  // and after_a[t, :] = A[:, x[t]] exactly.
  std::vector<int64_t> act_shape = c.x_shape;
  act_shape.push_back(c.r);
  TestTensor out2(c.out, out_shape, dev), act(c.ab, act_shape, dev);
  out2.poison();
  act.poison();
  ops::EmbeddingOptions with_act;
  with_act.after_a = act.view();
  ops::lora_embedding(X.view(c.x_shape, xstrides), Wt.view(), A.view(), B.view(), s, out2.view(), with_act,
                      nullptr, c.config);
  test::sync(dev);
  out2.download();
  act.download();
  for (int64_t i = 0; i < out.numel(); ++i) CHECK(out2.get(i) == out.get(i));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < c.r; ++k) CHECK(act.get(t * c.r + k) == A.get(k * c.V + int64_t(X.get(t * xs))));
  // A half out with fp32 adapters takes them in the table's product (docs/ops.md): bf16
  // for a bf16 table, TF32 for an f16 one on the GPU, s*A rounded once. The reference
  // rounds them so (at rank 128 a bf16 product's rounding reaches 1.3% of W's scale, as
  // much as out's own); the exact product is checked within twice the tolerance.
  const bool rounded = c.ab == DType::f32 && c.out != DType::f32;
  const auto promise = [&](double v) {
    if (rounded && c.w == DType::bf16) return test::round_to(DType::bf16, v);
    if (rounded && c.w == DType::f16 && dev.is_cuda()) return test::tf32(float(v));
    return v;
  };
  std::vector<double> got, ref, exact;
  for (int64_t t = 0; t < T; ++t) {
    const auto id = int64_t(X.get(t * xs));
    for (int64_t d = 0; d < c.D; ++d) {
      double l = 0, promised = 0;
      for (int64_t k = 0; k < c.r; ++k) {
        const double a = A.get(k * c.V + id), b = B.get(d * c.r + k);
        l += a * b;
        promised += promise(float(a) * float(s)) * promise(b);
      }
      exact.push_back(Wt.get(id * c.D + d) + s * l);
      ref.push_back(Wt.get(id * c.D + d) + promised);
      got.push_back(out.get(t * c.D + d));
    }
  }
  // An fp32 out keeps fp32 precision whatever the inputs' dtypes: half values are exact,
  // fp32 adapters multiply in fp32 (not rounded to a half table's dtype first).
  CHECK(test::max_relative_error(got, ref, 1.0) <= test::tolerance(c.out));
  CHECK(test::max_relative_error(got, exact, 1.0) <= 2 * test::tolerance(c.out));
}

void run_forward_cases(Device dev) {
  const std::vector<EmbCase> cases = {
      {{3, 37}, 1000, 130, 5, DType::i64, DType::bf16, DType::f32, DType::bf16},
      {{111}, 1000, 130, 5, DType::i32, DType::f32, DType::f32, DType::f32},
      {{70}, 400, 96, 16, DType::i64, DType::bf16, DType::f32, DType::f32},  // PEFT: bf16 base, fp32 adapters
      {{4, 16}, 512, 256, 16, DType::i64, DType::bf16, DType::bf16, DType::bf16},
      {{2, 9}, 300, 64, 8, DType::i32, DType::f16, DType::f16, DType::f32, true},
      {{50}, 77, 33, 1, DType::i64, DType::f32, DType::bf16, DType::f32, true},
      // Warps sharing the dot's columns (Config.meta WARPS_N), partial tiles.
      {{3, 37}, 1000, 130, 5, DType::i64, DType::bf16, DType::f32, DType::bf16, false,
       ops::Config{64, 128, 0, 8, 3, {{"WARPS_N", 2}}}},
      {{200}, 512, 300, 16, DType::i32, DType::bf16, DType::bf16, DType::f32, true,
       ops::Config{128, 64, 2, 8, 2, {{"WARPS_N", 4}}}},
  };
  uint64_t seed = 6100;
  for (const EmbCase& c : cases) check_forward(c, dev, seed++);
}

struct BackCase {
  int64_t T, V, D, r;
  DType g, ab, grads;
  std::optional<int64_t> padding;
  bool by_freq;
  int64_t split = 0;
  bool rotate = false;  // Config.meta ROTATE: token blocks start their steps over D apart
  bool gather = false;  // Config.meta GATHER: gather, a one-pass product by column blocks, scatter
  int64_t l2_prefetch = 0;  // Config.meta L2_PREFETCH (a hint: the same answer)
  bool staged = false;  // Config.meta STAGED_ADDS: dB's per-step atomics as whole-row 4-wide vectors
  int64_t block_t = 0, block_d = 0;  // the tile (0: kerf's, or 16x32 with ROTATE or GATHER)
  // Config.meta GROUP_BY_ID (-1: kerf's choice): each id's sums in one row of a
  // workspace, dA written whole by a kernel of its own.
  int group = -1;
  // Config.meta FUSED (-1: kerf's choice): grouped, one cooperative kernel on a GPU.
  int fused = -1;
  // EmbeddingOptions::after_a: 0 not given; 1 the activations A[:, x[t]]^T; 2 twice them
  // (grad_B doubles: the kernel reads them, not A).
  int after_a = 0;
  // Config.meta EARLY_PROLOGUE (-1: kerf's choice, on for a GPU): the pass's first copies
  // before the ids' load, or (0) where its loop begins.
  int early = -1;
  // Config.meta WGMMA: dB's product as Hopper's warpgroup dots (sm_90a; elsewhere the same
  // kernel with mma.sync or, on the CPU, loops), the activations kept by rank.
  bool wgmma = false;
  int64_t warps = 0;  // Config::num_warps (0: kerf's, 8 on a GPU for 128-token blocks, else 4)
};

void check_backward(const BackCase& c, Device dev, uint64_t seed) {
  CAPTURE(c.T, c.V, c.D, c.r, dtype_name(c.g), dtype_name(c.ab), dtype_name(c.grads),
          c.padding.value_or(-999), c.by_freq, c.split, c.rotate, c.gather, c.l2_prefetch, c.staged, c.block_t,
          c.block_d, c.group, c.fused, c.after_a, c.early, c.wgmma, c.warps, seed, dev.str());
  std::mt19937_64 rng(seed);
  TestTensor X(DType::i64, {c.T}, dev), A(c.ab, {c.r, c.V}, dev), B(c.ab, {c.D, c.r}, dev);
  TestTensor G(c.g, {c.T, c.D}, dev), dA(c.grads, {c.r, c.V}, dev), dB(c.grads, {c.D, c.r}, dev);
  fill_ids(X, c.T, 1, c.V, rng);
  if (c.padding)  // some padding tokens
    for (int64_t t = 0; t < c.T; t += 5)
      X.set(t, double(*c.padding < 0 ? *c.padding + c.V : *c.padding));
  X.upload();
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  G.randomize(rng);
  dA.poison();
  dB.poison();
  ops::EmbeddingOptions o;
  o.padding_idx = c.padding;
  o.scale_grad_by_freq = c.by_freq;
  ops::Config cfg;
  cfg.split_k = c.split;
  if (c.rotate || c.gather) {
    cfg.block_m = 16;
    cfg.block_k = 32;
  }
  if (c.block_t) cfg.block_m = c.block_t;
  if (c.block_d) cfg.block_k = c.block_d;
  if (c.rotate) cfg.meta["ROTATE"] = 1;
  if (c.gather) cfg.meta["GATHER"] = 1;
  if (c.staged) cfg.meta["STAGED_ADDS"] = 1;
  if (c.l2_prefetch) cfg.meta["L2_PREFETCH"] = c.l2_prefetch;
  if (c.group >= 0) cfg.meta["GROUP_BY_ID"] = c.group;
  if (c.fused >= 0) cfg.meta["FUSED"] = c.fused;
  if (c.early >= 0) cfg.meta["EARLY_PROLOGUE"] = c.early;
  if (c.wgmma) cfg.meta["WGMMA"] = 1;
  cfg.num_warps = c.warps;
  const double act_scale = c.after_a == 2 ? 2.0 : 1.0;
  TestTensor act(c.ab, {c.T, c.r}, dev);
  if (c.after_a) {
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t k = 0; k < c.r; ++k) act.set(t * c.r + k, act_scale * A.get(k * c.V + int64_t(X.get(t))));
    act.upload();
    o.after_a = act.view();
  }
  const double s = 2.0;
  ops::lora_embedding_backward(X.view(), A.view(), B.view(), G.view(), s, dA.view(), dB.view(), o,
                               nullptr, cfg);
  if (!c.gather) {
    // Again into fresh garbage: the first call must have left its workspace as it found it.
    test::sync(dev);
    dA.poison();
    dB.poison();
    ops::lora_embedding_backward(X.view(), A.view(), B.view(), G.view(), s, dA.view(), dB.view(), o,
                                 nullptr, cfg);
  }
  test::sync(dev);
  dA.download();
  dB.download();
  const int64_t pad = c.padding ? (*c.padding < 0 ? *c.padding + c.V : *c.padding) : -1;
  // grad_out's products take the adapters in its own product (docs/ops.md): bf16 for bf16
  // grad_out, TF32 on the GPU for f16 grad_out with fp32 or bf16 adapters; the reference
  // rounds them so (an id repeated by 16 tokens sums 16 rows of the product's rounding).
  const auto promise = [&](double v) {
    if (c.g == DType::bf16) return test::round_to(DType::bf16, v);
    if (c.g == DType::f16 && c.ab != DType::f16 && dev.is_cuda()) return test::tf32(float(v));
    return v;
  };
  std::vector<double> count(size_t(c.V), 0.0), ra(size_t(c.r * c.V), 0.0),
      rb(size_t(c.D * c.r), 0.0);
  for (int64_t t = 0; t < c.T; ++t) count[size_t(X.get(t))] += 1;
  for (int64_t t = 0; t < c.T; ++t) {
    const auto id = int64_t(X.get(t));
    for (int64_t k = 0; k < c.r; ++k) {
      double gb = 0;
      for (int64_t d = 0; d < c.D; ++d) gb += G.get(t * c.D + d) * promise(B.get(d * c.r + k));
      if (id != pad) ra[size_t(k * c.V + id)] += s * gb / (c.by_freq ? count[size_t(id)] : 1.0);
      const double a = promise(act_scale * A.get(k * c.V + id));
      for (int64_t d = 0; d < c.D; ++d) rb[size_t(d * c.r + k)] += s * G.get(t * c.D + d) * a;
    }
  }
  std::vector<double> ga, gb;
  for (int64_t i = 0; i < dA.numel(); ++i) ga.push_back(dA.get(i));
  for (int64_t i = 0; i < dB.numel(); ++i) gb.push_back(dB.get(i));
  const double tol = test::tolerance(is_half(c.g) || is_half(c.grads) ? DType::bf16 : DType::f32);
  CHECK(scaled_error(ga, ra) <= tol);
  CHECK(scaled_error(gb, rb) <= tol);
  if (pad >= 0)
    for (int64_t k = 0; k < c.r; ++k) CHECK(dA.get(k * c.V + pad) == 0.0);  // exactly no gradient
}

void run_backward_cases(Device dev) {
  const std::vector<BackCase> cases = {
      {111, 1000, 130, 5, DType::f32, DType::f32, DType::f32, std::nullopt, false},
      {111, 1000, 130, 5, DType::bf16, DType::f32, DType::f32, 0, true},
      {64, 512, 256, 16, DType::bf16, DType::bf16, DType::bf16, -1, false, 1},
      {200, 300, 64, 8, DType::f16, DType::f32, DType::bf16, std::nullopt, true, 3},
      {37, 50, 40, 3, DType::f32, DType::bf16, DType::f32, 7, true},
      {111, 1000, 130, 5, DType::bf16, DType::f32, DType::f32, 0, true, 0, true},
      {200, 300, 200, 8, DType::f16, DType::f32, DType::bf16, std::nullopt, false, 2, true},
      // GATHER: split_k is the number of programs sharing a column block's tokens.
      {111, 1000, 130, 5, DType::f32, DType::f32, DType::f32, std::nullopt, false, 0, false, true},
      {111, 1000, 130, 5, DType::bf16, DType::f32, DType::f32, 0, true, 3, false, true},
      {64, 512, 256, 16, DType::bf16, DType::bf16, DType::bf16, -1, false, 1, true, true},
      {200, 300, 70, 40, DType::f16, DType::f32, DType::bf16, 299, true, 2, false, true},
      {37, 50, 40, 3, DType::f32, DType::bf16, DType::f32, 7, true, 1, false, true},
      {200, 300, 200, 8, DType::bf16, DType::bf16, DType::f32, 3, false, 2, true, false, 128},
      // STAGED_ADDS: dB's share of each step through shared memory, rows of r floats (16 and 64
      // wide, and r=5 padded to 16) as 4-wide reductions; D not a multiple of the step.
      {300, 1000, 200, 16, DType::bf16, DType::bf16, DType::f32, 0, false, 2, false, false, 0, true, 64, 64},
      {300, 1000, 200, 16, DType::bf16, DType::bf16, DType::bf16, std::nullopt, true, 0, true, false, 0, true, 128,
       128},
      {111, 1000, 130, 5, DType::f32, DType::f32, DType::f32, std::nullopt, false, 3, false, false, 0, true, 32, 64},
      {200, 300, 330, 64, DType::f16, DType::f16, DType::f32, 7, false, 2, false, false, 0, true, 64, 128},
  };
  uint64_t seed = 6200;
  for (const BackCase& c : cases) check_backward(c, dev, seed++);
  // With the forward's activations given (after_a), and given doubled; on a GPU also as
  // the one cooperative kernel.
  for (BackCase c : cases) {
    if (c.gather) continue;
    c.after_a = c.T % 2 ? 2 : 1;
    check_backward(c, dev, seed++);
    if (dev.is_cuda()) {
      c.group = 1;
      c.fused = 1;
      check_backward(c, dev, seed++);
    }
  }
  // Each case but GATHER's also with GROUP_BY_ID named: on (kerf's choice on a GPU only
  // in some cases, docs/ops.md) and, on a GPU, off.
  for (BackCase c : cases) {
    if (c.gather) continue;
    for (const int group : {1, 0}) {
      if (group == 0 && !dev.is_cuda()) continue;  // the CPU's default, run above
      c.group = group;
      check_backward(c, dev, seed++);
      // And as the one cooperative kernel: grouped, or (f32 grad_A) adding into grad_A itself.
      if (dev.is_cuda() && (group == 1 || c.grads == DType::f32)) {
        c.fused = 1;
        check_backward(c, dev, seed++);
        c.fused = -1;
      }
    }
  }
  // On a GPU, with the pass's first copies where its loop begins (EARLY_PROLOGUE=0), as
  // kerf's choice and fused, gathering and with after_a.
  if (dev.is_cuda())
    for (BackCase c : cases) {
      if (c.gather) continue;
      c.early = 0;
      c.fused = int(c.T % 2);
      c.after_a = c.r % 2 ? 0 : 1;
      check_backward(c, dev, seed++);
    }
  // WGMMA (both products of a step from shared memory, both tiles through descriptors, where
  // the tiles are 64 tokens and 64 columns wide or more): 8 and 4 warps on 128-token blocks
  // (4: each warpgroup two m tiles), 4 on 64; ranks 5 (padded to 16), 16, 32 and 64; bf16
  // and f16 products (fp32 adapters beside bf16 grad_out); D, T and V not multiples of the
  // tile; gathering and with after_a; on a GPU also as the one cooperative kernel. 32-token
  // blocks keep mma.sync for g^T @ act. Ranks 128 and 256 below.
  std::vector<BackCase> wg = {
      {300, 1000, 200, 16, DType::bf16, DType::bf16, DType::bf16, std::nullopt, false, 0, true, false, 0, true, 128,
       128},
      {333, 2000, 330, 5, DType::bf16, DType::f32, DType::f32, 0, true, 0, false, false, 0, false, 64, 128},
      {200, 300, 330, 64, DType::f16, DType::f16, DType::f32, 7, false, 2, false, false, 0, true, 128, 64},
      {257, 4000, 512, 32, DType::bf16, DType::bf16, DType::bf16, -1, false, 0, true, false, 0, true, 128, 128},
      {100, 500, 200, 16, DType::bf16, DType::bf16, DType::f32, std::nullopt, true, 0, true, false, 0, true, 32, 64},
  };
  // Steps of 32 columns (g's tile not swizzled: A's fragments in registers, B's step tile
  // still a 32-byte-swizzled wgmma operand), and 256-token blocks on 8 warps.
  wg.push_back({300, 1000, 200, 16, DType::bf16, DType::bf16, DType::bf16, std::nullopt, false, 0, true, false, 0,
                true, 128, 32});
  wg.push_back({600, 2000, 260, 16, DType::bf16, DType::f32, DType::f32, 0, true, 0, true, false, 0, true, 256, 64});
  // Ranks 128 and 256 on 64x64 tiles (B's step tile [64, r] in 64-column blocks, the
  // activations [r, 64] one instruction of r columns a warpgroup).
  wg.push_back({200, 700, 200, 128, DType::bf16, DType::bf16, DType::f32, std::nullopt, false, 0, true, false, 0,
                true, 64, 64});
  wg.push_back({150, 300, 130, 256, DType::f16, DType::f16, DType::f16, 3, true, 0, false, false, 0, true, 64, 64});
  // The tuner's usual choice at 8192x128256x4096 on an H100: 128x128 on 4 warps.
  BackCase four = wg[0];
  four.T = 521;
  four.D = 390;
  four.warps = 4;
  wg.push_back(four);
  four.by_freq = true;
  four.grads = DType::f32;
  wg.push_back(four);
  for (BackCase c : wg) {
    c.wgmma = true;
    for (const int after_a : {0, 1}) {
      c.after_a = after_a;
      c.fused = -1;
      c.group = -1;
      check_backward(c, dev, seed++);
      if (dev.is_cuda()) {
        c.fused = 1;
        c.group = 1;
        check_backward(c, dev, seed++);
      }
    }
  }
}

// axolotl's regression tests: TestEmbeddingPaddingIdxGrad and TestEmbeddingScaleGradByFreq.
void check_axolotl_regressions(Device dev) {
  const int64_t V = 100, H = 32, r = 4;
  std::mt19937_64 rng(6300);
  TestTensor A(DType::f32, {r, V}, dev), B(DType::f32, {H, r}, dev), dA(DType::f32, {r, V}, dev),
      dB(DType::f32, {H, r}, dev);
  A.randomize(rng);
  B.randomize(rng);
  {
    TestTensor X(DType::i64, {1, 5}, dev), G(DType::f32, {1, 5, H}, dev);
    const double ids[] = {0, 1, 2, 0, 3};
    for (int i = 0; i < 5; ++i) X.set(i, ids[i]);
    X.upload();
    G.randomize(rng);
    ops::EmbeddingOptions o;
    o.padding_idx = 0;
    ops::lora_embedding_backward(X.view(), A.view(), B.view(), G.view(), 2.0, dA.view(), dB.view(),
                                 o);
    test::sync(dev);
    dA.download();
    for (int64_t k = 0; k < r; ++k) {
      CHECK(dA.get(k * V + 0) == 0.0);
      CHECK(dA.get(k * V + 1) != 0.0);
    }
  }
  {
    // Token 5 three times: with scale_grad_by_freq its gradient is a third.
    TestTensor X(DType::i64, {6}, dev), G(DType::f32, {6, H}, dev);
    const double ids[] = {5, 9, 5, 11, 5, 2};
    for (int i = 0; i < 6; ++i) X.set(i, ids[i]);
    X.upload();
    G.randomize(rng);
    ops::EmbeddingOptions o;
    ops::lora_embedding_backward(X.view(), A.view(), B.view(), G.view(), 2.0, dA.view(), dB.view(),
                                 o);
    test::sync(dev);
    dA.download();
    std::vector<double> plain;
    for (int64_t k = 0; k < r; ++k) plain.push_back(dA.get(k * V + 5));
    o.scale_grad_by_freq = true;
    ops::lora_embedding_backward(X.view(), A.view(), B.view(), G.view(), 2.0, dA.view(), dB.view(),
                                 o);
    test::sync(dev);
    dA.download();
    for (int64_t k = 0; k < r; ++k)
      CHECK(std::abs(dA.get(k * V + 5) / plain[size_t(k)] - 1.0 / 3) < 0.01);
  }
}

struct Bad {
  TestTensor X, Wt, A, B, out;
  explicit Bad(Device dev, DType ids = DType::i64)
      : X(ids, {2, 6}, dev),
        Wt(DType::f32, {50, 16}, dev),
        A(DType::f32, {4, 50}, dev),
        B(DType::f32, {16, 4}, dev),
        out(DType::f32, {2, 6, 16}, dev) {
    std::mt19937_64 rng(6400);
    Wt.randomize(rng);
    A.randomize(rng);
    B.randomize(rng);
    const double ids_v[] = {1, 2, 3,  50, 4, 5,
                            6, 7, -3, 8,  9, 49};  // x[3] = 50 and x[8] = -3 are out of range
    for (int i = 0; i < 12; ++i) X.set(i, ids_v[i]);
    X.upload();
    out.poison();
  }
  void call(const ops::EmbeddingOptions& o = {}) {
    ops::lora_embedding(X.view(), Wt.view(), A.view(), B.view(), 1.0, out.view(), o);
  }
};

// Calls with nothing to compute (dim 0, or rank 0 in the backward) still report ids out
// of range, as F.embedding would; with good ids they pass.
void check_ids_with_nothing_to_compute(Device dev) {
  Bad b(dev);
  const auto fwd_dim0 = [&] {
    TestTensor W0(DType::f32, {50, 0}, dev), B0(DType::f32, {0, 4}, dev), out0(DType::f32, {2, 6, 0}, dev);
    ops::lora_embedding(b.X.view(), W0.view(), b.A.view(), B0.view(), 1.0, out0.view());
  };
  const auto bwd = [&](int64_t r, int64_t dim) {
    TestTensor A(DType::f32, {r, 50}, dev), B(DType::f32, {dim, r}, dev), G(DType::f32, {2, 6, dim}, dev),
        dA(DType::f32, {r, 50}, dev), dB(DType::f32, {dim, r}, dev);
    dA.poison();
    try {
      ops::lora_embedding_backward(b.X.view(), A.view(), B.view(), G.view(), 1.0, dA.view(),
                                   dB.view());
    } catch (...) {
      // The CPU reads the ids before anything runs: a refused call leaves grad_A as it was
      // (dim 0 zeroed it first). A GPU reports them after its kernels, zeros written.
      if (!dev.is_cuda()) {
        dA.download();
        for (int64_t i = 0; i < r * 50; ++i) CHECK(std::isnan(dA.get(i)));
      }
      throw;
    }
  };
  CHECK_THROWS_WITH(fwd_dim0(), Catch::Contains("lora_embedding: token id x[") &&
                                    Catch::Contains("is outside the vocabulary [0, 50) (2 ids out of range in all)"));
  for (const auto& [r, dim] : {std::pair<int64_t, int64_t>{0, 16}, {4, 0}, {0, 0}}) {
    CAPTURE(r, dim);
    CHECK_THROWS_WITH(bwd(r, dim), Catch::Contains("lora_embedding_backward: token id x[") &&
                                       Catch::Contains("is outside the vocabulary [0, 50)"));
  }
  b.X.set(3, 0);
  b.X.set(8, 49);
  b.X.upload();
  CHECK_NOTHROW(fwd_dim0());
  for (const auto& [r, dim] : {std::pair<int64_t, int64_t>{0, 16}, {4, 0}, {0, 0}}) CHECK_NOTHROW(bwd(r, dim));
}

}  // namespace

TEST_CASE("embedding calls with nothing to compute still report ids out of range", "[cpu][ops][embedding]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_ids_with_nothing_to_compute(Device::cpu());
}

TEST_CASE("embedding calls with nothing to compute still report ids out of range on the GPU",
          "[gpu][ops][embedding]") {
  KERF_REQUIRE_GPU();
  check_ids_with_nothing_to_compute(Device::cuda(0));
}

TEST_CASE("lora_embedding matches a float64 reference on the CPU", "[cpu][ops][embedding]") {
  KERF_REQUIRE_CPU_BACKEND();
  run_forward_cases(Device::cpu());
}

TEST_CASE("lora_embedding matches a float64 reference on the GPU", "[gpu][ops][embedding]") {
  KERF_REQUIRE_GPU();
  run_forward_cases(Device::cuda(0));
}

TEST_CASE(
    "lora_embedding_backward matches a float64 reference with padding_idx and scale_grad_by_freq "
    "on the CPU",
    "[cpu][ops][embedding]") {
  KERF_REQUIRE_CPU_BACKEND();
  run_backward_cases(Device::cpu());
}

TEST_CASE(
    "lora_embedding_backward matches a float64 reference with padding_idx and scale_grad_by_freq "
    "on the GPU",
    "[gpu][ops][embedding]") {
  KERF_REQUIRE_GPU();
  run_backward_cases(Device::cuda(0));
}

// Untuned (KERF_AUTOTUNE=0, or a first call in a capture): the op's own tiles, narrowed at
// ranks >= 128 to fit the shared memory, both ways, on every product.
TEST_CASE("lora_embedding and its backward with their untuned tiles at ranks 64 to 256 match a float64 "
          "reference on the GPU",
          "[gpu][ops][embedding][large_rank]") {
  KERF_REQUIRE_GPU();
  test::ScopedEnv env({{"KERF_AUTOTUNE", "0"}});
  const std::vector<EmbCase> forward = {
      {{3, 37}, 1000, 130, 128, DType::i64, DType::bf16, DType::bf16, DType::bf16},
      {{70}, 400, 96, 256, DType::i64, DType::f16, DType::f32, DType::f32},
      {{50}, 77, 33, 256, DType::i32, DType::f32, DType::f32, DType::f32, true},
      {{4, 16}, 512, 256, 128, DType::i64, DType::bf16, DType::f32, DType::bf16},
      {{70}, 400, 96, 256, DType::i64, DType::bf16, DType::f32, DType::bf16},
      // Rank 64 with fp32 adapters on a half table (64-token blocks; 282624 bytes before).
      {{3, 37}, 1000, 130, 64, DType::i64, DType::bf16, DType::f32, DType::bf16},
      {{70}, 400, 96, 64, DType::i64, DType::f16, DType::f32, DType::f16},
      // Small tiles on two stages, as an untuned call runs them on GPUs of 99 KiB.
      {{40}, 300, 96, 256, DType::i64, DType::bf16, DType::f32, DType::bf16, false, ops::Config{16, 32, 0, 4, 2}},
  };
  uint64_t seed = 4800;
  for (const EmbCase& c : forward) check_forward(c, Device::cuda(0), seed++);
  const std::vector<BackCase> backward = {
      {111, 1000, 130, 128, DType::bf16, DType::bf16, DType::bf16, std::nullopt, false},
      {64, 512, 256, 256, DType::f16, DType::f32, DType::f32, 0, true},
      {37, 50, 40, 256, DType::f32, DType::f32, DType::f32, 7, false},
      {200, 300, 200, 128, DType::bf16, DType::f32, DType::bf16, std::nullopt, true},
      // PEFT's fp32 adapters with bf16 grad_out at rank 256 (half-height token blocks).
      {111, 1000, 130, 256, DType::bf16, DType::f32, DType::f32, std::nullopt, false},
      {64, 512, 256, 256, DType::bf16, DType::f32, DType::bf16, 3, true},
      // Rank 64 with fp32 adapters (64-column steps; 247808 bytes before, 321536 in TF32).
      {111, 1000, 130, 64, DType::bf16, DType::f32, DType::f32, std::nullopt, false},
      {200, 300, 200, 64, DType::f16, DType::f32, DType::bf16, 7, true},
      // Small tiles on two stages, as an untuned call runs them on GPUs of 99 KiB.
      {111, 1000, 130, 256, DType::bf16, DType::f32, DType::f32, std::nullopt, false, 0, false, false, 0, false, 16,
       32},
  };
  for (BackCase c : backward) {
    check_backward(c, Device::cuda(0), seed++);
    c.after_a = 1;
    check_backward(c, Device::cuda(0), seed++);
  }
}

// Untuned up to rank 16 with 16-bit products: the fused 128x128 warpgroup tile on 4 warps
// (grouped calls), the same tile in three launches where the call does not group (fp32
// grad_A without scale_grad_by_freq); sizes it does not divide, padding_idx, after_a.
TEST_CASE("lora_embedding_backward with its untuned tile at ranks up to 16 matches a float64 reference on the GPU",
          "[gpu][ops][embedding]") {
  KERF_REQUIRE_GPU();
  test::ScopedEnv env({{"KERF_AUTOTUNE", "0"}});
  const std::vector<BackCase> backward = {
      {521, 3000, 390, 16, DType::bf16, DType::bf16, DType::bf16, std::nullopt, false},
      {300, 1000, 200, 5, DType::f16, DType::f16, DType::f32, 0, true},
      {257, 2000, 130, 16, DType::bf16, DType::f32, DType::f32, -1, false},
      {129, 400, 260, 8, DType::bf16, DType::bf16, DType::bf16, 7, true},
  };
  uint64_t seed = 4900;
  for (BackCase c : backward) {
    check_backward(c, Device::cuda(0), seed++);
    c.after_a = 1;
    check_backward(c, Device::cuda(0), seed++);
  }
}

TEST_CASE("lora_embedding_backward with FUSED runs one kernel where the grouped form runs three",
          "[gpu][ops][embedding]") {
  KERF_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  const int64_t T = 300, V = 1000, D = 200, r = 16;
  std::mt19937_64 rng(6350);
  TestTensor X(DType::i64, {T}, dev), A(DType::bf16, {r, V}, dev), B(DType::bf16, {D, r}, dev);
  TestTensor G(DType::bf16, {T, D}, dev), dA(DType::bf16, {r, V}, dev), dB(DType::bf16, {D, r}, dev);
  fill_ids(X, T, 1, V, rng);
  X.upload();
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  G.randomize(rng);
  // Kernels looked up by a first call with the kernel cache emptied: one per launch.
  const auto lookups = [&](int fused) {
    ops::Config cfg;
    cfg.meta["GROUP_BY_ID"] = 1;
    cfg.meta["FUSED"] = fused;
    clear_kernel_cache();
    cache::reset_stats();
    ops::lora_embedding_backward(X.view(), A.view(), B.view(), G.view(), 2.0, dA.view(), dB.view(), {}, nullptr,
                                 cfg);
    test::sync(dev);
    const cache::Stats st = cache::stats();
    return st.bundle_hits + st.disk_hits + st.misses;
  };
  lookups(0);  // anything made once per process (the id-error record) is made here
  const uint64_t fused = lookups(1), three = lookups(0);
  CAPTURE(fused, three);
  CHECK(three == fused + 2);  // the id launch, the kernel and the column writes against one
}

TEST_CASE(
    "lora_embedding_backward passes axolotl's padding_idx and scale_grad_by_freq checks on the CPU",
    "[cpu][ops][embedding]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_axolotl_regressions(Device::cpu());
}

TEST_CASE(
    "lora_embedding_backward passes axolotl's padding_idx and scale_grad_by_freq checks on the GPU",
    "[gpu][ops][embedding]") {
  KERF_REQUIRE_GPU();
  check_axolotl_regressions(Device::cuda(0));
}

// Untuned on a GPU (KERF_AUTOTUNE=0, a first call inside a graph capture): 16-bit products
// up to rank 16 run the tuner's usual choice on an H100, 128x128 on 4 warps with warpgroup
// dots, one cooperative kernel where the call groups by id; otherwise the plan's own tiles.
TEST_CASE("the embedding backward's own GPU config is the fused 128x128 warpgroup tile up to rank 16",
          "[ops][embedding]") {
  const autotune::TunableOp op = test::registered_op("lora_embedding_backward");
  void* const p = reinterpret_cast<void*>(uintptr_t(1) << 20);
  const auto planned = [&](int64_t r, DType t, const autotune::Config& c) {
    std::vector<TensorView> views;
    for (const autotune::Operand& o : op.operands({8192, 128256, 4096, r}, t))
      views.push_back(TensorView::contiguous(p, o.dtype, o.shape, Device::cuda(0)));
    return op.kernels(views, c, 132);
  };
  for (const DType t : {DType::bf16, DType::f16})
    for (const int64_t r : {1, 5, 16}) {
      CAPTURE(dtype_name(t), r);
      const std::vector<autotune::KernelCall> k = planned(r, t, {});
      REQUIRE(k.size() == 1);  // grouped by id (16-bit gradients), fused
      CHECK(k[0].kernel->name() == std::string("lora_embedding_backward_fused"));
      CHECK(k[0].meta.at("BLOCK_T") == 128);
      CHECK(k[0].meta.at("BLOCK_D") == 128);
      CHECK(k[0].meta.at("num_warps") == 4);
      CHECK(k[0].meta.at("num_stages") == 3);
      CHECK(k[0].meta.at("ROTATE") == 1);
      CHECK(k[0].meta.at("staged_adds") == 1);
      CHECK(k[0].meta.at("wgmma") == 1);
      CHECK(k[0].meta.at("wgmma_ss") == 1);
    }
  // Rank 32, fp32 products, a tile named: the plan's own tiles (8 warps, mma.sync, three
  // launches for grouped calls).
  for (const auto& [r, t] : {std::pair<int64_t, DType>{32, DType::bf16}, {16, DType::f32}}) {
    CAPTURE(r, dtype_name(t));
    const std::vector<autotune::KernelCall> k = planned(r, t, {});
    for (const autotune::KernelCall& call : k) CHECK_FALSE(call.meta.count("wgmma"));
  }
  const std::vector<autotune::KernelCall> named = planned(16, DType::bf16, {{"BLOCK_T", 64}, {"BLOCK_D", 64}});
  REQUIRE(named.size() == 3);
  CHECK(named[1].meta.at("BLOCK_T") == 64);
  CHECK_FALSE(named[1].meta.count("wgmma"));
  // Meta given without a tile keep the own tile and win over its meta.
  const std::vector<autotune::KernelCall> unfused = planned(16, DType::bf16, {{"FUSED", 0}});
  REQUIRE(unfused.size() == 3);
  CHECK(unfused[1].kernel->name() == std::string("lora_embedding_backward"));
  CHECK(unfused[1].meta.at("BLOCK_T") == 128);
  CHECK(unfused[1].meta.at("num_warps") == 4);
  CHECK(unfused[1].meta.at("wgmma") == 1);
}

TEST_CASE("lora_embedding rejects ids out of range on the CPU before anything runs",
          "[cpu][ops][embedding]") {
  KERF_REQUIRE_CPU_BACKEND();
  for (DType ids : {DType::i32, DType::i64}) {
    Bad b(Device::cpu(), ids);
    CHECK_THROWS_WITH(
        b.call(),
        Catch::Contains("lora_embedding: token id x[0, 3] = 50 is outside the vocabulary [0, 50)") &&
            Catch::Contains("(2 ids out of range in all)"));
    b.out.download();
    for (int64_t i = 0; i < b.out.numel(); ++i) CHECK(std::isnan(b.out.get(i)));  // untouched
  }
  Bad b(Device::cpu());
  TestTensor G(DType::f32, {2, 6, 16}, Device::cpu()), dA(DType::f32, {4, 50}, Device::cpu()),
      dB(DType::f32, {16, 4}, Device::cpu());
  CHECK_THROWS_WITH(
      ops::lora_embedding_backward(b.X.view(), b.A.view(), b.B.view(), G.view(), 1.0, dA.view(),
                                   dB.view()),
      Catch::Contains(
          "lora_embedding_backward: token id x[0, 3] = 50 is outside the vocabulary [0, 50)"));
}

TEST_CASE("lora_embedding masks ids out of range on the GPU and reports them",
          "[gpu][ops][embedding]") {
  KERF_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  {
    Bad b(dev);
    CHECK_THROWS_WITH(b.call(), Catch::Contains("token id x[") &&
                                    Catch::Contains("is outside the vocabulary [0, 50)") &&
                                    Catch::Contains("(2 ids out of range in all)"));
    b.out.download();
    // The bad tokens' rows are zeros; the others are right.
    for (int64_t t : {3, 8})
      for (int64_t d = 0; d < 16; ++d) CHECK(b.out.get(t * 16 + d) == 0.0);
    for (int64_t d = 0; d < 16; ++d) {
      double l = 0;
      for (int64_t k = 0; k < 4; ++k) l += b.A.get(k * 50 + 49) * b.B.get(d * 4 + k);
      CHECK(std::abs(b.out.get(11 * 16 + d) - (b.Wt.get(49 * 16 + d) + l)) < 1e-5);
    }
    // The record was cleared by the throw: a good call passes.
    b.X.set(3, 0);
    b.X.set(8, 0);
    b.X.upload();
    CHECK_NOTHROW(b.call());
  }
  {
    // Deferred: the call returns; the check throws once, then the record is clear.
    Bad b(dev);
    ops::EmbeddingOptions o;
    o.id_check = ops::IdCheck::deferred;
    CHECK_NOTHROW(b.call(o));
    CHECK_THROWS_WITH(ops::check_embedding_ids(dev),
                      Catch::Contains("is outside the vocabulary [0, 50)"));
    CHECK_NOTHROW(ops::check_embedding_ids(dev));
  }
}
