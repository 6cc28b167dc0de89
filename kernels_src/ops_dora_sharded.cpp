// DoRA norm beyond ops::dora_norm: the finish that turns summed partial sums of
// squares (dora_norm_partial, in ops_dora.cpp beside the plan it shares) into norm
// and scale, and the backward of the scale with respect to the magnitude.
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

// In-place elementwise ops may write where they read, element for element;
// any other overlap of an output with an input is rejected.
void expect_disjoint_or_same(const char* op, const char* out_name, const TensorView& out,
                             const char* in_name, const TensorView& in) {
  const bool same =
      out.data == in.data && out.dtype == in.dtype && out.rank == in.rank &&
      std::equal(out.strides.begin(), out.strides.begin() + out.rank, in.strides.begin());
  if (!same) expect_disjoint(op, out_name, out, in_name, in);
}

}  // namespace

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
