// DoRA norm beyond ops::dora_norm: the partial sums of squares of a shard
// split on in-features, the finish that turns summed partials into norm and
// scale, and the backward of the scale with respect to the magnitude.
#include <algorithm>
#include <string>

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

const std::vector<OperandDims>& partial_operands() {
  static const std::vector<OperandDims> o = {
      {"W", {"out", "in"}}, {"A", {"r", "in"}}, {"B", {"out", "r"}}, {"sumsq", {"out"}}};
  return o;
}

// In-place elementwise ops may write where they read, element for element;
// any other overlap of an output with an input is rejected.
void expect_disjoint_or_same(const char* op, const char* out_name, const TensorView& out,
                             const char* in_name, const TensorView& in) {
  const bool same =
      out.data == in.data && out.dtype == in.dtype && out.rank == in.rank &&
      std::equal(out.strides.begin(), out.strides.begin() + out.rank, in.strides.begin());
  if (!same) expect_disjoint(op, out_name, out, in_name, in);
}

// The partial sums' launches: sumsq zeroed, then the shard's columns added into it (none
// when `in` is 0). `programs`: the multiprocessors (CPU threads) to fill.
struct PartialLaunch {
  autotune::KernelCall call;
  Grid grid;
};

std::vector<PartialLaunch> partial_calls(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                                         const TensorView& sumsq, const Config& config, int64_t programs) {
  const int64_t out = W.shape[0], in = W.shape[1], r = A.shape[0];
  std::vector<PartialLaunch> calls;
  calls.push_back({{&kernels::fill(), {sumsq, Scalar(0.0)}, {{"BLOCK", 1024}}}, Grid{uint32_t(cdiv(out, 1024)), 1, 1}});
  if (in == 0) return calls;
  const bool gpu = W.device.is_cuda();
  const Product dot = product_dtype(W.dtype, A.dtype, B.dtype);
  const int64_t r_pad = rank_pad(r);
  // 64x128 steps, narrowed from rank 128 so that A's and B's tiles leave the shared memory
  // an H100 has (at 64x128 on three stages rank 128 with fp32 products took 337920 bytes,
  // rank 256 in bf16 294912).
  const int64_t bm = config.block_m ? config.block_m : (gpu ? 64 : 16);
  const int64_t bk = config.block_k ? config.block_k
                                    : (gpu ? rank_narrowed(128, r_pad, rank_bytes(dot, A.dtype, B.dtype), 512) : 64);
  const int64_t blocks = cdiv(out, bm);
  const int64_t split = config.split_k ? config.split_k : split_for(blocks, programs, cdiv(in, bk));
  dsl::MetaMap meta = {{"BLOCK_M", bm},
                       {"BLOCK_K", bk},
                       {"R_PAD", r_pad},
                       {"num_warps", config.num_warps ? config.num_warps : 4},
                       {"num_stages", config.num_stages ? config.num_stages : (gpu ? 3 : 1)}};
  set_product_meta(meta, dot, config);
  set_dora_scale_meta(meta, dot);
  calls.push_back({{&kernels::dora_norm_partial(), {W, A, B, Scalar(s), sumsq}, meta},
                   Grid{uint32_t(blocks), uint32_t(split), 1}});
  return calls;
}

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
    dora_norm_partial(v[0], v[1], v[2], 1.0, v[3], stream, {}, layout_at_origin(layout));
  };
  op.kernels = [](const std::vector<TensorView>& v, const autotune::Config& c, int sm_count) {
    std::vector<autotune::KernelCall> calls;
    for (const PartialLaunch& l : partial_calls(v[0], v[1], v[2], 1.0, v[3], config_from(c, "BLOCK_M", "BLOCK_K"),
                                                sm_count))
      calls.push_back(l.call);
    return calls;
  };
  op.gpu_candidates = [] { return std::vector<autotune::Config>{}; };
  autotune::register_op(std::move(op));
  return true;
}();

}  // namespace

void dora_norm_partial(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                       const TensorView& sumsq, void* stream, const Config& config,
                       const Layout& layout) {
  const char* op = "dora_norm_partial";
  expect_finite_scale(op, s);
  expect_meta(op, config, {kTf32});
  const LayoutSplits splits = check_layout(op, layout, partial_operands());
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
  for (const auto& [n, t] : {std::pair{"W", &W}, {"A", &A}, {"B", &B}})
    expect_disjoint(op, "sumsq", sumsq, n, *t);
  if (r > 256)
    throw InvalidArgument(std::string(op) + ": rank " + std::to_string(r) +
                          " is above the supported 256");
  if (out == 0 || checks_only()) return;

  const std::string text = layout.canonical();
  LaunchOptions options;
  options.stream = stream;
  options.layout = text;
  for (const PartialLaunch& l : partial_calls(W, A, B, s, sumsq, config, parallelism(W.device)))
    launch(*l.call.kernel, l.call.args, l.grid, l.call.meta, options);
}

void dora_norm_finish(const TensorView& sumsq, const TensorView& m, double eps,
                      const TensorView& norm, const TensorView& scale, void* stream,
                      const Layout& layout) {
  const char* op = "dora_norm_finish";
  check_layout(op, layout, [] {
    return std::vector<OperandDims>{{"sumsq", {"out"}}, {"m", {"out"}}, {"norm", {"out"}}, {"scale", {"out"}}};
  });
  expect_shape(op, "sumsq", sumsq, {-1});
  const int64_t out = sumsq.shape[0];
  expect_shape(op, "m", m, {out});
  expect_shape(op, "norm", norm, {out});
  expect_shape(op, "scale", scale, {out});
  expect_dtype(op, "sumsq", sumsq, {DType::f32});
  expect_dtype(op, "m", m, float_dtypes());
  expect_dtype(op, "norm", norm, {DType::f32});
  expect_dtype(op, "scale", scale, {DType::f32});
  expect_device(op, {{"sumsq", &sumsq}, {"m", &m}, {"norm", &norm}, {"scale", &scale}});
  for (const auto& [n, t] :
       {std::pair{"sumsq", &sumsq}, {"m", &m}, {"norm", &norm}, {"scale", &scale}}) {
    expect_addressable(op, n, *t);
    expect_int32_dims(op, n, *t);
  }
  expect_eps(op, eps);
  for (const auto& [n, t] : {std::pair{"norm", &norm}, {"scale", &scale}}) {
    expect_no_self_overlap(op, n, *t);
    expect_disjoint_or_same(op, n, *t, "sumsq", sumsq);
    expect_disjoint_or_same(op, n, *t, "m", m);
  }
  expect_disjoint(op, "scale", scale, "norm", norm);
  if (out == 0) return;
  const std::string text = layout.canonical();
  LaunchOptions options;
  options.stream = stream;
  options.layout = text;
  launch(kernels::dora_norm_finish(), {sumsq, m, Scalar(eps), norm, scale},
         Grid{uint32_t(cdiv(out, 1024)), 1, 1}, {{"BLOCK", 1024}}, options);
}

void dora_norm_backward(const TensorView& norm, const TensorView& grad_scale,
                        const TensorView& grad_m, void* stream, const Layout& layout) {
  const char* op = "dora_norm_backward";
  check_layout(op, layout, [] {
    return std::vector<OperandDims>{{"norm", {"out"}}, {"grad_scale", {"out"}}, {"grad_m", {"out"}}};
  });
  expect_shape(op, "norm", norm, {-1});
  const int64_t out = norm.shape[0];
  expect_shape(op, "grad_scale", grad_scale, {out});
  expect_shape(op, "grad_m", grad_m, {out});
  expect_dtype(op, "norm", norm, float_dtypes());
  expect_dtype(op, "grad_scale", grad_scale, float_dtypes());
  expect_dtype(op, "grad_m", grad_m, float_dtypes());
  expect_device(op, {{"norm", &norm}, {"grad_scale", &grad_scale}, {"grad_m", &grad_m}});
  for (const auto& [n, t] :
       {std::pair{"norm", &norm}, {"grad_scale", &grad_scale}, {"grad_m", &grad_m}}) {
    expect_addressable(op, n, *t);
    expect_int32_dims(op, n, *t);
  }
  expect_no_self_overlap(op, "grad_m", grad_m);
  expect_disjoint_or_same(op, "grad_m", grad_m, "grad_scale", grad_scale);
  expect_disjoint_or_same(op, "grad_m", grad_m, "norm", norm);
  if (out == 0) return;
  const std::string text = layout.canonical();
  LaunchOptions options;
  options.stream = stream;
  options.layout = text;
  // It runs in every backward pass of a DoRA layer: one meta map and memo for all
  // calls, so a repeated launch finds its kernel without the process-wide lookup.
  static const dsl::MetaMap meta = {{"BLOCK", 1024}};
  static LaunchMemo memo;
  options.memo = &memo;
  launch(kernels::dora_norm_backward(), {norm, grad_scale, grad_m}, Grid{uint32_t(cdiv(out, 1024)), 1, 1}, meta,
         options);
}

}  // namespace kerf::ops
