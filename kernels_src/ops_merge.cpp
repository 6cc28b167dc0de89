// ops::lora_merge / lora_unmerge, PyTorch and Flax layouts: argument checks,
// the mapping of both layouts onto one kernel (W[g] += s * B[g] @ A[g]), launches.
#include <algorithm>
#include <functional>
#include <memory>

#include "kerf/jit/launch.h"
#include "kerf/kernels/kernels.h"
#include "kerf/ops/ops.h"
#include "ops_checks.h"
#include "ops_common.h"
#include "ops_tune.h"

namespace kerf::ops {

using namespace detail;

namespace {

// The product's dtype, and whether s is applied after it (B exact in that dtype).
Product merge_dot_dtype(DType w, DType a, DType b, bool* scale_after) {
  *scale_after = is_half(a) && a == b;
  if (*scale_after) return a;
  return product_dtype(w, a, b);
}

struct MergePlan {
  dsl::MetaMap meta;
  Grid grid;
  DType cast_a = DType::f32;  // CAST_A: what an f32 A is rounded to first, in one pass (f32: nothing)
  // The one-tile form after A's cast on a GPU: the cast lets the merge start while it runs
  // (RELEASE), and the merge asks for W's and B's tiles before it waits for the cast (WAIT_PRIOR).
  bool overlap_cast = false;
};

// The op's own tile on an H100 (sm_90a) for a call whose Config names none (untuned, or a first
// call inside a graph capture) with a bf16 or f16 W whose product runs in a half dtype (a bf16 W
// with adapters of any dtype, an f16 W with f16 or bf16 ones), at ranks up to 64, and with an f16 W
// and fp32 adapters (TF32) up to rank 16.
//
// At ranks up to 32 (R_PAD 16 or 32) with W's rows contiguous: one tile a program in its one-tile
// form (STREAM, ONE_TILE), 32 rows by 64 columns on 4 warps at R_PAD 32 (128 columns with fp32
// adapters, whose wider side reads cost more a program) and by 128 at R_PAD 16, unless the Config
// names STREAM (0 asks for tiles walking columns), says ONE_TILE=0 or names WALK_ROWS (those ask
// for the ring tile below at R_PAD 32, the mma.sync tile at 16). On an H100 at r=32, 4096x4096 /
// 8192x8192 / 14336x4096 all-bf16: 27.6 / 96.7 / 85.0 us (96.8-97.3% of a copy) against 29.7 /
// 100.1 / 90.3 tuned before; at 8192x8192 an f16 W 96.6 against 100.4, f16 adapters 96.6 against
// 101.6, fp32 adapters 101.2 (32x128; 116.8 at 32x64, 109.0 at 32x256) against 104.0, and with
// an fp32 A cast to bf16 first (CAST_A), the merge launched to overlap the cast (it asks for W's
// and B's tiles, then waits for the cast before reading A), 96.5 (96.9%; 98.2 on 64x128, 8 warps,
// 98.6 with the launches one after the other there), so at R_PAD 32 an fp32 A is cast. At r=16
// 32x128: 27.3 / 96.2 / 84.7 (f16 W 96.2) against 30.8 / 102.7 / 94.1 (102.6) on the mma.sync tile
// (32x64 was slower there: 111.7 at 8192x8192); a bf16 W with fp32 adapters (PEFT's) there runs
// 64x128 on 8 warps: 94.3 us at 8192x8192 (98.7% of a copy) against 99.3 on 32x128 and 96.1 tuned
// without ONE_TILE (128x64 on 8 warps 94.8; casting A first, CAST_A, cost 2-4 us on each). An f16
// W with fp32 adapters (TF32 products) runs the 32x128 one-tile form up to rank 16 too: 95.8 us at
// r=16, 8192x8192, against 102.8 without ONE_TILE and 100.9 tuned on the mma.sync tile. At r=64
// the one-tile form ran at 55-82% of a copy (A's columns pass through registers), so R_PAD 64 keeps
// the ring tile.
//
// Otherwise (R_PAD 64; at R_PAD 32 a strided W or a Config that asks): the MoE forward's tile
// (ops_moe.cpp), 64x128 on one warpgroup (WGMMA), W's new tile moved to its store layout through
// its spent ring slot (STORE_IN_RING), 128-byte L2 prefetches, its programs owning columns and
// walking the rows (WALK_ROWS; walk_rows_split's slices), on three stages at R_PAD 32 and two at
// 64. On an H100, at 4096x4096 / 8192x8192 / 14336x4096 all-bf16: r=64 30.4 / 99.8 / 88.7 us (30.9
// / 101.7 / 90.5 on three stages) against 33.5 / 106.6 / 98.3 on the same tile walking columns and
// 37.4 / 119.5 / 112.0 on the 64x128 mma.sync tile, r=32 29.8 / 100.6 / 89.2 against 31.4 / 104.3 /
// 95.1 and 32.8 / 106.8 / 98.6 (on two stages 30.2 / 100.8 / 90.1); at 8192x8192 and r=64, f16 W
// with bf16 adapters 100.5 against 119.0 (mma.sync), bf16 W with f16 ones 100.1 against 114.0, with
// fp32 ones (PEFT's) 107.7 (111.4 on three stages) against 154.5. The MoE forward walking columns
// keeps three (two: 543.3 against 538.3 us, 64x2816x2048). r=16 is slower on the warpgroup tile
// (107.9 against 104.3 at 8192x8192, walking columns), so ranks up to 16 keep the mma.sync tile
// where the one-tile form does not apply, as do an f16 W with fp32 adapters (TF32 products) above
// rank 16.
Config own_merge_config(const Config& config, const TensorView& W3, const Product& dot,
                        bool fp32_adapters, bool fp32_a, int64_t r_pad, bool gpu) {
  if (!gpu || config.block_m || config.block_k || !is_half(W3.dtype) || r_pad > 64 || meta_or(config, "STREAM", 0) ||
      !wgmma_target(W3.device))
    return config;
  const bool half_product = is_half(dot.dtype) && !dot.tf32;
  if ((half_product ? r_pad <= 32 : dot.tf32 && r_pad <= 16) && one_tile_own_allowed(config, W3)) {
    if (half_product && fp32_adapters && r_pad == 16) return with_one_tile(config, 64, 128, 8);
    Config own = with_one_tile(config, 32, r_pad == 16 || fp32_adapters ? 128 : 64);
    // At R_PAD 32 an fp32 A is cast first (its launch overlapped by the merge's).
    if (half_product && fp32_a && r_pad == 32) own.meta.emplace("CAST_A", 1);
    return own;
  }
  if (!half_product || r_pad < 32) return config;
  Config own = config;
  // Walking the rows at ranks 33 to 64: two stages, three programs a multiprocessor, not two.
  if (!own.num_stages && r_pad > 32 && meta_or(config, "WALK_ROWS", 1)) own.num_stages = 2;
  own = with_ring_tile(own);
  own.meta.emplace("WALK_ROWS", 1);
  return own;
}

// W3 [G, out, in], r: the meta-parameters and grid for `given` (0 fields: defaults).
MergePlan plan_merge(const TensorView& W3, const TensorView& A3, const TensorView& B3, bool gpu,
                     int64_t programs, const Config& given) {
  const int64_t G = W3.shape[0], out = W3.shape[1], in = W3.shape[2], r = A3.shape[1];
  bool scale_after = false;
  const Product dot = merge_dot_dtype(W3.dtype, A3.dtype, B3.dtype, &scale_after);
  const int64_t r_pad = rank_pad(r);
  const bool fp32_adapters = A3.dtype == DType::f32 || B3.dtype == DType::f32;
  const Config config =
      own_merge_config(given, W3, dot, fp32_adapters, A3.dtype == DType::f32, r_pad, gpu);
  // B's rows stay in registers: fewer rows per program at large ranks.
  const int64_t bm_default = gpu ? std::clamp<int64_t>(8192 / r_pad, 16, 64) : 16;
  const int64_t bm = config.block_m ? config.block_m : bm_default;
  const int64_t bk =
      config.block_k ? config.block_k : (gpu ? rank_narrowed(128, r_pad, rank_bytes(dot, A3.dtype, B3.dtype), 512) : 64);
  // WALK_ROWS: programs own BLOCK_K columns and walk a slice of the rows (not with STREAM).
  const bool walk_rows = meta_or(config, "WALK_ROWS", 0) && !meta_or(config, "STREAM", 0);
  const int64_t stages = config.num_stages ? config.num_stages : (gpu ? 3 : 1);
  const int64_t steps = std::max<int64_t>(1, walk_rows ? cdiv(out, bm) : cdiv(in, bk));
  int64_t split = slices_within(config.split_k, steps);
  if (split == 0) {
    const int64_t blocks = (walk_rows ? cdiv(in, bk) : cdiv(out, bm)) * G;
    split = walk_rows ? walk_rows_split(blocks, programs, steps, stages) : split_for(blocks, programs, steps);
  }
  MergePlan p;
  p.cast_a = cast_a_dtype(config, dot);
  p.meta = {{"BLOCK_M", bm},
            {"BLOCK_K", bk},
            {"R_PAD", r_pad},
            {"SCALE_AFTER", scale_after ? 1 : 0},
            {"num_warps", config.num_warps ? config.num_warps : 4},
            {"num_stages", stages}};
  set_product_meta(p.meta, dot, config);
  pass_meta(config, p.meta, {"EVICT", "WARPS_N"});
  add_codegen_hints(config, p.meta);
  if (walk_rows) {
    p.meta["WALK_ROWS"] = 1;
    p.grid = Grid{uint32_t(cdiv(in, bk)), uint32_t(split), uint32_t(G)};
    return p;
  }
  const Config order = stream_plan(config, W3.dtype, steps, p.meta, &split);
  p.grid = row_slice_grid(cdiv(out, bm), split, G, order, p.meta);
  if (gpu && A3.dtype == DType::f32 && p.cast_a != DType::f32 && p.meta.count("ONE_TILE")) {
    p.overlap_cast = true;
    p.meta["WAIT_PRIOR"] = 1;
  }
  return p;
}

// A plan's compile list: A's cast (CAST_A), then the merge.
std::vector<autotune::KernelCall> merge_calls(const MergePlan& p, const TensorView& W3, const TensorView& A3,
                                              const TensorView& B3, double s) {
  std::vector<autotune::KernelCall> calls;
  const TensorView a = compiled_a(A3, p.cast_a, calls, p.overlap_cast);
  calls.push_back({&kernels::lora_merge(), {W3, a, B3, Scalar(s)}, p.meta});
  return calls;
}

void run_merge(const TensorView& W3, const TensorView& A3, const TensorView& B3, double s, void* stream,
               const Config& config) {
  const MergePlan p = plan_merge(W3, A3, B3, W3.device.is_cuda(), parallelism(W3.device), config);
  LaunchOptions options;
  options.stream = stream;
  // CAST_A: A rounded to the product's dtype once (the kernel would round each tile it
  // reads the same way), so that every step reads half its bytes.
  const RunA a = run_a(A3, p.cast_a, options, p.overlap_cast);
  LaunchOptions merge_options = options;
  merge_options.overlap_prior = p.overlap_cast;
  launch(kernels::lora_merge(), {W3, a.a, B3, Scalar(s)}, p.grid, p.meta, merge_options);
}

std::vector<autotune::Config> merge_gpu_candidates() {
  return autotune::product(
      {{"BLOCK_M", {32, 64, 128}}, {"BLOCK_K", {64, 128}}, {"num_warps", {4, 8}}, {"num_stages", {2, 3}}});
}

TensorView as_batch_of_one(const TensorView& t) {
  return restride(t, {1, t.shape[0], t.shape[1]}, {0, t.strides[0], t.strides[1]});
}

Config tuned_merge_config(const TensorView& W3, const TensorView& A3, const TensorView& B3, double s,
                          void* stream) {
  const int64_t G = W3.shape[0], out = W3.shape[1], in = W3.shape[2], r = A3.shape[1];
  TuneRequest q;
  q.problem = {"lora_merge",
               {next_pow2(G), next_pow2(out), next_pow2(in), rank_pad(r)},
               {W3.dtype, A3.dtype, B3.dtype},
               "",
               W3.device};
  add_memory_order(q.problem.shape_bucket, W3);
  q.block_m_name = "BLOCK_M";
  q.block_k_name = "BLOCK_K";
  // Also with the columns split for 1 to 16 waves of one program per SM (4096x4096 at
  // BLOCK_M=64 makes 448 programs by default, 1.7 waves of two per SM; at 14336x4096 a
  // Triton merge was fastest with 4 programs per 32-row block, about 16 such waves),
  // and into one tile per program, leaving the overlap of tiles to the hardware's scheduler.
  q.gpu_candidates = with_wave_splits(merge_gpu_candidates(), "BLOCK_M", out, "BLOCK_K", in, G,
                                      parallelism(W3.device), {1, 2, 4, 8, 16, 0});
  bool scale_after = false;
  const Product product = merge_dot_dtype(W3.dtype, A3.dtype, B3.dtype, &scale_after);
  q.gpu_candidates = with_stream_tiles(q.gpu_candidates, "BLOCK_M", "BLOCK_K", product);
  q.finalist_variants = with_one_tile_variant(
      with_cols_first_variants(with_wgmma_variant(
          with_l2_prefetch_variants(with_warps_n_variants(evict_and_cast_variants(A3, product), product)), product,
          W3.device)),
      product);
  // W's new tile staged in W's spent ring slot: a tile of shared memory less, so where
  // that bounds the programs per multiprocessor, one more of them.
  if (W3.device.is_cuda()) q.finalist_variants.push_back({{"STORE_IN_RING", 1}});
  q.extent_m = out;
  q.extent_k = in;
  q.split_batch = G;
  q.split_programs = parallelism(W3.device);
  q.kernels = [&](const Config& c) {
    return merge_calls(plan_merge(W3, A3, B3, true, parallelism(W3.device), c), W3, A3, B3, s);
  };
  q.run = [&](const Config& c) { run_merge(W3, A3, B3, s, stream, c); };
  // Each timed run adds s*B@A to W once more: W's bytes are saved and put back.
  std::unique_ptr<SavedBytes> saved;
  q.restore = [&] {
    if (!saved) saved = std::make_unique<SavedBytes>(W3, W3, stream);
    saved->restore();
  };
  q.stream = stream;
  return tuned_config(q);
}

// One launch over W3 [G, out, in] += s * B3 [G, out, r] @ A3 [G, r, in], with the
// caller's Config or else the autotuner's (remembered per call signature).
void launch_merge(const char* op, const TensorView& W3, const TensorView& A3, const TensorView& B3, double s,
                  void* stream, const Config& config) {
  expect_meta(op, config,
              {{"EVICT", 0, 2}, {"CAST_A", 0, 1}, {"WALK_ROWS", 0, 1}, kStream, kOneTile, kWarpsN, kL2Prefetch,
               kWgmma, kWgmmaSs, kColsFirst, kTf32, kStoreInRing});
  if (checks_only()) return;
  if (has_config(config))
    return run_merge(W3, A3, B3, s, stream, config);
  static PlanMemo<Config> tuned;
  CallKey key;
  key.add(W3).add(A3).add(B3.dtype).add(W3.device);
  run_merge(W3, A3, B3, s, stream, *tuned.get(key, [&] { return tuned_merge_config(W3, A3, B3, s, stream); }));
}

void check_common(const char* op, const TensorView& W, const TensorView& A, const TensorView& B,
                  const char* wn, const char* an, const char* bn) {
  expect_dtype(op, wn, W, float_dtypes());
  expect_dtype(op, an, A, float_dtypes());
  expect_dtype(op, bn, B, float_dtypes());
  expect_device(op, {{wn, &W}, {an, &A}, {bn, &B}});
  for (const auto& [n, t] : {std::pair{wn, &W}, {an, &A}, {bn, &B}}) {
    expect_addressable(op, n, *t);
    expect_int32_dims(op, n, *t);
  }
  expect_no_self_overlap(op, wn, W);
  expect_disjoint(op, wn, W, an, A);
  expect_disjoint(op, wn, W, bn, B);
}

void merge_torch(const char* op, const TensorView& W, const TensorView& A, const TensorView& B,
                 double s, void* stream, const Config& config) {
  expect_finite_scale(op, s);
  expect_shape(op, "W", W, {-1, -1});
  const int64_t out = W.shape[0], in = W.shape[1];
  expect_shape(op, "A", A, {-1, in});
  const int64_t r = A.shape[0];
  expect_shape(op, "B", B, {out, r});
  check_common(op, W, A, B, "W", "A", "B");
  if (r > 256)
    throw InvalidArgument(std::string(op) + ": rank " + std::to_string(r) +
                          " is above the supported 256");
  if (out == 0 || in == 0 || r == 0) return;
  launch_merge(op, as_batch_of_one(W), as_batch_of_one(A), as_batch_of_one(B), s, stream, config);
}

std::string dims_text(const TensorView& t, int from, int to) {
  std::string s = "[";
  for (int d = from; d < to; ++d) s += (d > from ? ", " : "") + std::to_string(t.shape[size_t(d)]);
  return s + "]";
}

// kernel [in..., out...] +/-= s * lora_a [in..., r] @ lora_b [r, out...], as
// W'[g] += s * B'[g] @ A'[g] with W' = kernel, B' = lora_a, A' = lora_b.
void merge_flax(const char* op, const TensorView& kernel, const TensorView& lora_a,
                const TensorView& lora_b, double s, void* stream, const Config& config) {
  expect_finite_scale(op, s);
  // The ranks decide which dims are read below: valid ones first.
  for (const auto& [n, t] :
       {std::pair{"kernel", &kernel}, {"lora_a", &lora_a}, {"lora_b", &lora_b}})
    expect_valid_view(op, n, *t);
  if (lora_a.rank < 2)
    throw InvalidArgument(std::string(op) +
                          ": lora_a must have shape [in..., r] (rank >= 2), got " +
                          shape_str(lora_a));
  if (lora_b.rank < 2)
    throw InvalidArgument(std::string(op) +
                          ": lora_b must have shape [r, out...] (rank >= 2), got " +
                          shape_str(lora_b));
  const int n_in = lora_a.rank - 1, n_out = lora_b.rank - 1;
  const int64_t r = lora_a.shape[size_t(n_in)];
  if (kernel.rank != n_in + n_out)
    throw InvalidArgument(std::string(op) + ": kernel must have shape [in..., out...] = " +
                          dims_text(lora_a, 0, n_in) + " + " + dims_text(lora_b, 1, lora_b.rank) +
                          " (lora_a's in dims, lora_b's out dims), got " + shape_str(kernel));
  std::vector<int64_t> want_a, want_b = {r};
  for (int d = 0; d < n_in; ++d) want_a.push_back(kernel.shape[size_t(d)]);
  want_a.push_back(-1);
  for (int d = 0; d < n_out; ++d) want_b.push_back(kernel.shape[size_t(n_in + d)]);
  expect_shape(op, "lora_a", lora_a, want_a);
  expect_shape(op, "lora_b", lora_b, want_b);
  check_common(op, kernel, lora_a, lora_b, "kernel", "lora_a", "lora_b");
  if (r > 256)
    throw InvalidArgument(std::string(op) + ": rank " + std::to_string(r) +
                          " is above the supported 256");
  if (kernel.numel() == 0 || r == 0) return;

  // Flatten the in dims (kernel and lora_a alike) and the out dims (kernel and lora_b alike).
  std::vector<int64_t> in_sizes, out_sizes;
  std::vector<std::vector<int64_t>> in_strides(2), out_strides(2);
  for (int d = 0; d < n_in; ++d) {
    in_sizes.push_back(kernel.shape[size_t(d)]);
    in_strides[0].push_back(kernel.strides[size_t(d)]);
    in_strides[1].push_back(lora_a.strides[size_t(d)]);
  }
  for (int d = 0; d < n_out; ++d) {
    out_sizes.push_back(kernel.shape[size_t(n_in + d)]);
    out_strides[0].push_back(kernel.strides[size_t(n_in + d)]);
    out_strides[1].push_back(lora_b.strides[size_t(1 + d)]);
  }
  // Flattened, each stays within the kernels' 32-bit sizes (dims that would pass it stay apart).
  const MergedDims rows = merge_dims(in_sizes, in_strides, INT32_MAX),
                   cols = merge_dims(out_sizes, out_strides, INT32_MAX);
  // Dims that did not flatten become a batch: strides in kernel, lora_b (A'), lora_a (B').
  struct BatchDim {
    int64_t size, w, a, b;
  };
  std::vector<BatchDim> batch;
  for (size_t d = 0; d + 1 < rows.sizes.size(); ++d)
    batch.push_back({rows.sizes[d], rows.strides[0][d], 0, rows.strides[1][d]});
  for (size_t d = 0; d + 1 < cols.sizes.size(); ++d)
    batch.push_back({cols.sizes[d], cols.strides[0][d], cols.strides[1][d], 0});
  const int64_t out = rows.sizes.back(), in = cols.sizes.back();
  const int64_t w_row = rows.strides[0].back(), w_col = cols.strides[0].back();
  const int64_t b_row = rows.strides[1].back(), a_col = cols.strides[1].back();
  const int64_t a_rank = lora_b.strides[0], b_rank = lora_a.strides[size_t(n_in)];
  // The innermost batch dim on the launch's grid axis (up to 65535 there), the others looped.
  BatchDim last{1, 0, 0, 0};
  if (!batch.empty() && batch.back().size <= 65535) {
    last = batch.back();
    batch.pop_back();
  }
  // Any further batch dims: one launch each (offsets in elements).
  std::function<void(size_t, int64_t, int64_t, int64_t)> each = [&](size_t d, int64_t ow,
                                                                    int64_t oa, int64_t ob) {
    if (d == batch.size()) {
      const auto at = [](const TensorView& t, int64_t off) {
        TensorView v = t;
        v.data = static_cast<char*>(t.data) + off * dtype_size_bytes(t.dtype);
        return v;
      };
      launch_merge(op, restride(at(kernel, ow), {last.size, out, in}, {last.w, w_row, w_col}),
                   restride(at(lora_b, oa), {last.size, r, in}, {last.a, a_rank, a_col}),
                   restride(at(lora_a, ob), {last.size, out, r}, {last.b, b_row, b_rank}), s,
                   stream, config);
      return;
    }
    for (int64_t i = 0; i < batch[d].size; ++i)
      each(d + 1, ow + i * batch[d].w, oa + i * batch[d].a, ob + i * batch[d].b);
  };
  each(0, 0, 0, 0);
}

// For kerf-cache warm.
const bool merge_registered = [] {
  autotune::TunableOp op;
  op.name = "lora_merge";
  op.shape_names = {"out", "in", "r"};
  op.operands = [](const std::vector<int64_t>& s, DType t) {
    return std::vector<autotune::Operand>{{{s[0], s[1]}, t}, {{s[2], s[1]}, t}, {{s[0], s[2]}, t}};
  };
  op.call = [](const std::vector<TensorView>& v, void* stream, const std::string&) {
    lora_merge(v[0], v[1], v[2], 1.0, stream);
  };
  op.kernels = [](const std::vector<TensorView>& v, const autotune::Config& c, int sm_count) {
    const TensorView W3 = as_batch_of_one(v[0]), A3 = as_batch_of_one(v[1]), B3 = as_batch_of_one(v[2]);
    return merge_calls(plan_merge(W3, A3, B3, true, sm_count, config_from(c, "BLOCK_M", "BLOCK_K")), W3, A3, B3, 1.0);
  };
  op.gpu_candidates = merge_gpu_candidates;
  autotune::register_op(std::move(op));
  return true;
}();

}  // namespace

void lora_merge(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                void* stream, const Config& config) {
  merge_torch("lora_merge", W, A, B, s, stream, config);
}

void lora_unmerge(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                  void* stream, const Config& config) {
  merge_torch("lora_unmerge", W, A, B, -s, stream, config);
}

void lora_merge_flax(const TensorView& kernel, const TensorView& lora_a, const TensorView& lora_b,
                     double s, void* stream, const Config& config) {
  merge_flax("lora_merge_flax", kernel, lora_a, lora_b, s, stream, config);
}

void lora_unmerge_flax(const TensorView& kernel, const TensorView& lora_a, const TensorView& lora_b,
                       double s, void* stream, const Config& config) {
  merge_flax("lora_unmerge_flax", kernel, lora_a, lora_b, -s, stream, config);
}

}  // namespace kerf::ops
