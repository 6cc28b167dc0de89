// An f16 base (or gradient) with fp32 adapters whose values, or s times them, lie beyond
// f16's range (65504) while the answer lies well inside it: every op gives finite answers,
// never inf or NaN (rounded to f16 first, s*B = 1e5 turned into inf, written into W in
// place by the merge). On the CPU the products run in fp32 and every answer is the
// float64 one; on the GPU they run in TF32, whose terms each carry their operands'
// rounding (2^-11 of the term, an f16's precision; here terms up to 40 times the answer
// cancel, so against exact products the answers would be up to 3.4% off): there the
// answers are checked against products of the adapters rounded as the GPU rounds them.
#include <cmath>
#include <random>

#include "catch.h"
#include "cpu_test_util.h"
#include "device_tensor.h"
#include "gpu_test_util.h"
#include "kerf/ops/ops.h"
#include "kernels_src/ops_accumulate.h"
#include "smem_fit_util.h"

using namespace kerf;
using kerf::test::TestTensor;

namespace {

// Uniform in [-1, 1) times `scale`, as f32.
void fill(TestTensor& t, std::mt19937_64& rng, double scale) { t.randomize(rng, -scale, scale); }

// delta[o, i] = s * sum_k B[o, k] A[k, i], in float64, of the adapters as `as_multiplied` gives them.
template <class F>
std::vector<double> lora_delta(TestTensor& A, TestTensor& B, int64_t out, int64_t in, int64_t r, double s,
                               const F& as_multiplied) {
  std::vector<double> d(size_t(out * in), 0.0);
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      double acc = 0;
      for (int64_t k = 0; k < r; ++k) acc += as_multiplied(B.get(o * r + k)) * as_multiplied(A.get(k * in + i));
      d[size_t(o * in + i)] = s * acc;
    }
  return d;
}

// W + delta, element by element: the merged weight the ops' answers are checked against.
std::vector<double> merged_weight(const std::vector<double>& w, const std::vector<double>& delta) {
  std::vector<double> v(w.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = w[i] + delta[i];
  return v;
}

// The 2-norm of each row of a row-major [rows, cols] matrix, in float64.
std::vector<double> row_norms(const std::vector<double>& v, int64_t rows, int64_t cols) {
  std::vector<double> n;
  for (int64_t o = 0; o < rows; ++o) {
    double ss = 0;
    for (int64_t i = 0; i < cols; ++i) ss += v[size_t(o * cols + i)] * v[size_t(o * cols + i)];
    n.push_back(std::sqrt(ss));
  }
  return n;
}

// t as one expert, [1, ...t's shape]: its dtype, device and values (the MoE ops' W, A, B).
TestTensor one_expert(TestTensor& t) {
  std::vector<int64_t> shape = t.shape();
  shape.insert(shape.begin(), 1);
  TestTensor e(t.dtype(), shape, t.view().device);
  const std::vector<double> v = values(t);
  for (size_t i = 0; i < v.size(); ++i) e.set(int64_t(i), v[i]);
  e.upload();
  return e;
}

void check_half_range(Device dev) {
  CAPTURE(dev.str());
  // Every answer is checked against products of the adapters as the kernels multiply
  // them: on the GPU as TF32 (f32's range at an f16's precision: the error of a term is
  // 2^-11 of the term, which for these adapters is up to 40 times the answer), on the
  // CPU in f32. s = 2 commutes with the rounding (s * B is what the kernels round).
  const auto as_multiplied = [&](double x) { return dev.is_cuda() ? test::tf32(x) : x; };
  std::mt19937_64 rng(9100);
  const int64_t out = 70, in = 130, r = 5;
  const double s = 2.0, tol = test::tolerance(DType::f16);
  // s * B up to 4e5 and A up to 1e-4: each term of B @ A below 20, every product finite.
  TestTensor W(DType::f16, {out, in}, dev), A(DType::f32, {r, in}, dev), B(DType::f32, {out, r}, dev);
  fill(W, rng, 1.0);
  fill(A, rng, 1e-4);
  fill(B, rng, 2e5);
  const std::vector<double> w0 = values(W);
  const std::vector<double> ref = merged_weight(w0, lora_delta(A, B, out, in, r, s, as_multiplied));
  {
    INFO("lora_merge");
    ops::lora_merge(W.view(), A.view(), B.view(), s);
    test::sync(dev);
    CHECK(test::max_relative_error(values(W), ref, 1.0) <= tol);
    // Back within the rounding of the merged values (f16: half an ulp, 2^-11 relative).
    double merged = 0;
    for (double v : ref) merged = std::max(merged, std::abs(v));
    ops::lora_unmerge(W.view(), A.view(), B.view(), s);
    test::sync(dev);
    CHECK(test::max_relative_error(values(W), w0, merged) <= 0x1p-10);
  }
  for (int64_t i = 0; i < W.numel(); ++i) W.set(i, w0[size_t(i)]);
  W.upload();
  {
    INFO("dora_norm");
    TestTensor m(DType::f32, {out}, dev), norm(DType::f32, {out}, dev), scale(DType::f32, {out}, dev);
    fill(m, rng, 1.0);
    norm.poison();
    scale.poison();
    ops::dora_norm(W.view(), A.view(), B.view(), m.view(), s, norm.view(), scale.view());
    test::sync(dev);
    const std::vector<double> rn = row_norms(ref, out, in);
    std::vector<double> rs;
    for (int64_t o = 0; o < out; ++o) rs.push_back(m.get(o) / rn[size_t(o)]);
    CHECK(test::max_relative_error(values(norm), rn) <= tol);
    CHECK(test::max_relative_error(values(scale), rs) <= tol);
  }
  {
    INFO("moe_lora_materialize");
    TestTensor W3 = one_expert(W), A3 = one_expert(A), B3 = one_expert(B), W_eff(DType::f16, {1, out, in}, dev);
    W_eff.poison();
    ops::moe_lora_materialize(W3.view(), A3.view(), B3.view(), s, W_eff.view());
    test::sync(dev);
    CHECK(test::max_relative_error(values(W_eff), ref, 1.0) <= tol);

    INFO("moe_lora_materialize_backward");
    // dA = s * B^T @ dW [r, in] and dB = s * dW @ A^T [out, r]: with B and A beyond f16 too.
    TestTensor dW(DType::f16, {1, out, in}, dev), A_big(DType::f32, {1, r, in}, dev),
        dA(DType::f32, {1, r, in}, dev), dB(DType::f32, {1, out, r}, dev);
    fill(dW, rng, 1.0);
    fill(A_big, rng, 1e5);
    dA.poison();
    dB.poison();
    ops::moe_lora_materialize_backward(dW.view(), A_big.view(), B3.view(), s, dA.view(), dB.view());
    test::sync(dev);
    std::vector<double> ra(size_t(r * in), 0.0), rb(size_t(out * r), 0.0);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i)
        for (int64_t k = 0; k < r; ++k) {
          ra[size_t(k * in + i)] += s * as_multiplied(B3.get(o * r + k)) * dW.get(o * in + i);
          rb[size_t(o * r + k)] += s * dW.get(o * in + i) * as_multiplied(A_big.get(k * in + i));
        }
    CHECK(test::max_relative_error(values(dA), ra, 1.0) <= 1e-4);
    CHECK(test::max_relative_error(values(dB), rb, 1.0) <= 1e-4);
  }
  {
    INFO("lora_embedding and lora_embedding_backward");
    // PEFT's layout: weight [V, D], A [r, V], B [D, r]; A's columns beyond f16, B tiny.
    const int64_t V = 50, D = 24, T = 37;
    TestTensor x(DType::i64, {T}, dev), weight(DType::f16, {V, D}, dev), Ae(DType::f32, {r, V}, dev),
        Be(DType::f32, {D, r}, dev), y(DType::f16, {T, D}, dev);
    std::uniform_int_distribution<int64_t> id(0, V - 1);
    for (int64_t t = 0; t < T; ++t) x.set(t, double(id(rng)));
    x.upload();
    fill(weight, rng, 1.0);
    fill(Ae, rng, 2e5);
    fill(Be, rng, 1e-4);
    y.poison();
    ops::lora_embedding(x.view(), weight.view(), Ae.view(), Be.view(), s, y.view());
    test::sync(dev);
    std::vector<double> ref_y;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t v = int64_t(x.get(t));
      for (int64_t d = 0; d < D; ++d) {
        double l = 0;
        for (int64_t k = 0; k < r; ++k) l += as_multiplied(Ae.get(k * V + v)) * as_multiplied(Be.get(d * r + k));
        ref_y.push_back(weight.get(v * D + d) + s * l);
      }
    }
    CHECK(test::max_relative_error(values(y), ref_y, 1.0) <= tol);
    // Backward with grad_out f16 and both adapters beyond f16's range.
    TestTensor g(DType::f16, {T, D}, dev), Bb(DType::f32, {D, r}, dev), dAe(DType::f32, {r, V}, dev),
        dBe(DType::f32, {D, r}, dev);
    fill(g, rng, 1.0);
    fill(Bb, rng, 1e5);
    dAe.poison();
    dBe.poison();
    ops::lora_embedding_backward(x.view(), Ae.view(), Bb.view(), g.view(), s, dAe.view(), dBe.view());
    test::sync(dev);
    std::vector<double> ra(size_t(r * V), 0.0), rb(size_t(D * r), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t v = int64_t(x.get(t));
      for (int64_t d = 0; d < D; ++d)
        for (int64_t k = 0; k < r; ++k) {
          ra[size_t(k * V + v)] += s * g.get(t * D + d) * as_multiplied(Bb.get(d * r + k));
          rb[size_t(d * r + k)] += s * g.get(t * D + d) * as_multiplied(Ae.get(k * V + v));
        }
    }
    CHECK(test::max_relative_error(values(dAe), ra, 1.0) <= 1e-4);
    CHECK(test::max_relative_error(values(dBe), rb, 1.0) <= 1e-4);
  }
}

// All f16: W, A and B in f16 (each within its range) and s large, so that s*B lies
// beyond 65504 (s*B rounded to f16 first was inf: the DoRA norms came out NaN, the MoE
// forward inf). The products are exact in f16 and s is applied in fp32 after them, so
// every answer is the float64 one to f16's tolerance.
void check_all_f16_large_scale(Device dev) {
  CAPTURE(dev.str());
  std::mt19937_64 rng(9200);
  const int64_t out = 70, in = 130, r = 5;
  const double s = 100.0, tol = test::tolerance(DType::f16);
  TestTensor W(DType::f16, {out, in}, dev), A(DType::f16, {r, in}, dev), B(DType::f16, {out, r}, dev);
  fill(W, rng, 1.0);
  fill(A, rng, 1e-2);
  fill(B, rng, 2e3);  // s*B up to 2e5
  const std::vector<double> ref = merged_weight(values(W), lora_delta(A, B, out, in, r, s, [](double x) { return x; }));
  const std::vector<double> rn = row_norms(ref, out, in);
  {
    INFO("dora_norm");
    TestTensor m(DType::f16, {out}, dev), norm(DType::f32, {out}, dev), scale(DType::f32, {out}, dev);
    fill(m, rng, 1.0);
    norm.poison();
    scale.poison();
    ops::dora_norm(W.view(), A.view(), B.view(), m.view(), s, norm.view(), scale.view());
    test::sync(dev);
    CHECK(test::max_relative_error(values(norm), rn) <= tol);
    INFO("dora_norm_partial");
    TestTensor sumsq(DType::f32, {out}, dev);
    sumsq.poison();
    ops::dora_norm_partial(W.view(), A.view(), B.view(), s, sumsq.view());
    test::sync(dev);
    std::vector<double> partial_norm;
    for (double v : values(sumsq)) partial_norm.push_back(std::sqrt(v));
    CHECK(test::max_relative_error(partial_norm, rn) <= tol);
  }
  {
    INFO("moe_lora_materialize");
    TestTensor W3 = one_expert(W), A3 = one_expert(A), B3 = one_expert(B), W_eff(DType::f16, {1, out, in}, dev);
    W_eff.poison();
    ops::moe_lora_materialize(W3.view(), A3.view(), B3.view(), s, W_eff.view());
    test::sync(dev);
    CHECK(test::max_relative_error(values(W_eff), ref, 1.0) <= tol);
  }
  {
    INFO("lora_merge");
    ops::lora_merge(W.view(), A.view(), B.view(), s);
    test::sync(dev);
    CHECK(test::max_relative_error(values(W), ref, 1.0) <= tol);
  }
}

}  // namespace

TEST_CASE("f16 bases with fp32 adapters beyond f16's range give finite right answers on the CPU",
          "[cpu][ops][dtypes]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_half_range(Device::cpu());
}

TEST_CASE("f16 bases with fp32 adapters beyond f16's range give finite right answers on the GPU",
          "[gpu][ops][dtypes]") {
  KERF_REQUIRE_GPU();
  check_half_range(Device::cuda(0));
}

// Config.meta TF32: 1 (the default) lets an f16 base's fp32 adapters multiply as TF32 on
// the GPU; 0 keeps them exact (fp32 FMA, PEFT's products). The planned kernel carries the
// choice; values other than 0 and 1 are refused, and ops without such products take it too.
TEST_CASE("Config.meta TF32 = 0 keeps an f16 base's fp32 products exact; other values are refused",
          "[ops][dtypes]") {
  const Device dev = Device::cuda(0);  // planned only: nothing is launched or read
  void* const p = test::planning_address();
  const TensorView dW = TensorView::contiguous(p, DType::f16, {2, 64, 128}, dev);
  const TensorView A = TensorView::contiguous(p, DType::f32, {2, 16, 128}, dev);
  const TensorView B = TensorView::contiguous(p, DType::f32, {2, 64, 16}, dev);
  const TensorView dA = TensorView::contiguous(p, DType::f32, {2, 16, 128}, dev);
  const TensorView dB = TensorView::contiguous(p, DType::f32, {2, 64, 16}, dev);
  const auto tf32_of = [&](const ops::Config& c) {
    const autotune::KernelCall k = ops::detail::moe_backward_kernel(dW, A, B, 1.0, dA, dB, 132, c);
    return k.meta.count("TF32") ? k.meta.at("TF32") : 0;
  };
  CHECK(tf32_of({}) == 1);
  ops::Config exact;
  exact.meta["TF32"] = 0;
  CHECK(tf32_of(exact) == 0);
  // bf16 gradients: no TF32 product either way.
  const TensorView dW16 = TensorView::contiguous(p, DType::bf16, {2, 64, 128}, dev);
  CHECK(ops::detail::moe_backward_kernel(dW16, A, B, 1.0, dA, dB, 132, {}).meta.count("TF32") == 0);

  TestTensor W(DType::f16, {4, 8}, Device::cpu()), Af(DType::f32, {2, 8}, Device::cpu()),
      Bf(DType::f32, {4, 2}, Device::cpu());
  ops::Config bad;
  bad.meta["TF32"] = 2;
  CHECK_THROWS_WITH(ops::lora_merge(W.view(), Af.view(), Bf.view(), 1.0, nullptr, bad),
                    Catch::Contains("Config.meta TF32 must be in [0, 1], got 2"));
}

TEST_CASE("all-f16 calls whose s*B passes f16's range give finite right answers on the CPU", "[cpu][ops][dtypes]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_all_f16_large_scale(Device::cpu());
}

TEST_CASE("all-f16 calls whose s*B passes f16's range give finite right answers on the GPU", "[gpu][ops][dtypes]") {
  KERF_REQUIRE_GPU();
  check_all_f16_large_scale(Device::cuda(0));
}
