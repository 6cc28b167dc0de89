// The flagship kernels (DoRA norm, MoE LoRA materialization) against float64
// references on fresh random data, odd and round shapes, on the CPU back end
// and, where a GPU is present, on the GPU.
#include <cmath>
#include <iostream>
#include <random>

#include "catch.h"
#include "device_tensor.h"
#include "gpu_test_util.h"
#include "kerf/jit/cpu_backend.h"
#include "kerf/jit/launch.h"
#include "kerf/kernels/kernels.h"
#include "kerf/ops/ops.h"
#include "smem_fit_util.h"
#include "sample_kernels.h"
#include "test_cache_util.h"

using namespace kerf;
using kerf::test::TestTensor;
using kerf::test::check_fits_h100;
using kerf::test::planning_address;

namespace {

#define KERF_REQUIRE_CPU_BACKEND()                                                         \
  do {                                                                                     \
    if (!kerf::jit::cpu::available()) {                                                    \
      std::cout << "KERF-SKIPPED: CPU back end not built (no LLVM)" << std::endl;          \
      return;                                                                              \
    }                                                                                      \
  } while (false)

struct DoraCase {
  int64_t out, in, r;
  DType w, ab;
  int64_t split;  // 0: let kerf choose
  int64_t stages = 0;
  int64_t cast_a = 0;  // Config.meta CAST_A: an f32 A rounded once by its own launch
  int64_t block_m = 0, warps = 0;
  int64_t warps_n = 0;  // Config.meta WARPS_N: warps sharing the dot's columns (the same answer)
  int64_t l2_prefetch = 0;  // Config.meta L2_PREFETCH: an L2 prefetch size hint (the same answer)
  int64_t block_k = 0;
  bool wgmma = false;  // Config.meta WGMMA: Hopper's warpgroup dots (sm_90a; elsewhere the same kernel)
  bool cols_first = false;  // Config.meta COLS_FIRST: column slices on grid axis 0 (the same answer)
  bool interleave = false;  // Config.meta INTERLEAVE: every split-th column block per split
};

ops::Config dora_config(const DoraCase& c) {
  ops::Config cfg;
  cfg.split_k = c.split;
  cfg.num_stages = c.stages;
  cfg.block_m = c.block_m;
  cfg.num_warps = c.warps;
  if (c.cast_a) cfg.meta["CAST_A"] = 1;
  if (c.warps_n) cfg.meta["WARPS_N"] = c.warps_n;
  if (c.l2_prefetch) cfg.meta["L2_PREFETCH"] = c.l2_prefetch;
  cfg.block_k = c.block_k;
  if (c.wgmma) cfg.meta["WGMMA"] = 1;
  if (c.cols_first) cfg.meta["COLS_FIRST"] = 1;
  if (c.interleave) cfg.meta["INTERLEAVE"] = 1;
  return cfg;
}

void check_dora(const DoraCase& c, Device dev, uint64_t seed) {
  CAPTURE(c.out, c.in, c.r, dtype_name(c.w), dtype_name(c.ab), c.split, c.cast_a, c.block_m, c.warps, c.warps_n, seed,
          dev.str(), c.block_k, c.wgmma, c.cols_first, c.interleave);
  std::mt19937_64 rng(seed);
  TestTensor W(c.w, {c.out, c.in}, dev), A(c.ab, {c.r, c.in}, dev), B(c.ab, {c.out, c.r}, dev);
  TestTensor m(DType::f32, {c.out}, dev), norm(DType::f32, {c.out}, dev), scale(DType::f32, {c.out}, dev);
  W.randomize(rng);
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  m.randomize(rng, 0.5, 1.5);
  norm.poison();
  scale.poison();
  const double s = 1.75, eps = 1e-6;
  const ops::Config cfg = dora_config(c);
  ops::dora_norm(W.view(), A.view(), B.view(), m.view(), s, norm.view(), scale.view(), eps, nullptr, cfg);
  if (dev.is_cuda()) cuda::device_synchronize(dev.index);
  norm.download();
  scale.download();
  std::vector<double> ref_n(size_t(c.out)), ref_s(size_t(c.out)), got_n(size_t(c.out)), got_s(size_t(c.out));
  for (int64_t i = 0; i < c.out; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < c.in; ++j) {
      double ba = 0;
      for (int64_t k = 0; k < c.r; ++k) ba += B.get(i * c.r + k) * A.get(k * c.in + j);
      const double v = W.get(i * c.in + j) + s * ba;
      ss += v * v;
    }
    ref_n[size_t(i)] = std::sqrt(ss + eps);
    ref_s[size_t(i)] = m.get(i) / ref_n[size_t(i)];
    got_n[size_t(i)] = norm.get(i);
    got_s[size_t(i)] = scale.get(i);
  }
  const double tol = test::tolerance(is_half(c.w) || is_half(c.ab) ? DType::bf16 : DType::f32);
  CHECK(test::max_relative_error(got_n, ref_n) <= tol);
  CHECK(test::max_relative_error(got_s, ref_s) <= tol);
}

std::vector<DoraCase> dora_cases() {
  return {
      {1000, 1500, 7, DType::f32, DType::f32, 0},   {1000, 1500, 7, DType::bf16, DType::bf16, 0},
      {1000, 1500, 7, DType::bf16, DType::f32, 1},  {64, 256, 16, DType::f16, DType::f16, 1},
      {256, 512, 64, DType::bf16, DType::bf16, 3},  {37, 130, 1, DType::f32, DType::f32, 2},
      {128, 1024, 32, DType::f32, DType::f32, 1},   {300, 700, 16, DType::bf16, DType::bf16, 0, 1},
      {300, 700, 16, DType::bf16, DType::bf16, 2, 4}, {96, 2000, 8, DType::f16, DType::f32, 1, 2},
      // A cast once into the workspace: alone, after a split's sums, with f16 and f32 W (no cast).
      {1000, 1500, 7, DType::bf16, DType::f32, 1, 0, 1}, {300, 700, 16, DType::bf16, DType::f32, 3, 3, 1},
      {96, 2000, 8, DType::f16, DType::f32, 0, 2, 1},     {37, 130, 1, DType::f32, DType::f32, 2, 0, 1},
      // Warps sharing the dot's columns: 2 or 4 of them, with the rest on rows (or copies where
      // rows run out); odd shapes, a split's partial sums, an f32 dot (FMA: no tensor-core layout).
      {300, 700, 64, DType::bf16, DType::bf16, 2, 3, 0, 128, 8, 2},
      {1000, 1500, 7, DType::bf16, DType::f32, 0, 0, 0, 64, 8, 4},
      {96, 2000, 8, DType::f16, DType::f16, 1, 2, 0, 32, 8, 4},
      {257, 333, 32, DType::bf16, DType::bf16, 3, 2, 1, 256, 16, 2},
      {37, 130, 5, DType::f32, DType::f32, 0, 0, 0, 64, 4, 2},
      {45, 300, 16, DType::bf16, DType::bf16, 2, 2, 0, 16, 8, 2},  // rows run out: the rest on columns
      // L2 prefetch sizes on the pipelined copies.
      {1000, 1500, 7, DType::bf16, DType::bf16, 0, 3, 0, 128, 8, 0, 256},
      {300, 700, 64, DType::bf16, DType::f32, 2, 3, 1, 64, 4, 2, 128},
      // Warpgroup dots (WGMMA; sm_90a, elsewhere the mma.sync kernel): B's tile of one and two
      // 64-column blocks, rows and columns split among warpgroups, f32 adapters rounded per step.
      {300, 700, 64, DType::bf16, DType::bf16, 0, 3, 0, 64, 4, 0, 0, 128, true},
      {1000, 1500, 7, DType::bf16, DType::f32, 2, 3, 0, 128, 8, 0, 0, 64, true},
      {257, 333, 32, DType::f16, DType::f16, 1, 2, 0, 64, 8, 2, 0, 64, true},
      {96, 2000, 16, DType::bf16, DType::bf16, 3, 3, 0, 64, 4, 0, 0, 64, true},
      // Rows of 1000 and 1544 elements (multiples of 8, not 16); column slices on grid axis 0
      // (COLS_FIRST), with the split's last program finishing each row block.
      {300, 1000, 16, DType::bf16, DType::bf16, 0},
      {300, 1544, 16, DType::bf16, DType::f32, 3, 3, 0, 0, 0, 0, 0, 0, false, true},
      {257, 1000, 32, DType::f32, DType::f32, 2, 2, 0, 64, 4, 0, 0, 0, false, true},
      {300, 700, 64, DType::bf16, DType::bf16, 4, 3, 0, 64, 4, 0, 0, 64, true, true},
      // Interleaved column blocks (INTERLEAVE): splits that divide the steps and splits that do
      // not (24 steps in 5), with the slices on either grid axis, an f32 A rounded per step.
      {1000, 1500, 7, DType::bf16, DType::bf16, 5, 3, 0, 64, 4, 0, 0, 64, false, false, true},
      {300, 1544, 16, DType::bf16, DType::f32, 3, 3, 0, 0, 0, 0, 0, 0, false, true, true},
      {300, 700, 64, DType::bf16, DType::bf16, 4, 3, 0, 128, 8, 0, 0, 128, true, false, true},
      {257, 1000, 32, DType::f32, DType::f32, 2, 2, 0, 64, 4, 0, 0, 0, false, false, true},
  };
}

void run_dora_cases(Device dev) {
  uint64_t seed = 1234;
  for (const DoraCase& c : dora_cases()) check_dora(c, dev, seed++);
}

struct MoeCase {
  int64_t E, N, K, r;
  DType w;
  bool peft_layout;  // A as lora_A [r*E, K], B as lora_B [N, r*E] (expert fastest)
  ops::Config config{};  // split_k: programs sharing each row block's columns
  DType ab = DType::i1;  // the adapters' dtype (i1: W's)
};

void check_moe(const MoeCase& c, Device dev, uint64_t seed) {
  const DType ab = c.ab == DType::i1 ? c.w : c.ab;
  CAPTURE(c.E, c.N, c.K, c.r, dtype_name(c.w), dtype_name(ab), c.peft_layout, c.config.block_m, c.config.block_k,
          c.config.split_k, c.config.num_warps, c.config.meta.count("CAST_A"), c.config.meta.count("WARPS_N"),
          c.config.meta.count("WALK_ROWS"), seed, dev.str());
  std::mt19937_64 rng(seed);
  TestTensor W(c.w, {c.E, c.N, c.K}, dev), out(c.w, {c.E, c.N, c.K}, dev);
  TestTensor A(ab, {c.E * c.r, c.K}, dev), B(ab, {c.N, c.r * c.E}, dev);
  W.randomize(rng);
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  out.poison();
  // A_e[k, i] = lora_A[e*r + k, i];  B_e[o, k] = lora_B[o, k*E + e]   (PEFT's layout)
  auto a_at = [&](int64_t e, int64_t k, int64_t i) { return A.get((e * c.r + k) * c.K + i); };
  auto b_at = [&](int64_t e, int64_t o, int64_t k) { return B.get(o * c.r * c.E + k * c.E + e); };
  TensorView av = A.view({c.E, c.r, c.K}, {c.r * c.K, c.K, 1});
  TensorView bv = B.view({c.E, c.N, c.r}, {1, c.r * c.E, c.E});
  if (!c.peft_layout) {
    // The same numbers laid out as plain batched [E, r, K] and [E, N, r].
    TestTensor A2(ab, {c.E, c.r, c.K}, dev), B2(ab, {c.E, c.N, c.r}, dev);
    for (int64_t e = 0; e < c.E; ++e) {
      for (int64_t k = 0; k < c.r; ++k)
        for (int64_t i = 0; i < c.K; ++i) A2.set((e * c.r + k) * c.K + i, a_at(e, k, i));
      for (int64_t o = 0; o < c.N; ++o)
        for (int64_t k = 0; k < c.r; ++k) B2.set((e * c.N + o) * c.r + k, b_at(e, o, k));
    }
    A2.upload();
    B2.upload();
    ops::moe_lora_materialize(W.view(), A2.view(), B2.view(), 0.5, out.view(), nullptr, c.config);
    if (dev.is_cuda()) cuda::device_synchronize(dev.index);
  } else {
    ops::moe_lora_materialize(W.view(), av, bv, 0.5, out.view(), nullptr, c.config);
    if (dev.is_cuda()) cuda::device_synchronize(dev.index);
  }
  out.download();
  std::vector<double> got, ref;
  for (int64_t e = 0; e < c.E; ++e)
    for (int64_t o = 0; o < c.N; ++o)
      for (int64_t i = 0; i < c.K; ++i) {
        double d = 0;
        for (int64_t k = 0; k < c.r; ++k) d += b_at(e, o, k) * a_at(e, k, i);
        const int64_t idx = (e * c.N + o) * c.K + i;
        ref.push_back(W.get(idx) + 0.5 * d);
        got.push_back(out.get(idx));
      }
  // Relative to the tile's scale: entries near zero are compared absolutely.
  CHECK(test::max_relative_error(got, ref, 1.0) <= test::tolerance(is_half(ab) ? ab : c.w));
}

std::vector<MoeCase> moe_cases() {
  return {
      {3, 100, 130, 5, DType::f32, false}, {3, 100, 130, 5, DType::bf16, true},
      {2, 64, 256, 16, DType::bf16, false}, {2, 64, 256, 16, DType::f32, true},
      {4, 32, 16, 4, DType::f16, true},
      // r=64 with no tile named: on an H100 the op's own warpgroup tile (ops_moe.cpp), with
      // PEFT's layout and with fp32 adapters on a bf16 W.
      {2, 130, 264, 64, DType::bf16, true}, {2, 72, 200, 64, DType::bf16, false, ops::Config{}, DType::f32},
      // More 64-row blocks than an H100 has multiprocessors at ranks 17 to 32: its one-tile own
      // tiles untuned (32x128; 128x64 on 8 warps with fp32 adapters).
      {3, 3000, 136, 24, DType::bf16, false}, {3, 3000, 136, 32, DType::bf16, false, ops::Config{}, DType::f32},
      // K shared by programs: 2 and 3 slices of 64 columns (the last of 3 gets none at K=256).
      {3, 100, 130, 5, DType::bf16, true, ops::Config{0, 64, 2, 0, 0}},
      {2, 64, 256, 16, DType::f16, false, ops::Config{0, 64, 3, 0, 0}},
      // fp32 adapters (PEFT's) on a half-precision W, converted per step or cast once (CAST_A),
      // through PEFT's strided views and the plain layout; f32 W takes no cast.
      {3, 100, 130, 5, DType::bf16, true, ops::Config{}, DType::f32},
      {3, 100, 130, 5, DType::bf16, true, ops::Config{0, 0, 0, 0, 0, {{"CAST_A", 1}}}, DType::f32},
      {2, 64, 256, 16, DType::f16, false, ops::Config{0, 64, 2, 0, 0, {{"CAST_A", 1}}}, DType::f32},
      {2, 64, 256, 16, DType::f32, true, ops::Config{0, 0, 0, 0, 0, {{"CAST_A", 1}}}, DType::f32},
      // Warps sharing the dot's columns (Config.meta WARPS_N).
      {3, 100, 130, 5, DType::bf16, true, ops::Config{64, 64, 0, 8, 3, {{"WARPS_N", 2}}}},
      {2, 200, 300, 16, DType::f16, false, ops::Config{128, 128, 2, 8, 2, {{"WARPS_N", 4}}}, DType::f32},
      {3, 100, 130, 5, DType::bf16, false, ops::Config{64, 64, 0, 4, 3, {{"L2_PREFETCH", 256}}}},
      // Warpgroup dots (WGMMA).
      {3, 100, 130, 5, DType::bf16, false, ops::Config{64, 64, 0, 4, 3, {{"WGMMA", 1}}}},
      {2, 200, 300, 64, DType::f16, true, ops::Config{128, 128, 0, 8, 3, {{"WGMMA", 1}}}, DType::f32},
      {2, 130, 200, 16, DType::bf16, false, ops::Config{128, 64, 2, 8, 2, {{"WGMMA", 1}, {"WARPS_N", 2}}}},
      // Rows of 200 and 264 columns (multiples of 8, not 16: 16-byte vectors on 8-element
      // facts), and column slices on grid axis 0 (COLS_FIRST).
      {3, 100, 200, 5, DType::bf16, false},
      {2, 72, 264, 16, DType::f32, true, ops::Config{0, 64, 0, 0, 0}, DType::bf16},
      {3, 100, 200, 5, DType::bf16, false, ops::Config{0, 64, 2, 0, 0, {{"COLS_FIRST", 1}}}},
      {2, 72, 264, 16, DType::f16, true, ops::Config{64, 128, 3, 4, 3, {{"COLS_FIRST", 1}}}, DType::f32},
      // One tile per program through the accumulator's registers (STREAM): PEFT's strided
      // adapters and the plain layout, fp32 adapters cast once, r=64, warps on columns, fp32 W.
      {3, 100, 200, 5, DType::bf16, true, ops::Config{64, 128, 0, 4, 0, {{"STREAM", 1}}}},
      {2, 72, 264, 16, DType::f16, false, ops::Config{32, 256, 0, 4, 0, {{"STREAM", 1}, {"CAST_A", 1}}}, DType::f32},
      {2, 130, 136, 64, DType::bf16, false, ops::Config{128, 64, 0, 4, 0, {{"STREAM", 1}, {"WARPS_N", 2}}}},
      {2, 64, 256, 16, DType::f32, true, ops::Config{32, 64, 0, 4, 0, {{"STREAM", 1}}}, DType::bf16},
      // W_eff stored from the dot accumulator's registers (ACC_STORE): mma.sync and warpgroup
      // dots, rows and columns past the tile, PEFT's fp32 adapters, an fp32 W.
      {3, 100, 200, 5, DType::bf16, false, ops::Config{0, 64, 2, 0, 0, {{"ACC_STORE", 1}}}},
      {2, 130, 264, 64, DType::bf16, false, ops::Config{128, 128, 2, 8, 3, {{"WGMMA", 1}, {"ACC_STORE", 1}}}},
      {2, 72, 200, 16, DType::f16, true, ops::Config{64, 128, 0, 4, 2, {{"WGMMA", 1}, {"ACC_STORE", 1}}}, DType::f32},
      {2, 64, 256, 16, DType::f32, true, ops::Config{64, 64, 0, 4, 2, {{"ACC_STORE", 1}}}},
      // Programs dealing out all the tiles round-robin (PERSISTENT: each program's tiles in
      // several row blocks and experts, rows and columns past the tile, more programs than
      // tiles in the last), on mma.sync and warpgroup dots, PEFT's fp32 adapters (s*B formed
      // per tile), fp32 W.
      {3, 100, 200, 5, DType::bf16, false, ops::Config{0, 64, 0, 0, 0, {{"PERSISTENT", 1}}}},
      {2, 130, 264, 64, DType::bf16, false,
       ops::Config{128, 128, 0, 8, 3, {{"WGMMA", 1}, {"ACC_STORE", 1}, {"PERSISTENT", 1}}}},
      {3, 100, 130, 5, DType::bf16, true, ops::Config{64, 64, 0, 4, 3, {{"PERSISTENT", 2}}}, DType::f32},
      {2, 200, 300, 64, DType::f16, true, ops::Config{64, 128, 0, 4, 2, {{"WGMMA", 1}, {"PERSISTENT", 1}}}, DType::f32},
      {2, 64, 256, 16, DType::f32, true, ops::Config{32, 64, 0, 4, 2, {{"PERSISTENT", 3}}}},
      {1, 20, 24, 4, DType::bf16, false, ops::Config{0, 64, 0, 0, 0, {{"PERSISTENT", 8}}}},
      // W_eff moved into the store's layout through the spent slot of W's ring (STORE_IN_RING):
      // warpgroup and mma.sync dots, 2-4 stages, rows and columns past the tile, PEFT's fp32
      // adapters, fp32 W, with PERSISTENT programs.
      {2, 130, 264, 64, DType::bf16, false,
       ops::Config{128, 128, 2, 8, 4, {{"WGMMA", 1}, {"STORE_IN_RING", 1}, {"L2_PREFETCH", 128}}}},
      {3, 100, 200, 5, DType::bf16, true, ops::Config{64, 128, 0, 4, 3, {{"WGMMA", 1}, {"STORE_IN_RING", 1}}}},
      {2, 72, 264, 16, DType::f16, true, ops::Config{64, 128, 3, 4, 2, {{"STORE_IN_RING", 1}}}, DType::f32},
      {2, 64, 256, 16, DType::f32, true, ops::Config{64, 64, 0, 4, 3, {{"STORE_IN_RING", 1}}}},
      {3, 100, 130, 5, DType::bf16, false,
       ops::Config{64, 128, 0, 4, 3, {{"WGMMA", 1}, {"STORE_IN_RING", 1}, {"PERSISTENT", 2}}}},
      // Programs owning an expert's columns and walking its rows (WALK_ROWS): the planner's
      // slices and 2 or 3 of them, rows and columns past the tile, the ring tile at r=64 on
      // two and three stages, PEFT's layout, fp32 adapters (s*B formed per step), fp32 W.
      {2, 130, 264, 64, DType::bf16, true,
       ops::Config{64, 128, 0, 4, 3, {{"WGMMA", 1}, {"STORE_IN_RING", 1}, {"L2_PREFETCH", 128}, {"WALK_ROWS", 1}}}},
      {2, 130, 200, 64, DType::bf16, false,
       ops::Config{64, 128, 2, 4, 2, {{"WGMMA", 1}, {"STORE_IN_RING", 1}, {"WALK_ROWS", 1}}}, DType::f32},
      {3, 100, 200, 5, DType::bf16, false, ops::Config{64, 128, 3, 4, 2, {{"WGMMA", 1}, {"WALK_ROWS", 1}}}},
      {2, 72, 264, 16, DType::f16, false, ops::Config{64, 64, 2, 4, 3, {{"WALK_ROWS", 1}}}, DType::f32},
      {2, 64, 256, 16, DType::f32, true, ops::Config{32, 64, 0, 4, 2, {{"WALK_ROWS", 1}}}},
      // Row blocks past four programs a multiprocessor (5 x 107 > 4 x 132): untuned on an H100
      // the own tile walks the columns (the small cases above walk the rows), K past the tile.
      {5, 6800, 40, 16, DType::bf16, false},
  };
}

void run_moe_cases(Device dev) {
  uint64_t seed = 99;
  for (const MoeCase& c : moe_cases()) check_moe(c, dev, seed++);
}

// STREAM in the kernel's one-tile form (ONE_TILE: W's tile asked for first, read after the
// product): PEFT's strided adapters and the plain layout, r=64 with rows and columns past the
// tile, fp32 adapters with warps on columns, an fp32 W.
std::vector<MoeCase> moe_one_tile_cases() {
  const auto one_tile = [](int64_t bn, int64_t bk, std::map<std::string, int64_t> meta = {}, int64_t warps = 4) {
    meta["STREAM"] = 1;
    meta["ONE_TILE"] = 1;
    return ops::Config{bn, bk, 0, warps, 0, std::move(meta)};
  };
  return {
      // The own tiles' (ops_moe.cpp own_config): 64x64 up to rank 16, 32x128 up to 32, 128x64 on
      // 8 warps with fp32 adapters there.
      {3, 100, 200, 16, DType::bf16, false, one_tile(64, 64)},
      {2, 130, 200, 24, DType::bf16, true, one_tile(32, 128)},
      {2, 300, 136, 32, DType::bf16, false, one_tile(128, 64, {}, 8), DType::f32},
      {3, 100, 200, 5, DType::bf16, true, one_tile(64, 128)},
      {2, 130, 136, 64, DType::bf16, false, one_tile(64, 128)},
      {2, 130, 136, 64, DType::bf16, true, one_tile(32, 128)},
      {2, 72, 264, 16, DType::f16, false, one_tile(32, 256, {{"WARPS_N", 2}}), DType::f32},
      {2, 64, 256, 16, DType::f32, true, one_tile(32, 64), DType::bf16},
  };
}

void run_moe_one_tile_cases(Device dev) {
  uint64_t seed = 199;
  for (const MoeCase& c : moe_one_tile_cases()) check_moe(c, dev, seed++);
}

}  // namespace

TEST_CASE("dora_norm matches a float64 reference on the CPU", "[cpu][kernels]") {
  KERF_REQUIRE_CPU_BACKEND();
  run_dora_cases(Device::cpu());
}

TEST_CASE("dora_norm matches a float64 reference on the GPU", "[gpu][kernels]") {
  KERF_REQUIRE_GPU();
  run_dora_cases(Device::cuda(0));
}

TEST_CASE("the tiles of dora_norm's GPU float64 cases fit an H100's shared memory", "[cuda][codegen][kernels]") {
  const Device dev = Device::cuda(0);
  void* const p = planning_address();
  for (const DoraCase& c : dora_cases()) {
    CAPTURE(c.out, c.in, c.r, dtype_name(c.w), dtype_name(c.ab), c.split, c.stages, c.block_m, c.warps, c.block_k,
            c.wgmma);
    const TensorView W = TensorView::contiguous(p, c.w, {c.out, c.in}, dev);
    const TensorView A = TensorView::contiguous(p, c.ab, {c.r, c.in}, dev);
    const TensorView B = TensorView::contiguous(p, c.ab, {c.out, c.r}, dev);
    const TensorView v = TensorView::contiguous(p, DType::f32, {c.out}, dev);
    check_fits_h100("dora_norm", {W, A, B, v, v, v}, dora_config(c));
  }
}

// Untuned (KERF_AUTOTUNE=0, as on a first call inside a graph capture) the ops run their
// own tiles, narrowed at ranks >= 128 to fit the shared memory: those tiles at ranks 128
// and 256 on every product (bf16, f16, TF32 for f16 W with fp32 adapters, fp32 FMA).
TEST_CASE("dora_norm with its untuned tiles at ranks 128 and 256 matches a float64 reference on the GPU",
          "[gpu][kernels][large_rank]") {
  KERF_REQUIRE_GPU();
  test::ScopedEnv env({{"KERF_AUTOTUNE", "0"}});
  const std::vector<DoraCase> cases = {
      {300, 700, 128, DType::bf16, DType::bf16, 0}, {300, 700, 256, DType::bf16, DType::f32, 0},
      {257, 333, 256, DType::f16, DType::f32, 0},   {257, 333, 128, DType::f16, DType::f16, 0},
      {130, 400, 128, DType::f32, DType::f32, 0},   {130, 400, 256, DType::f32, DType::f32, 0},
      {1000, 1500, 256, DType::bf16, DType::bf16, 0},
      // Small tiles on two stages, as an untuned call runs them on GPUs of 99 KiB.
      {300, 700, 256, DType::bf16, DType::f32, 0, 2, 0, 32, 4, 0, 0, 16},
      {257, 333, 128, DType::f16, DType::f32, 0, 2, 0, 16, 4, 0, 0, 32},
  };
  uint64_t seed = 4400;
  for (const DoraCase& c : cases) check_dora(c, Device::cuda(0), seed++);
}

TEST_CASE("moe_lora_materialize matches a float64 reference on the CPU", "[cpu][kernels]") {
  KERF_REQUIRE_CPU_BACKEND();
  run_moe_cases(Device::cpu());
}

TEST_CASE("moe_lora_materialize's one-tile form matches a float64 reference on the CPU", "[cpu][kernels]") {
  KERF_REQUIRE_CPU_BACKEND();
  run_moe_one_tile_cases(Device::cpu());
}

TEST_CASE("moe_lora_materialize's one-tile form matches a float64 reference on the GPU", "[gpu][kernels]") {
  KERF_REQUIRE_GPU();
  run_moe_one_tile_cases(Device::cuda(0));
}

TEST_CASE("moe_lora_materialize matches a float64 reference on the GPU", "[gpu][kernels]") {
  KERF_REQUIRE_GPU();
  run_moe_cases(Device::cuda(0));
}

// Untuned, the cases that name no tile run the op's own (on an H100 its warpgroup tile with
// W_eff moved through W's ring, at ranks up to 64, walking the rows where the experts' row
// blocks are few, the columns where they are many; at ranks up to 32 with more row blocks than
// multiprocessors, one tile a program in its one-tile form, and up to 16 with fewer, one 32x256
// tile a program; ops_moe.cpp, own_config).
TEST_CASE("moe_lora_materialize untuned on its own tiles matches a float64 reference on the GPU",
          "[gpu][kernels]") {
  KERF_REQUIRE_GPU();
  test::ScopedEnv env({{"KERF_AUTOTUNE", "0"}});
  uint64_t seed = 7700;
  int ran = 0;
  for (const MoeCase& c : moe_cases())
    if (!c.config.block_m && !c.config.block_k) {
      check_moe(c, Device::cuda(0), seed++);
      ++ran;
    }
  CHECK(ran >= 8);
}

// Every tile the GPU cases above run fits an H100's shared memory (a case over it is refused
// at launch, which only a GPU run would show): each case's kernels as planned for sm_90a.
TEST_CASE("the tiles of moe_lora_materialize's GPU float64 cases fit an H100's shared memory",
          "[cuda][codegen][kernels]") {
  const Device dev = Device::cuda(0);
  void* const p = planning_address();
  std::vector<MoeCase> cases = moe_cases();
  for (const MoeCase& c : moe_one_tile_cases()) cases.push_back(c);
  for (const MoeCase& c : cases) {
    const DType ab = c.ab == DType::i1 ? c.w : c.ab;
    CAPTURE(c.E, c.N, c.K, c.r, dtype_name(c.w), dtype_name(ab), c.peft_layout, c.config.block_m, c.config.block_k,
            c.config.num_stages);
    const TensorView W = TensorView::contiguous(p, c.w, {c.E, c.N, c.K}, dev);
    const TensorView A = c.peft_layout ? TensorView::strided(p, ab, {c.E, c.r, c.K}, {c.r * c.K, c.K, 1}, dev)
                                       : TensorView::contiguous(p, ab, {c.E, c.r, c.K}, dev);
    const TensorView B = c.peft_layout ? TensorView::strided(p, ab, {c.E, c.N, c.r}, {1, c.r * c.E, c.E}, dev)
                                       : TensorView::contiguous(p, ab, {c.E, c.N, c.r}, dev);
    check_fits_h100("moe_lora_materialize", {W, A, B, W}, c.config);
  }
}

TEST_CASE("moe_lora_materialize with its untuned tiles at ranks 128 and 256 matches a float64 reference on the GPU",
          "[gpu][kernels][large_rank]") {
  KERF_REQUIRE_GPU();
  test::ScopedEnv env({{"KERF_AUTOTUNE", "0"}});
  const std::vector<MoeCase> cases = {
      {2, 100, 130, 128, DType::bf16, true},
      {2, 72, 264, 256, DType::f16, false, ops::Config{}, DType::f32},
      {2, 64, 256, 256, DType::f32, true},
      {3, 130, 200, 256, DType::bf16, false},
      // PEFT's fp32 adapters on a bf16 W (a bf16 product, the adapters staged as fp32).
      {2, 100, 130, 256, DType::bf16, true, ops::Config{}, DType::f32},
      {2, 72, 264, 128, DType::bf16, false, ops::Config{}, DType::f32},
      // Small tiles on two stages, as an untuned call runs them on GPUs of 99 KiB.
      {2, 64, 130, 256, DType::bf16, true, ops::Config{16, 32, 0, 4, 2}, DType::f32},
  };
  uint64_t seed = 4500;
  for (const MoeCase& c : cases) check_moe(c, Device::cuda(0), seed++);
}

namespace {

// fill_pair: two strided rank-3 views (inside larger buffers, whose other
// elements must stay as they were) set in one launch, as its contract says.
void check_fill_pair(Device dev) {
  TestTensor a(DType::f32, {2, 40, 310}, dev), b(DType::bf16, {1, 70, 16}, dev);
  a.poison();
  b.poison();
  a.upload();
  b.upload();
  const TensorView av = a.view({2, 37, 300}, {40 * 310, 310, 1});
  const TensorView bv = b.view({1, 70, 16}, {70 * 16, 16, 1});
  const int64_t bm0 = 8, bk0 = 128, bm1 = 32, bk1 = 16;
  const int64_t n0 = 2 * ((37 + bm0 - 1) / bm0) * ((300 + bk0 - 1) / bk0);
  const int64_t n1 = 1 * ((70 + bm1 - 1) / bm1) * ((16 + bk1 - 1) / bk1);
  launch(kernels::fill_pair(), {av, bv, Scalar(1.5)}, Grid{uint32_t(n0 + n1), 1, 1},
         {{"BLOCK_M0", bm0}, {"BLOCK_K0", bk0}, {"BLOCK_M1", bm1}, {"BLOCK_K1", bk1}});
  test::sync(dev);
  a.download();
  b.download();
  int64_t wrong = 0;
  for (int64_t g = 0; g < 2; ++g)
    for (int64_t i = 0; i < 40; ++i)
      for (int64_t j = 0; j < 310; ++j) {
        const double v = a.get((g * 40 + i) * 310 + j);
        const bool inside = i < 37 && j < 300;
        if (inside ? v != 1.5 : !std::isnan(v)) ++wrong;
      }
  for (int64_t i = 0; i < b.numel(); ++i)
    if (b.get(i) != 1.5) ++wrong;
  CHECK(wrong == 0);
}

}  // namespace

TEST_CASE("fill_pair sets two strided views in one launch on the CPU", "[cpu][kernels]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_fill_pair(Device::cpu());
}

TEST_CASE("fill_pair sets two strided views in one launch on the GPU", "[gpu][kernels]") {
  KERF_REQUIRE_GPU();
  check_fill_pair(Device::cuda(0));
}

namespace {

// Programmatic dependent launch: the consumer is launched to overlap the
// producer (LaunchOptions::overlap_prior) and reads what the producer writes
// after its wait_prior_grid(), at the top level or inside its loop; y starts
// poisoned each round, so a read that overtook the wait would show. A consumer
// with no wait is launched as usual, overlap_prior notwithstanding.
void check_overlapped_launches(Device dev) {
  const int64_t M = 300, N = 1000, BM = 16, BN = 128;
  TestTensor x(DType::f32, {M, N}, dev), y(DType::f32, {M, N}, dev), out(DType::f32, {M}, dev);
  std::mt19937_64 rng(77);
  const Grid grid{uint32_t((M + BM - 1) / BM), 1, 1};
  LaunchOptions overlap;
  overlap.overlap_prior = true;
  for (int round = 0; round < 6; ++round) {
    const int64_t wait = round % 3;  // 0: none, 1: top level, 2: in the loop
    CAPTURE(round, wait, dev.str());
    x.randomize(rng);
    y.poison();
    out.poison();
    launch(test::overlap_producer_kernel(), {x.view(), y.view()}, grid,
           {{"BM", BM}, {"BN", BN}, {"REPEAT", 8}, {"RELEASE", 1}});
    launch(test::overlap_consumer_kernel(), {x.view(), y.view(), out.view()}, grid,
           {{"BM", BM}, {"BN", BN}, {"WAIT", wait}, {"num_stages", 3}}, overlap);
    test::sync(dev);
    out.download();
    std::vector<double> got(static_cast<size_t>(M)), ref(static_cast<size_t>(M));
    for (int64_t i = 0; i < M; ++i) {
      double acc = 0;
      for (int64_t j = 0; j < N; ++j) {
        const double v = x.get(i * N + j);
        acc += v * (2.0 * v + 1.0);
      }
      ref[size_t(i)] = acc;
      got[size_t(i)] = out.get(i);
    }
    CHECK(test::max_relative_error(got, ref) <= 1e-5);
  }
}

}  // namespace

TEST_CASE("a launch overlapping the previous kernel sees its writes after the wait, on the CPU",
          "[cpu][kernels]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_overlapped_launches(Device::cpu());
}

TEST_CASE("a launch overlapping the previous kernel sees its writes after the wait, on the GPU",
          "[gpu][kernels]") {
  KERF_REQUIRE_GPU();
  check_overlapped_launches(Device::cuda(0));
}
