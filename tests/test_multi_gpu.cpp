// Several GPUs in one process: each op runs on the device its tensors are on
// (with the null stream, or a stream of that device) while another device is
// current, and leaves the caller's current device as it was; two threads each
// driving its own GPU; sharded ops with one shard per GPU (the partial sums
// combined on the host, as an all-reduce would), against float64 references.
// These need two GPUs and say they were skipped elsewhere.
#include <cmath>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch.h"
#include "device_tensor.h"
#include "error_test_util.h"
#include "gpu_test_util.h"
#include "kerf/error.h"
#include "kerf/ops/ops.h"

using namespace kerf;
using kerf::test::TestTensor;

namespace {

using test::rms_scaled_error;

// A tensor on `dev` holding `values` (rounded to its dtype).
TestTensor tensor_of(DType t, std::vector<int64_t> shape, Device dev,
                     const std::vector<double>& values) {
  TestTensor x(t, std::move(shape), dev);
  for (size_t i = 0; i < values.size(); ++i) x.set(int64_t(i), values[i]);
  x.upload();
  return x;
}

std::vector<double> uniform(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = d(rng);
  return v;
}

// `v` as `t` holds it (what the GPU reads of a rounded input).
std::vector<double> rounded(DType t, std::vector<double> v) {
  for (double& x : v) x = test::round_to(t, x);
  return v;
}

// (W + s * B @ A) for W [out, in], A [r, in], B [out, r], row-major, float64.
std::vector<double> merged(const std::vector<double>& W, const std::vector<double>& A,
                           const std::vector<double>& B, double s, int64_t out, int64_t in,
                           int64_t r) {
  std::vector<double> y(W);
  for (int64_t i = 0; i < out; ++i)
    for (int64_t k = 0; k < r; ++k) {
      const double b = s * B[size_t(i * r + k)];
      for (int64_t j = 0; j < in; ++j) y[size_t(i * in + j)] += b * A[size_t(k * in + j)];
    }
  return y;
}

// DoRA's norm and scale of W + s * B @ A per row, float64.
struct DoraRef {
  std::vector<double> norm, scale;
};
DoraRef dora_reference(const std::vector<double>& W, const std::vector<double>& A,
                       const std::vector<double>& B, const std::vector<double>& m, double s,
                       int64_t out, int64_t in, int64_t r) {
  const std::vector<double> y = merged(W, A, B, s, out, in, r);
  DoraRef ref{std::vector<double>(size_t(out)), std::vector<double>(size_t(out))};
  for (int64_t i = 0; i < out; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < in; ++j) ss += y[size_t(i * in + j)] * y[size_t(i * in + j)];
    ref.norm[size_t(i)] = std::sqrt(ss);
    ref.scale[size_t(i)] = m[size_t(i)] / ref.norm[size_t(i)];
  }
  return ref;
}

// The LoRA embedding's output and gradients (PEFT's layout), float64.
struct EmbeddingRef {
  std::vector<double> out, grad_a, grad_b;
};
EmbeddingRef embedding_reference(const std::vector<double>& ids, const std::vector<double>& table,
                                 const std::vector<double>& A, const std::vector<double>& B,
                                 const std::vector<double>& grad_out, double s, int64_t V,
                                 int64_t D, int64_t r) {
  const int64_t T = int64_t(ids.size());
  EmbeddingRef ref{std::vector<double>(size_t(T * D)), std::vector<double>(size_t(r * V), 0.0),
                   std::vector<double>(size_t(D * r), 0.0)};
  for (int64_t t = 0; t < T; ++t) {
    const int64_t v = int64_t(ids[size_t(t)]);
    for (int64_t d = 0; d < D; ++d) {
      double acc = table[size_t(v * D + d)];
      for (int64_t q = 0; q < r; ++q) acc += s * A[size_t(q * V + v)] * B[size_t(d * r + q)];
      ref.out[size_t(t * D + d)] = acc;
      const double g = grad_out[size_t(t * D + d)];
      for (int64_t q = 0; q < r; ++q) {
        ref.grad_a[size_t(q * V + v)] += s * g * B[size_t(d * r + q)];
        ref.grad_b[size_t(d * r + q)] += s * g * A[size_t(q * V + v)];
      }
    }
  }
  return ref;
}

// The MoE backward's dA [E, r, K] and dB [E, N, r] of dW [E, N, K], float64.
struct MoeGrads {
  std::vector<double> da, db;
};
MoeGrads moe_backward_reference(const std::vector<double>& dW, const std::vector<double>& A,
                                const std::vector<double>& B, double s, int64_t E, int64_t N,
                                int64_t K, int64_t r) {
  MoeGrads ref{std::vector<double>(size_t(E * r * K), 0.0),
               std::vector<double>(size_t(E * N * r), 0.0)};
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const double g = dW[size_t((e * N + n) * K + k)];
        for (int64_t q = 0; q < r; ++q) {
          ref.da[size_t((e * r + q) * K + k)] += s * B[size_t((e * N + n) * r + q)] * g;
          ref.db[size_t((e * N + n) * r + q)] += s * g * A[size_t((e * r + q) * K + k)];
        }
      }
  return ref;
}

// The device of every other test is 0: put it back however a case ends.
struct CurrentDeviceZero {
  CurrentDeviceZero() { cuda::set_current_device(0); }
  ~CurrentDeviceZero() {
    try {
      cuda::set_current_device(0);
    } catch (...) {
    }
  }
};

// Each op on `dev`, on `stream` (null: the device's legacy stream), checked against
// float64; the thread's current device is 0 throughout and stays so.
void check_ops_on(Device dev, void* stream, std::mt19937_64& rng) {
  CAPTURE(dev.str(), stream != nullptr);
  const auto sync = [&] {
    if (stream)
      cuda::stream_synchronize(stream);
    else
      cuda::device_synchronize(dev.index);
  };
  // DoRA norm: bf16 W with fp32 adapters (PEFT's default; here holding bf16 values), sizes no tile
  // divides.
  {
    const int64_t out = 203, in = 333, r = 12;
    const double s = 0.75;
    const std::vector<double> w = rounded(DType::bf16, uniform(rng, out * in, -1, 1)),
                              a = rounded(DType::bf16, uniform(rng, r * in, -0.3, 0.3)),
                              b = rounded(DType::bf16, uniform(rng, out * r, -0.3, 0.3)),
                              m = uniform(rng, out, 0.5, 1.5);
    TestTensor W = tensor_of(DType::bf16, {out, in}, dev, w),
               A = tensor_of(DType::f32, {r, in}, dev, a),
               B = tensor_of(DType::f32, {out, r}, dev, b),
               M = tensor_of(DType::f32, {out}, dev, m);
    TestTensor norm(DType::f32, {out}, dev), scale(DType::f32, {out}, dev);
    norm.poison();
    scale.poison();
    ops::dora_norm(W.view(), A.view(), B.view(), M.view(), s, norm.view(), scale.view(), 0.0,
                   stream);
    CHECK(cuda::current_device() == 0);
    sync();
    const DoraRef ref = dora_reference(w, a, b, m, s, out, in, r);
    CHECK(test::max_relative_error(test::values(norm), ref.norm) <= 1e-2);
    CHECK(test::max_relative_error(test::values(scale), ref.scale) <= 1e-2);
  }
  // LoRA merge in place, fp32.
  {
    const int64_t out = 100, in = 129, r = 5;
    const double s = 1.25;
    const std::vector<double> w = uniform(rng, out * in, -1, 1), a = uniform(rng, r * in, -1, 1),
                              b = uniform(rng, out * r, -1, 1);
    TestTensor W = tensor_of(DType::f32, {out, in}, dev, w),
               A = tensor_of(DType::f32, {r, in}, dev, a),
               B = tensor_of(DType::f32, {out, r}, dev, b);
    ops::lora_merge(W.view(), A.view(), B.view(), s, stream);
    CHECK(cuda::current_device() == 0);
    sync();
    CHECK(rms_scaled_error(test::values(W), merged(w, a, b, s, out, in, r)) <= 1e-5);
  }
  // MoE materialize forward and backward, bf16 (the backward's bf16 gradients are summed in
  // an fp32 workspace of the device and flushed into them).
  {
    const int64_t E = 3, N = 70, K = 90, r = 4;
    const double s = 0.5;
    const std::vector<double> w = rounded(DType::bf16, uniform(rng, E * N * K, -1, 1)),
                              a = rounded(DType::bf16, uniform(rng, E * r * K, -1, 1)),
                              b = rounded(DType::bf16, uniform(rng, E * N * r, -1, 1)),
                              g = rounded(DType::bf16, uniform(rng, E * N * K, -1, 1));
    TestTensor W = tensor_of(DType::bf16, {E, N, K}, dev, w),
               A = tensor_of(DType::bf16, {E, r, K}, dev, a),
               B = tensor_of(DType::bf16, {E, N, r}, dev, b),
               G = tensor_of(DType::bf16, {E, N, K}, dev, g);
    TestTensor W_eff(DType::bf16, {E, N, K}, dev), dA(DType::bf16, {E, r, K}, dev),
        dB(DType::bf16, {E, N, r}, dev);
    W_eff.poison();
    dA.poison();
    dB.poison();
    ops::moe_lora_materialize(W.view(), A.view(), B.view(), s, W_eff.view(), stream);
    ops::moe_lora_materialize_backward(G.view(), A.view(), B.view(), s, dA.view(), dB.view(),
                                       stream);
    CHECK(cuda::current_device() == 0);
    sync();
    std::vector<double> ref_w;
    for (int64_t e = 0; e < E; ++e) {
      const auto part = [e](const std::vector<double>& v, int64_t n) {
        return std::vector<double>(v.begin() + e * n, v.begin() + (e + 1) * n);
      };
      const std::vector<double> we =
          merged(part(w, N * K), part(a, r * K), part(b, N * r), s, N, K, r);
      ref_w.insert(ref_w.end(), we.begin(), we.end());
    }
    const MoeGrads ref = moe_backward_reference(g, a, b, s, E, N, K, r);
    CHECK(test::max_relative_error(test::values(W_eff), ref_w, 1e-1) <= 1e-2);
    CHECK(rms_scaled_error(test::values(dA), ref.da) <= 1e-2);
    CHECK(rms_scaled_error(test::values(dB), ref.db) <= 1e-2);
  }
  // LoRA embedding forward and backward (ids with repeats; fp32 tables, bf16 gradient).
  {
    const int64_t T = 37, V = 300, D = 64, r = 8;
    const double s = 2.0;
    std::uniform_int_distribution<int64_t> id(0, V - 1);
    std::vector<double> ids(static_cast<size_t>(T));
    for (double& x : ids) x = double(id(rng));
    ids[5] = ids[9] = ids[30];
    const std::vector<double> wt = uniform(rng, V * D, -1, 1),
                              a = rounded(DType::bf16, uniform(rng, r * V, -1, 1)),
                              b = rounded(DType::bf16, uniform(rng, D * r, -1, 1)),
                              g = rounded(DType::bf16, uniform(rng, T * D, -1, 1));
    TestTensor X = tensor_of(DType::i64, {T}, dev, ids),
               Wt = tensor_of(DType::f32, {V, D}, dev, wt),
               A = tensor_of(DType::f32, {r, V}, dev, a), B = tensor_of(DType::f32, {D, r}, dev, b),
               G = tensor_of(DType::bf16, {T, D}, dev, g);
    TestTensor out(DType::f32, {T, D}, dev), gA(DType::f32, {r, V}, dev),
        gB(DType::f32, {D, r}, dev);
    out.poison();
    gA.poison();
    gB.poison();
    ops::lora_embedding(X.view(), Wt.view(), A.view(), B.view(), s, out.view(), {}, stream);
    ops::lora_embedding_backward(X.view(), A.view(), B.view(), G.view(), s, gA.view(), gB.view(),
                                 {}, stream);
    CHECK(cuda::current_device() == 0);
    sync();
    const EmbeddingRef ref = embedding_reference(ids, wt, a, b, g, s, V, D, r);
    CHECK(rms_scaled_error(test::values(out), ref.out) <= 1e-5);
    // grad_out is bf16 (products in bf16: the adapters hold bf16 values, so none is rounded).
    CHECK(rms_scaled_error(test::values(gA), ref.grad_a) <= 1e-2);
    CHECK(rms_scaled_error(test::values(gB), ref.grad_b) <= 1e-2);
  }
}

}  // namespace

TEST_CASE("each op runs on the GPU its tensors are on, the caller's current device left as it was",
          "[gpu][multigpu]") {
  KERF_REQUIRE_TWO_GPUS();
  const CurrentDeviceZero zero;
  std::mt19937_64 rng(9100);
  const int last = cuda::device_count() - 1;
  for (const int d : {last, 0}) {
    check_ops_on(Device::cuda(d), nullptr, rng);
    const cuda::Stream stream(d);
    check_ops_on(Device::cuda(d), stream.handle(), rng);
  }
}

TEST_CASE("two threads, each driving its own GPU, get their own answers", "[gpu][multigpu]") {
  KERF_REQUIRE_TWO_GPUS();
  const CurrentDeviceZero zero;
  const int n = std::min(cuda::device_count(), 4);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  // Catch2's assertions are not for other threads: each thread reports a failure in words.
  for (int d = 0; d < n; ++d)
    threads.emplace_back([d, &errors] {
      try {
        const Device dev = Device::cuda(d);
        cuda::set_current_device(d);
        std::mt19937_64 rng(uint64_t(9200 + d));
        for (int round = 0; round < 3; ++round) {
          const int64_t out = 257 + 31 * d, in = 515, r = 16;
          const double s = 0.5 + d;
          const std::vector<double> w = uniform(rng, out * in, -1, 1),
                                    a = uniform(rng, r * in, -0.3, 0.3),
                                    b = uniform(rng, out * r, -0.3, 0.3),
                                    m = uniform(rng, out, 0.5, 1.5);
          TestTensor W = tensor_of(DType::f32, {out, in}, dev, w),
                     A = tensor_of(DType::f32, {r, in}, dev, a),
                     B = tensor_of(DType::f32, {out, r}, dev, b),
                     M = tensor_of(DType::f32, {out}, dev, m);
          TestTensor norm(DType::f32, {out}, dev), scale(DType::f32, {out}, dev);
          norm.poison();
          ops::dora_norm(W.view(), A.view(), B.view(), M.view(), s, norm.view(), scale.view());
          cuda::device_synchronize(d);
          const std::vector<double> ref = dora_reference(w, a, b, m, s, out, in, r).norm;
          const double err = test::max_relative_error(test::values(norm), ref);
          if (!(err <= 1e-5))
            throw std::runtime_error("round " + std::to_string(round) + ": relative error " +
                                     std::to_string(err));
          if (cuda::current_device() != d)
            throw std::runtime_error("the thread's current device changed");
        }
      } catch (const std::exception& e) {
        errors[size_t(d)] = "cuda:" + std::to_string(d) + ": " + e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::string& e : errors) CHECK(e.empty());
}

TEST_CASE("sharded ops with one shard per GPU, combined on the host, match float64",
          "[gpu][multigpu]") {
  KERF_REQUIRE_TWO_GPUS();
  const CurrentDeviceZero zero;
  std::mt19937_64 rng(9300);
  const Device g0 = Device::cuda(0), g1 = Device::cuda(cuda::device_count() - 1);
  const Device shard_dev[2] = {g0, g1};

  SECTION("DoRA norm with W split on in (row-parallel): partial sums per GPU, then the finish") {
    const int64_t out = 150, in = 2 * 161, r = 16, half = in / 2;
    const double s = 0.5;
    const std::vector<double> w = rounded(DType::bf16, uniform(rng, out * in, -1, 1)),
                              a = rounded(DType::bf16, uniform(rng, r * in, -0.3, 0.3)),
                              b = rounded(DType::bf16, uniform(rng, out * r, -0.3, 0.3)),
                              m = uniform(rng, out, 0.5, 1.5);
    ops::Layout tp;
    tp.mesh = {{"tp", 2}};
    tp.specs = {{"W", {"", "tp"}}, {"A", {"", "tp"}}};
    std::vector<double> total(static_cast<size_t>(out), 0.0);
    for (int c = 0; c < 2; ++c) {
      std::vector<double> wc, ac;
      for (int64_t i = 0; i < out; ++i)
        wc.insert(wc.end(), w.begin() + i * in + c * half, w.begin() + i * in + (c + 1) * half);
      for (int64_t k = 0; k < r; ++k)
        ac.insert(ac.end(), a.begin() + k * in + c * half, a.begin() + k * in + (c + 1) * half);
      TestTensor W = tensor_of(DType::bf16, {out, half}, shard_dev[c], wc),
                 A = tensor_of(DType::bf16, {r, half}, shard_dev[c], ac),
                 B = tensor_of(DType::bf16, {out, r}, shard_dev[c], b),
                 part(DType::f32, {out}, shard_dev[c]);
      part.poison();
      ops::dora_norm_partial(W.view(), A.view(), B.view(), s, part.view(), nullptr, {}, tp);
      CHECK(cuda::current_device() == 0);
      const std::vector<double> p = test::values(part);
      for (int64_t i = 0; i < out; ++i) total[size_t(i)] += p[size_t(i)];
    }
    TestTensor sumsq = tensor_of(DType::f32, {out}, g1, total),
               M = tensor_of(DType::f32, {out}, g1, m);
    TestTensor norm(DType::f32, {out}, g1), scale(DType::f32, {out}, g1);
    ops::dora_norm_finish(sumsq.view(), M.view(), 0.0, norm.view(), scale.view());
    const DoraRef ref = dora_reference(w, a, b, m, s, out, in, r);
    CHECK(test::max_relative_error(test::values(norm), ref.norm) <= 1e-2);
    CHECK(test::max_relative_error(test::values(scale), ref.scale) <= 1e-2);
  }

  SECTION(
      "the embedding split on vocab (vocab-parallel): each GPU looks up its ids, the outputs "
      "summed") {
    const int64_t T = 41, V = 2 * 97, D = 48, r = 8, Vh = V / 2;
    const double s = 1.5;
    std::uniform_int_distribution<int64_t> id(0, V - 1);
    std::vector<double> ids(static_cast<size_t>(T));
    for (double& x : ids) x = double(id(rng));
    const std::vector<double> wt = uniform(rng, V * D, -1, 1), a = uniform(rng, r * V, -1, 1),
                              b = uniform(rng, D * r, -1, 1), g = uniform(rng, T * D, -1, 1);
    std::vector<double> out_sum(static_cast<size_t>(T * D), 0.0),
        gb_sum(static_cast<size_t>(D * r), 0.0), ga_all(static_cast<size_t>(r * V), 0.0);
    for (int c = 0; c < 2; ++c) {
      const Device dev = shard_dev[c];
      // The forward's operands and the backward's (its own: no weight, grad_A beside A).
      ops::Layout vp, vp_back;
      vp.mesh = vp_back.mesh = {{"vp", 2}};
      vp.specs = {{"weight", {"vp"}}, {"A", {"", "vp"}}};
      vp_back.specs = {{"A", {"", "vp"}}, {"grad_A", {"", "vp"}}};
      vp.coords = vp_back.coords = {c};
      std::vector<double> ac;
      for (int64_t q = 0; q < r; ++q)
        ac.insert(ac.end(), a.begin() + q * V + c * Vh, a.begin() + q * V + (c + 1) * Vh);
      TestTensor X = tensor_of(DType::i32, {T}, dev, ids),
                 Wt = tensor_of(
                     DType::f32, {Vh, D}, dev,
                     std::vector<double>(wt.begin() + c * Vh * D, wt.begin() + (c + 1) * Vh * D)),
                 A = tensor_of(DType::f32, {r, Vh}, dev, ac),
                 B = tensor_of(DType::f32, {D, r}, dev, b),
                 G = tensor_of(DType::f32, {T, D}, dev, g);
      TestTensor out(DType::f32, {T, D}, dev), gA(DType::f32, {r, Vh}, dev),
          gB(DType::f32, {D, r}, dev);
      out.poison();
      gA.poison();
      gB.poison();
      ops::lora_embedding(X.view(), Wt.view(), A.view(), B.view(), s, out.view(), {}, nullptr, {},
                          vp);
      ops::lora_embedding_backward(X.view(), A.view(), B.view(), G.view(), s, gA.view(), gB.view(),
                                   {}, nullptr, {}, vp_back);
      CHECK(cuda::current_device() == 0);
      const std::vector<double> o = test::values(out), ga = test::values(gA), gb = test::values(gB);
      for (size_t i = 0; i < o.size(); ++i) out_sum[i] += o[i];
      for (size_t i = 0; i < gb.size(); ++i) gb_sum[i] += gb[i];
      for (int64_t q = 0; q < r; ++q)
        for (int64_t v = 0; v < Vh; ++v)
          ga_all[size_t(q * V + c * Vh + v)] = ga[size_t(q * Vh + v)];
    }
    const EmbeddingRef ref = embedding_reference(ids, wt, a, b, g, s, V, D, r);
    CHECK(rms_scaled_error(out_sum, ref.out) <= 1e-5);
    CHECK(rms_scaled_error(ga_all, ref.grad_a) <= 1e-5);
    CHECK(rms_scaled_error(gb_sum, ref.grad_b) <= 1e-5);
  }

  SECTION(
      "the MoE backward with experts split (expert-parallel): each GPU its experts' gradients") {
    const int64_t E = 4, N = 66, K = 130, r = 8, Eh = E / 2;
    const double s = 0.25;
    const std::vector<double> a = rounded(DType::bf16, uniform(rng, E * r * K, -1, 1)),
                              b = rounded(DType::bf16, uniform(rng, E * N * r, -1, 1)),
                              g = rounded(DType::bf16, uniform(rng, E * N * K, -1, 1));
    ops::Layout ep;
    ep.mesh = {{"ep", 2}};
    ep.specs = {{"dW_eff", {"ep"}}, {"A", {"ep"}}, {"B", {"ep"}}, {"dA", {"ep"}}, {"dB", {"ep"}}};
    std::vector<double> da_all, db_all;
    for (int c = 0; c < 2; ++c) {
      const Device dev = shard_dev[c];
      const auto part = [c, Eh](const std::vector<double>& v, int64_t per_expert) {
        return std::vector<double>(v.begin() + c * Eh * per_expert,
                                   v.begin() + (c + 1) * Eh * per_expert);
      };
      TestTensor G = tensor_of(DType::bf16, {Eh, N, K}, dev, part(g, N * K)),
                 A = tensor_of(DType::f32, {Eh, r, K}, dev, part(a, r * K)),
                 B = tensor_of(DType::f32, {Eh, N, r}, dev, part(b, N * r));
      TestTensor dA(DType::f32, {Eh, r, K}, dev), dB(DType::f32, {Eh, N, r}, dev);
      dA.poison();
      dB.poison();
      ops::moe_lora_materialize_backward(G.view(), A.view(), B.view(), s, dA.view(), dB.view(),
                                         nullptr, {}, ep);
      CHECK(cuda::current_device() == 0);
      const std::vector<double> da = test::values(dA), db = test::values(dB);
      da_all.insert(da_all.end(), da.begin(), da.end());
      db_all.insert(db_all.end(), db.begin(), db.end());
    }
    const MoeGrads ref = moe_backward_reference(g, a, b, s, E, N, K, r);
    // fp32 adapters holding bf16 values on a bf16 gradient (products in bf16, nothing rounded).
    CHECK(rms_scaled_error(da_all, ref.da) <= 1e-2);
    CHECK(rms_scaled_error(db_all, ref.db) <= 1e-2);
  }
}

TEST_CASE("a stream of another GPU than the tensors' is refused, naming both", "[gpu][multigpu]") {
  KERF_REQUIRE_TWO_GPUS();
  const CurrentDeviceZero zero;
  const int last = cuda::device_count() - 1;
  const Device dev = Device::cuda(last);
  std::mt19937_64 rng(9400);
  const int64_t out = 96, in = 160, r = 8;
  TestTensor W = tensor_of(DType::f32, {out, in}, dev, uniform(rng, out * in, -1, 1)),
             A = tensor_of(DType::f32, {r, in}, dev, uniform(rng, r * in, -1, 1)),
             B = tensor_of(DType::f32, {out, r}, dev, uniform(rng, out * r, -1, 1));
  const cuda::Stream other(0);
  const std::string want = "runs on device " + std::to_string(last);
  // A given config (no tuning): the launch fails, and says why.
  const std::string untuned = test::thrown<InvalidArgument>([&] {
    ops::lora_merge(W.view(), A.view(), B.view(), 0.5, other.handle(),
                    ops::Config{64, 64, 1, 4, 2});
  });
  CHECK_THAT(untuned, Catch::Contains("belongs to CUDA device 0"));
  CHECK_THAT(untuned, Catch::Contains(want));
  // The tuner's own calls (a shape not tuned before): refused before any candidate is timed.
  TestTensor W2 = tensor_of(DType::f32, {out + 1, in}, dev, uniform(rng, (out + 1) * in, -1, 1)),
             B2 = tensor_of(DType::f32, {out + 1, r}, dev, uniform(rng, (out + 1) * r, -1, 1));
  const std::string tuned = test::thrown<InvalidArgument>(
      [&] { ops::lora_merge(W2.view(), A.view(), B2.view(), 0.5, other.handle()); });
  CHECK_THAT(tuned, Catch::Contains("belongs to CUDA device 0"));
  CHECK_THAT(tuned, Catch::Contains(want));
  // With the right stream the same calls run.
  const cuda::Stream own(last);
  ops::lora_merge(W.view(), A.view(), B.view(), 0.5, own.handle(), ops::Config{64, 64, 1, 4, 2});
  own.synchronize();
}
