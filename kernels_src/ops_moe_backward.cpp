// ops::moe_lora_materialize_backward (one pass over dW_eff) and the views of
// PEFT's flat expert adapters the MoE ops take.
#include <algorithm>
#include <optional>
#include <string>

#include "kerf/jit/launch.h"
#include "kerf/kernels/kernels.h"
#include "kerf/ops/ops.h"
#include "ops_accumulate.h"
#include "ops_checks.h"
#include "ops_common.h"
#include "ops_layout.h"
#include "ops_tune.h"

namespace kerf::ops {

using namespace detail;

namespace {

// One launch of the backward: the row-owning kernel (dB rows in registers, dA
// added atomically) or, with Config.meta BY_COLUMNS, the column-owning one (dA
// columns in registers, dB added atomically).
struct MoeBackwardPlan {
  const dsl::Kernel* kernel = nullptr;
  dsl::MetaMap meta;
  Grid grid;
  int64_t split = 1;
  bool by_columns = false;
  bool da_atomic = true, db_atomic = false;  // which gradient the kernel adds atomically
  // Which gradient is added to in an fp32 workspace and flushed into it after the kernel
  // (one added atomically that is not f32 itself); the other is the kernel's output directly.
  bool flush_da = false, flush_db = false;
  // PACK: the dtypes the strided adapters are copied into first (none: read in place).
  std::optional<DType> pack_a, pack_b;
};

// The GPU's own config for a 16-bit product up to rank 64 (a call with no tiles and no
// kernel named in its Config: untuned, or a first call inside a graph capture): the
// column-owning kernel's 64x256 on 8 warps and 3 stages, dB's per-step shares staged
// (STAGED_ADDS) and warpgroup dots (WGMMA; targets other than sm_90a ignore it). On an
// H100 (r=64, 64x2816x2048) the row-owning 128x64 it replaced took 657.0 / 658.4 us with
// f32 / bf16 gradients, this 377.4 / 384.7. Larger ranks and fp32 or TF32 products keep
// the row-owning kernel's tiles, which fit an H100's shared memory at every rank.
//
// At ranks 33 to 64 with adapters in the product's 16-bit dtype, where 512-column blocks
// fill their waves of programs (`programs` at a time) to at least 90%, with at most an
// eighth of the last block past K, and K and r multiples of 8 (rows of 16-byte multiples:
// every tile then goes through the copy ring and the tile fits an H100's shared memory;
// with other row lengths, or adapters converted, it takes up to 355328 bytes): 64x512 on
// two stages, dW's tile read by both dots from shared memory (WGMMA_SS), rows whole
// (split_k 1, so dA is stored once per program). On an H100
// (64x2816x2048: 256 blocks, two waves of 132) 342.6-344.0 / 354.6-354.7 us with f32 /
// bf16 gradients against 64x256's 376.7-378.0 / 384.6, and 376.7 against 406.8-407.2 in
// PEFT's layout; split in two (as split_for would) it took 362.1 / 409.6. fp32 adapters'
// tiles do not fit beside it.
Config own_config(const Config& config, Product dot, DType a, DType b, int64_t r, const TensorView& dW,
                  int64_t programs, bool gpu) {
  const int64_t r_pad = rank_pad(r);
  if (!gpu || config.block_m || config.block_k || config.meta.count("BY_COLUMNS") || !is_half(dot) || r_pad > 64)
    return config;
  const int64_t E = dW.shape[0], K = dW.shape[2], blocks = cdiv(K, 512) * E;
  const int64_t waves = cdiv(blocks, std::max<int64_t>(programs, 1));
  const bool wide = r_pad == 64 && r % 8 == 0 && K % 8 == 0 && a == dot.dtype && b == dot.dtype &&
                    config.num_stages <= 2 && 8 * cdiv(K, 512) * 512 <= 9 * K && blocks >= programs &&
                    10 * blocks >= 9 * waves * programs && wgmma_target(dW.device);
  if (!wide) return with_own_tile(config, 64, 256, 8, 3, {{"BY_COLUMNS", 1}, {"STAGED_ADDS", 1}, {"WGMMA", 1}});
  Config c =
      with_own_tile(config, 64, 512, 8, 2, {{"BY_COLUMNS", 1}, {"STAGED_ADDS", 1}, {"WGMMA", 1}, {"WGMMA_SS", 1}});
  if (!c.split_k) c.split_k = 1;
  return c;
}

// The column-owning kernel's default split: programs sharing each column block's rows
// (BLOCK_N x BLOCK_K tiles, `programs` at a time), as split_for gives it.
int64_t column_split(const TensorView& dW, int64_t bn, int64_t bk, int64_t programs) {
  return split_for(cdiv(dW.shape[2], bk) * dW.shape[0], programs, cdiv(dW.shape[1], bn));
}

MoeBackwardPlan plan_launch(const TensorView& dW, DType a, DType b, int64_t r, bool gpu, int64_t programs,
                            const Config& given) {
  const int64_t E = dW.shape[0], N = dW.shape[1], K = dW.shape[2];
  const Product dot = product_dtype(dW.dtype, a, b);
  const int64_t r_pad = rank_pad(r);
  const Config config = own_config(given, dot, a, b, r, dW, programs, gpu);
  const int64_t rotate = meta_or(config, "ROTATE", 0);
  // CLUSTER: programs of neighbouring blocks sum each step's atomics on chip first. Not
  // among the tuner's candidates: on an H100 (r=64, 64x2816x2048, 256x64 WGMMA tiles) it
  // was slower than the plain atomics (516.7 us in clusters of 2 against 458.8 us).
  const int64_t cluster = meta_or(config, "CLUSTER", 1);
  const auto clustered = [cluster](MoeBackwardPlan& p, int64_t blocks) {
    if (cluster > 1) p.meta["cluster_size"] = cluster;
    return uint32_t(cdiv(blocks, cluster) * cluster);
  };
  if (meta_or(config, "BY_COLUMNS", 0)) {
    // Wide column blocks: dB's atomics per dW element are R_PAD / BLOCK_K.
    const int64_t bn = config.block_m ? config.block_m : (gpu ? 32 : 16);
    const int64_t bk = config.block_k ? config.block_k : (gpu ? 256 : 32);
    MoeBackwardPlan p;
    p.by_columns = true;
    p.kernel = &kernels::moe_lora_backward_by_columns();
    p.split = config.split_k ? config.split_k : column_split(dW, bn, bk, programs);
    p.da_atomic = p.split > 1;
    p.db_atomic = true;
    p.meta = {{"BLOCK_N", bn},
              {"BLOCK_K", bk},
              {"R_PAD", r_pad},
              {"DA_ATOMIC", p.da_atomic ? 1 : 0},
              {"ROTATE", rotate},
              {"num_warps", config.num_warps ? config.num_warps : (gpu && bk >= 512 ? 16 : gpu ? 8 : 4)},
              {"num_stages", config.num_stages ? config.num_stages : (gpu ? 3 : 1)}};
    set_product_meta(p.meta, dot, config);
    add_codegen_hints(config, p.meta);
    if (gpu) p.meta["WAIT_PRIOR"] = 1;  // overlaps the zero-fill launched before it
    p.grid = Grid{clustered(p, cdiv(K, bk)), uint32_t(p.split), uint32_t(E)};
    return p;
  }
  // Tall row blocks: dA's atomics per dW element are R_PAD / BLOCK_N.
  const int64_t bn =
      config.block_m ? config.block_m : (gpu ? std::clamp<int64_t>(8192 / r_pad, 32, 128) : 16);
  const int64_t bk =
      config.block_k ? config.block_k : (gpu ? rank_narrowed(64, r_pad, rank_bytes(dot, a, b), 1024) : 64);
  MoeBackwardPlan p;
  p.kernel = &kernels::moe_lora_backward();
  p.split = config.split_k;
  if (p.split == 0) p.split = split_for(cdiv(N, bn) * E, programs, cdiv(K, bk));
  p.db_atomic = p.split > 1;
  p.meta = {{"BLOCK_N", bn},
            {"BLOCK_K", bk},
            {"R_PAD", r_pad},
            {"DB_ATOMIC", p.split > 1 ? 1 : 0},
            {"ROTATE", rotate},
            {"num_warps", config.num_warps ? config.num_warps : (gpu && bn >= 128 ? 8 : 4)},
            {"num_stages", config.num_stages ? config.num_stages : (gpu ? 3 : 1)}};
  set_product_meta(p.meta, dot, config);
  add_codegen_hints(config, p.meta);
  if (gpu) p.meta["WAIT_PRIOR"] = 1;
  p.grid = Grid{clustered(p, cdiv(N, bn)), uint32_t(p.split), uint32_t(E)};
  return p;
}

// PACK (ops_common.h): the backward's copies are in the product's dtype where that is half
// and the adapter f32 (rounded where the kernel would round it: the same answer), and its
// strided gradients are summed in the contiguous fp32 workspace and flushed into them
// (transposed, as the copies). Else the kernel gathers such an adapter one element per
// 32-byte sector at every step: on an H100 (r=64, 64x2816x2048, bf16 adapters and
// gradients in PEFT's layout) 1038.7 us against 414.7 us packed.

// The dtype adapter t is copied into for a product in `dot` (PACK), or none: read in place.
std::optional<DType> packed_dtype(const TensorView& t, const Product& dot, bool pack) {
  if (!pack || !strided_last(t)) return std::nullopt;
  return t.dtype == DType::f32 && is_half(dot) ? DType(dot) : t.dtype;
}

// The launch for gradients dA and dB: on GPUs, a kernel followed by a flush of an
// fp32 accumulator lets the flush's launch start before its own end (RELEASE_END).
// With Config.meta DB_WORKSPACE an f32 dB the kernel adds to is summed in the contiguous
// fp32 workspace and flushed into it too, as a bf16 one is: for a dB whose rank columns are
// not adjacent, whose atomics cannot go out as whole-line vectors (PACK, the default on
// GPUs, sends every gradient with a strided last dim there anyway).
MoeBackwardPlan plan_moe_backward(const TensorView& dW, const TensorView& A, const TensorView& B, bool gpu,
                                  int64_t programs, const Config& config, const TensorView& dA, const TensorView& dB) {
  const bool pack = packs(config, gpu);
  const Product dot = product_dtype(dW.dtype, A.dtype, B.dtype);
  const std::optional<DType> pack_a = packed_dtype(A, dot, pack), pack_b = packed_dtype(B, dot, pack);
  MoeBackwardPlan p =
      plan_launch(dW, pack_a.value_or(A.dtype), pack_b.value_or(B.dtype), A.shape[1], gpu, programs, config);
  p.pack_a = pack_a;
  p.pack_b = pack_b;
  p.flush_da = (p.da_atomic && dA.dtype != DType::f32) || (pack && strided_last(dA));
  p.flush_db = (p.db_atomic && (dB.dtype != DType::f32 || meta_or(config, "DB_WORKSPACE", 0) != 0)) ||
               (pack && strided_last(dB));
  if (gpu && (p.flush_da || p.flush_db)) p.meta["RELEASE_END"] = 1;
  return p;
}

const std::vector<OperandDims>& backward_operands() {
  static const std::vector<OperandDims> o = {{"dW_eff", {"E", "N", "K"}},
                                             {"A", {"E", "r", "K"}},
                                             {"B", {"E", "N", "r"}},
                                             {"dA", {"E", "r", "K"}},
                                             {"dB", {"E", "N", "r"}}};
  return o;
}

}  // namespace

namespace detail {

// The launches of one call with `config`: zero or carve the fp32 accumulators,
// the kernel, and the flushes into bf16/f16 gradients.
void run_moe_backward(const TensorView& dW, const TensorView& A, const TensorView& B, double s,
                      const TensorView& dA, const TensorView& dB, const LaunchOptions& options,
                      const Config& config, bool db_is_zero) {
  const int64_t E = dW.shape[0], N = dW.shape[1], K = dW.shape[2], r = A.shape[1];
  const bool gpu = dW.device.is_cuda();
  const MoeBackwardPlan p = plan_moe_backward(dW, A, B, gpu, parallelism(dW.device), config, dA, dB);
  // A gradient the kernel adds to atomically is accumulated in fp32: in the
  // gradient itself when it is f32 (zeroed first), else in a zero workspace
  // that is then flushed into it. One the kernel stores is written directly.
  const bool da_direct = !p.flush_da, db_direct = !p.flush_db;
  size_t ws_bytes = 0;
  if (!da_direct) ws_bytes += carved_bytes(E, r, K);
  if (!db_direct) ws_bytes += carved_bytes(E, N, r);
  const WorkspaceLease ws = ws_bytes ? lease_workspace(dW.device, options.stream, ws_bytes) : WorkspaceLease{};
  char* cursor = ws.data;
  const TensorView da_acc = da_direct ? dA : carve_f32(&cursor, E, r, K, dW.device);
  const TensorView db_acc = db_direct ? dB : carve_f32(&cursor, E, N, r, dW.device);
  // The workspace's lock before the copies' scratch (ops_common.h).
  const CopiedAdapters in = copied_adapters(A, p.pack_a, B, p.pack_b, &options);  // PACK's copies, queued
  const bool filled = zero_fills(dA, p.da_atomic && da_direct, dB,
                                 p.db_atomic && db_direct && !(db_is_zero && dB.dtype == DType::f32), options, gpu);
  LaunchOptions main = options;
  main.overlap_prior = filled;  // taken where the kernel waits for the fill (WAIT_PRIOR, GPUs)
  launch(*p.kernel, {dW, in.A, in.B, Scalar(s), da_acc, db_acc}, p.grid, p.meta, main);
  // A flush right after the kernel is launched while its last programs run (RELEASE_END), and
  // waits for the whole grid before it reads.
  if (p.flush_da) flush_accumulator(da_acc, dA, options, true);
  if (p.flush_db) flush_accumulator(db_acc, dB, options, !p.flush_da);
}

// The kernel a call with `config` launches; dA/dB stand for the f32 accumulators when
// they are not f32 themselves (`stand_in`: aligned like workspace, never dereferenced).
autotune::KernelCall moe_backward_kernel(const TensorView& dW, const TensorView& A, const TensorView& B, double s,
                                         const TensorView& dA, const TensorView& dB, int64_t programs,
                                         const Config& config) {
  const int64_t E = dW.shape[0], N = dW.shape[1], K = dW.shape[2], r = A.shape[1];
  const MoeBackwardPlan p = plan_moe_backward(dW, A, B, true, programs, config, dA, dB);
  void* const stand_in = unused_memory();
  const TensorView da_acc =
      p.flush_da ? TensorView::contiguous(stand_in, DType::f32, {E, r, K}, dW.device) : dA;
  const TensorView db_acc =
      p.flush_db ? TensorView::contiguous(stand_in, DType::f32, {E, N, r}, dW.device) : dB;
  const CopiedAdapters in = copied_adapters(A, p.pack_a, B, p.pack_b, nullptr);  // views only
  return {p.kernel, {dW, in.A, in.B, Scalar(s), da_acc, db_acc}, p.meta};
}

}  // namespace detail

namespace {

// GPU: the row-owning kernel's tiles, and the column-owning kernel's (its
// column blocks 256 wide with 8 warps or 512 with 16: the dA accumulator is
// 64 registers per thread at r = 64), each with and without rotated steps.
std::vector<autotune::Config> moe_backward_gpu_candidates() {
  std::vector<autotune::Config> c = autotune::product({{"BLOCK_N", {64, 128, 256}},
                                                       {"BLOCK_K", {32, 64}},
                                                       {"num_warps", {4, 8}},
                                                       {"num_stages", {2, 3}},
                                                       {"ROTATE", {0, 1}}});
  for (const auto& [bk, warps] : {std::pair<int64_t, int64_t>{256, 8}, {512, 16}})
    for (autotune::Config& by_columns : autotune::product({{"BLOCK_N", {16, 32, 64}},
                                                           {"BLOCK_K", {bk}},
                                                           {"num_warps", {warps}},
                                                           {"num_stages", {2, 3}},
                                                           {"ROTATE", {0, 1}},
                                                           {"BY_COLUMNS", {1}}}))
      c.push_back(std::move(by_columns));
  return c;
}

// The tiles that ran best with WGMMA on an H100 (bf16, r=64, 64x2816x2048):
// the column-owning kernel's 64x256 on two warpgroups with three stages (440.3
// us with bf16 gradients, against 465.5 us for the tuner's choice without it),
// and the row-owning kernel's 256x64 on two (458.8 us with f32 gradients),
// with and without rotated steps, and each with its per-step atomics staged
// through shared memory (STAGED_ADDS: 64x256 took 384.0 / 393.8 us with f32 /
// bf16 gradients, against 428.6 / 440.3 us adding from the accumulator). First-
// round candidates of their own: the finalists' WGMMA variant alone missed the first.
std::vector<autotune::Config> moe_backward_wgmma_tiles(const TensorView& dW, int64_t programs) {
  std::vector<autotune::Config> c = autotune::product({{"BLOCK_N", {64}},
                                                       {"BLOCK_K", {256}},
                                                       {"num_warps", {8}},
                                                       {"num_stages", {3}},
                                                       {"ROTATE", {0, 1}},
                                                       {"STAGED_ADDS", {0, 1}},
                                                       {"BY_COLUMNS", {1}}});
  // 512 columns on two stages with dW's tile read by both dots from shared memory
  // (WGMMA_SS; from registers it spills): half the per-step dB bytes per dW byte. On an
  // H100 (64x2816x2048) 362.1-368.8 us against 376.2-384.5 for 64x256 with f32 gradients,
  // 409.6-415.9 against 384.6-392.3 with bf16 ones, both split in two; with rows whole
  // (below) 342.6-344.0 and 354.6-354.7.
  for (autotune::Config& wide : autotune::product({{"BLOCK_N", {64}},
                                                   {"BLOCK_K", {512}},
                                                   {"num_warps", {8}},
                                                   {"num_stages", {2}},
                                                   {"ROTATE", {0, 1}},
                                                   {"STAGED_ADDS", {1}},
                                                   {"WGMMA_SS", {1}},
                                                   {"BY_COLUMNS", {1}}}))
    c.push_back(std::move(wide));
  for (autotune::Config& rows : autotune::product({{"BLOCK_N", {256}},
                                                   {"BLOCK_K", {64}},
                                                   {"num_warps", {8}},
                                                   {"num_stages", {3}},
                                                   {"ROTATE", {0, 1}},
                                                   {"STAGED_ADDS", {0, 1}}}))
    c.push_back(std::move(rows));
  // Each column tile that split_for would split (few column blocks: E=64, K=2048 gives
  // the 512-column tile 256 blocks and split 2) also with rows whole (split_k 1): dA is
  // then stored once per program instead of added, with bf16 gradients through an fp32
  // workspace, its fill and its flush.
  for (size_t i = 0, n = c.size(); i < n; ++i) {
    if (!autotune::value_or_zero(c[i], "BY_COLUMNS")) continue;
    const int64_t bn = autotune::value_or_zero(c[i], "BLOCK_N"), bk = autotune::value_or_zero(c[i], "BLOCK_K");
    if (column_split(dW, bn, bk, programs) == 1) continue;
    autotune::Config whole = c[i];
    whole["split_k"] = 1;
    c.push_back(std::move(whole));
  }
  return c;
}

Config tuned_moe_backward_config(const TensorView& dW, const TensorView& A, const TensorView& B, double s,
                                 const TensorView& dA, const TensorView& dB, void* stream) {
  const int64_t E = dW.shape[0], N = dW.shape[1], K = dW.shape[2], r = A.shape[1];
  TuneRequest q;
  q.problem = {"moe_lora_materialize_backward",
               {next_pow2(E), next_pow2(N), next_pow2(K), rank_pad(r)},
               {dW.dtype, A.dtype, B.dtype, dA.dtype, dB.dtype},
               "",
               dW.device};
  add_memory_order(q.problem.shape_bucket, dW);
  add_adapter_order(q.problem.shape_bucket, A, B);
  add_adapter_order(q.problem.shape_bucket, dA, dB, true);
  q.block_m_name = "BLOCK_N";
  q.block_k_name = "BLOCK_K";
  const Product product = product_dtype(dW.dtype, A.dtype, B.dtype);
  q.gpu_candidates = with_wgmma_tiles(moe_backward_gpu_candidates(),
                                      moe_backward_wgmma_tiles(dW, parallelism(dW.device)), product, dW.device);
  q.finalist_variants = with_wgmma_variant(with_l2_prefetch_variants({}), product, dW.device);
  // Operands strided along their last dim (PEFT's layouts): also without the copies and
  // workspace PACK puts them through on GPUs.
  if (dW.device.is_cuda() && (strided_last(A) || strided_last(B) || strided_last(dA) || strided_last(dB)))
    q.finalist_variants.push_back({{"PACK", 0}});
  q.extent_m = N;
  q.extent_k = K;
  q.kernels = [&](const Config& c) {
    return std::vector<autotune::KernelCall>{moe_backward_kernel(dW, A, B, s, dA, dB, parallelism(dW.device), c)};
  };
  LaunchOptions options;
  options.stream = stream;
  q.run = [&](const Config& c) { run_moe_backward(dW, A, B, s, dA, dB, options, c); };
  q.stream = stream;
  return tuned_config(q);
}

// For kerf-cache warm (gradients in the dtype of dW_eff).
const bool moe_backward_registered = [] {
  autotune::TunableOp op;
  op.name = "moe_lora_materialize_backward";
  op.shape_names = {"E", "N", "K", "r"};
  op.takes_layout = true;
  op.operands = [](const std::vector<int64_t>& s, DType t) {
    return std::vector<autotune::Operand>{{{s[0], s[1], s[2]}, t}, {{s[0], s[3], s[2]}, t},
                                          {{s[0], s[1], s[3]}, t}, {{s[0], s[3], s[2]}, t},
                                          {{s[0], s[1], s[3]}, t}};
  };
  op.call = [](const std::vector<TensorView>& v, void* stream, const std::string& layout) {
    moe_lora_materialize_backward(v[0], v[1], v[2], 1.0, v[3], v[4], stream, {}, layout_at_origin(layout));
  };
  op.kernels = [](const std::vector<TensorView>& v, const autotune::Config& c, int sm_count) {
    return std::vector<autotune::KernelCall>{
        moe_backward_kernel(v[0], v[1], v[2], 1.0, v[3], v[4], sm_count, config_from(c, "BLOCK_N", "BLOCK_K"))};
  };
  op.gpu_candidates = moe_backward_gpu_candidates;
  op.block_m_name = "BLOCK_N";
  autotune::register_op(std::move(op));
  return true;
}();

}  // namespace

void moe_lora_materialize_backward(const TensorView& dW, const TensorView& A, const TensorView& B,
                                   double s, const TensorView& dA, const TensorView& dB,
                                   void* stream, const Config& config, const Layout& layout) {
  const char* op = "moe_lora_materialize_backward";
  expect_finite_scale(op, s);
  expect_meta(op, config,
              {{"ROTATE", 0, 1}, {"BY_COLUMNS", 0, 1}, {"DB_WORKSPACE", 0, 1}, {"PACK", 0, 1}, kL2Prefetch, kWgmma, kWgmmaSs, kCluster,
               kStagedAdds, kTf32});
  const LayoutSplits splits = check_layout(op, layout, backward_operands());
  expect_unsplit(op, layout, splits, "r", "each expert's product B[e] @ A[e] needs every rank");
  expect_shape(op, "dW_eff", dW, {-1, -1, -1});
  const int64_t E = dW.shape[0], N = dW.shape[1], K = dW.shape[2];
  expect_shape(op, "A", A, {E, -1, K});
  const int64_t r = A.shape[1];
  expect_shape(op, "B", B, {E, N, r});
  expect_shape(op, "dA", dA, {E, r, K});
  expect_shape(op, "dB", dB, {E, N, r});
  const std::vector<std::pair<const char*, const TensorView*>> all = {
      {"dW_eff", &dW}, {"A", &A}, {"B", &B}, {"dA", &dA}, {"dB", &dB}};
  for (const auto& [n, t] : all) {
    expect_dtype(op, n, *t, float_dtypes());
    expect_addressable(op, n, *t);
    expect_int32_dims(op, n, *t);
  }
  expect_device(op, all);
  if (r > 256)
    throw InvalidArgument(std::string(op) + ": rank " + std::to_string(r) +
                          " is above the supported 256");
  if (E > 65535)
    throw InvalidArgument(std::string(op) + ": at most 65535 experts per call, got " +
                          std::to_string(E));
  for (const auto& [n, t] : {std::pair{"dA", &dA}, {"dB", &dB}}) {
    expect_no_self_overlap(op, n, *t);
    for (const auto& [in_name, in] : {std::pair{"dW_eff", &dW}, {"A", &A}, {"B", &B}})
      expect_disjoint(op, n, *t, in_name, *in);
  }
  expect_disjoint(op, "dB", dB, "dA", dA);
  if (E == 0 || r == 0 || checks_only()) return;

  const std::string text = layout.canonical();
  LaunchOptions options;
  options.stream = stream;
  options.layout = text;
  if (N == 0 || K == 0) {  // sums over nothing
    fill_pair_3d(dA, dB, 0.0, options);
    return;
  }
  static PlanMemo<Config> tuned;
  CallKey key;
  key.add(dW).add(A).add(B).add(dA).add(dB).add(dW.device);  // their memory orders too
  const Config cfg =
      has_config(config) ? config : *tuned.get(key, [&] { return tuned_moe_backward_config(dW, A, B, s, dA, dB, stream); });
  run_moe_backward(dW, A, B, s, dA, dB, options, cfg);
}

MoeLoraViews peft_moe_lora_views(const TensorView& W, const TensorView& lora_A,
                                 const TensorView& lora_B, bool is_transposed) {
  const char* op = "peft_moe_lora_views";
  expect_shape(op, "W", W, {-1, -1, -1});
  const int64_t E = W.shape[0], d1 = W.shape[1], d2 = W.shape[2];
  const int64_t in = is_transposed ? d1 : d2, out = is_transposed ? d2 : d1;
  const std::string which = is_transposed
                                ? " (is_transposed: W[e] is [in=d1, out=d2], lora_A [r*E, d1], "
                                  "lora_B [d2, r*E])"
                                : " (W[e] is [out=d1, in=d2]: lora_A [r*E, d2], lora_B [d1, r*E])";
  if (lora_A.rank != 2 || lora_A.shape[1] != in)
    throw InvalidArgument(std::string(op) + ": lora_A must have shape [r*E, " + std::to_string(in) +
                          "]" + which + ", got " + shape_str(lora_A));
  const int64_t rE = lora_A.shape[0];
  if ((E == 0 && rE != 0) || (E > 0 && rE % E != 0))
    throw InvalidArgument(std::string(op) + ": lora_A has " + std::to_string(rE) +
                          " rows, not a multiple of the " + std::to_string(E) +
                          " experts (r*E rows)" + which);
  const int64_t r = E ? rE / E : 0;
  expect_shape(op, "lora_B", lora_B, {out, rE});
  const int64_t a0 = lora_A.strides[0], a1 = lora_A.strides[1], b0 = lora_B.strides[0],
                b1 = lora_B.strides[1];
  MoeLoraViews v;
  if (!is_transposed) {
    // A_e[k, i] = lora_A[e*r + k, i];  B_e[o, k] = lora_B[o, k*E + e]
    v.A = restride(lora_A, {E, r, in}, {r * a0, a0, a1});
    v.B = restride(lora_B, {E, out, r}, {b1, b0, E * b1});
  } else {
    // W_eff[e] = W[e] + s * A_e^T @ B_e^T: B'[e][i, k] = A_e[k, i], A'[e][k, o] = B_e[o, k]
    v.B = restride(lora_A, {E, in, r}, {r * a0, a1, a0});
    v.A = restride(lora_B, {E, r, out}, {b1, E * b1, b0});
  }
  return v;
}

}  // namespace kerf::ops
