// ops::lora_merge / lora_unmerge (PyTorch layout) and lora_merge_flax /
// lora_unmerge_flax (MaxText's JAX layout) against float64 references, on
// every dtype combination, odd and round shapes, strided and misaligned
// views; merge then unmerge returns W within rounding of its dtype.
#include <cmath>
#include <random>
#include <tuple>

#include "catch.h"
#include "cpu_test_util.h"
#include "device_tensor.h"
#include "gpu_test_util.h"
#include "kerf/error.h"
#include "kerf/ops/ops.h"
#include "smem_fit_util.h"
#include "test_cache_util.h"

using namespace kerf;
using kerf::test::TestTensor;

namespace {

// The tolerance of W + s*B@A in W's dtype: fp32 W is exact up to fp32 sums
// (half adapters are exact in the product); a half W rounds.
double merge_tolerance(DType w) {
  return test::tolerance(w);
}

struct MergeCase {
  int64_t out, in, r;
  DType w, a, b;
  bool transposed = false;  // W given as the strided view of a [in, out] buffer (fan_in_fan_out)
  int64_t offset = 0;  // W starts this many elements into its buffer (misaligned for the fast path)
  double s = 1.5;
  int64_t evict = 0;  // Config.meta EVICT (an L2 hint: the same answer)
  int64_t warps_n = 0, block_m = 0, warps = 0;  // Config.meta WARPS_N and the tile it splits (the same answer)
  bool wgmma = false;  // Config.meta WGMMA: Hopper's warpgroup dots (sm_90a; elsewhere the same kernel)
  int64_t split = 0, cols_first = 0;  // Config split_k and meta COLS_FIRST (the same answer)
  int64_t block_k = 0;
  bool stream = false;  // Config.meta STREAM: one tile per program, W moved through the accumulator's registers
  bool store_in_ring = false;  // Config.meta STORE_IN_RING: W's new tile staged in its spent ring slot
  bool walk_rows = false;  // Config.meta WALK_ROWS: programs own columns, keep A's, and walk the rows
  bool cast_a = false;  // Config.meta CAST_A: an fp32 A rounded to the product's dtype first (the same answer)
  bool one_tile = false;  // Config.meta ONE_TILE (with STREAM): W's tile asked for first, added after the product
  bool wgmma_ss =
      false;  // Config.meta WGMMA_SS (with WGMMA): the warpgroup dots read A from shared memory
};

ops::Config merge_config(const MergeCase& c) {
  ops::Config cfg;
  if (c.evict) cfg.meta["EVICT"] = c.evict;
  if (c.warps_n) cfg.meta["WARPS_N"] = c.warps_n;
  cfg.block_m = c.block_m;
  cfg.num_warps = c.warps;
  cfg.split_k = c.split;
  if (c.cols_first) cfg.meta["COLS_FIRST"] = c.cols_first;
  cfg.block_k = c.block_k;
  if (c.stream) cfg.meta["STREAM"] = 1;
  if (c.store_in_ring) cfg.meta["STORE_IN_RING"] = 1;
  if (c.walk_rows) cfg.meta["WALK_ROWS"] = 1;
  if (c.cast_a) cfg.meta["CAST_A"] = 1;
  if (c.wgmma_ss) cfg.meta["WGMMA_SS"] = 1;
  if (c.one_tile) cfg.meta["ONE_TILE"] = 1;
  if (c.wgmma) {
    if (!c.block_k) cfg.block_k = 64;
    cfg.meta["WGMMA"] = 1;
  }
  return cfg;
}

void check_merge(const MergeCase& c, Device dev, uint64_t seed) {
  CAPTURE(c.out, c.in, c.r, dtype_name(c.w), dtype_name(c.a), dtype_name(c.b), c.transposed,
          c.offset, c.evict, c.warps_n, c.block_m, c.warps, seed, dev.str(), c.wgmma, c.split,
          c.cols_first, c.block_k, c.stream, c.store_in_ring, c.walk_rows, c.cast_a, c.one_tile,
          c.wgmma_ss);
  std::mt19937_64 rng(seed);
  TestTensor Wbuf(c.w, {c.out * c.in + c.offset}, dev), A(c.a, {c.r, c.in}, dev),
      B(c.b, {c.out, c.r}, dev);
  Wbuf.randomize(rng);
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  // W[o, i] lives at element offset + (transposed ? i*out + o : o*in + i).
  const auto w_at = [&](int64_t o, int64_t i) {
    return c.offset + (c.transposed ? i * c.out + o : o * c.in + i);
  };
  const TensorView W = c.transposed ? Wbuf.view_at(c.offset, {c.out, c.in}, {1, c.out})
                                    : Wbuf.view_at(c.offset, {c.out, c.in}, {c.in, 1});
  std::vector<double> w0(size_t(Wbuf.numel()));
  for (int64_t i = 0; i < Wbuf.numel(); ++i) w0[size_t(i)] = Wbuf.get(i);

  const ops::Config cfg = merge_config(c);
  ops::lora_merge(W, A.view(), B.view(), c.s, nullptr, cfg);
  test::sync(dev);
  Wbuf.download();
  // Adapters of one half dtype are exact in the product; otherwise it takes A and s*B
  // rounded once (docs/ops.md): to bf16 for a bf16 W, to TF32 on the GPU for an f16 W; the
  // reference rounds them so, and the exact sum is checked within twice the tolerance.
  const bool exact_halves = is_half(c.a) && c.a == c.b;
  const auto promise = [&](double v) {
    if (!exact_halves && c.w == DType::bf16) return test::round_to(DType::bf16, v);
    if (!exact_halves && c.w == DType::f16 && dev.is_cuda()) return test::tf32(float(v));
    return v;
  };
  std::vector<double> got, ref, exact;
  for (int64_t o = 0; o < c.out; ++o)
    for (int64_t i = 0; i < c.in; ++i) {
      double d = 0, promised = 0;
      for (int64_t k = 0; k < c.r; ++k) {
        const double b = B.get(o * c.r + k), a = A.get(k * c.in + i);
        d += b * a;
        promised += exact_halves ? c.s * b * a : promise(float(b) * float(c.s)) * promise(a);
      }
      exact.push_back(w0[size_t(w_at(o, i))] + c.s * d);
      ref.push_back(w0[size_t(w_at(o, i))] + promised);
      got.push_back(Wbuf.get(w_at(o, i)));
    }
  for (int64_t i = 0; i < c.offset; ++i)
    CHECK(Wbuf.get(i) == w0[size_t(i)]);  // nothing before W is touched
  // Relative to W's scale (~1): entries near zero are compared absolutely.
  CHECK(test::max_relative_error(got, ref, 1.0) <= merge_tolerance(c.w));
  CHECK(test::max_relative_error(got, exact, 1.0) <= 2 * merge_tolerance(c.w));

  ops::lora_unmerge(W, A.view(), B.view(), c.s, nullptr, cfg);
  test::sync(dev);
  Wbuf.download();
  std::vector<double> back, orig;
  for (int64_t i = 0; i < Wbuf.numel(); ++i) {
    back.push_back(Wbuf.get(i));
    orig.push_back(w0[size_t(i)]);
  }
  // Two roundings of W's dtype (merge, then unmerge), element by element: the first of the
  // merged value, whose scale grows with the rank (s*B@A beside W's ~1), the second of W's.
  // Elements outside W are untouched.
  std::vector<double> merged_scale(size_t(Wbuf.numel()), 0.0);
  for (int64_t o = 0; o < c.out; ++o)
    for (int64_t i = 0; i < c.in; ++i)
      merged_scale[size_t(w_at(o, i))] = std::max(1.0, std::abs(ref[size_t(o * c.in + i)]));
  double worst = 0;
  for (size_t i = 0; i < back.size(); ++i) {
    if (merged_scale[i] == 0.0) {
      CHECK(back[i] == orig[i]);
      continue;
    }
    worst = std::max(worst, std::abs(back[i] - orig[i]) / merged_scale[i]);
  }
  CHECK(worst <= 2 * merge_tolerance(c.w));
}

// `c` with Config.meta STREAM (one tile a program) on a BM x BK tile, WARPS_N `warps_n`.
MergeCase streamed(MergeCase c, int64_t bm, int64_t bk, int64_t warps_n = 0) {
  c.stream = true;
  c.block_m = bm;
  c.block_k = bk;
  c.warps_n = warps_n;
  return c;
}

std::vector<MergeCase> merge_cases() {
  std::vector<MergeCase> cases;
  // Every dtype combination: W in {bf16, f16, f32} x adapters in {f32, bf16, f16}, odd shapes.
  for (DType w : {DType::bf16, DType::f16, DType::f32})
    for (DType ab : {DType::f32, DType::bf16, DType::f16}) cases.push_back({67, 130, 5, w, ab, ab});
  cases.push_back(
      {128, 256, 16, DType::bf16, DType::f32, DType::bf16});  // mixed adapter dtypes, round shape
  cases.push_back({96, 64, 16, DType::f32, DType::bf16, DType::f32});
  cases.push_back({300, 200, 64, DType::bf16, DType::bf16, DType::bf16});  // a large rank
  cases.push_back({33, 47, 1, DType::f32, DType::f32, DType::f32});
  cases.push_back({40, 72, 8, DType::bf16, DType::f32, DType::f32, true});  // fan_in_fan_out
  cases.push_back({64, 128, 16, DType::bf16, DType::bf16, DType::bf16, false, 1});  // misaligned W
  cases.push_back({50, 70, 3, DType::f32, DType::f32, DType::f32, false, 3, -0.75});
  cases.push_back({128, 256, 16, DType::bf16, DType::bf16, DType::bf16, false, 0, 1.5, 1});  // L2 hints
  cases.push_back({67, 130, 5, DType::f16, DType::f32, DType::f32, false, 0, 1.5, 2});
  // Warps sharing the dot's columns (WARPS_N), in place, partial tiles.
  cases.push_back({300, 200, 64, DType::bf16, DType::bf16, DType::bf16, false, 0, 1.5, 0, 2, 128, 8});
  cases.push_back({67, 130, 5, DType::f16, DType::f32, DType::f32, false, 0, -0.5, 0, 4, 64, 8});
  cases.push_back({40, 72, 8, DType::bf16, DType::f32, DType::f32, true, 0, 1.5, 0, 2, 32, 4});
  // Warpgroup dots (WGMMA): 64 and 128 rows per program, 1 and 2 warpgroups.
  cases.push_back({300, 200, 64, DType::bf16, DType::bf16, DType::bf16, false, 0, 1.5, 0, 0, 64, 4, true});
  cases.push_back({130, 333, 16, DType::f16, DType::f32, DType::f32, true, 0, -0.5, 0, 0, 128, 8, true});
  // ... reading A's tiles from shared memory (WGMMA_SS): ranks 64 and 16.
  MergeCase ss{300, 200, 64, DType::bf16, DType::bf16, DType::bf16, false,
               0,   1.5, 0,  0,           64,          4,           true};
  ss.wgmma_ss = true;
  cases.push_back(ss);
  MergeCase ss16{130, 333,  16, DType::f16, DType::f16, DType::f16, false,
                 0,   -0.5, 0,  0,          128,        8,          true};
  ss16.wgmma_ss = true;
  cases.push_back(ss16);
  // Rows of 200 and 136 elements (multiples of 8, not 16); column slices on grid axis 0 (COLS_FIRST).
  cases.push_back({130, 200, 16, DType::bf16, DType::bf16, DType::bf16});
  cases.push_back({67, 136, 5, DType::f32, DType::f32, DType::f32});
  cases.push_back({130, 200, 16, DType::bf16, DType::bf16, DType::bf16, false, 0, 1.5, 0, 0, 0, 0, false, 2, 1});
  cases.push_back({67, 136, 5, DType::f16, DType::f32, DType::f32, true, 0, -0.5, 0, 0, 32, 4, false, 3, 1});
  // STREAM: bf16 W with bf16 adapters (s applied after the product), f16 W with
  // f32 adapters (the product onto W), f32 W (runs of 4), partial tiles, a large
  // rank, warps along the columns, fan_in_fan_out and misaligned W (no vectors).
  cases.push_back(streamed({130, 200, 16, DType::bf16, DType::bf16, DType::bf16}, 64, 128));
  cases.push_back(streamed({67, 300, 5, DType::f16, DType::f32, DType::f32, false, 0, -0.5}, 32, 256));
  cases.push_back(streamed({96, 136, 16, DType::f32, DType::bf16, DType::bf16}, 32, 64));
  cases.push_back(streamed({300, 200, 64, DType::bf16, DType::bf16, DType::bf16}, 128, 64));
  cases.push_back(streamed({130, 333, 16, DType::bf16, DType::f32, DType::bf16}, 64, 128, 2));
  cases.push_back(streamed({40, 72, 8, DType::bf16, DType::f32, DType::f32, true}, 32, 64));
  cases.push_back(streamed({64, 128, 16, DType::bf16, DType::bf16, DType::bf16, false, 1}, 64, 64));
  // STORE_IN_RING: W's new tile moved to its store layout through the ring slot W's tile
  // was read from: warpgroup and mma.sync dots, fp32 adapters on f16 W, fp32 W, partial
  // tiles; fan_in_fan_out and misaligned W (no pipelined copy of W) stage as before.
  const auto in_ring = [](MergeCase c, int64_t bm, int64_t warps) {
    c.store_in_ring = true;
    c.block_m = bm;
    c.warps = warps;
    return c;
  };
  MergeCase wg{300, 200, 64, DType::bf16, DType::bf16, DType::bf16};
  wg.wgmma = true;
  cases.push_back(in_ring(wg, 64, 4));
  // The same warpgroup tile (sm_90a's own tile for all-bf16 or all-f16 merges at ranks 17 to
  // 64) with adapters of another dtype than W: f16 W with bf16 adapters, bf16 W with f16 ones
  // and PEFT's fp32 adapters on a bf16 W.
  for (const auto& [w, ab, r] : {std::tuple{DType::f16, DType::bf16, int64_t(64)}, {DType::bf16, DType::f16, 48},
                                 {DType::bf16, DType::f32, 64}}) {
    MergeCase mixed{300, 200, r, w, ab, ab, false, 0, -0.75};
    mixed.wgmma = true;
    mixed.block_k = 128;
    cases.push_back(in_ring(mixed, 64, 4));
  }
  cases.push_back(in_ring({130, 333, 16, DType::bf16, DType::bf16, DType::bf16}, 128, 8));
  cases.push_back(in_ring({67, 130, 5, DType::f16, DType::f32, DType::f32, false, 0, -0.5}, 32, 4));
  cases.push_back(in_ring({67, 136, 5, DType::f32, DType::f32, DType::f32}, 64, 4));
  cases.push_back(in_ring({40, 72, 8, DType::bf16, DType::f32, DType::f32, true}, 32, 4));
  cases.push_back(in_ring({64, 128, 16, DType::bf16, DType::bf16, DType::bf16, false, 1}, 64, 4));
  // WALK_ROWS: programs own column blocks (the last partial) and walk slices of the rows (the
  // last step partial): the warpgroup ring tile on one dtype and on fp32 adapters (s*B rounded
  // per step), mma.sync tiles on TF32 and fp32 products, fan_in_fan_out and misaligned W.
  const auto walking = [](MergeCase c, int64_t bm, int64_t bk, int64_t split, bool wgmma) {
    c.walk_rows = true;
    c.block_m = bm;
    c.block_k = bk;
    c.split = split;
    c.wgmma = wgmma;
    c.store_in_ring = wgmma;
    c.warps = 4;
    return c;
  };
  cases.push_back(walking({300, 333, 64, DType::bf16, DType::bf16, DType::bf16, false, 0, -0.75}, 64, 128, 2, true));
  cases.push_back(walking({200, 520, 48, DType::bf16, DType::f32, DType::f32}, 64, 128, 0, true));
  cases.push_back(walking({130, 200, 32, DType::f16, DType::f16, DType::f16}, 64, 64, 3, true));
  cases.push_back(walking({67, 130, 5, DType::f16, DType::f32, DType::f32, false, 0, -0.5}, 32, 64, 2, false));
  cases.push_back(walking({96, 136, 16, DType::f32, DType::bf16, DType::bf16}, 32, 64, 1, false));
  cases.push_back(walking({40, 72, 8, DType::bf16, DType::f32, DType::f32, true}, 16, 64, 2, false));
  cases.push_back(walking({64, 128, 16, DType::bf16, DType::bf16, DType::bf16, false, 1}, 32, 64, 0, false));
  // CAST_A: PEFT's fp32 adapters on a bf16 W with A rounded to bf16 in a pass of its own, on the
  // warpgroup ring tile, on the kernel's default tile with a fan_in_fan_out W and a bf16 B, and
  // walking the rows; on an f16 W (TF32 products) it changes nothing.
  MergeCase cast{300, 520, 64, DType::bf16, DType::f32, DType::f32, false, 0, -0.75};
  cast.cast_a = true;
  cast.wgmma = true;
  cast.block_k = 128;
  cases.push_back(in_ring(cast, 64, 4));
  MergeCase cast2{130, 333, 16, DType::bf16, DType::f32, DType::bf16, true};
  cast2.cast_a = true;
  cases.push_back(cast2);
  MergeCase cast3 = walking({200, 300, 32, DType::bf16, DType::f32, DType::f32}, 64, 128, 0, true);
  cast3.cast_a = true;
  cases.push_back(cast3);
  MergeCase cast4{67, 130, 5, DType::f16, DType::f32, DType::f32, false, 0, 0.5};
  cast4.cast_a = true;
  cases.push_back(cast4);
  return cases;
}

void run_merge_cases(Device dev) {
  uint64_t seed = 4100;
  for (const MergeCase& c : merge_cases()) check_merge(c, dev, seed++);
}

// STREAM in the kernel's one-tile form (ONE_TILE: W's tile asked for first, added after the
// product): both product forms, fp32 W, rows and columns past the tile at ranks 32 to 64,
// warps along the columns, fan_in_fan_out (strided W) and misaligned W (no vectors).
std::vector<MergeCase> one_tile_cases() {
  const auto cast_first = [](MergeCase c, int64_t warps) {
    c.cast_a = true;
    c.warps = warps;
    return c;
  };
  const auto one_tile = [](MergeCase c, int64_t bm, int64_t bk, int64_t warps_n = 0) {
    c = streamed(c, bm, bk, warps_n);
    c.one_tile = true;
    return c;
  };
  return {
      one_tile({130, 200, 64, DType::bf16, DType::bf16, DType::bf16}, 64, 128),
      one_tile({130, 333, 32, DType::bf16, DType::bf16, DType::bf16, false, 0, -0.5}, 32, 128),
      one_tile({67, 300, 5, DType::f16, DType::f32, DType::f32, false, 0, -0.5}, 32, 256),
      one_tile({96, 136, 16, DType::f32, DType::bf16, DType::bf16}, 32, 64),
      one_tile({300, 200, 48, DType::bf16, DType::f32, DType::bf16}, 32, 128, 2),
      one_tile({40, 72, 8, DType::bf16, DType::f32, DType::f32, true}, 32, 64),
      one_tile({64, 128, 16, DType::f16, DType::f16, DType::f16, false, 1}, 64, 64),
      // CAST_A: PEFT's fp32 adapters, A cast to bf16 by a launch the merge's overlaps on a GPU
      // (the merge asks for W's and B's tiles, then waits for the cast before reading A).
      cast_first(one_tile({200, 520, 20, DType::bf16, DType::f32, DType::f32}, 64, 128), 8),
      cast_first(
          one_tile({130, 333, 32, DType::bf16, DType::f32, DType::bf16, false, 0, -0.5}, 32, 128),
          4),
  };
}

// MaxText: kernel [in..., out...] += s * einsum(lora_a [in..., r], lora_b [r, out...]).
struct FlaxCase {
  std::vector<int64_t> in_dims, out_dims;
  int64_t r;
  DType w, ab;
  double s;
  int64_t pad_last =
      0;  // kernel and lora_b views of buffers whose last dim is wider: dims do not flatten
};

void check_flax(const FlaxCase& c, Device dev, uint64_t seed) {
  CAPTURE(c.in_dims, c.out_dims, c.r, dtype_name(c.w), dtype_name(c.ab), c.s, c.pad_last, seed,
          dev.str());
  std::mt19937_64 rng(seed);
  int64_t nin = 1, nout = 1;
  for (int64_t d : c.in_dims) nin *= d;
  for (int64_t d : c.out_dims) nout *= d;
  // Buffers: the last out dim padded by pad_last elements.
  const int64_t last = c.out_dims.back(), last_pad = last + c.pad_last;
  const int64_t nout_buf = nout / last * last_pad;
  TestTensor K(c.w, {nin * nout_buf}, dev), la(c.ab, {nin * c.r}, dev),
      lb(c.ab, {c.r * nout_buf}, dev);
  K.randomize(rng);
  la.randomize(rng, -0.5, 0.5);
  lb.randomize(rng, -0.5, 0.5);
  // Row-major strides of the padded buffers.
  std::vector<int64_t> kshape = c.in_dims, kstrides(c.in_dims.size() + c.out_dims.size());
  kshape.insert(kshape.end(), c.out_dims.begin(), c.out_dims.end());
  std::vector<int64_t> bshape = {c.r}, bstrides(c.out_dims.size() + 1);
  bshape.insert(bshape.end(), c.out_dims.begin(), c.out_dims.end());
  std::vector<int64_t> ashape = c.in_dims, astrides(c.in_dims.size() + 1);
  ashape.push_back(c.r);
  int64_t st = 1;
  for (size_t d = kshape.size(); d-- > 0;) {
    kstrides[d] = st;
    st *= d + 1 == kshape.size() ? last_pad : kshape[d];
  }
  st = 1;
  for (size_t d = bshape.size(); d-- > 0;) {
    bstrides[d] = st;
    st *= d + 1 == bshape.size() ? last_pad : bshape[d];
  }
  st = 1;
  for (size_t d = ashape.size(); d-- > 0;) {
    astrides[d] = st;
    st *= ashape[d];
  }
  // Element offsets of (flat in index, flat out index) in the padded buffers.
  const auto out_off = [&](int64_t o) { return (o / last) * last_pad + o % last; };
  const auto k_at = [&](int64_t i, int64_t o) { return i * nout_buf + out_off(o); };
  std::vector<double> k0(size_t(K.numel()));
  for (int64_t i = 0; i < K.numel(); ++i) k0[size_t(i)] = K.get(i);

  ops::lora_merge_flax(K.view(kshape, kstrides), la.view(ashape, astrides),
                       lb.view(bshape, bstrides), c.s);
  test::sync(dev);
  K.download();
  std::vector<double> got, ref;
  for (int64_t i = 0; i < nin; ++i)
    for (int64_t o = 0; o < nout; ++o) {
      double d = 0;
      for (int64_t k = 0; k < c.r; ++k)
        d += la.get(i * c.r + k) * lb.get(k * nout_buf + out_off(o));
      ref.push_back(k0[size_t(k_at(i, o))] + c.s * d);
      got.push_back(K.get(k_at(i, o)));
    }
  CHECK(test::max_relative_error(got, ref, 1.0) <= merge_tolerance(c.w));
  // Padding between rows is never written.
  for (int64_t i = 0; i < nin; ++i)
    for (int64_t p = 0; p < nout_buf; ++p)
      if (p % last_pad >= last) CHECK(K.get(i * nout_buf + p) == k0[size_t(i * nout_buf + p)]);

  ops::lora_unmerge_flax(K.view(kshape, kstrides), la.view(ashape, astrides),
                         lb.view(bshape, bstrides), c.s);
  test::sync(dev);
  K.download();
  std::vector<double> back, orig;
  for (int64_t i = 0; i < K.numel(); ++i) {
    back.push_back(K.get(i));
    orig.push_back(k0[size_t(i)]);
  }
  if (c.w == DType::f32) {
    // MaxText's own round-trip test: rtol 1e-5, atol 1e-6.
    for (size_t i = 0; i < back.size(); ++i)
      CHECK(std::abs(back[i] - orig[i]) <= 1e-6 + 1e-5 * std::abs(orig[i]));
  } else {
    CHECK(test::max_relative_error(back, orig, 1.0) <= 2 * merge_tolerance(c.w));
  }
}

void run_flax_cases(Device dev) {
  const std::vector<FlaxCase> cases = {
      // MaxText's unit test: emb=4, heads=2, head_dim=3, rank=2, scales 0.5, 0.7, 1.0, fp32.
      {{4}, {2, 3}, 2, DType::f32, DType::f32, 0.5},
      {{4}, {2, 3}, 2, DType::f32, DType::f32, 0.7},
      {{4}, {2, 3}, 2, DType::f32, DType::f32, 1.0},
      // query [emb, heads, head_dim], odd and round shapes, bf16 kernels with fp32 adapters.
      {{130}, {3, 24}, 8, DType::bf16, DType::f32, 0.25},
      {{256}, {4, 32}, 16, DType::bf16, DType::bf16, 2.0},
      // out [heads, head_dim, emb]: two in dims.
      {{3, 20}, {70}, 4, DType::f16, DType::f16, 0.5},
      // heads and head_dim that do not flatten (padded rows): a batch of launches.
      {{37}, {3, 5}, 4, DType::f32, DType::f32, 0.5, 2},
      {{2, 9}, {4, 6}, 3, DType::bf16, DType::f32, 1.0, 1},
      // ... more of them than a launch's grid axis takes (65535): each looped on the host.
      {{3}, {65537, 2}, 2, DType::f32, DType::f32, 0.75, 1},
  };
  uint64_t seed = 4200;
  for (const FlaxCase& c : cases) check_flax(c, dev, seed++);
}

void check_merge_edges(Device dev) {
  std::mt19937_64 rng(4300);
  // r = 0: W is not touched at all.
  TestTensor W(DType::bf16, {5, 7}, dev), A(DType::f32, {0, 7}, dev), B(DType::f32, {5, 0}, dev);
  W.randomize(rng);
  const std::vector<uint8_t> before = W.bytes();
  ops::lora_merge(W.view(), A.view(), B.view(), 2.0);
  ops::lora_unmerge_flax(W.view(), TestTensor(DType::f32, {5, 0}, dev).view(),
                         TestTensor(DType::f32, {0, 7}, dev).view(), 2.0);
  test::sync(dev);
  W.download();
  CHECK(W.bytes() == before);
  // An empty W: nothing to do.
  TestTensor E(DType::f32, {0, 7}, dev), Ae(DType::f32, {3, 7}, dev), Be(DType::f32, {0, 3}, dev);
  CHECK_NOTHROW(ops::lora_merge(E.view(), Ae.view(), Be.view(), 1.0));
}

}  // namespace

TEST_CASE(
    "lora_merge and lora_unmerge match a float64 reference for every dtype combination on the CPU",
    "[cpu][ops][merge]") {
  KERF_REQUIRE_CPU_BACKEND();
  run_merge_cases(Device::cpu());
}

TEST_CASE(
    "lora_merge and lora_unmerge match a float64 reference for every dtype combination on the GPU",
    "[gpu][ops][merge]") {
  KERF_REQUIRE_GPU();
  run_merge_cases(Device::cuda(0));
}

TEST_CASE("lora_merge's one-tile form matches a float64 reference on the CPU", "[cpu][ops][merge]") {
  KERF_REQUIRE_CPU_BACKEND();
  uint64_t seed = 4700;
  for (const MergeCase& c : one_tile_cases()) check_merge(c, Device::cpu(), seed++);
}

TEST_CASE("lora_merge's one-tile form matches a float64 reference on the GPU", "[gpu][ops][merge]") {
  KERF_REQUIRE_GPU();
  uint64_t seed = 4700;
  for (const MergeCase& c : one_tile_cases()) check_merge(c, Device::cuda(0), seed++);
}

// The tiles the GPU cases above run fit an H100 (each case's kernel as planned for sm_90a).
TEST_CASE("the tiles of lora_merge's GPU float64 cases fit an H100's shared memory", "[cuda][codegen][merge]") {
  const Device dev = Device::cuda(0);
  void* const p = test::planning_address();
  std::vector<MergeCase> cases = merge_cases();
  for (const MergeCase& c : one_tile_cases()) cases.push_back(c);
  for (const MergeCase& c : cases) {
    CAPTURE(c.out, c.in, c.r, dtype_name(c.w), dtype_name(c.a), dtype_name(c.b), c.transposed, c.block_m, c.warps,
            c.block_k, c.wgmma, c.stream, c.store_in_ring);
    const TensorView W = c.transposed ? TensorView::strided(p, c.w, {c.out, c.in}, {1, c.out}, dev)
                                      : TensorView::contiguous(p, c.w, {c.out, c.in}, dev);
    test::check_fits_h100("lora_merge", {W, TensorView::contiguous(p, c.a, {c.r, c.in}, dev),
                                         TensorView::contiguous(p, c.b, {c.out, c.r}, dev)},
                          merge_config(c));
  }
}

// Untuned merges on sm_90a up to rank 64 with a bf16 or f16 W whose product runs in a half
// dtype (a bf16 W with any adapters, an f16 W with f16 or bf16 ones): up to rank 32 with W's
// rows contiguous, one tile a program in its one-tile form, 32x64 at ranks 17 to 32 (32x128
// with fp32 adapters) and 32x128 up to 16 (there also for TF32 products: an f16 W, fp32
// adapters; a bf16 W with fp32 adapters 64x128 on 8 warps); at ranks 17 to 64 otherwise (33
// to 64, or asked with ONE_TILE=0 or WALK_ROWS, or with W strided: fan_in_fan_out) the MoE
// forward's warpgroup tile through W's ring, its programs owning columns and walking the rows
// (WALK_ROWS), on two stages at ranks 33 to 64 and three below; other ranks, dtypes and GPUs
// keep the 64x128 mma.sync tile walking columns.
// Each dtype combination's own tile fits an H100's shared memory.
TEST_CASE("the merge's own config on sm_90a is one tile a program up to rank 32 and the MoE forward's 64x128 "
          "ring tile walking the rows at ranks 33 to 64",
          "[ops][merge]") {
  const autotune::TunableOp op = test::registered_op("lora_merge");
  void* const p = test::planning_address();
  const auto planned = [&](const char* arch, DType w, DType ab, int64_t r, const autotune::Config& c,
                           bool transposed = false) {
    const ops::detail::PlanningArch target(arch);
    const auto t = [&](DType d, std::initializer_list<int64_t> shape) {
      return TensorView::contiguous(p, d, shape, Device::cuda(0));
    };
    const TensorView W = transposed ? TensorView::strided(p, w, {8192, 4096}, {1, 8192}, Device::cuda(0))
                                    : t(w, {8192, 4096});
    const std::vector<autotune::KernelCall> calls = op.kernels({W, t(ab, {r, 4096}), t(ab, {8192, r})}, c, 132);
    REQUIRE((calls.size() == 1 || calls.size() == 2));
    const autotune::KernelCall& merge = calls.back();
    if (std::string(arch) == "sm_90a")
      CHECK(test::sm90a_smem_bytes(merge) <= autotune::typical_max_shared_memory("sm_90a"));
    autotune::Config m = merge.meta;
    if (calls.size() == 2) {  // an fp32 A cast first (CAST_A), waited for in the one-tile form
      CHECK(ab == DType::f32);
      CHECK(merge.meta.count("ONE_TILE") == merge.meta.count("WAIT_PRIOR"));
      m["CAST_A"] = 1;
    }
    return m;
  };
  // The ring tile on two stages (the own tile's above rank 32) or three (at rank 32 and below).
  const auto ring_tile = [](const autotune::Config& m) {
    return test::is_ring_tile(m, "BLOCK_M", 2) || test::is_ring_tile(m, "BLOCK_M", 3);
  };
  for (const auto& [w, ab] : {std::pair{DType::bf16, DType::bf16}, {DType::f16, DType::f16}, {DType::f16, DType::bf16},
                              {DType::bf16, DType::f16}, {DType::bf16, DType::f32}})
    for (const int64_t r : {17, 32, 48, 64}) {
      CAPTURE(dtype_name(w), dtype_name(ab), r);
      const autotune::Config own = planned("sm_90a", w, ab, r, {});
      // PEFT's fp32 adapters at ranks 17 to 32: A cast first, the merge overlapping the cast.
      CHECK(own.count("CAST_A") == (ab == DType::f32 && r <= 32 ? 1u : 0u));
      if (r <= 32) {
        CHECK(test::is_one_tile(own, "BLOCK_M", 32, ab == DType::f32 ? 128 : 64));
        if (ab == DType::f32) CHECK(own.at("WAIT_PRIOR") == 1);
        CHECK_FALSE(ring_tile(own));
        // ONE_TILE=0, STREAM=0, WALK_ROWS named, or W strided: the ring tile walking the rows,
        // three stages.
        for (const autotune::Config& asked :
             {autotune::Config{{"ONE_TILE", 0}}, autotune::Config{{"WALK_ROWS", 1}}, autotune::Config{{"STREAM", 0}}}) {
          const autotune::Config ring = planned("sm_90a", w, ab, r, asked);
          CHECK(test::is_ring_tile(ring, "BLOCK_M", 3));
          CHECK(ring.count("WALK_ROWS"));
        }
        const autotune::Config strided = planned("sm_90a", w, ab, r, {}, true);
        CHECK(test::is_ring_tile(strided, "BLOCK_M", 3));
        CHECK_FALSE(strided.count("ONE_TILE"));
      } else {
        CHECK(test::is_ring_tile(own, "BLOCK_M", 2));  // three programs a multiprocessor at ranks 33 to 64
        CHECK(own.count("WALK_ROWS"));
        CHECK_FALSE(own.count("ONE_TILE"));
      }
      const autotune::Config off = planned("sm_80", w, ab, r, {});
      CHECK_FALSE(ring_tile(off));
      CHECK_FALSE(off.count("WALK_ROWS"));
      CHECK_FALSE(off.count("ONE_TILE"));
    }
  // Ranks up to 16: 32x128 one-tile (the mma.sync tile with ONE_TILE=0 or W strided).
  for (const int64_t r : {1, 16}) {
    CAPTURE(r);
    CHECK(test::is_one_tile(planned("sm_90a", DType::bf16, DType::bf16, r, {}), "BLOCK_M", 32, 128));
    const autotune::Config peft = planned("sm_90a", DType::bf16, DType::f32, r, {});
    CHECK(test::is_one_tile(peft, "BLOCK_M", 64, 128, 8));  // PEFT's, A read as it is
    CHECK_FALSE(peft.count("CAST_A"));
    for (const autotune::Config& m : {planned("sm_90a", DType::bf16, DType::bf16, r, {{"ONE_TILE", 0}}),
                                      planned("sm_90a", DType::bf16, DType::bf16, r, {{"STREAM", 0}}),
                                      planned("sm_90a", DType::bf16, DType::bf16, r, {}, true)}) {
      CHECK_FALSE(ring_tile(m));
      CHECK_FALSE(m.count("ONE_TILE"));
      CHECK_FALSE(m.count("WALK_ROWS"));
      CHECK(m.at("BLOCK_M") == 64);
    }
  }
  const autotune::Config large = planned("sm_90a", DType::bf16, DType::bf16, 128, {});
  CHECK_FALSE(ring_tile(large));
  CHECK_FALSE(large.count("ONE_TILE"));
  for (const auto& [w, ab] : {std::pair{DType::f32, DType::f32}, {DType::f32, DType::bf16}, {DType::f16, DType::f32}}) {
    CAPTURE(dtype_name(w), dtype_name(ab));  // fp32 products, an fp32 W, TF32
    for (const int64_t r : {16, 32, 64}) {
      CAPTURE(r);
      const autotune::Config own = planned("sm_90a", w, ab, r, {});
      CHECK_FALSE(ring_tile(own));
      // TF32 products (an f16 W, fp32 adapters) up to rank 16: the 32x128 one-tile form.
      if (w == DType::f16 && r <= 16)
        CHECK(test::is_one_tile(own, "BLOCK_M", 32, 128));
      else
        CHECK_FALSE(own.count("ONE_TILE"));
    }
  }
  CHECK_FALSE(planned("sm_90a", DType::f16, DType::f32, 16, {{"ONE_TILE", 0}}).count("ONE_TILE"));
  CHECK_FALSE(ring_tile(planned("sm_90a", DType::bf16, DType::bf16, 64, {{"STREAM", 1}})));
  CHECK_FALSE(planned("sm_90a", DType::bf16, DType::bf16, 64, {{"STREAM", 1}}).count("ONE_TILE"));
  // WALK_ROWS=0 keeps the own ring tile, walking columns.
  for (const int64_t r : {32, 64}) {
    const autotune::Config by_columns = planned("sm_90a", DType::bf16, DType::bf16, r, {{"WALK_ROWS", 0}});
    CHECK(test::is_ring_tile(by_columns, "BLOCK_M", 3));  // walking columns on three stages, as before
    CHECK_FALSE(by_columns.count("WALK_ROWS"));
  }
  // A caller's fields win; the rest is the own tile's.
  const autotune::Config deeper = planned("sm_90a", DType::bf16, DType::bf16, 64, {{"num_stages", 4}});
  CHECK(deeper.at("num_stages") == 4);
  CHECK(planned("sm_90a", DType::bf16, DType::bf16, 32, {{"ONE_TILE", 0}, {"num_stages", 2}}).at("num_stages") == 2);
  CHECK(deeper.count("store_in_ring"));
  CHECK(planned("sm_90a", DType::bf16, DType::bf16, 64, {{"BLOCK_M", 128}}).at("BLOCK_M") == 128);
  CHECK_FALSE(planned("sm_90a", DType::bf16, DType::f32, 32, {{"CAST_A", 0}}).count("CAST_A"));
  CHECK_FALSE(planned("sm_80", DType::bf16, DType::f32, 32, {}).count("CAST_A"));
  const autotune::Config wide = planned("sm_90a", DType::bf16, DType::bf16, 32, {{"num_warps", 8}});
  CHECK(wide.at("num_warps") == 8);
  CHECK(wide.at("ONE_TILE") == 1);
  CHECK(wide.at("BLOCK_M") == 32);
}

// CAST_A in the one-tile form on a GPU: the cast lets the merge's launch start (RELEASE) and
// the merge waits for it (WAIT_PRIOR) after asking for W's and B's tiles; in other forms and
// with an A that needs no cast, neither.
TEST_CASE("lora_merge's one-tile form after its fp32 A's cast overlaps the cast's launch on GPUs",
          "[ops][merge]") {
  const autotune::TunableOp op = test::registered_op("lora_merge");
  void* const p = test::planning_address();
  const ops::detail::PlanningArch target("sm_90a");
  const auto calls_of = [&](DType a, const autotune::Config& c) {
    const auto t = [&](DType d, std::initializer_list<int64_t> shape) {
      return TensorView::contiguous(p, d, shape, Device::cuda(0));
    };
    return op.kernels({t(DType::bf16, {8192, 4096}), t(a, {32, 4096}), t(DType::f32, {8192, 32})},
                      c, 132);
  };
  const autotune::Config one_tile{{"STREAM", 1},   {"ONE_TILE", 1},  {"CAST_A", 1},
                                  {"BLOCK_M", 64}, {"BLOCK_K", 128}, {"num_warps", 8}};
  const std::vector<autotune::KernelCall> overlapped = calls_of(DType::f32, one_tile);
  REQUIRE(overlapped.size() == 2);
  CHECK(overlapped[0].meta.at("RELEASE") == 1);
  CHECK(overlapped[1].meta.at("ONE_TILE") == 1);
  CHECK(overlapped[1].meta.at("WAIT_PRIOR") == 1);
  // The ring tile reads A in every step: the cast ends before it starts.
  const std::vector<autotune::KernelCall> ring = calls_of(
      DType::f32,
      {{"CAST_A", 1}, {"WGMMA", 1}, {"STORE_IN_RING", 1}, {"BLOCK_M", 64}, {"BLOCK_K", 128}});
  REQUIRE(ring.size() == 2);
  CHECK_FALSE(ring[0].meta.count("RELEASE"));
  CHECK_FALSE(ring[1].meta.count("WAIT_PRIOR"));
  // A bf16 A: nothing to cast, nothing to wait for.
  const std::vector<autotune::KernelCall> no_cast = calls_of(DType::bf16, one_tile);
  REQUIRE(no_cast.size() == 1);
  CHECK_FALSE(no_cast[0].meta.count("WAIT_PRIOR"));
  // Without CAST_A: one launch.
  autotune::Config uncast = one_tile;
  uncast.erase("CAST_A");
  const std::vector<autotune::KernelCall> plain = calls_of(DType::f32, uncast);
  REQUIRE(plain.size() == 1);
  CHECK_FALSE(plain[0].meta.count("WAIT_PRIOR"));
}

// f16 W and adapters at rank 64 on the 64x128 mma.sync tile on three stages (the op's own
// tile off sm_90a), the kernel that compile_kernel compiles again for one program a
// multiprocessor (ptxas spilled 4 bytes of it at 168 registers; tests/test_cuda_codegen.cpp);
// then untuned, the op's own tile (on sm_90a, products in a half dtype: up to rank 32 one tile
// a program in its one-tile form, TF32 products up to 16 too; at 33 to 64, and with W strided,
// the MoE forward's warpgroup tile through W's ring, walking the rows), W and adapters of one
// dtype and of two.
TEST_CASE("lora_merge in f16 at rank 64 on the tile compiled twice, and untuned at ranks up to 64, matches a "
          "float64 reference on the GPU",
          "[gpu][ops][merge]") {
  KERF_REQUIRE_GPU();
  test::ScopedEnv env({{"KERF_AUTOTUNE", "0"}});
  MergeCase tile{300, 200, 64, DType::f16, DType::f16, DType::f16};
  tile.block_m = 64;
  tile.block_k = 128;
  tile.warps = 4;
  const std::vector<MergeCase> cases = {
      tile,
      {520, 1000, 64, DType::f16, DType::f16, DType::f16, false, 0, -0.5},
      {300, 200, 64, DType::bf16, DType::bf16, DType::bf16},
      {260, 300, 32, DType::bf16, DType::bf16, DType::bf16, false, 0, -0.5},
      {130, 333, 32, DType::bf16, DType::f32, DType::bf16, true},  // fan_in_fan_out: strided W
      {300, 200, 64, DType::f16, DType::bf16, DType::bf16},
      {260, 300, 48, DType::bf16, DType::f16, DType::f16, false, 0, -0.5},
      {300, 520, 64, DType::bf16, DType::f32, DType::f32},  // PEFT's fp32 adapters
      {200, 300, 64, DType::bf16, DType::f32, DType::bf16, false, 0, -0.75},
      // The one-tile own tile at ranks 17 to 32: 32x64 (32x128 with fp32 adapters), rows and
      // columns not multiples of the tile.
      {130, 333, 17, DType::f16, DType::f16, DType::f16},
      {301, 130, 32, DType::bf16, DType::f32, DType::f32, false, 0, -0.5},
      {99, 200, 24, DType::f16, DType::bf16, DType::bf16},
      // ... and 32x128 at ranks up to 16 (64x128 on 8 warps with a bf16 W and fp32 adapters).
      {130, 333, 16, DType::bf16, DType::bf16, DType::bf16, false, 0, -0.5},
      {130, 333, 16, DType::bf16, DType::f32, DType::f32, false, 0, -0.5},
      {67, 300, 5, DType::f16, DType::f16, DType::f16},
      {200, 130, 9, DType::bf16, DType::f32, DType::f32},
      {130, 200, 16, DType::f16, DType::f32, DType::f32, false, 0, -0.5},  // TF32
  };
  uint64_t seed = 4650;
  for (const MergeCase& c : cases) check_merge(c, Device::cuda(0), seed++);
}

// Untuned (KERF_AUTOTUNE=0, or a first call in a capture): the op's own tiles, narrowed at
// ranks >= 128 to fit the shared memory, on every product.
TEST_CASE("lora_merge with its untuned tiles at ranks 128 and 256 matches a float64 reference on the GPU",
          "[gpu][ops][merge][large_rank]") {
  KERF_REQUIRE_GPU();
  test::ScopedEnv env({{"KERF_AUTOTUNE", "0"}});
  const std::vector<MergeCase> cases = {
      {300, 200, 128, DType::bf16, DType::bf16, DType::bf16},
      {200, 300, 256, DType::bf16, DType::bf16, DType::bf16},
      {130, 333, 256, DType::f16, DType::f32, DType::f32, true, 0, -0.5},  // TF32, fan_in_fan_out
      {67, 136, 256, DType::f32, DType::f32, DType::f32},
      {96, 130, 128, DType::f32, DType::bf16, DType::f32},
      // PEFT's fp32 adapters on a bf16 W (a bf16 product, the adapters staged as fp32).
      {130, 200, 128, DType::bf16, DType::f32, DType::f32},
      {200, 300, 256, DType::bf16, DType::f32, DType::f32, false, 0, -0.5},
      // Small tiles on two stages, as an untuned call runs them on GPUs of 99 KiB.
      {130, 200, 256, DType::bf16, DType::f32, DType::f32, false, 0, 1.5, 0, 0, 16, 4, false, 0, 0, 32},
      {67, 136, 128, DType::f16, DType::f32, DType::f32, true, 0, 1.5, 0, 0, 32, 4, false, 0, 0, 16},
  };
  uint64_t seed = 4600;
  for (const MergeCase& c : cases) check_merge(c, Device::cuda(0), seed++);
}

TEST_CASE("lora_merge_flax handles MaxText kernels through strides on the CPU",
          "[cpu][ops][merge]") {
  KERF_REQUIRE_CPU_BACKEND();
  run_flax_cases(Device::cpu());
}

TEST_CASE("lora_merge_flax handles MaxText kernels through strides on the GPU",
          "[gpu][ops][merge]") {
  KERF_REQUIRE_GPU();
  run_flax_cases(Device::cuda(0));
}

TEST_CASE("lora_merge with rank 0 or an empty W leaves memory untouched on the CPU",
          "[cpu][ops][merge]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_merge_edges(Device::cpu());
}

TEST_CASE("lora_merge with rank 0 or an empty W leaves memory untouched on the GPU",
          "[gpu][ops][merge]") {
  KERF_REQUIRE_GPU();
  check_merge_edges(Device::cuda(0));
}

TEST_CASE("a config whose shared memory exceeds the device's is refused with a clear message on the GPU",
          "[gpu][ops][merge]") {
  KERF_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  std::mt19937_64 rng(11);
  TestTensor W(DType::bf16, {512, 1024}, dev), A(DType::bf16, {16, 1024}, dev), B(DType::bf16, {512, 16}, dev);
  W.randomize(rng);
  A.randomize(rng);
  B.randomize(rng);
  std::vector<double> before;
  for (int64_t i = 0; i < 512 * 1024; ++i) before.push_back(W.get(i));
  // 256 x 1024 bf16 tiles in 4 stages: 2 MiB of shared memory, more than any GPU has.
  const ops::Config huge{256, 1024, 0, 8, 4};
  try {
    ops::lora_merge(W.view(), A.view(), B.view(), 0.5, nullptr, huge);
    FAIL("the merge ran with a config that cannot fit");
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("bytes of shared memory per block") != std::string::npos);
    CHECK(msg.find("allows") != std::string::npos);
    CHECK(msg.find("num_stages") != std::string::npos);
  }
  // Nothing was written, and the op still runs with its own choice.
  cuda::device_synchronize(0);
  W.download();
  for (int64_t i = 0; i < 512 * 1024; i += 997) CHECK(W.get(i) == before[size_t(i)]);
  ops::lora_merge(W.view(), A.view(), B.view(), 0.5);
  cuda::device_synchronize(0);
}
