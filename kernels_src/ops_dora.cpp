// ops::dora_norm: argument checks, variant and configuration, launches.
#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <mutex>

#include "kerf/jit/autotune.h"
#include "kerf/jit/launch.h"
#include "kerf/kernels/kernels.h"
#include "kerf/ops/ops.h"
#include "ops_checks.h"
#include "ops_common.h"
#include "ops_layout.h"
#include "ops_tune.h"

namespace kerf::ops {

using namespace detail;

namespace {

// One launch of the DoRA norm: the variant, its meta-parameters and grid.
struct DoraPlan {
  const dsl::Kernel* kernel = nullptr;
  dsl::MetaMap meta;
  Grid grid;
  int64_t split = 1;
  int64_t blocks_m = 0;
  int64_t ws_floats = 0;  // workspace: sumsq floats (then blocks_m ticket ints) when split > 1
  DType cast_a = DType::f32;  // CAST_A: what an f32 A is rounded to first (f32: nothing)
  mutable LaunchMemo memo;    // the kernel that `kernel` with `meta` resolved to, by call
};

// `programs`: multiprocessors (CPU threads) the launch should fill.
// `blocksize` > 0: W is given as 4-bit codes in blocks of that many elements,
// and `w_dtype` is the product's dtype.
DoraPlan plan_dora(int64_t out, int64_t in, int64_t r, Product w_dtype, bool gpu, int64_t programs,
                   const Config& config, int64_t blocksize = 0) {
  const bool four_bit = blocksize > 0;
  const Product dot = is_half(w_dtype) ? w_dtype : Product(DType::f32, w_dtype.tf32);
  const int64_t r_pad = rank_pad(r);
  // The GPU default for ranks of 32 and up on tensor cores (the op's own tile, not
  // a candidate's): 128x64, 8 warps, 2 stages, the columns split for two waves of
  // programs. On an H100 (bf16, untuned) it took r=64 from 32.5 / 74.4 / 71.5 /
  // 70.6 us to 21.6 / 59.4 / 55.3 / 54.5 us at 4096x4096, 8192x8192,
  // 14336x4096 and 4096x14336, and r=32 from 26.6 / 63.1 / 59.2 / 58.0 to
  // 20.4 / 57.6 / 52.6 / 52.7 us, against 64x128, 4 warps, 3 stages, about
  // three waves (which stays the default for r=16).
  // Large ranks (256, and 128 for fp32 FMA): B's rows and A's tiles would pass the 232448
  // bytes of shared memory an H100 has on the tiles below (rank 256: 128x64 on two stages
  // with fp32 adapters 281104 bytes over bf16 W, 317968 as TF32, the 4-bit split kernel
  // 292880; fp32 FMA at rank 128 on 64x128, three stages, 338192); 64x32 on two stages
  // take 158992 at rank 256.
  const bool own_tiles = gpu && !config.block_m && !config.block_k;  // the op's tiles, not a caller's
  const bool big_rank = own_tiles && r_pad >= (dtype_size_bytes(dot) == 4 && !dot.tf32 ? 128 : 256);
  const bool wide = own_tiles && !four_bit && !big_rank && (is_half(dot) || dot.tf32) && r_pad >= 32;
  // Products that hold more registers per tile than bf16's: f16 adapters (SCALE_AFTER:
  // the product does not start from W's tile, so both are live) and TF32 (fp32 or bf16
  // adapters on an f16 base, PEFT's fp16 default: twice the registers per fragment).
  // Their own tiles use four warps where the wide tile has eight, and the narrow tile
  // takes 64-column steps: on an H100 (8192x8192, untuned) TF32 r=64 took
  // 119.9 us on eight warps, 90.8-94.3 on four (tuned: 77.2), r=16 61.4 us on 64x128
  // steps, 58.1 on 64x64 (tuned 56.2); all-f16 r=16 64.5 and 57.2 (tuned 53.8), r=64
  // 75.3 on eight warps, 65.2-67.1 on four (tuned 55.8).
  const bool heavy_product = dot.tf32 || dot.dtype == DType::f16;
  const int64_t bm = config.block_m ? config.block_m : (wide ? 128 : gpu ? 64 : 16);
  // The 4-bit kernel keeps fp32 adapters as they are in shared memory: from rank 128, steps
  // of 64 whatever the adapters (rank 128 with fp32 ones on 64x128 steps, three stages:
  // 312592 bytes).
  const bool narrow_steps = (four_bit && r_pad >= 128) || (own_tiles && !four_bit && heavy_product);
  int64_t bk_default = big_rank ? 32 : wide ? 64 : gpu && !narrow_steps ? 128 : 64;
  if (four_bit) {  // by default a step stays inside a scale block when it can
    const int64_t b = std::clamp<int64_t>(blocksize, 32, bk_default);
    if (in % b == 0 && blocksize % b == 0) bk_default = b;
  }
  const int64_t bk = config.block_k ? config.block_k : bk_default;
  const int64_t warps = config.num_warps ? config.num_warps : (wide && !heavy_product ? 8 : 4);
  DoraPlan p;
  p.blocks_m = cdiv(out, bm);
  const int64_t steps = cdiv(in, bk);
  p.split = slices_within(config.split_k, steps);
  if (p.split == 0)
    p.split = wide ? split_for_waves(p.blocks_m, programs, steps, 2) : split_for(p.blocks_m, programs, steps);
  p.meta = {{"BLOCK_M", bm}, {"BLOCK_K", bk}, {"R_PAD", r_pad}, {"num_warps", warps}};
  set_product_meta(p.meta, dot, config);
  set_dora_scale_meta(p.meta, dot);
  // cp.async pipelining on the GPU; the CPU back end has no use for stages.
  p.meta["num_stages"] = config.num_stages ? config.num_stages : (wide || big_rank ? 2 : gpu ? 3 : 1);
  pass_meta(config, p.meta, {"EVICT", "WARPS_N"});
  add_codegen_hints(config, p.meta);
  p.cast_a = cast_a_dtype(config, dot);
  // A step within one scale block per row: one scale per row and step.
  if (four_bit && in % bk == 0 && blocksize % bk == 0) p.meta["SCALE_PER_STEP"] = 1;
  if (p.split == 1) {
    p.kernel = four_bit ? &kernels::dora_norm_4bit() : &kernels::dora_norm_fused();
    p.grid = Grid{uint32_t(p.blocks_m), 1, 1};
    return p;
  }
  // One launch: the splits add partial sums into a zeroed workspace and the
  // last split of each row block finishes it (and zeroes it again).
  p.kernel = four_bit ? &kernels::dora_norm_4bit_split() : &kernels::dora_norm_split();
  if (!four_bit) pass_meta(config, p.meta, {"INTERLEAVE"});
  p.grid = row_slice_grid(p.blocks_m, p.split, 1, config, p.meta);
  p.ws_floats = (out + 3) / 4 * 4;
  return p;
}

size_t workspace_bytes(const DoraPlan& p) { return size_t(p.ws_floats + p.blocks_m) * 4; }

// A compile list: A's cast when the plan makes one, then the norm kernel's call
// for the A it reads.
std::vector<autotune::KernelCall> with_cast_a(const DoraPlan& p, const TensorView& A,
                                              const std::function<autotune::KernelCall(const TensorView&)>& main) {
  std::vector<autotune::KernelCall> calls;
  const TensorView a = compiled_a(A, p.cast_a, calls);
  calls.push_back(main(a));
  return calls;
}

// dora_norm_partial's plan: dora_norm's tiles, split and variants (the same sums of
// squares), run by the kernel that adds each slice's sums into sumsq, with no workspace
// and no finish. W must have columns.
DoraPlan plan_dora_partial(int64_t out, int64_t in, int64_t r, Product product, bool gpu, int64_t programs,
                           const Config& config) {
  DoraPlan p = plan_dora(out, in, r, product, gpu, programs, config);
  p.kernel = &kernels::dora_norm_partial();
  p.ws_floats = 0;
  // plan_dora's one-program-per-row-block kernel has no slices' grid axis; this one does.
  if (p.split == 1) p.grid = row_slice_grid(p.blocks_m, 1, 1, config, p.meta);
  return p;
}

// What plan_dora reads of a call besides its Config: the sizes, the product and the device.
struct DoraShape {
  int64_t out, in, r;
  Product product;
  bool gpu;
  int64_t programs;  // multiprocessors (CPU threads) to fill
  DoraShape(const TensorView& W, const TensorView& A, const TensorView& B)
      : out(W.shape[0]),
        in(W.shape[1]),
        r(A.shape[0]),
        product(product_dtype(W.dtype, A.dtype, B.dtype)),
        gpu(W.device.is_cuda()),
        programs(parallelism(W.device)) {}
  DoraPlan plan(const Config& c) const { return plan_dora(out, in, r, product, gpu, programs, c); }
  DoraPlan partial(const Config& c) const { return plan_dora_partial(out, in, r, product, gpu, programs, c); }
};

// The partial sums' kernels: sumsq zeroed, then, when W has columns, A's cast where the
// plan makes one and the kernel that adds each slice's sums of squares into sumsq.
std::vector<autotune::KernelCall> partial_kernels(const DoraPlan* p, const TensorView& W, const TensorView& A,
                                                  const TensorView& B, double s, const TensorView& sumsq) {
  std::vector<autotune::KernelCall> calls = {{&kernels::fill(), {sumsq, Scalar(0.0)}, {{"BLOCK", 1024}}}};
  if (!p) return calls;
  for (autotune::KernelCall& c : with_cast_a(*p, A, [&](const TensorView& a) {
         return autotune::KernelCall{p->kernel, {W, a, B, Scalar(s), sumsq}, p->meta};
       }))
    calls.push_back(std::move(c));
  return calls;
}

// Runs them (`p` null: W has no columns, sumsq is only zeroed); the partial sums' kernel
// finds itself in the plan's memo.
void run_partial(const DoraPlan* p, const TensorView& W, const TensorView& A, const TensorView& B, double s,
                 const TensorView& sumsq, LaunchOptions options) {
  options.memo = nullptr;
  launch(kernels::fill(), {sumsq, Scalar(0.0)}, Grid{uint32_t(cdiv(sumsq.shape[0], 1024)), 1, 1}, {{"BLOCK", 1024}},
         options);
  if (!p) return;
  const RunA a = run_a(A, p->cast_a, options);
  options.memo = &p->memo;
  launch(*p->kernel, {W, a.a, B, Scalar(s), sumsq}, p->grid, p->meta, options);
}

// A contiguous vector view (no allocation: every call makes its workspace views).
TensorView vector_view(void* data, DType dtype, int64_t n, const Device& dev) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.rank = 1;
  t.shape[0] = n;
  t.strides[0] = 1;
  t.device = dev;
  return t;
}

// A row-major [rows, cols] view, made as vector_view is.
TensorView matrix_view(void* data, DType dtype, int64_t rows, int64_t cols, const Device& dev) {
  TensorView t = vector_view(data, dtype, rows, dev);
  t.rank = 2;
  t.shape[1] = cols;
  t.strides[0] = cols;
  t.strides[1] = 1;
  return t;
}

// The plan's arguments, into `args`; `ws` is the workspace when the plan splits
// (workspace_bytes of it); `A` the one the kernel reads (compiled_a / run_a).
void dora_args(const DoraPlan& p, const TensorView& W, const TensorView& A, const TensorView& B,
               const TensorView& m, double s, double eps, const TensorView& norm, const TensorView& scale,
               void* ws, std::vector<Arg>& args) {
  args.clear();
  for (const TensorView* t : {&W, &A, &B, &m}) args.emplace_back(*t);
  args.emplace_back(Scalar(s));
  args.emplace_back(Scalar(eps));
  args.emplace_back(norm);
  args.emplace_back(scale);
  if (p.split == 1) return;
  float* f = static_cast<float*>(ws);
  args.emplace_back(vector_view(f, DType::f32, W.shape[0], W.device));
  args.emplace_back(vector_view(f + p.ws_floats, DType::i32, p.blocks_m, W.device));
}

// The same, as a new vector.
std::vector<Arg> dora_args(const DoraPlan& p, const TensorView& W, const TensorView& A, const TensorView& B,
                           const TensorView& m, double s, double eps, const TensorView& norm,
                           const TensorView& scale, void* ws) {
  std::vector<Arg> args;
  dora_args(p, W, A, B, m, s, eps, norm, scale, ws, args);
  return args;
}

Config tuned_dora_config(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& m,
                         const TensorView& norm, const TensorView& scale, void* stream);

}  // namespace

namespace {

// The part of the DoRA norms' memory checks that depends on where the memory
// lies: norm and scale disjoint from the inputs and from each other.
void expect_norm_outputs_disjoint(const char* op,
                                  std::initializer_list<std::pair<const char*, const TensorView*>> inputs,
                                  const TensorView& norm, const TensorView& scale) {
  std::array<NamedSpan, 8> ins;  // the spans found once each
  if (inputs.size() > ins.size()) throw InternalError("expect_norm_outputs_disjoint: more than 8 inputs");
  size_t n = 0;
  for (const auto& [name, t] : inputs) ins[n++] = NamedSpan(name, *t);
  const NamedSpan outs[] = {{"norm", norm}, {"scale", scale}};
  expect_disjoint(op, outs, 2, ins.data(), n);
}

// The DoRA norms' memory checks: inputs element-aligned with int32 dims; norm
// and scale written where nothing is read, nor into each other.
void expect_norm_memory(const char* op, std::initializer_list<std::pair<const char*, const TensorView*>> inputs,
                        const TensorView& norm, const TensorView& scale) {
  for (const auto& [name, t] : inputs) {
    expect_addressable(op, name, *t);
    expect_int32_dims(op, name, *t);
  }
  for (const auto& [name, t] : {std::pair{"norm", &norm}, {"scale", &scale}}) expect_no_self_overlap(op, name, *t);
  expect_norm_outputs_disjoint(op, inputs, norm, scale);
}

// A repeated call's memory checks (its fingerprint keeps only each address's alignment):
// every view addressable, and norm and scale apart from the inputs and from each other.
void expect_repeated_norm_memory(
    const char* op, std::initializer_list<std::pair<const char*, const TensorView*>> inputs,
    const TensorView& norm, const TensorView& scale) {
  for (const auto& [name, t] : inputs) expect_addressable(op, name, *t);
  expect_addressable(op, "norm", norm);
  expect_addressable(op, "scale", scale);
  expect_norm_outputs_disjoint(op, inputs, norm, scale);
}

// This thread's last call of one DoRA op: what its checks read (a fingerprint), its
// plan and the kernel its launch resolved to. A call with the same fingerprint, no
// Config meta and no layout (whose checks read more) has passed every check but
// those of where its memory lies, and reuses the plan and the kernel.
struct LastDoraCall {
  CallFingerprint print;
  std::shared_ptr<const DoraPlan> plan;
  ResolvedKernel kernel;

  // The plan of a call with fingerprint `p`, when it repeats this one; else null.
  std::shared_ptr<const DoraPlan> repeated(const CallFingerprint& p) const {
    return plan && p == print ? plan : nullptr;
  }
  void remember(const CallFingerprint& p, std::shared_ptr<const DoraPlan> made) {
    print = p;
    plan = std::move(made);
    kernel.reset();
  }
};

// The fingerprint's words for what a DoRA call's checks and plan read besides its tensors.
void add_call_options(CallFingerprint& print, const Config& config, double eps) {
  print.add(uint64_t(config.block_m)).add(uint64_t(config.block_k)).add(uint64_t(config.split_k));
  print.add(uint64_t(config.num_warps)).add(uint64_t(config.num_stages));
  print.add(uint64_t(refused_eps(eps))).add(autotune::generation());  // a refused eps (negative, NaN) never repeats
}

// Launches plan `p` with `args`: straight to the kernel `last` holds when `p` is its
// plan, else through the kernel lookup, keeping the kernel in `last` when `repeatable`.
void launch_dora(LastDoraCall& last, bool repeatable, const std::shared_ptr<const DoraPlan>& p,
                 const std::vector<Arg>& args, LaunchOptions options) {
  if (repeatable && last.plan == p && last.kernel.usable()) {
    launch(last.kernel, args, p->grid, options);
    return;
  }
  options.memo = &p->memo;
  if (repeatable && last.plan == p) options.resolved = &last.kernel;
  launch(*p->kernel, args, p->grid, p->meta, options);
}

// Every check of a dora_norm call, then its plan (null: nothing to run, W has no rows).
std::shared_ptr<const DoraPlan> checked_dora_plan(const TensorView& W, const TensorView& A, const TensorView& B,
                                                  const TensorView& m, const TensorView& norm,
                                                  const TensorView& scale, double eps, void* stream,
                                                  const Config& config) {
  const char* op = "dora_norm";
  expect_meta(op, config,
              {{"EVICT", 0, 2}, {"CAST_A", 0, 1}, {"INTERLEAVE", 0, 1}, kWarpsN, kL2Prefetch, kWgmma, kColsFirst, kTf32});
  expect_shape(op, "W", W, {-1, -1});
  const int64_t out = W.shape[0], in = W.shape[1];
  expect_shape(op, "A", A, {-1, in});
  const int64_t r = A.shape[0];
  expect_shape(op, "B", B, {out, r});
  expect_shape(op, "m", m, {out});
  expect_shape(op, "norm", norm, {out});
  expect_shape(op, "scale", scale, {out});
  for (const auto& [name, t] : {std::pair{"W", &W}, {"A", &A}, {"B", &B}, {"m", &m}})
    expect_dtype(op, name, *t, {DType::bf16, DType::f16, DType::f32});
  expect_dtype(op, "norm", norm, {DType::f32});
  expect_dtype(op, "scale", scale, {DType::f32});
  expect_device(op, {{"W", &W}, {"A", &A}, {"B", &B}, {"m", &m}, {"norm", &norm}, {"scale", &scale}});
  if (r > 256) throw InvalidArgument("dora_norm: rank " + std::to_string(r) + " is above the supported 256");
  expect_eps("dora_norm", eps);
  expect_addressable(op, "norm", norm);
  expect_addressable(op, "scale", scale);
  expect_norm_memory(op, {{"W", &W}, {"A", &A}, {"B", &B}, {"m", &m}}, norm, scale);
  if (out == 0 || checks_only()) return nullptr;

  static PlanMemo<DoraPlan> plans;
  CallKey key;
  key.add(W).add(A).add(B.dtype).add(m.dtype).add(W.device);
  key.add(config);
  return plans.get(key, [&] {
    // A caller's Config wins; otherwise the autotuner's choice (its defaults when tuning is off).
    const Config cfg = has_config(config)
                           ? config
                           : tuned_dora_config(W, A, B, m, norm, scale, stream);
    return DoraShape(W, A, B).plan(cfg);
  });
}

// The checks, plan and launch of dora_norm on local tensors; `layout` is the
// canonical layout text the kernel is launched with ("" unsharded).
void run_dora_norm(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& m, double s,
                   const TensorView& norm, const TensorView& scale, double eps, void* stream, const Config& config,
                   const std::string& layout) {
  // A repeated call (the same shapes, strides, dtypes, devices, alignment and
  // options as this thread's last one) runs only the checks of where its memory lies.
  expect_finite_scale("dora_norm", s);
  thread_local LastDoraCall last;
  const bool repeatable = layout.empty() && config.meta.empty() && !checks_only();
  CallFingerprint print;
  std::shared_ptr<const DoraPlan> p;
  if (repeatable) {
    for (const TensorView* t : {&W, &A, &B, &m, &norm, &scale}) print.add(*t);
    add_call_options(print, config, eps);
    if ((p = last.repeated(print)))
      expect_repeated_norm_memory("dora_norm", {{"W", &W}, {"A", &A}, {"B", &B}, {"m", &m}}, norm,
                                  scale);
  }
  if (!p) {
    const ProvisionalWatch provisional;
    p = checked_dora_plan(W, A, B, m, norm, scale, eps, stream, config);
    if (!p) return;
    if (repeatable && !provisional.seen()) last.remember(print, p);
  }
  const WorkspaceLease ws = p->split > 1 ? lease_workspace(W.device, stream, workspace_bytes(*p)) : WorkspaceLease{};
  LaunchOptions options;
  options.stream = stream;
  options.layout = layout;
  const RunA a = run_a(A, p->cast_a, options);
  thread_local std::vector<Arg> args;  // kept: its capacity spares a repeated call the allocation
  dora_args(*p, W, a.a, B, m, s, eps, norm, scale, ws.data, args);
  launch_dora(last, repeatable, p, args, options);
}

}  // namespace

void dora_norm(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& m,
               double s, const TensorView& norm, const TensorView& scale, double eps, void* stream,
               const Config& config) {
  run_dora_norm(W, A, B, m, s, norm, scale, eps, stream, config, "");
}

// ---------------------------------------------------------------- autotuning (jit/autotune.h)
namespace {

// GPU: BLOCK_M x BLOCK_K x warps x stages (split-K follows from BLOCK_M: it fills the device).
// 256-row blocks also with 16 warps: at r=64 every row block reads A's [r, in]
// from L2, so taller blocks read it less, and 8 warps hold 64 accumulators each there.
std::vector<autotune::Config> dora_gpu_candidates() {
  std::vector<autotune::Config> c = autotune::product(
      {{"BLOCK_M", {32, 64, 128, 256}}, {"BLOCK_K", {64, 128}}, {"num_warps", {4, 8}}, {"num_stages", {2, 3}}});
  for (autotune::Config& tall :
       autotune::product({{"BLOCK_M", {256}}, {"BLOCK_K", {64, 128}}, {"num_warps", {16}}, {"num_stages", {2, 3}}}))
    c.push_back(std::move(tall));
  return c;
}

// `tiles` (dora_gpu_candidates by default), each also with split-K set to one,
// two and four full waves of programs on `programs` multiprocessors (the default
// split aims at about three). Fewer, longer programs pay the B tile and the finish
// once per more columns: at r=64 on 4096x4096, one wave (split 4 at BLOCK_M=128)
// ran 21.6 us against 25.6 us for the default split of 13 on an H100. Four: where
// four small programs share a multiprocessor (64x64 on 4 warps, 2 stages), that
// is one wave of them; with INTERLEAVE it took r=64 at 4096x14336 to 50.0 us.
std::vector<autotune::Config> dora_gpu_candidates(int64_t out, int64_t in, int64_t programs,
                                                  const std::vector<autotune::Config>& tiles = dora_gpu_candidates()) {
  return with_wave_splits(tiles, "BLOCK_M", out, "BLOCK_K", in, 1, programs, {1, 2, 4});
}

// The tiles that won with WGMMA on an H100 (bf16, r=32 and 64, the four benchmark
// shapes): 64 rows on one warpgroup with two or three stages, and 128 rows on two
// warpgroups with 64- or 128-column steps, the latter mostly with one or two waves.
std::vector<autotune::Config> dora_wgmma_tiles() {
  std::vector<autotune::Config> c =
      autotune::product({{"BLOCK_M", {64}}, {"BLOCK_K", {64}}, {"num_warps", {4}}, {"num_stages", {2, 3}}});
  for (autotune::Config& t :
       autotune::product({{"BLOCK_M", {128}}, {"BLOCK_K", {64, 128}}, {"num_warps", {8}}, {"num_stages", {3}}}))
    c.push_back(std::move(t));
  // Each also with a row block's splits interleaved and adjacent in launch order
  // (INTERLEAVE, COLS_FIRST): the programs running together then read neighbouring
  // column blocks of the same rows. At fixed configs on an H100 (r=64) it took
  // 4096x14336 from 52.6 to 52.2 us (128x128, split 4) and 64x64 split 8 to 50.0
  // us, 8192x8192 from 57.9 to 55.8 us (64x64, split 4), 14336x4096 from 53.1 to
  // 52.1 us (64x64, split 2).
  const size_t n = c.size();
  for (size_t i = 0; i < n; ++i) {
    autotune::Config t = c[i];
    t["INTERLEAVE"] = 1;
    t["COLS_FIRST"] = 1;
    c.push_back(std::move(t));
  }
  return c;
}

// `variants` and, for each that sets COLS_FIRST, the same with INTERLEAVE.
std::vector<autotune::Config> with_interleave_variants(std::vector<autotune::Config> variants) {
  const size_t n = variants.size();
  for (size_t i = 0; i < n; ++i)
    if (autotune::value_or_zero(variants[i], "COLS_FIRST")) {
      autotune::Config v = variants[i];
      v["INTERLEAVE"] = 1;
      variants.push_back(std::move(v));
    }
  return variants;
}

// The tuning request dora_norm and dora_norm_partial share (their kernels sum the same
// squares over the same tiles): the problem, named `op` with the operands' dtypes `dtypes`,
// its candidates, the finalists' variants and the form a candidate runs as. The caller
// sets kernels, run and stream.
TuneRequest dora_tune_request(const char* op, const TensorView& W, const TensorView& A, const DoraShape& d,
                              std::vector<DType> dtypes) {
  TuneRequest q;
  q.problem = {op, {next_pow2(d.out), next_pow2(d.in), rank_pad(d.r)}, std::move(dtypes), "", W.device};
  add_memory_order(q.problem.shape_bucket, W);
  q.block_m_name = "BLOCK_M";
  q.block_k_name = "BLOCK_K";
  q.gpu_candidates = dora_gpu_candidates(
      d.out, d.in, d.programs, with_wgmma_tiles(dora_gpu_candidates(), dora_wgmma_tiles(), d.product, W.device));
  q.finalist_variants = with_interleave_variants(with_cols_first_variants(with_wgmma_variant(
      with_l2_prefetch_variants(with_warps_n_variants(evict_and_cast_variants(A, d.product), d.product)), d.product,
      W.device)));
  // One program per row block: no slices to order or interleave.
  q.canonical = [d](autotune::Config c) {
    if (d.plan(config_from(c, "BLOCK_M", "BLOCK_K")).split == 1) {
      c.erase("INTERLEAVE");
      c.erase("COLS_FIRST");
    }
    return c;
  };
  q.extent_m = d.out;
  q.extent_k = d.in;
  q.split_programs = d.programs;
  return q;
}

Config tuned_dora_config(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& m,
                         const TensorView& norm, const TensorView& scale, void* stream) {
  const DoraShape d(W, A, B);
  TuneRequest q = dora_tune_request("dora_norm", W, A, d, {W.dtype, A.dtype, B.dtype, m.dtype});
  q.kernels = [&](const Config& c) {
    const DoraPlan p = d.plan(c);
    return with_cast_a(p, A, [&](const TensorView& a) {
      return autotune::KernelCall{p.kernel, dora_args(p, W, a, B, m, 1.0, 0.0, norm, scale, unused_memory()), p.meta};
    });
  };
  // The candidates run on the caller's tensors: norm and scale are outputs only, and
  // the split workspace is zero again after every launch, so nothing needs restoring.
  q.run = [&](const Config& c) {
    const DoraPlan p = d.plan(c);
    const WorkspaceLease ws = p.split == 1 ? WorkspaceLease{} : lease_workspace(W.device, stream, workspace_bytes(p));
    LaunchOptions options;
    options.stream = stream;
    const RunA a = run_a(A, p.cast_a, options);
    launch(*p.kernel, dora_args(p, W, a.a, B, m, 1.0, 0.0, norm, scale, ws.data), p.grid, p.meta, options);
  };
  q.stream = stream;
  return tuned_config(q);
}

Config tuned_partial_config(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& sumsq,
                            void* stream) {
  const DoraShape d(W, A, B);
  TuneRequest q = dora_tune_request("dora_norm_partial", W, A, d, {W.dtype, A.dtype, B.dtype});
  q.kernels = [&](const Config& c) {
    const DoraPlan p = d.partial(c);
    return partial_kernels(&p, W, A, B, 1.0, sumsq);
  };
  // sumsq is an output the run zeroes first: nothing needs restoring.
  q.run = [&](const Config& c) {
    const DoraPlan p = d.partial(c);
    LaunchOptions options;
    options.stream = stream;
    run_partial(&p, W, A, B, 1.0, sumsq, options);
  };
  q.stream = stream;
  return tuned_config(q);
}

// For kerf-cache warm.
const bool dora_registered = [] {
  autotune::TunableOp op;
  op.name = "dora_norm";
  op.shape_names = {"out", "in", "r"};
  op.takes_layout = true;
  op.operands = [](const std::vector<int64_t>& s, DType t) {
    return std::vector<autotune::Operand>{{{s[0], s[1]}, t}, {{s[2], s[1]}, t}, {{s[0], s[2]}, t},
                                          {{s[0]}, t},       {{s[0]}, DType::f32}, {{s[0]}, DType::f32}};
  };
  op.call = [](const std::vector<TensorView>& v, void* stream, const std::string& layout) {
    dora_norm(v[0], v[1], v[2], v[3], 1.0, v[4], v[5], 0.0, stream, {}, detail::layout_at_origin(layout));
  };
  op.kernels = [](const std::vector<TensorView>& v, const autotune::Config& c, int sm_count) {
    const DoraPlan p = plan_dora(v[0].shape[0], v[0].shape[1], v[1].shape[0],
                                 product_dtype(v[0].dtype, v[1].dtype, v[2].dtype), true, sm_count,
                                 config_from(c, "BLOCK_M", "BLOCK_K"));
    return with_cast_a(p, v[1], [&](const TensorView& a) {
      return autotune::KernelCall{
          p.kernel, dora_args(p, v[0], a, v[2], v[3], 1.0, 0.0, v[4], v[5], unused_memory()), p.meta};
    });
  };
  op.gpu_candidates = [] { return dora_gpu_candidates(); };
  autotune::register_op(std::move(op));
  return true;
}();

// For kerf-cache warm (and the planning tests): the partial sums of a shard, with its layout.
const bool partial_registered = [] {
  autotune::TunableOp op;
  op.name = "dora_norm_partial";
  op.shape_names = {"out", "in", "r"};
  op.takes_layout = true;
  op.operands = [](const std::vector<int64_t>& s, DType t) {
    return std::vector<autotune::Operand>{
        {{s[0], s[1]}, t}, {{s[2], s[1]}, t}, {{s[0], s[2]}, t}, {{s[0]}, DType::f32}};
  };
  op.call = [](const std::vector<TensorView>& v, void* stream, const std::string& layout) {
    dora_norm_partial(v[0], v[1], v[2], 1.0, v[3], stream, {}, detail::layout_at_origin(layout));
  };
  op.kernels = [](const std::vector<TensorView>& v, const autotune::Config& c, int sm_count) {
    if (v[0].shape[1] == 0) return partial_kernels(nullptr, v[0], v[1], v[2], 1.0, v[3]);
    const DoraPlan p = plan_dora_partial(v[0].shape[0], v[0].shape[1], v[1].shape[0],
                                         product_dtype(v[0].dtype, v[1].dtype, v[2].dtype), true, sm_count,
                                         config_from(c, "BLOCK_M", "BLOCK_K"));
    return partial_kernels(&p, v[0], v[1], v[2], 1.0, v[3]);
  };
  op.gpu_candidates = [] { return dora_gpu_candidates(); };
  autotune::register_op(std::move(op));
  return true;
}();

}  // namespace

}  // namespace kerf::ops

// ---------------------------------------------------------------- 4-bit weights
namespace kerf::ops {

const std::array<float, 16>& nf4_code() {
  // QLoRA's NormalFloat-4: quantiles of a standard normal scaled to [-1, 1], with an exact zero.
  static const std::array<float, 16> code = {
      -1.0f,          -0.6961928010f, -0.5250730515f, -0.3949174881f, -0.2844413817f, -0.1847734302f,
      -0.0910500363f, 0.0f,           0.0795802996f,  0.1609302014f,  0.2461123019f,  0.3379152417f,
      0.4407098293f,  0.5626170039f,  0.7229568362f,  1.0f};
  return code;
}

TensorView nf4_code_tensor(const Device& device) {
  const std::array<float, 16>& code = nf4_code();
  if (!device.is_cuda())
    return TensorView::contiguous(const_cast<float*>(code.data()), DType::f32, {16}, device);
  // One copy per device, never freed: views of it may live as long as the process.
  static std::mutex mu;
  static auto* copies = new std::map<int, cuda::DeviceBuffer>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = copies->find(device.index);
  if (it == copies->end()) {
    cuda::DeviceBuffer buf(sizeof(float) * code.size(), device.index);
    buf.copy_from_host(code.data(), sizeof(float) * code.size());
    it = copies->emplace(device.index, std::move(buf)).first;
  }
  return TensorView::contiguous(it->second.data(), DType::f32, {16}, device);
}

namespace {

// The product's dtype for 4-bit W: f16 for f16 adapters, else bf16 (tensor cores either way).
DType dot_4bit(const TensorView& A, const TensorView& B) {
  return A.dtype == DType::f16 && B.dtype == DType::f16 ? DType::f16 : DType::bf16;
}

int log2_exact(int64_t x) {
  int n = 0;
  while ((int64_t(1) << n) < x) ++n;
  return n;
}

// The kernel arguments of a 4-bit plan; `packed2` is packed seen as [out, in/2].
std::vector<Arg> dora_4bit_args(const DoraPlan& p, const TensorView& packed2, const Weight4bit& W,
                                const TensorView& A, const TensorView& B, const TensorView& m, double s, double eps,
                                const TensorView& norm, const TensorView& scale, void* ws) {
  // absmax and code in any contiguous shape (checked by count), as the kernel reads them: flat.
  const auto flat = [](const TensorView& t) { return TensorView::contiguous(t.data, t.dtype, {t.numel()}, t.device); };
  std::vector<Arg> args = {packed2, flat(W.absmax), flat(W.code), A, B, m, Scalar(s), Scalar(eps),
                           Scalar(log2_exact(W.blocksize)), norm, scale};
  if (p.split == 1) return args;
  float* f = static_cast<float*>(ws);
  const int64_t out = packed2.shape[0];
  args.push_back(TensorView::contiguous(f, DType::f32, {out}, packed2.device));
  args.push_back(TensorView::contiguous(f + p.ws_floats, DType::i32, {p.blocks_m}, packed2.device));
  return args;
}

// Where some candidate step lies inside one scale block per row (in and the
// block size multiples of BLOCK_K), only such steps: the others read a scale
// per byte, which never wins.
std::vector<autotune::Config> dora_4bit_candidates(const std::vector<autotune::Config>& all, int64_t in,
                                                  int64_t blocksize) {
  const auto per_step = [&](const autotune::Config& c) {
    const int64_t bk = c.at("BLOCK_K");
    return in % bk == 0 && blocksize % bk == 0;
  };
  std::vector<autotune::Config> kept;
  for (const autotune::Config& c : all)
    if (per_step(c)) kept.push_back(c);
  return kept.empty() ? all : kept;
}

Config tuned_dora_4bit_config(const TensorView& packed2, const Weight4bit& W, const TensorView& A,
                              const TensorView& B, const TensorView& m, const TensorView& norm,
                              const TensorView& scale, void* stream) {
  const bool gpu = packed2.device.is_cuda();
  const int64_t out = packed2.shape[0], in = 2 * packed2.shape[1], r = A.shape[0];
  const int64_t programs = parallelism(packed2.device);
  const DType dot = dot_4bit(A, B);
  TuneRequest q;
  // The scale block size decides which steps read one scale per row; it joins
  // the key when it is not bitsandbytes' default (64, what kerf-cache warm tunes).
  std::vector<int64_t> shape = {next_pow2(out), next_pow2(in),
                                rank_pad(r)};
  if (W.blocksize != 64) shape.push_back(W.blocksize);
  // So does in's largest power-of-two divisor when it is below the block size: the
  // candidates then differ (dora_4bit_candidates), and a choice made for in = 4096 must
  // not serve in = 4032 (negative: no size is).
  if (in % W.blocksize != 0) shape.push_back(-(in & -in));
  q.problem = {"dora_norm_4bit", shape, {A.dtype, B.dtype, m.dtype}, "", packed2.device};
  q.block_m_name = "BLOCK_M";
  q.block_k_name = "BLOCK_K";
  q.gpu_candidates = dora_4bit_candidates(dora_gpu_candidates(out, in, programs), in, W.blocksize);
  q.finalist_variants = with_l2_prefetch_variants(with_warps_n_variants(evict_and_cast_variants(A, dot), dot));
  q.extent_m = out;
  q.extent_k = in;
  q.split_programs = programs;
  q.kernels = [&](const Config& c) {
    const DoraPlan p = plan_dora(out, in, r, dot, gpu, programs, c, W.blocksize);
    return with_cast_a(p, A, [&](const TensorView& a) {
      return autotune::KernelCall{
          p.kernel, dora_4bit_args(p, packed2, W, a, B, m, 1.0, 0.0, norm, scale, unused_memory()), p.meta};
    });
  };
  q.run = [&](const Config& c) {
    const DoraPlan p = plan_dora(out, in, r, dot, gpu, programs, c, W.blocksize);
    const WorkspaceLease ws =
        p.split == 1 ? WorkspaceLease{} : lease_workspace(packed2.device, stream, workspace_bytes(p));
    LaunchOptions options;
    options.stream = stream;
    const RunA a = run_a(A, p.cast_a, options);
    launch(*p.kernel, dora_4bit_args(p, packed2, W, a.a, B, m, 1.0, 0.0, norm, scale, ws.data), p.grid, p.meta, options);
  };
  q.stream = stream;
  return tuned_config(q);
}

// packed as [out, in/2] when W's arrays fit A, B and blocksize; the messages say which does not.
TensorView checked_packed(const char* op, const Weight4bit& W, int64_t out, int64_t in) {
  const int64_t bs = W.blocksize;
  if (bs < 2 || bs > (int64_t(1) << 30) || (bs & (bs - 1)) != 0)
    throw InvalidArgument(std::string(op) + ": blocksize must be a power of two >= 2, got " + std::to_string(bs));
  if (in % 2 != 0)
    throw InvalidArgument(std::string(op) + ": in (A's columns) must be even, two 4-bit codes per byte of a row; got " +
                          std::to_string(in));
  for (const auto& [name, t] :
       {std::pair{"packed", &W.packed}, {"absmax", &W.absmax}, {"code", &W.code}})
    expect_valid_view(op, name, *t);
  expect_dtype(op, "packed", W.packed, {DType::u8});
  expect_dtype(op, "absmax", W.absmax, {DType::f32});
  expect_dtype(op, "code", W.code, {DType::f32});
  for (const auto& [name, t] : {std::pair{"packed", &W.packed}, {"absmax", &W.absmax}, {"code", &W.code}})
    if (!t->is_contiguous())
      throw InvalidArgument(std::string(op) + ": " + name + " must be contiguous, got " + t->describe());
  const int64_t n = out * in;
  if (W.packed.numel() != n / 2)
    throw InvalidArgument(std::string(op) + ": packed must hold out*in/2 = " + std::to_string(n / 2) +
                          " bytes for W [" + std::to_string(out) + ", " + std::to_string(in) + "], got " +
                          std::to_string(W.packed.numel()) + " (shape " + shape_str(W.packed) + ")");
  if (W.absmax.numel() != cdiv(n, bs))
    throw InvalidArgument(std::string(op) + ": absmax must hold cdiv(out*in, blocksize) = " +
                          std::to_string(cdiv(n, bs)) + " scales for blocks of " + std::to_string(bs) + ", got " +
                          std::to_string(W.absmax.numel()) + " (is blocksize right?)");
  if (W.code.numel() != 16)
    throw InvalidArgument(std::string(op) + ": code must hold the 16 values of the 4-bit codes, got " +
                          std::to_string(W.code.numel()));
  return matrix_view(W.packed.data, DType::u8, out, in / 2, W.packed.device);
}

}  // namespace

namespace {

// Every check of a dora_norm_4bit call, then its plan (null: nothing to run).
std::shared_ptr<const DoraPlan> checked_dora_4bit_plan(const Weight4bit& W, const TensorView& A, const TensorView& B,
                                                       const TensorView& m, const TensorView& norm,
                                                       const TensorView& scale, double eps, void* stream,
                                                       const Config& config) {
  const char* op = "dora_norm_4bit";
  expect_meta(op, config, {{"EVICT", 0, 2}, {"CAST_A", 0, 1}, kWarpsN, kL2Prefetch, kColsFirst});
  expect_shape(op, "A", A, {-1, -1});
  const int64_t r = A.shape[0], in = A.shape[1];
  expect_shape(op, "B", B, {-1, r});
  const int64_t out = B.shape[0];
  expect_shape(op, "m", m, {out});
  expect_shape(op, "norm", norm, {out});
  expect_shape(op, "scale", scale, {out});
  for (const auto& [name, t] : {std::pair{"A", &A}, {"B", &B}, {"m", &m}})
    expect_dtype(op, name, *t, float_dtypes());
  expect_dtype(op, "norm", norm, {DType::f32});
  expect_dtype(op, "scale", scale, {DType::f32});
  const TensorView packed2 = checked_packed(op, W, out, in);
  expect_device(op, {{"packed", &W.packed}, {"absmax", &W.absmax}, {"code", &W.code}, {"A", &A}, {"B", &B},
                     {"m", &m}, {"norm", &norm}, {"scale", &scale}});
  if (r > 256) throw InvalidArgument(std::string(op) + ": rank " + std::to_string(r) + " is above the supported 256");
  expect_eps(op, eps);
  if (config.block_k == 1) throw InvalidArgument(std::string(op) + ": block_k must be at least 2 (a byte per step)");
  expect_norm_memory(
      op, {{"packed", &W.packed}, {"absmax", &W.absmax}, {"code", &W.code}, {"A", &A}, {"B", &B}, {"m", &m}},
      norm, scale);
  if (out == 0 || checks_only()) return nullptr;

  static PlanMemo<DoraPlan> plans;
  CallKey key;
  // absmax and code are read flat, their counts set by packed2's shape and the blocksize.
  key.add(packed2).add(A).add(B.dtype).add(m.dtype).add(W.blocksize);
  key.add(packed2.device);  // each device (and the CPU) tuned and split for itself
  key.add(config);
  return plans.get(key, [&] {
    const Config cfg = has_config(config) ? config
                                          : tuned_dora_4bit_config(packed2, W, A, B, m, norm, scale, stream);
    return plan_dora(out, in, r, dot_4bit(A, B), packed2.device.is_cuda(), parallelism(packed2.device), cfg, W.blocksize);
  });
}

}  // namespace

void dora_norm_4bit(const Weight4bit& W, const TensorView& A, const TensorView& B, const TensorView& m, double s,
                    const TensorView& norm, const TensorView& scale, double eps, void* stream, const Config& config) {
  // A repeated call runs only the checks of where its memory lies (see dora_norm).
  expect_finite_scale("dora_norm_4bit", s);
  thread_local LastDoraCall last;
  const bool repeatable = config.meta.empty() && !checks_only();
  CallFingerprint print;
  std::shared_ptr<const DoraPlan> p;
  if (repeatable) {
    for (const TensorView* t : {&W.packed, &W.absmax, &W.code, &A, &B, &m, &norm, &scale}) print.add(*t);
    print.add(uint64_t(W.blocksize));
    add_call_options(print, config, eps);
    if ((p = last.repeated(print)))
      expect_repeated_norm_memory("dora_norm_4bit",
                                  {{"packed", &W.packed},
                                   {"absmax", &W.absmax},
                                   {"code", &W.code},
                                   {"A", &A},
                                   {"B", &B},
                                   {"m", &m}},
                                  norm, scale);
  }
  if (!p) {
    const ProvisionalWatch provisional;
    p = checked_dora_4bit_plan(W, A, B, m, norm, scale, eps, stream, config);
    if (!p) return;
    if (repeatable && !provisional.seen()) last.remember(print, p);
  }
  // packed as [out, in/2], as checked_packed views it (packed is contiguous u8).
  const TensorView packed2 = matrix_view(W.packed.data, DType::u8, B.shape[0], A.shape[1] / 2, W.packed.device);
  const WorkspaceLease ws =
      p->split > 1 ? lease_workspace(packed2.device, stream, workspace_bytes(*p)) : WorkspaceLease{};
  LaunchOptions options;
  options.stream = stream;
  const RunA a = run_a(A, p->cast_a, options);
  launch_dora(last, repeatable, p, dora_4bit_args(*p, packed2, W, a.a, B, m, s, eps, norm, scale, ws.data), options);
}

namespace {

// For kerf-cache warm: NF4 blocks of 64, adapters and m in the given dtype.
const bool dora_4bit_registered = [] {
  autotune::TunableOp op;
  op.name = "dora_norm_4bit";
  op.shape_names = {"out", "in", "r"};
  op.operands = [](const std::vector<int64_t>& s, DType t) {
    return std::vector<autotune::Operand>{{{s[0] * s[1] / 2}, DType::u8}, {{cdiv(s[0] * s[1], 64)}, DType::f32},
                                          {{16}, DType::f32},            {{s[2], s[1]}, t},
                                          {{s[0], s[2]}, t},             {{s[0]}, t},
                                          {{s[0]}, DType::f32},          {{s[0]}, DType::f32}};
  };
  op.call = [](const std::vector<TensorView>& v, void* stream, const std::string&) {
    dora_norm_4bit(Weight4bit{v[0], v[1], v[2], 64}, v[3], v[4], v[5], 1.0, v[6], v[7], 0.0, stream);
  };
  op.kernels = [](const std::vector<TensorView>& v, const autotune::Config& c, int sm_count) {
    const int64_t out = v[4].shape[0], in = v[3].shape[1], r = v[3].shape[0];
    const Weight4bit W{v[0], v[1], v[2], 64};
    const TensorView packed2 = matrix_view(v[0].data, DType::u8, out, in / 2, v[0].device);
    const DoraPlan p = plan_dora(out, in, r, dot_4bit(v[3], v[4]), true, sm_count, config_from(c, "BLOCK_M", "BLOCK_K"),
                                 64);
    return with_cast_a(p, v[3], [&](const TensorView& a) {
      return autotune::KernelCall{
          p.kernel, dora_4bit_args(p, packed2, W, a, v[4], v[5], 1.0, 0.0, v[6], v[7], unused_memory()), p.meta};
    });
  };
  // kerf-cache warm --all-candidates compiles what a call would try (in = 4096: a multiple of any step).
  op.gpu_candidates = [] { return dora_4bit_candidates(dora_gpu_candidates(), 4096, 64); };
  autotune::register_op(std::move(op));
  return true;
}();

}  // namespace

}  // namespace kerf::ops

// ---------------------------------------------------------------- sharded layouts (ops/layout.h)
// Kept apart from the unsharded path above: the layout is checked first, then
// the local shards run the same plan, launched with the layout's canonical
// text (part of the kernel's cache key).

namespace kerf::ops {

void dora_norm(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& m,
               double s, const TensorView& norm, const TensorView& scale, double eps, void* stream,
               const Config& config, const Layout& layout) {
  const char* op = "dora_norm";
  const detail::LayoutSplits splits = detail::check_layout(op, layout, [] {
    return std::vector<detail::OperandDims>{{"W", {"out", "in"}}, {"A", {"r", "in"}},    {"B", {"out", "r"}},
                                            {"m", {"out"}},       {"norm", {"out"}},     {"scale", {"out"}}};
  });
  detail::expect_unsplit(
      op, layout, splits, "r",
      "the norm of W + s*B@A needs the whole product, so B and A keep every rank");
  if (splits.split("in"))
    throw InvalidArgument(
        std::string(op) + ": layout: " + detail::spec_text(layout, "W") + " splits in over " +
        splits.of("in").str() +
        ": a row's norm needs every column; call dora_norm_partial on each shard, sum sumsq "
        "over " +
        splits.of("in").str() + " (all-reduce), then dora_norm_finish");
  run_dora_norm(W, A, B, m, s, norm, scale, eps, stream, config, layout.canonical());
}

void dora_norm_partial(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                       const TensorView& sumsq, void* stream, const Config& config, const Layout& layout) {
  using namespace detail;
  const char* op = "dora_norm_partial";
  expect_finite_scale(op, s);
  expect_meta(op, config,
              {{"EVICT", 0, 2}, {"CAST_A", 0, 1}, {"INTERLEAVE", 0, 1}, kWarpsN, kL2Prefetch, kWgmma, kColsFirst, kTf32});
  const LayoutSplits splits = check_layout(op, layout, [] {
    return std::vector<OperandDims>{{"W", {"out", "in"}}, {"A", {"r", "in"}}, {"B", {"out", "r"}}, {"sumsq", {"out"}}};
  });
  expect_unsplit(op, layout, splits, "r",
                 "the norm of W + s*B@A needs the whole product, so B and A keep every rank");
  expect_shape(op, "W", W, {-1, -1});
  const int64_t out = W.shape[0], in = W.shape[1];
  expect_shape(op, "A", A, {-1, in});
  const int64_t r = A.shape[0];
  expect_shape(op, "B", B, {out, r});
  expect_shape(op, "sumsq", sumsq, {out});
  expect_dtype(op, "W", W, float_dtypes());
  expect_dtype(op, "A", A, float_dtypes());
  expect_dtype(op, "B", B, float_dtypes());
  expect_dtype(op, "sumsq", sumsq, {DType::f32});
  expect_device(op, {{"W", &W}, {"A", &A}, {"B", &B}, {"sumsq", &sumsq}});
  for (const auto& [n, t] : {std::pair{"W", &W}, {"A", &A}, {"B", &B}, {"sumsq", &sumsq}}) {
    expect_addressable(op, n, *t);
    expect_int32_dims(op, n, *t);
  }
  expect_no_self_overlap(op, "sumsq", sumsq);
  for (const auto& [n, t] : {std::pair{"W", &W}, {"A", &A}, {"B", &B}}) expect_disjoint(op, "sumsq", sumsq, n, *t);
  if (r > 256)
    throw InvalidArgument(std::string(op) + ": rank " + std::to_string(r) + " is above the supported 256");
  if (out == 0 || checks_only()) return;

  const std::string text = layout.canonical();
  LaunchOptions options;
  options.stream = stream;
  options.layout = text;
  if (in == 0) {  // no columns: every row's partial sum is 0
    run_partial(nullptr, W, A, B, s, sumsq, options);
    return;
  }
  // A caller's Config wins; otherwise the autotuner's choice (its defaults when tuning is off).
  static PlanMemo<DoraPlan> plans;
  CallKey key;
  key.add(W).add(A).add(B.dtype).add(W.device);
  key.add(config);
  const std::shared_ptr<const DoraPlan> p = plans.get(key, [&] {
    return DoraShape(W, A, B).partial(has_config(config) ? config : tuned_partial_config(W, A, B, sumsq, stream));
  });
  run_partial(p.get(), W, A, B, s, sumsq, options);
}

}  // namespace kerf::ops
