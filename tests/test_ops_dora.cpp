// The DoRA norm beyond ops::dora_norm: partial sums of squares and their
// finish, the magnitude's backward (grad_m = grad_scale / norm), and what eps
// does to a zero row (PEFT's eps = 0: norm 0, scale m/0).
#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "catch.h"
#include "cpu_test_util.h"
#include "device_tensor.h"
#include "error_test_util.h"
#include "gpu_test_util.h"
#include "kerf/error.h"
#include "kerf/ops/ops.h"

using namespace kerf;
using kerf::test::TestTensor;

namespace {

// sumsq[i] = sum_j (W + s*B@A)[i, j]^2 in float64, over columns [c0, c1).
std::vector<double> ref_sumsq(const TestTensor& W, const TestTensor& A, const TestTensor& B,
                              double s, int64_t c0, int64_t c1) {
  const int64_t out = W.shape()[0], in = W.shape()[1], r = A.shape()[0];
  std::vector<double> ss(size_t(out), 0.0);
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = c0; j < c1; ++j) {
      double ba = 0;
      for (int64_t k = 0; k < r; ++k) ba += B.get(i * r + k) * A.get(k * in + j);
      const double v = W.get(i * in + j) + s * ba;
      ss[size_t(i)] += v * v;
    }
  return ss;
}

struct PartialCase {
  int64_t out, in, r;
  DType w, ab;
  int64_t split;
};

void check_partial_and_finish(const PartialCase& c, Device dev, uint64_t seed) {
  CAPTURE(c.out, c.in, c.r, dtype_name(c.w), dtype_name(c.ab), c.split, seed, dev.str());
  std::mt19937_64 rng(seed);
  TestTensor W(c.w, {c.out, c.in}, dev), A(c.ab, {c.r, c.in}, dev), B(c.ab, {c.out, c.r}, dev);
  TestTensor m(DType::bf16, {c.out}, dev), sumsq(DType::f32, {c.out}, dev);
  TestTensor norm(DType::f32, {c.out}, dev), scale(DType::f32, {c.out}, dev);
  W.randomize(rng);
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  m.randomize(rng, 0.5, 1.5);
  sumsq.poison();
  norm.poison();
  scale.poison();
  const double s = 1.5, eps = 1e-6;
  ops::Config cfg;
  cfg.split_k = c.split;
  ops::dora_norm_partial(W.view(), A.view(), B.view(), s, sumsq.view(), nullptr, cfg);
  ops::dora_norm_finish(sumsq.view(), m.view(), eps, norm.view(), scale.view());
  test::sync(dev);
  sumsq.download();
  norm.download();
  scale.download();
  const std::vector<double> ref = ref_sumsq(W, A, B, s, 0, c.in);
  std::vector<double> gs, gn, gsc, rn, rsc;
  for (int64_t i = 0; i < c.out; ++i) {
    gs.push_back(sumsq.get(i));
    gn.push_back(norm.get(i));
    gsc.push_back(scale.get(i));
    rn.push_back(std::sqrt(ref[size_t(i)] + eps));
    rsc.push_back(m.get(i) / rn.back());
  }
  const double tol = test::tolerance(is_half(c.w) || is_half(c.ab) ? DType::bf16 : DType::f32);
  CHECK(test::max_relative_error(gs, ref) <= tol);
  CHECK(test::max_relative_error(gn, rn) <= tol);
  CHECK(test::max_relative_error(gsc, rsc) <= tol);
}

void run_partial_cases(Device dev) {
  const std::vector<PartialCase> cases = {
      {100, 130, 5, DType::f32, DType::f32, 0},
      {100, 130, 5, DType::bf16, DType::f32, 1},
      {256, 512, 16, DType::bf16, DType::bf16, 3},
      {37, 2000, 8, DType::f16, DType::f16, 0},
      // Ranks whose operands narrow the GPU steps (the 64x128 tile took 294912 bytes of
      // shared memory at rank 256 in bf16, 337920 at rank 128 with fp32 products).
      {70, 200, 256, DType::bf16, DType::bf16, 0},
      {70, 200, 128, DType::f32, DType::f32, 0},
      {70, 200, 200, DType::bf16, DType::f32, 0},
  };
  uint64_t seed = 7100;
  for (const PartialCase& c : cases) check_partial_and_finish(c, dev, seed++);
}

void check_backward(Device dev) {
  std::mt19937_64 rng(7200);
  for (DType gs_t : {DType::f32, DType::bf16})
    for (DType gm_t : {DType::f32, DType::bf16}) {
      CAPTURE(dtype_name(gs_t), dtype_name(gm_t), dev.str());
      const int64_t n = 1037;
      TestTensor norm(DType::f32, {n}, dev), gs(gs_t, {n}, dev), gm(gm_t, {n}, dev);
      norm.randomize(rng, 0.5, 4.0);
      gs.randomize(rng);
      gm.poison();
      ops::dora_norm_backward(norm.view(), gs.view(), gm.view());
      test::sync(dev);
      gm.download();
      std::vector<double> got, ref;
      for (int64_t i = 0; i < n; ++i) {
        got.push_back(gm.get(i));
        ref.push_back(gs.get(i) / norm.get(i));
      }
      CHECK(test::max_relative_error(got, ref) <= test::tolerance(gm_t));
    }
  // In place: grad_m may be grad_scale itself.
  TestTensor norm(DType::f32, {300}, dev), g(DType::f32, {300}, dev);
  norm.randomize(rng, 0.5, 4.0);
  g.randomize(rng);
  std::vector<double> ref;
  for (int64_t i = 0; i < 300; ++i) ref.push_back(g.get(i) / norm.get(i));
  ops::dora_norm_backward(norm.view(), g.view(), g.view());
  test::sync(dev);
  g.download();
  std::vector<double> got;
  for (int64_t i = 0; i < 300; ++i) got.push_back(g.get(i));
  CHECK(test::max_relative_error(got, ref) <= 1e-6);
}

// A zero row of W + s*B@A: with eps = 0 (PEFT) the norm is 0 and the scale is
// m / 0: +inf for m > 0, -inf for m < 0, NaN for m = 0. With eps > 0 the norm
// is sqrt(eps) and the scale finite. Both through dora_norm (fused and split)
// and through dora_norm_partial + dora_norm_finish.
void check_eps(Device dev) {
  const int64_t out = 6, in = 300, r = 4;
  std::mt19937_64 rng(7300);
  TestTensor W(DType::bf16, {out, in}, dev), A(DType::f32, {r, in}, dev),
      B(DType::f32, {out, r}, dev);
  TestTensor m(DType::f32, {out}, dev), norm(DType::f32, {out}, dev), scale(DType::f32, {out}, dev),
      sumsq(DType::f32, {out}, dev);
  W.randomize(rng);
  A.randomize(rng);
  B.randomize(rng);
  m.randomize(rng, 0.5, 1.5);
  // Rows 1, 2, 3 are zero in W and in B: their V rows are zero.
  for (int64_t i : {1, 2, 3}) {
    for (int64_t j = 0; j < in; ++j) W.set(i * in + j, 0.0);
    for (int64_t k = 0; k < r; ++k) B.set(i * r + k, 0.0);
  }
  m.set(1, 2.0);
  m.set(2, -3.0);
  m.set(3, 0.0);
  W.upload();
  B.upload();
  m.upload();
  for (double eps : {0.0, 1e-12, 0.25}) {
    for (int variant = 0; variant < 3; ++variant) {
      CAPTURE(eps, variant, dev.str());
      norm.poison();
      scale.poison();
      ops::Config cfg;
      if (variant == 0) cfg.split_k = 1;
      if (variant == 1) cfg.split_k = 3;
      if (variant < 2) {
        ops::dora_norm(W.view(), A.view(), B.view(), m.view(), 1.0, norm.view(), scale.view(), eps,
                       nullptr, cfg);
      } else {
        ops::dora_norm_partial(W.view(), A.view(), B.view(), 1.0, sumsq.view());
        ops::dora_norm_finish(sumsq.view(), m.view(), eps, norm.view(), scale.view());
      }
      test::sync(dev);
      norm.download();
      scale.download();
      const double n0 = std::sqrt(eps);
      for (int64_t i : {1, 2, 3}) CHECK(norm.get(i) == float(n0));
      if (eps == 0) {
        CHECK(scale.get(1) == std::numeric_limits<double>::infinity());
        CHECK(scale.get(2) == -std::numeric_limits<double>::infinity());
        CHECK(std::isnan(scale.get(3)));
      } else {
        CHECK(scale.get(1) == Approx(2.0 / n0).epsilon(1e-6));
        CHECK(scale.get(2) == Approx(-3.0 / n0).epsilon(1e-6));
        CHECK(scale.get(3) == 0.0);
      }
      for (int64_t i : {0, 4, 5}) CHECK(std::isfinite(scale.get(i)));
    }
  }
}

// dora_norm_finish in place: norm or scale written over m or over sumsq (f32, same
// strides), as an elementwise op may; each row's inputs are read before it is written.
void check_finish_in_place(Device dev) {
  const int64_t out = 1000;
  std::mt19937_64 rng(7400);
  for (int which = 0; which < 4; ++which) {
    CAPTURE(which, dev.str());
    TestTensor sumsq(DType::f32, {out}, dev), m(DType::f32, {out}, dev), norm(DType::f32, {out}, dev),
        scale(DType::f32, {out}, dev);
    sumsq.randomize(rng, 0.5, 4.0);
    m.randomize(rng, -2.0, 2.0);
    std::vector<double> want_norm, want_scale;
    for (int64_t i = 0; i < out; ++i) {
      want_norm.push_back(std::sqrt(sumsq.get(i) + 0.125));
      want_scale.push_back(m.get(i) / want_norm.back());
    }
    norm.poison();
    scale.poison();
    // 0: norm over m, 1: scale over m, 2: norm over sumsq, 3: scale over sumsq.
    TestTensor& n_out = which == 0 ? m : which == 2 ? sumsq : norm;
    TestTensor& s_out = which == 1 ? m : which == 3 ? sumsq : scale;
    ops::dora_norm_finish(sumsq.view(), m.view(), 0.125, n_out.view(), s_out.view());
    test::sync(dev);
    n_out.download();
    s_out.download();
    std::vector<double> got_norm, got_scale;
    for (int64_t i = 0; i < out; ++i) {
      got_norm.push_back(n_out.get(i));
      got_scale.push_back(s_out.get(i));
    }
    CHECK(test::max_relative_error(got_norm, want_norm, 1e-6) <= 1e-5);
    CHECK(test::max_relative_error(got_scale, want_scale, 1e-6) <= 1e-5);
  }
}

}  // namespace

TEST_CASE("dora_norm_finish may write norm or scale over m or sumsq", "[cpu][ops][dora]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_finish_in_place(Device::cpu());
}

TEST_CASE("dora_norm_finish may write norm or scale over m or sumsq on the GPU", "[gpu][ops][dora]") {
  KERF_REQUIRE_GPU();
  check_finish_in_place(Device::cuda(0));
}

TEST_CASE("dora_norm_partial and dora_norm_finish match a float64 reference on the CPU",
          "[cpu][ops][dora]") {
  KERF_REQUIRE_CPU_BACKEND();
  run_partial_cases(Device::cpu());
}

TEST_CASE("dora_norm_partial and dora_norm_finish match a float64 reference on the GPU",
          "[gpu][ops][dora]") {
  KERF_REQUIRE_GPU();
  run_partial_cases(Device::cuda(0));
}

TEST_CASE("dora_norm_backward gives grad_m = grad_scale / norm on the CPU", "[cpu][ops][dora]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_backward(Device::cpu());
}

TEST_CASE("dora_norm_backward gives grad_m = grad_scale / norm on the GPU", "[gpu][ops][dora]") {
  KERF_REQUIRE_GPU();
  check_backward(Device::cuda(0));
}

TEST_CASE("dora_norm's eps decides what a zero row gives, as documented, on the CPU",
          "[cpu][ops][dora]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_eps(Device::cpu());
}

TEST_CASE("dora_norm's eps decides what a zero row gives, as documented, on the GPU",
          "[gpu][ops][dora]") {
  KERF_REQUIRE_GPU();
  check_eps(Device::cuda(0));
}

namespace {

// A call repeating the last one's shapes, strides, dtypes and alignment takes the
// op's short path: it must still compute from the data it is given, and still
// refuse outputs that overlap an input or each other; a call that changes
// anything the checks read is checked in full.
void check_repeated_calls(Device dev) {
  CAPTURE(dev.str());
  std::mt19937_64 rng(71);
  const int64_t out = 37, in = 45, r = 3;  // neither a multiple of any block size
  TestTensor W(DType::f32, {out, in}, dev), A(DType::f32, {r, in}, dev), B(DType::f32, {out, r}, dev);
  // m, norm and scale in one buffer, 64 floats apart (every view 16-byte aligned).
  TestTensor pool(DType::f32, {4 * 64}, dev);
  pool.randomize(rng, 0.5, 1.5);
  const auto slot = [&](int64_t k) {
    return TensorView::contiguous(static_cast<float*>(pool.data()) + k * 64, DType::f32, {out}, dev);
  };
  const TensorView m = slot(0), norm = slot(1), scale = slot(2);
  const double s = 0.75;
  for (int call = 0; call < 4; ++call) {
    CAPTURE(call);
    // The kernel the op keeps for its repeated calls lapses on a cache clear: the
    // third call resolves it again, the fourth launches it directly.
    if (call == 2) clear_kernel_cache();
    W.randomize(rng);  // fresh data in the same memory each call
    A.randomize(rng, -0.5, 0.5);
    B.randomize(rng, -0.5, 0.5);
    ops::dora_norm(W.view(), A.view(), B.view(), m, s, norm, scale, 0.0, nullptr);
    test::sync(dev);
    pool.download();
    const std::vector<double> ss = ref_sumsq(W, A, B, s, 0, in);
    for (int64_t i = 0; i < out; ++i) {
      const double want = std::sqrt(ss[size_t(i)]), got = pool.get(64 + i);
      CHECK(std::abs(got - want) <= 1e-5 * want);
      CHECK(std::abs(pool.get(128 + i) - pool.get(i) / want) <= 1e-5 * std::abs(pool.get(i) / want));
    }
  }
  // The same fingerprint with memory that overlaps: refused, and nothing is written.
  CHECK_INVALID(ops::dora_norm(W.view(), A.view(), B.view(), m, s, m, scale, 0.0, nullptr),
                "dora_norm: output norm overlaps m in memory");
  CHECK_INVALID(ops::dora_norm(W.view(), A.view(), B.view(), m, s, norm, norm, 0.0, nullptr),
                "dora_norm: output scale overlaps norm in memory");
  // The fingerprint keeps only an address's alignment: one whose elements would run past the
  // end of the address space is refused on the short path too.
  const uintptr_t low4 = reinterpret_cast<uintptr_t>(norm.data) & 15;
  const TensorView high = TensorView::contiguous(reinterpret_cast<void*>(uintptr_t(0) - 64 + low4),
                                                 DType::f32, {out}, dev);
  CHECK_INVALID(ops::dora_norm(W.view(), A.view(), B.view(), m, s, high, scale, 0.0, nullptr),
                "has strides that reach beyond the address space");
  CHECK_INVALID(ops::dora_norm(W.view(), A.view(), B.view(), m, s, norm, scale, -1.0, nullptr),
                "dora_norm: eps must be >= 0, got -1");
  CHECK_INVALID(ops::dora_norm(W.view(), A.view(), B.view(), m, s, norm, scale, std::nan(""), nullptr),
                "dora_norm: eps must be >= 0, got");  // NaN compares false both ways
  CHECK_INVALID(ops::dora_norm(W.view(), A.view(), B.view(), m, s, norm, scale, 1e39, nullptr),
                "dora_norm: eps must be within float32's range (<= 3.40282e+38), got 1e+39");  // inf in fp32
  CHECK_INVALID(ops::dora_norm(W.view(), A.view(), B.view(), m, s, norm, scale, -1e-30, nullptr),
                "dora_norm: eps must be >= 0, got -1e-30");
  CHECK_INVALID(ops::dora_norm(W.view(), A.view(), B.view({out, r - 1}, {r, 1}), m, s, norm, scale, 0.0, nullptr),
                "dora_norm: B must have shape [37, 3], got [37, 2]");
  // Another alignment (4 bytes past the pool's 16) is a new specialization, still right.
  const TensorView norm4 =
      TensorView::contiguous(static_cast<float*>(pool.data()) + 3 * 64 + 1, DType::f32, {out}, dev);
  ops::dora_norm(W.view(), A.view(), B.view(), m, s, norm4, scale, 0.0, nullptr);
  test::sync(dev);
  pool.download();
  const std::vector<double> ss = ref_sumsq(W, A, B, s, 0, in);
  for (int64_t i = 0; i < out; ++i) {
    const double want = std::sqrt(ss[size_t(i)]);
    CHECK(std::abs(pool.get(3 * 64 + 1 + i) - want) <= 1e-5 * want);
  }
}

}  // namespace

TEST_CASE("a repeated dora_norm call computes from its new data and rechecks its memory on the CPU",
          "[cpu][ops][dora]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_repeated_calls(Device::cpu());
}

TEST_CASE("a repeated dora_norm call computes from its new data and rechecks its memory on the GPU",
          "[gpu][ops][dora]") {
  KERF_REQUIRE_GPU();
  check_repeated_calls(Device::cuda(0));
}
