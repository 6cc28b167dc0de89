// ops::moe_lora_materialize: argument checks, configuration, launch.
#include <algorithm>
#include <cstring>
#include <optional>

#include "kerf/jit/autotune.h"
#include "kerf/jit/launch.h"
#include "kerf/kernels/kernels.h"
#include "kerf/ops/ops.h"
#include "kerf/runtime/cuda.h"
#include "ops_common.h"
#include "ops_layout.h"
#include "ops_tune.h"
#include "ops_checks.h"

namespace kerf::ops {

using namespace detail;

namespace {

// The launch's meta-parameters and grid for `config` (0 fields: the defaults).
struct MoePlan {
  dsl::MetaMap meta;
  Grid grid;
  DType cast_a = DType::f32;  // CAST_A: what an f32 A is rounded to first (f32: nothing)
  bool pack = false;  // PACK (ops_common.h): adapters strided along their last dims copied first
  bool pack_b = false;  // ... B among them (PACK 2: only A, which every column step reads; B read in place)
  bool experts_last = false;  // EXPERTS_LAST: B given to the kernel as [N, r, E] (its experts fastest)
};

// The op's own tile on an H100 (sm_90a), for a call whose Config names none (untuned, or a first
// call inside a graph capture) and whose product is bf16 or f16 at ranks up to 64: 64x128 on one
// warpgroup (WGMMA), three stages, W_eff moved to its store layout through W's spent ring slot
// (STORE_IN_RING: two programs a multiprocessor), 128-byte L2 prefetches, the columns split in two.
// On an H100 it took 527.9 us at r=64, 64x2816x2048 (the 64x128 it replaced, on mma.sync dots
// without the rest: 606.1), 564.7 / 281.1 us at r=16, 128x1536x2048 / 128x2048x768 (577.4 / 288.8)
// and 115.7 at 1x8192x8200 (115.4). Calls that ask for one tile a program (STREAM) or programs
// dealing out the tiles (PERSISTENT) keep the tile those were measured with. A few large experts,
// whose row blocks are at most four programs a multiprocessor (E=1 at 8192 rows: 128), walk the
// rows instead (WALK_ROWS, as the merge's own tile), on two stages: at 1x8192x8192 r=64 99.5 us
// against 107.5-108.3 walking columns (101.2 on three stages), at 1x8192x8200 r=16 102.6 against
// 114.1-114.3 (123.4), at 8x4096x14336 r=16 (512 row blocks) 666.1 against 676.8; where the row
// blocks are many, walking the rows was slower or even (64x2816x2048 r=64 523.0 against
// 521.3-521.8; at r=16 128x1536x2048 and 128x2048x768 568.2 and 297.9 against 556.0-556.6 and
// 278.2-278.3, 8x14336x4096 660.4 against 658.8).
//
// At ranks up to 32 with W's rows contiguous, one tile a program in its one-tile form (STREAM,
// ONE_TILE) instead, unless the Config names STREAM (0: the ring tile), says ONE_TILE=0 or names
// WALK_ROWS or EXPERT_GROUP: 64x64 on 4 warps at R_PAD 16, 32x128 on 4 warps at R_PAD 32, 128x64
// on 8 warps with fp32 adapters there; where the experts' 64-row blocks are at most one a
// multiprocessor (one large expert), 32x256 on 4 warps at R_PAD 16, and at R_PAD 32 the rows
// walked as above. On an H100 at r=16: 542.3 / 276.4 us at 128x1536x2048 / 128x2048x768 (555.5 /
// 278.3 on the ring tile), Mixtral's 8x14336x4096 and 8x4096x14336 629.1 / 629.8 (658.4, and
// 689.4 walking the rows), fp32 adapters 550.3 (566.2): 99.0-99.5% of a copy, the autotuner's
// choice or within its noise; one 8192x8192 / 8192x8200 expert 95.5 / 101.8 us on 32x256 (97.9 /
// 95.1%) against 102.5 / 103.4 walking the rows, 98.7 / 104.1 on 32x128 and 124.9 (8200) on
// 64x64. At r=32, 128x1536x2048: 544.4 us (99.3%; 32x64 545.0) against 557.7 on the ring tile;
// fp32 adapters 559.0 (98.4%; 570.1 on 32x64 and 598.2 on 32x128 at 4 warps) against 642.0, and
// 572.3 tuned. One 8192x8200 expert at r=32: 101.8 on 32x64 (116.6 on 32x256) against 101.1
// walking the rows.
Config own_config(const Config& config, const TensorView& W, Product dot, bool fp32_adapters, int64_t r_pad, bool gpu,
                  int64_t programs) {
  if (!gpu || config.block_m || config.block_k || !is_half(dot) || dot.tf32 || r_pad > 64 ||
      meta_or(config, "STREAM", 0) || meta_or(config, "PERSISTENT", 0) || !wgmma_target(W.device))
    return config;
  const int64_t row_blocks = W.shape[0] * cdiv(W.shape[1], 64);
  const bool grouped = meta_or(config, "EXPERT_GROUP", 0);
  if (r_pad <= 32 && one_tile_own_allowed(config, W) && !grouped) {
    if (r_pad <= 16) return row_blocks > programs ? with_one_tile(config, 64, 64) : with_one_tile(config, 32, 256);
    if (row_blocks > programs)
      return fp32_adapters ? with_one_tile(config, 128, 64, 8) : with_one_tile(config, 32, 128);
  }
  const bool walk_rows = row_blocks <= 4 * programs && meta_or(config, "WALK_ROWS", 1) && !grouped;
  Config c = config;
  if (walk_rows && !c.num_stages) c.num_stages = 2;
  c = with_ring_tile(c);
  if (walk_rows)
    c.meta.emplace("WALK_ROWS", 1);
  else if (!c.split_k)
    c.split_k = 2;
  return c;
}

// `programs`: the multiprocessors (CPU threads) the plan counts; 0: W's device's, asked.
MoePlan plan_moe(const TensorView& W, DType a, const TensorView& B, int64_t r, bool gpu, const Config& given,
                 int64_t programs = 0) {
  const DType b = B.dtype;
  const int64_t E = W.shape[0], N = W.shape[1];
  const Product dot = product_dtype(W.dtype, a, b);
  const int64_t r_pad = rank_pad(r);
  if (!programs) programs = parallelism(W.device);
  const Config config = own_config(given, W, dot, a == DType::f32 || b == DType::f32, r_pad, gpu, programs);
  const int64_t bn = config.block_m ? config.block_m : (gpu ? 64 : 16);
  const int64_t bk =
      config.block_k ? config.block_k : (gpu ? rank_narrowed(128, r_pad, rank_bytes(dot, a, b), 512) : 64);
  MoePlan p;
  p.meta = {{"BLOCK_N", bn}, {"BLOCK_K", bk}, {"R_PAD", r_pad}, {"num_warps", config.num_warps ? config.num_warps : 4}};
  set_product_meta(p.meta, dot, config);
  // Adapters already in the product's half dtype are exact there: s is applied in fp32
  // after the product (as lora_merge), not rounded into s*B (2^-9 of the LoRA term in bf16;
  // in f16, beyond 65504, inf).
  if (is_half(dot) && !dot.tf32 && a == dot.dtype && b == dot.dtype) p.meta["SCALE_AFTER"] = 1;
  // cp.async pipelining on the GPU; the CPU back end has no use for stages.
  p.meta["num_stages"] = config.num_stages ? config.num_stages : (gpu ? 3 : 1);
  pass_meta(config, p.meta, {"EVICT", "WARPS_N"});
  add_codegen_hints(config, p.meta);
  p.cast_a = cast_a_dtype(config, dot);
  p.pack = packs(config, gpu);
  p.pack_b = p.pack && meta_or(config, "PACK", 1) != 2;
  // Column slices per row block (grid axis 1): 1 unless the config asks for more.
  const int64_t steps = cdiv(W.shape[2], bk);
  int64_t split = std::max<int64_t>(1, slices_within(config.split_k, steps));
  const Config order = stream_plan(config, W.dtype, steps, p.meta, &split);
  p.grid = row_slice_grid(cdiv(N, bn), split, E, order, p.meta);
  // EXPERT_GROUP G: G neighbouring experts along grid axis 0, the row blocks on axis 1, the
  // groups times the slices on axis 2 (where those fit its 65535; else the grid above).
  if (const int64_t g = meta_or(config, "EXPERT_GROUP", 0);
      g && !meta_or(config, "PERSISTENT", 0) && cdiv(N, bn) <= 65535 && cdiv(E, g) * split <= 65535) {
    p.meta.erase("COLS_FIRST");
    p.meta.erase("ONE_TILE");  // its programs own whole slices of a group's experts
    p.meta["EXPERT_GROUP"] = g;
    p.grid = Grid{uint32_t(g), uint32_t(cdiv(N, bn)), uint32_t(cdiv(E, g) * split)};
    if (const int64_t c = meta_or(config, "CLUSTER", 0); c > 1 && g % c == 0) {
      p.meta["cluster_size"] = c;
      // B's experts its unit-stride dimension (PEFT's flat lora_B): read by the clusters.
      if (B.strides[0] == 1 && meta_or(config, "EXPERTS_LAST", 0)) {
        p.experts_last = true;
        p.meta["EXPERTS_LAST"] = 1;
        p.pack_b = false;
      }
    }
  }
  // WALK_ROWS: a program owns BLOCK_K columns of one expert (grid axis 0; experts on axis 2)
  // and walks a slice of its rows (axis 1: split_k slices; 0, walk_rows_split's). STREAM,
  // EXPERT_GROUP and PERSISTENT turn it off.
  if (meta_or(config, "WALK_ROWS", 0) && !meta_or(config, "STREAM", 0) && !p.meta.count("EXPERT_GROUP") &&
      !meta_or(config, "PERSISTENT", 0)) {
    const int64_t row_steps = cdiv(N, bn), col_blocks = cdiv(W.shape[2], bk);
    int64_t slices = slices_within(config.split_k, row_steps);
    if (slices == 0)
      slices = walk_rows_split(col_blocks * E, programs, row_steps, p.meta.at("num_stages"));
    p.meta.erase("COLS_FIRST");
    p.meta["WALK_ROWS"] = 1;
    p.grid = Grid{uint32_t(col_blocks), uint32_t(std::min<int64_t>(slices, 65535)), uint32_t(E)};
    return p;
  }
  // PERSISTENT: that many programs per multiprocessor (CPU thread), which deal out all
  // the tiles; where the tiles would not count in 32 bits (with a program's steps ahead),
  // the grid above.
  const int64_t tiles = E * cdiv(N, bn) * steps;
  if (const int64_t per_sm = meta_or(config, "PERSISTENT", 0); per_sm && tiles < (int64_t(1) << 30)) {
    p.meta.erase("COLS_FIRST");
    p.meta["PERSISTENT"] = 1;
    p.grid = Grid{uint32_t(std::min(tiles, per_sm * programs)), 1, 1};
  }
  return p;
}

// The adapters as a plan's kernel reads them: A's cast (CAST_A) and the copies PACK makes
// (in their own dtypes: the same answer), or the views themselves. `options`: the copies
// are queued on its stream; nullptr: views into unused memory (compile lists).
CopiedAdapters moe_inputs(const MoePlan& p, const TensorView& A, const TensorView& B, const LaunchOptions* options) {
  std::optional<DType> a_to, b_to;
  if (p.cast_a != DType::f32 && A.dtype == DType::f32)
    a_to = p.cast_a;
  else if (p.pack && strided_last(A))
    a_to = A.dtype;
  if (p.pack_b && strided_last(B)) b_to = B.dtype;
  // EXPERTS_LAST: B as [N, r, E], read in place.
  const TensorView b =
      p.experts_last ? restride(B, {B.shape[1], B.shape[2], B.shape[0]}, {B.strides[1], B.strides[2], B.strides[0]})
                     : B;
  return copied_adapters(A, a_to, b, b_to, options);
}

// A plan's compile list: its copies, then the materialization.
std::vector<autotune::KernelCall> moe_calls(const MoePlan& p, const TensorView& W, const TensorView& A,
                                            const TensorView& B, const TensorView& W_eff) {
  const CopiedAdapters in = moe_inputs(p, A, B, nullptr);
  std::vector<autotune::KernelCall> calls = in.copies.calls;
  calls.push_back({&kernels::moe_lora_materialize(), {W, in.A, in.B, Scalar(1.0), W_eff}, p.meta});
  return calls;
}

// Queues a plan's launches (its copies, then the materialization).
void launch_moe(const MoePlan& p, const TensorView& W, const TensorView& A, const TensorView& B, double s,
                const TensorView& W_eff, const LaunchOptions& options) {
  const CopiedAdapters in = moe_inputs(p, A, B, &options);
  launch(kernels::moe_lora_materialize(), {W, in.A, in.B, Scalar(s), W_eff}, p.grid, p.meta, options);
}

// The tiles that ran best with WGMMA on an H100 (bf16, r=64): 64x128 on one
// warpgroup with two stages, 128x128 on two with three, and 64x128 with three stages
// whose W_eff moves to its store layout through W's spent ring slot (STORE_IN_RING:
// 110592 bytes of shared memory instead of 128000, so two programs share a
// multiprocessor), each at the usual splits.
std::vector<autotune::Config> moe_wgmma_tiles() {
  std::vector<autotune::Config> c;
  for (const autotune::Config& tile : std::vector<autotune::Config>{
           {{"BLOCK_N", 64}, {"BLOCK_K", 128}, {"num_warps", 4}, {"num_stages", 2}},
           {{"BLOCK_N", 128}, {"BLOCK_K", 128}, {"num_warps", 8}, {"num_stages", 3}},
           {{"BLOCK_N", 64}, {"BLOCK_K", 128}, {"num_warps", 4}, {"num_stages", 3}, {"STORE_IN_RING", 1}}})
    for (const int64_t split : {1, 2, 3, 4}) {
      autotune::Config t = tile;
      t["split_k"] = split;
      c.push_back(std::move(t));
    }
  return c;
}

Config tuned_moe_config(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& W_eff,
                        void* stream);

}  // namespace

namespace detail {
void check_moe_materialize_memory(const TensorView& W, const TensorView& A, const TensorView& B,
                                  const TensorView& W_eff);
}  // namespace detail

namespace {

// The checks, plan and launch on local tensors; `layout` is the canonical layout
// text the kernel is launched with ("" unsharded).
void run_moe_lora_materialize(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                              const TensorView& W_eff, void* stream, const Config& config,
                              const std::string& layout) {
  const char* op = "moe_lora_materialize";
  expect_meta(op, config,
              {{"EVICT", 0, 2}, {"CAST_A", 0, 1}, {"PACK", 0, 2}, kStream, kOneTile, kWarpsN, kL2Prefetch, kWgmma,
               kColsFirst, kTf32, kAccStore, kStoreInRing, {"PERSISTENT", 0, 8}, {"EXPERT_GROUP", 0, 64},
               {"CLUSTER", 0, 8}, {"EXPERTS_LAST", 0, 1}, {"WALK_ROWS", 0, 1}});
  if (meta_or(config, "PERSISTENT", 0) && meta_or(config, "STREAM", 0))
    throw InvalidArgument(std::string(op) +
                          ": Config.meta PERSISTENT (programs that deal out the tiles) and STREAM (one tile a "
                          "program) do not go together");
  // CLUSTER and EXPERTS_LAST work on EXPERT_GROUP's grid: a cluster is that many of a
  // group's experts, so it must divide the group.
  if (const int64_t c = meta_or(config, "CLUSTER", 0), g = meta_or(config, "EXPERT_GROUP", 0);
      c > 1 && (g == 0 || g % c))
    throw InvalidArgument(std::string(op) + ": Config.meta CLUSTER " + std::to_string(c) +
                          " must divide EXPERT_GROUP (the experts of a group that share grid axis 0), got " +
                          (g ? "EXPERT_GROUP " + std::to_string(g) : std::string("no EXPERT_GROUP")));
  if (meta_or(config, "EXPERTS_LAST", 0) && meta_or(config, "CLUSTER", 0) < 2)
    throw InvalidArgument(std::string(op) +
                          ": Config.meta EXPERTS_LAST (B read by clusters of experts) needs CLUSTER of 2 or more "
                          "and EXPERT_GROUP");
  expect_finite_scale(op, s);
  expect_shape(op, "W", W, {-1, -1, -1});
  const int64_t E = W.shape[0], N = W.shape[1], K = W.shape[2];
  expect_shape(op, "A", A, {E, -1, K});
  const int64_t r = A.shape[1];
  expect_shape(op, "B", B, {E, N, r});
  expect_shape(op, "W_eff", W_eff, {E, N, K});
  for (const auto& [name, t] : {std::pair{"W", &W}, {"A", &A}, {"B", &B}})
    expect_dtype(op, name, *t, {DType::bf16, DType::f16, DType::f32});
  expect_dtype(op, "W_eff", W_eff, {W.dtype});
  expect_device(op, {{"W", &W}, {"A", &A}, {"B", &B}, {"W_eff", &W_eff}});
  check_moe_materialize_memory(W, A, B, W_eff);  // alignment, aliasing (end of file)
  if (r > 256) throw InvalidArgument(std::string(op) + ": rank " + std::to_string(r) + " is above the supported 256");
  if (E > 65535) throw InvalidArgument(std::string(op) + ": at most 65535 experts per call, got " + std::to_string(E));
  if (E == 0 || N == 0 || K == 0 || checks_only()) return;

  static PlanMemo<MoePlan> plans;
  CallKey key;
  key.add(W).add(A).add(B).add(W.device);  // B: its memory order too (PEFT's flat lora_B)
  key.add(config);
  const std::shared_ptr<const MoePlan> p = plans.get(key, [&] {
    // A caller's Config wins; otherwise the autotuner's choice (its defaults when tuning is off).
    const Config cfg = has_config(config)
                           ? config
                           : tuned_moe_config(W, A, B, W_eff, stream);
    return plan_moe(W, A.dtype, B, r, W.device.is_cuda(), cfg);
  });
  LaunchOptions options;
  options.stream = stream;
  options.layout = layout;
  launch_moe(*p, W, A, B, s, W_eff, options);
}

}  // namespace

void moe_lora_materialize(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                          const TensorView& W_eff, void* stream, const Config& config) {
  run_moe_lora_materialize(W, A, B, s, W_eff, stream, config, "");
}

// ---------------------------------------------------------------- autotuning (jit/autotune.h)
namespace {

// GPU: BLOCK_N x BLOCK_K x warps x stages, each whole and with K split in two,
// three and four (the split changes only the grid, so it compiles nothing new).
// Splitting evens out the last wave: E=64 N=2816 at BLOCK_N=128 makes 1408
// programs, 10.7 waves of one program per SM, and the last wave leaves a third
// of the SMs idle; split in three they make 32 full waves. A split beyond the
// column steps is clamped to them: 65535 stands for one tile per program.
std::vector<autotune::Config> moe_gpu_candidates() {
  return autotune::product({{"BLOCK_N", {32, 64, 128}},
                            {"BLOCK_K", {64, 128}},
                            {"num_warps", {4, 8}},
                            {"num_stages", {2, 3}},
                            {"split_k", {1, 2, 3, 4, 65535}}});
}

Config tuned_moe_config(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& W_eff,
                        void* stream) {
  const bool gpu = W.device.is_cuda();
  const int64_t E = W.shape[0], N = W.shape[1], K = W.shape[2], r = A.shape[1];
  TuneRequest q;
  q.problem = {"moe_lora_materialize",
               {next_pow2(E), next_pow2(N), next_pow2(K), rank_pad(r)},
               {W.dtype, A.dtype, B.dtype},
               "",
               W.device};
  add_memory_order(q.problem.shape_bucket, W);
  add_adapter_order(q.problem.shape_bucket, A, B);
  q.block_m_name = "BLOCK_N";
  q.block_k_name = "BLOCK_K";
  const Product product = product_dtype(W.dtype, A.dtype, B.dtype);
  q.gpu_candidates = with_stream_tiles(with_wgmma_tiles(moe_gpu_candidates(), moe_wgmma_tiles(), product, W.device),
                                       "BLOCK_N", "BLOCK_K", product);
  q.finalist_variants = with_one_tile_variant(
      with_wgmma_variant(
          with_l2_prefetch_variants(with_warps_n_variants(evict_and_cast_variants(A, product), product)), product,
          W.device),
      product);
  // Adapters strided along their last dims (PEFT's layouts): also read in place.
  if (gpu && (strided_last(A) || strided_last(B))) q.finalist_variants.push_back({{"PACK", 0}});
  // Both strided (PEFT's transposed experts): also A copied alone, B (read once a program) in place.
  if (gpu && strided_last(A) && strided_last(B)) q.finalist_variants.push_back({{"PACK", 2}});
  q.extent_m = N;
  q.extent_k = K;
  q.kernels = [&](const Config& c) { return moe_calls(plan_moe(W, A.dtype, B, r, gpu, c), W, A, B, W_eff); };
  q.run = [&](const Config& c) {
    LaunchOptions options;
    options.stream = stream;
    launch_moe(plan_moe(W, A.dtype, B, r, gpu, c), W, A, B, 1.0, W_eff, options);
  };
  // When W_eff is W (materializing in place) every timed run would add s*B@A once
  // more: W's bytes are saved, only when a tuning actually runs, and put back.
  std::unique_ptr<SavedBytes> saved;
  q.restore = [&] {
    if (!saved) saved = std::make_unique<SavedBytes>(W, W_eff, stream);
    saved->restore();
  };
  q.stream = stream;
  return tuned_config(q);
}

// For kerf-cache warm.
const bool moe_registered = [] {
  autotune::TunableOp op;
  op.name = "moe_lora_materialize";
  op.shape_names = {"E", "N", "K", "r"};
  op.takes_layout = true;
  op.operands = [](const std::vector<int64_t>& s, DType t) {
    return std::vector<autotune::Operand>{
        {{s[0], s[1], s[2]}, t}, {{s[0], s[3], s[2]}, t}, {{s[0], s[1], s[3]}, t}, {{s[0], s[1], s[2]}, t}};
  };
  op.call = [](const std::vector<TensorView>& v, void* stream, const std::string& layout) {
    moe_lora_materialize(v[0], v[1], v[2], 1.0, v[3], stream, {}, detail::layout_at_origin(layout));
  };
  op.kernels = [](const std::vector<TensorView>& v, const autotune::Config& c, int sm_count) {
    const MoePlan p =
        plan_moe(v[0], v[1].dtype, v[2], v[1].shape[1], true, config_from(c, "BLOCK_N", "BLOCK_K"), sm_count);
    return moe_calls(p, v[0], v[1], v[2], v[3]);
  };
  op.gpu_candidates = moe_gpu_candidates;
  op.block_m_name = "BLOCK_N";
  autotune::register_op(std::move(op));
  return true;
}();

}  // namespace

}  // namespace kerf::ops

// ---------------------------------------------------------------- argument memory, sharded layouts
// Kept apart from the unsharded path above. W_eff may be W itself (in place:
// each element is read before it is written, by the program that writes it);
// any other overlap of W_eff with an input is rejected.
#include "ops_checks.h"

namespace kerf::ops {
namespace detail {

void check_moe_materialize_memory(const TensorView& W, const TensorView& A, const TensorView& B,
                                  const TensorView& W_eff) {
  const char* op = "moe_lora_materialize";
  for (const auto& [n, t] : {std::pair{"W", &W}, {"A", &A}, {"B", &B}, {"W_eff", &W_eff}}) {
    expect_addressable(op, n, *t);
    expect_int32_dims(op, n, *t);
  }
  expect_no_self_overlap(op, "W_eff", W_eff);
  const bool in_place = W_eff.data == W.data && W_eff.dtype == W.dtype &&
                        std::equal(W.strides.begin(), W.strides.begin() + 3, W_eff.strides.begin());
  if (!in_place) expect_disjoint(op, "W_eff", W_eff, "W", W);
  expect_disjoint(op, "W_eff", W_eff, "A", A);
  expect_disjoint(op, "W_eff", W_eff, "B", B);
}

}  // namespace detail

void moe_lora_materialize(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                          const TensorView& W_eff, void* stream, const Config& config,
                          const Layout& layout) {
  const char* op = "moe_lora_materialize";
  const detail::LayoutSplits splits = detail::check_layout(op, layout, [] {
    return std::vector<detail::OperandDims>{
        {"W", {"E", "N", "K"}}, {"A", {"E", "r", "K"}}, {"B", {"E", "N", "r"}}, {"W_eff", {"E", "N", "K"}}};
  });
  detail::expect_unsplit(op, layout, splits, "r",
                         "each expert's product B[e] @ A[e] needs every rank");
  run_moe_lora_materialize(W, A, B, s, W_eff, stream, config, layout.canonical());
}

}  // namespace kerf::ops
