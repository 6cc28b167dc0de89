// Every autotuned op gives, when it tunes, the answer of its default config:
// the candidates' timed runs leave no trace (in-place ops are restored between
// and after them), and the chosen config computes the same function.
#include <map>
#include <random>
#include <string>
#include <vector>

#include "catch.h"
#include "cpu_test_util.h"
#include "device_tensor.h"
#include "gpu_test_util.h"
#include "kerf/ops/ops.h"
#include "kernels_src/ops_common.h"
#include "kernels_src/ops_tune.h"
#include "smem_fit_util.h"
#include "test_cache_util.h"

using namespace kerf;
using kerf::test::TestTensor;

namespace {

// The ops' outputs, in order, for one set of inputs (drawn from `seed`).
std::vector<double> run_ops(const Device& dev, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> results;
  const auto keep = [&](TestTensor& t) {
    test::sync(dev);
    t.download();
    for (int64_t i = 0; i < t.numel(); ++i) results.push_back(t.get(i));
  };
  {  // lora_merge, in place
    TestTensor W(DType::f32, {37, 70}, dev), A(DType::f32, {5, 70}, dev), B(DType::f32, {37, 5}, dev);
    W.randomize(rng);
    A.randomize(rng, -0.5, 0.5);
    B.randomize(rng, -0.5, 0.5);
    ops::lora_merge(W.view(), A.view(), B.view(), 0.75);
    keep(W);
  }
  {  // moe_lora_materialize in place (W_eff is W), then its backward
    TestTensor W(DType::f32, {3, 20, 36}, dev), A(DType::f32, {3, 4, 36}, dev), B(DType::f32, {3, 20, 4}, dev);
    TestTensor dA(DType::f32, {3, 4, 36}, dev), dB(DType::f32, {3, 20, 4}, dev);
    W.randomize(rng);
    A.randomize(rng, -0.5, 0.5);
    B.randomize(rng, -0.5, 0.5);
    dA.poison();
    dB.poison();
    ops::moe_lora_materialize(W.view(), A.view(), B.view(), 0.5, W.view());
    keep(W);
    ops::moe_lora_materialize_backward(W.view(), A.view(), B.view(), 0.5, dA.view(), dB.view());
    keep(dA);
    keep(dB);
  }
  {  // lora_embedding forward and backward
    const int64_t T = 9, V = 30, D = 24, r = 3;
    TestTensor x(DType::i64, {T}, dev), table(DType::f32, {V, D}, dev), A(DType::f32, {r, V}, dev),
        B(DType::f32, {D, r}, dev), out(DType::f32, {T, D}, dev), g(DType::f32, {T, D}, dev),
        dA(DType::f32, {r, V}, dev), dB(DType::f32, {D, r}, dev);
    std::uniform_int_distribution<int64_t> id(0, V - 1);
    for (int64_t t = 0; t < T; ++t) x.set(t, double(id(rng)));
    x.upload();
    table.randomize(rng);
    A.randomize(rng, -0.5, 0.5);
    B.randomize(rng, -0.5, 0.5);
    g.randomize(rng);
    out.poison();
    dA.poison();
    dB.poison();
    ops::lora_embedding(x.view(), table.view(), A.view(), B.view(), 2.0, out.view());
    keep(out);
    ops::lora_embedding_backward(x.view(), A.view(), B.view(), g.view(), 2.0, dA.view(), dB.view());
    keep(dA);
    keep(dB);
  }
  return results;
}

void check_tuned_equals_default(const Device& dev) {
  test::TempDir dir;
  std::vector<double> defaults, tuned;
  {
    test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "0"}});
    defaults = run_ops(dev, 11);
  }
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "info"}});
  test::LogCapture logs;
  tuned = run_ops(dev, 11);
  // Five ops tuned: merge, MoE forward and backward, embedding forward and backward.
  CHECK(logs.count("chose") == 5);
  for (const char* op : {"lora_merge", "moe_lora_materialize ", "moe_lora_materialize_backward",
                         "lora_embedding ", "lora_embedding_backward"})
    CHECK(logs.count(std::string("autotune ") + op) == 1);
  REQUIRE(tuned.size() == defaults.size());
  CHECK(test::max_relative_error(tuned, defaults) < 1e-5);
}


// In-place ops tuned on a view with gaps between its rows (the left part of a
// wider W, starting off an aligned address; a 3-D expert slice for MoE): each
// timed run is undone element by element, so the view ends merged once and the
// memory between its elements keeps its own values.
void check_gapped_in_place_tuning(const Device& dev, DType dtype) {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "info"}});
  test::LogCapture logs;
  std::mt19937_64 rng(23);
  const double tol = dtype == DType::f32 ? 1e-5 : 1e-2;
  {  // lora_merge on W[:, 3:3+in] of a [rows, cols] tensor
    const int64_t rows = 45, cols = 150, in = 100, r = 6, off = 3;
    TestTensor W(dtype, {rows, cols}, dev), A(DType::f32, {r, in}, dev), B(DType::f32, {rows, r}, dev);
    W.randomize(rng);
    A.randomize(rng, -0.5, 0.5);
    B.randomize(rng, -0.5, 0.5);
    std::vector<double> before(size_t(W.numel()));
    for (int64_t i = 0; i < W.numel(); ++i) before[size_t(i)] = W.get(i);
    ops::lora_merge(W.view_at(off, {rows, in}, {cols, 1}), A.view(), B.view(), 0.5);
    test::sync(dev);
    W.download();
    CHECK(logs.count("autotune lora_merge") == 1);
    std::vector<double> got, ref;
    int64_t gap_changed = 0;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t at = i * cols + j;
        if (j < off || j >= off + in) {
          gap_changed += W.get(at) != before[size_t(at)];
          continue;
        }
        double ba = 0;
        for (int64_t k = 0; k < r; ++k) ba += B.get(i * r + k) * A.get(k * in + (j - off));
        got.push_back(W.get(at));
        ref.push_back(before[size_t(at)] + 0.5 * ba);  // added once, not once per timed run
      }
    CHECK(gap_changed == 0);
    CHECK(test::max_relative_error(got, ref, 1.0) < tol);  // values of order 1
  }
  {  // moe_lora_materialize in place on experts 0..E-1 of [E, N, K+5], columns 0..K-1
    const int64_t E = 3, N = 24, K = 40, pad = 5, r = 4;
    TestTensor W(dtype, {E, N, K + pad}, dev), A(DType::f32, {E, r, K}, dev), B(DType::f32, {E, N, r}, dev);
    W.randomize(rng);
    A.randomize(rng, -0.5, 0.5);
    B.randomize(rng, -0.5, 0.5);
    std::vector<double> before(size_t(W.numel()));
    for (int64_t i = 0; i < W.numel(); ++i) before[size_t(i)] = W.get(i);
    const TensorView w = W.view({E, N, K}, {N * (K + pad), K + pad, 1});
    ops::moe_lora_materialize(w, A.view(), B.view(), 0.25, w);
    test::sync(dev);
    W.download();
    CHECK(logs.count("autotune moe_lora_materialize ") == 1);
    std::vector<double> got, ref;
    int64_t gap_changed = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K + pad; ++k) {
          const int64_t at = (e * N + n) * (K + pad) + k;
          if (k >= K) {
            gap_changed += W.get(at) != before[size_t(at)];
            continue;
          }
          double ba = 0;
          for (int64_t j = 0; j < r; ++j) ba += B.get((e * N + n) * r + j) * A.get((e * r + j) * K + k);
          got.push_back(W.get(at));
          ref.push_back(before[size_t(at)] + 0.25 * ba);
        }
    CHECK(gap_changed == 0);
    CHECK(test::max_relative_error(got, ref, 1.0) < tol);  // values of order 1
  }
}

}  // namespace

TEST_CASE("tuned ops give the answer of their default config, in-place ones included, on the CPU",
          "[autotune][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_tuned_equals_default(Device::cpu());
}

TEST_CASE("in-place tuning of a view with gaps restores its elements only, on the CPU", "[autotune][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_gapped_in_place_tuning(Device::cpu(), DType::f32);
  check_gapped_in_place_tuning(Device::cpu(), DType::bf16);
}

TEST_CASE("in-place tuning of a view with gaps restores its elements only, on the GPU", "[autotune][gpu]") {
  KERF_REQUIRE_GPU();
  check_gapped_in_place_tuning(Device::cuda(0), DType::f32);
  check_gapped_in_place_tuning(Device::cuda(0), DType::bf16);
}

TEST_CASE("tuned ops give the answer of their default config, in-place ones included, on the GPU",
          "[autotune][gpu]") {
  KERF_REQUIRE_GPU();
  check_tuned_equals_default(Device::cuda(0));
}

// The split candidates a tile gets: its default split (split_for's, or with
// default_waves that many full waves) once, and each asked-for wave count's
// split unless it equals one already there.
TEST_CASE("wave-split candidates try each split once, the op's own default included", "[autotune][cpu]") {
  using ops::detail::split_for;
  using ops::detail::split_for_waves;
  using ops::detail::with_wave_splits;
  const autotune::Config tile = {{"BLOCK_T", 64}, {"BLOCK_D", 64}};
  const auto splits = [](const std::vector<autotune::Config>& c) {
    std::vector<int64_t> s;
    for (const autotune::Config& x : c) s.push_back(autotune::value_or_zero(x, "split_k"));
    return s;
  };
  // 132 row blocks of 64 over 132 programs, 64 column steps: split_for gives 3.
  const int64_t rows = 132 * 64 - 5, cols = 64 * 64 - 7, programs = 132;
  REQUIRE(split_for(132, programs, 64) == 3);
  CHECK(split_for_waves(132, programs, 64, 1) == 1);
  CHECK(split_for_waves(132, programs, 64, 3) == 3);
  CHECK(split_for_waves(1, programs, 64, 2) == 64);  // at most one step per program
  CHECK(split_for_waves(1000, programs, 64, 1) == 1);  // at least 1
  // Default split_for (3): the three-wave split is that default, so it is not repeated.
  CHECK(splits(with_wave_splits({tile}, "BLOCK_T", rows, "BLOCK_D", cols, 1, programs, {2, 3})) ==
        std::vector<int64_t>{0, 2});
  // Default one wave (1): two and three waves are both new.
  CHECK(splits(with_wave_splits({tile}, "BLOCK_T", rows, "BLOCK_D", cols, 1, programs, {2, 3}, 1)) ==
        std::vector<int64_t>{0, 2, 3});
  // A wave count whose split is the default's adds nothing; 0 is one step per program.
  CHECK(splits(with_wave_splits({tile}, "BLOCK_T", rows, "BLOCK_D", cols, 1, programs, {1, 0}, 1)) ==
        std::vector<int64_t>{0, 64});
}

// The merge's WALK_ROWS row slices: two waves of two programs a multiprocessor (two on two
// stages, which run three at once), slices of at least 8 BLOCK_M steps where there are that
// many, at least one slice, at most one a step.
TEST_CASE("the merge's row-walking programs take two waves of row slices of at least 8 steps", "[autotune][cpu]") {
  using ops::detail::walk_rows_split;
  CHECK(walk_rows_split(64, 132, 128) == 8);   // 8192x8192, 64x128 tiles
  CHECK(walk_rows_split(32, 132, 224) == 16);  // 14336x4096
  CHECK(walk_rows_split(32, 132, 64) == 8);    // 4096x4096: 8 steps a slice
  CHECK(walk_rows_split(4, 132, 4) == 1);      // fewer than 8 steps: one slice
  CHECK(walk_rows_split(2000, 132, 4096) == 1);
  CHECK(walk_rows_split(1, 132, 100000) == 528);
  CHECK(walk_rows_split(0, 132, 0) == 1);
  // Two stages: half as many programs in all.
  CHECK(walk_rows_split(64, 132, 128, 2) == 4);   // 8192x8192
  CHECK(walk_rows_split(32, 132, 224, 2) == 8);   // 14336x4096
  CHECK(walk_rows_split(32, 132, 64, 2) == 8);    // 4096x4096
  CHECK(walk_rows_split(32, 132, 224, 4) == 16);  // four stages as three
}

// A wave-split choice stored for one shape serves another shape of its bucket
// (next powers of two) with the split that fills that shape's waves: 4096 rows
// tuned to one wave of 128-row blocks (split 4 on 132 SMs: 32 x 4 programs) must
// not run 2100 rows (17 blocks) as split 4, half a wave.
TEST_CASE("a stored wave split is recomputed for the shape of each call", "[autotune][cpu]") {
  using ops::detail::config_of;
  using ops::detail::split_for_waves;
  using ops::detail::TuneRequest;
  using ops::detail::with_wave_splits;
  const int64_t programs = 132;
  const autotune::Config tile = {{"BLOCK_M", 128}, {"BLOCK_K", 64}};
  const std::vector<autotune::Config> tuned =
      with_wave_splits({tile}, "BLOCK_M", 4096, "BLOCK_K", 4096, 1, programs, {1, 2, 0});
  REQUIRE(tuned.size() == 4);
  TuneRequest q;
  q.block_m_name = "BLOCK_M";
  q.block_k_name = "BLOCK_K";
  q.split_programs = programs;
  q.extent_m = 4096;
  q.extent_k = 4096;
  CHECK(config_of(q, tuned[1]).split_k == 4);  // one wave at the tuned shape
  CHECK(config_of(q, tuned[1]).meta.count("split_waves") == 0);  // not a kernel meta
  q.extent_m = 2100;  // same bucket
  CHECK(config_of(q, tuned[1]).split_k == split_for_waves(17, programs, 64, 1));
  CHECK(config_of(q, tuned[1]).split_k == 7);  // 17 x 7 = 119 programs, not 17 x 4 = 68
  CHECK(config_of(q, tuned[2]).split_k == split_for_waves(17, programs, 64, 2));
  q.extent_k = 3000;  // one column step per program: 47 steps here
  CHECK(config_of(q, tuned[3]).split_k == 47);
  q.split_batch = 3;  // three groups of rows (the merge's batch)
  CHECK(config_of(q, tuned[1]).split_k == split_for_waves(51, programs, 47, 1));
  // Without the request's machine size (an op that does not give it) the split stays as stored.
  q.split_programs = 0;
  CHECK(config_of(q, tuned[1]).split_k == 4);
  // A config without a wave count (the op's default, or an explicit split) is left alone.
  CHECK(config_of(q, tuned[0]).split_k == 0);
}

// WGMMA tiles are first-round candidates only where warpgroup dots exist: a
// half-precision product on an sm_90a GPU.
TEST_CASE("WGMMA tiles join the candidates only for a tensor-core product on sm_90a", "[autotune][cpu]") {
  using ops::detail::with_wgmma_tiles;
  const std::vector<autotune::Config> base = {{{"BLOCK_M", 32}}}, tiles = {{{"BLOCK_M", 64}}, {{"BLOCK_M", 128}}};
  CHECK(with_wgmma_tiles(base, tiles, DType::bf16, Device::cpu()) == base);
  CHECK(with_wgmma_tiles(base, tiles, DType::f32, Device::cuda(0)) == base);  // no tensor-core product
  // Planned for a target (as kerf-cache warm does): sm_90a's GPUs take them, others not.
  {
    const ops::detail::PlanningArch h100("sm_90a");
    CHECK(with_wgmma_tiles(base, tiles, DType::bf16, Device::cuda(0)).size() == 3);
    CHECK(with_wgmma_tiles(base, tiles, DType::bf16, Device::cpu()) == base);
  }
  const ops::detail::PlanningArch a100("sm_80");
  CHECK(with_wgmma_tiles(base, tiles, DType::bf16, Device::cuda(0)) == base);
}

TEST_CASE("WGMMA tiles join the candidates on an sm_90a GPU and nowhere else", "[autotune][gpu]") {
  KERF_REQUIRE_GPU();
  using ops::detail::with_wgmma_tiles;
  const std::vector<autotune::Config> base = {{{"BLOCK_M", 32}}}, tiles = {{{"BLOCK_M", 64}}, {{"BLOCK_M", 128}}};
  const std::vector<autotune::Config> got = with_wgmma_tiles(base, tiles, DType::f16, Device::cuda(0));
  if (device_arch(0) != "sm_90a") {
    CHECK(got == base);
    return;
  }
  REQUIRE(got.size() == 3);
  CHECK(got[0] == base[0]);
  CHECK(got[1] == autotune::Config{{"BLOCK_M", 64}, {"WGMMA", 1}});
  CHECK(got[2] == autotune::Config{{"BLOCK_M", 128}, {"WGMMA", 1}});
}

TEST_CASE("COLS_FIRST joins the finalist variants alone and beside each WGMMA variant", "[autotune][cpu]") {
  using ops::detail::with_cols_first_variants;
  const std::vector<autotune::Config> none = with_cols_first_variants({});
  CHECK(none == std::vector<autotune::Config>{{{"COLS_FIRST", 1}}});
  const std::vector<autotune::Config> got =
      with_cols_first_variants({{{"EVICT", 1}}, {{"WGMMA", 1}}, {{"L2_PREFETCH", 128}}});
  CHECK(got == std::vector<autotune::Config>{{{"EVICT", 1}},
                                             {{"WGMMA", 1}},
                                             {{"L2_PREFETCH", 128}},
                                             {{"COLS_FIRST", 1}},
                                             {{"WGMMA", 1}, {"COLS_FIRST", 1}}});
}

TEST_CASE("WGMMA_SS asks for shared-memory A operands only beside WGMMA", "[autotune][cpu]") {
  const auto hints = [](const std::map<std::string, int64_t>& m, int64_t wgmma_ss_default = 0) {
    ops::Config cfg;
    cfg.meta = m;
    dsl::MetaMap meta;
    ops::detail::add_codegen_hints(cfg, meta, wgmma_ss_default);
    return meta;
  };
  CHECK(hints({{"WGMMA", 1}}) == dsl::MetaMap{{"wgmma", 1}});
  CHECK(hints({{"WGMMA", 1}, {"WGMMA_SS", 1}}) == dsl::MetaMap{{"wgmma", 1}, {"wgmma_ss", 1}});
  CHECK(hints({{"WGMMA", 1}, {"WGMMA_SS", 0}}) == dsl::MetaMap{{"wgmma", 1}});
  CHECK(hints({{"WGMMA_SS", 1}}).empty());  // nothing to read from shared memory without wgmma
  // An op whose default is on (the embedding backward): unset means on, 0 still off.
  CHECK(hints({{"WGMMA", 1}}, 1) == dsl::MetaMap{{"wgmma", 1}, {"wgmma_ss", 1}});
  CHECK(hints({{"WGMMA", 1}, {"WGMMA_SS", 0}}, 1) == dsl::MetaMap{{"wgmma", 1}});
  CHECK(hints({}, 1).empty());
}

// ONE_TILE=1 joins the merge's and MoE forward's finalist variants where their products run
// on tensor cores in a half dtype (where with_stream_tiles gives them STREAM candidates).
TEST_CASE("ONE_TILE joins the finalist variants for products in a half dtype only", "[autotune][cpu]") {
  using ops::detail::with_one_tile_variant;
  const std::vector<autotune::Config> base = {{{"EVICT", 1}}};
  for (const DType half : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(half));
    CHECK(with_one_tile_variant(base, half) == std::vector<autotune::Config>{{{"EVICT", 1}}, {{"ONE_TILE", 1}}});
  }
  CHECK(with_one_tile_variant(base, DType::f32) == base);
}

TEST_CASE("a STREAM config runs as one without the entries its plan overrides", "[autotune][cpu]") {
  using ops::detail::stream_canonical;
  const autotune::Config tiled = {{"BLOCK_M", 64}, {"BLOCK_K", 128}, {"num_stages", 3}, {"split_k", 4},
                                  {"L2_PREFETCH", 128}, {"COLS_FIRST", 1}, {"EVICT", 1}};
  CHECK(stream_canonical(tiled) == tiled);  // not streaming: every entry counts
  autotune::Config streamed = tiled;
  streamed["STREAM"] = 1;
  CHECK(stream_canonical(streamed) ==
        autotune::Config{{"BLOCK_M", 64}, {"BLOCK_K", 128}, {"EVICT", 1}, {"STREAM", 1}});
  // What the canonical form drops is what the plan sets itself: the same meta and grid.
  for (const char* name : {"split_k", "split_waves", "num_stages", "L2_PREFETCH", "COLS_FIRST"}) {
    CAPTURE(name);
    autotune::Config plain = {{"BLOCK_M", 64}, {"BLOCK_K", 128}, {"STREAM", 1}};
    autotune::Config with = plain;
    with[name] = name == std::string("L2_PREFETCH") ? 128 : name == std::string("COLS_FIRST") ? 1 : 2;
    const auto plan = [](const autotune::Config& c) {
      const ops::Config cfg = ops::detail::config_from(c, "BLOCK_M", "BLOCK_K");
      dsl::MetaMap meta;
      if (cfg.num_stages) meta["num_stages"] = cfg.num_stages;
      ops::detail::add_codegen_hints(cfg, meta);
      int64_t split = cfg.split_k;
      const ops::Config order = ops::detail::stream_plan(cfg, DType::bf16, 9, meta, &split);
      const Grid g = ops::detail::row_slice_grid(5, split, 1, order, meta);
      return std::make_tuple(meta, split, g.x, g.y, g.z);
    };
    CHECK(plan(with) == plan(plain));
    CHECK(stream_canonical(with) == plain);
  }
  // ONE_TILE: the one-tile form of STREAM's programs, kept at 1 with STREAM; at 0, or without
  // STREAM (where the plan has no use for it), dropped.
  autotune::Config one_tile = streamed;
  one_tile["ONE_TILE"] = 1;
  CHECK(stream_canonical(one_tile).at("ONE_TILE") == 1);
  one_tile["ONE_TILE"] = 0;
  CHECK(stream_canonical(one_tile) == stream_canonical(streamed));
  autotune::Config tiled_one = tiled;
  tiled_one["ONE_TILE"] = 1;
  CHECK(stream_canonical(tiled_one) == tiled);
  const auto kernel_meta = [](const autotune::Config& c) {
    const ops::Config cfg = ops::detail::config_from(c, "BLOCK_M", "BLOCK_K");
    dsl::MetaMap meta;
    int64_t split = 9;
    ops::detail::stream_plan(cfg, DType::bf16, 9, meta, &split);
    return meta;
  };
  CHECK(kernel_meta(tiled_one) == kernel_meta(tiled));
  CHECK_FALSE(kernel_meta(tiled_one).count("ONE_TILE"));
}

// An untuned call (KERF_AUTOTUNE=0, or a first call in a capture) on a GPU whose blocks hold
// less shared memory than an H100's runs, where the op's own tiles would not fit, the tuner's
// candidate that fits with the most; on an H100 the op's own tiles at every rank up to 256.
// Each op planned (not run) at r = 64, 128 and 256 in bf16, fp32 and fp32 adapters on bf16,
// for an A100's 163 KiB and the 99 KiB of sm_86/sm_89 GPUs.
TEST_CASE("untuned calls on GPUs with less shared memory than an H100 run the candidate that fits",
          "[autotune][cuda][codegen]") {
  using ops::detail::UntunedFit;
  void* const p = test::planning_address();
  int fitted = 0, planned = 0;
  for (const autotune::TunableOp& op : autotune::tunable_ops()) {
    for (const DType t : {DType::bf16, DType::f32})
      for (const bool fp32_adapters : {false, true}) {
        if (fp32_adapters && t == DType::f32) continue;
        for (const int64_t r : {64, 128, 256}) {
          CAPTURE(op.name, dtype_name(t), fp32_adapters, r);
          std::vector<int64_t> shape;
          for (const std::string& n : op.shape_names) shape.push_back(n == "r" ? r : n == "E" ? 4 : 1024);
          std::vector<TensorView> views;
          for (const autotune::Operand& o : op.operands(shape, t)) {
            const bool adapter = std::find(o.shape.begin(), o.shape.end(), r) != o.shape.end();
            views.push_back(
                TensorView::contiguous(p, fp32_adapters && adapter ? DType::f32 : o.dtype, o.shape, Device::cuda(0)));
          }
          UntunedFit h100;
          CHECK(ops::detail::untuned_candidate(op, views, "sm_90a", 232448, 132, &h100).empty());
          CHECK(h100.candidate.empty());
          for (const char* arch : {"sm_80", "sm_89"}) {
            CAPTURE(arch);
            const int limit = autotune::typical_max_shared_memory(arch);
            UntunedFit f;
            const autotune::Config c = ops::detail::untuned_candidate(op, views, arch, limit, 132, &f);
            CHECK(f.bytes <= limit);
            CHECK(c.empty() == (f.own_bytes <= limit));
            // The candidate's kernels, planned as a caller's Config, take what it said.
            int most = 0;
            for (const autotune::KernelCall& k : op.kernels(views, c, 132))
              most = std::max(most, autotune::shared_memory_bytes(*k.kernel, k.args, k.meta, arch));
            CHECK(most == f.bytes);
            if (!f.candidate.empty()) ++fitted;
            ++planned;
          }
        }
      }
  }
  CHECK(planned == 8 * 3 * 3 * 2);  // eight ops: dora_norm, its 4-bit and partial forms, merge, MoE both ways, embedding both ways
  CHECK(fitted > 0);  // some of the op's own tiles need more than 99 KiB
}
