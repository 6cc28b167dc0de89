// Using an installed kerf from another CMake project: each LoRA op once, on
// the GPU when one is present and on the CPU otherwise, checked against plain
// C++ loops. Exit code 0 when every result matches.
#include <kerf/kerf.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace kerf;

namespace {

Device g_dev;  // where the ops run

// A float32 (or int64) tensor: a host copy of its values, and its memory (on
// the GPU, or host memory for the CPU back end). upload() after changing values.
class Tensor {
 public:
  Tensor(std::vector<int64_t> shape, DType dtype = DType::f32)
      : shape_(std::move(shape)), dtype_(dtype) {
    int64_t n = 1;
    for (int64_t d : shape_) n *= d;
    host_.assign(size_t(n), 0.0);
    memory_.assign(size_t(n) * size_t(dtype_size_bytes(dtype)), 0);
    if (g_dev.is_cuda())
      device_ = cuda::DeviceBuffer(std::max<size_t>(memory_.size(), 1), g_dev.index);
    upload();
  }
  double& operator[](int64_t i) { return host_[size_t(i)]; }
  int64_t numel() const { return int64_t(host_.size()); }
  void random(std::mt19937_64& rng, double scale = 1.0) {
    std::uniform_real_distribution<double> u(-scale, scale);
    for (double& v : host_) v = float(u(rng));
    upload();
  }
  TensorView view() const { return TensorView::contiguous(data(), dtype_, shape_, g_dev); }
  // Memory <- host values.
  void upload() {
    for (size_t i = 0; i < host_.size(); ++i) {
      if (dtype_ == DType::i64) {
        const auto v = int64_t(host_[i]);
        std::memcpy(&memory_[i * 8], &v, 8);
      } else {
        const auto v = float(host_[i]);
        std::memcpy(&memory_[i * 4], &v, 4);
      }
    }
    if (g_dev.is_cuda() && !memory_.empty()) device_.copy_from_host(memory_.data(), memory_.size());
  }
  // Host values <- memory (after the ops ran; waits for the GPU).
  void fetch() {
    if (g_dev.is_cuda() && !memory_.empty()) device_.copy_to_host(memory_.data(), memory_.size());
    for (size_t i = 0; i < host_.size(); ++i) {
      if (dtype_ == DType::i64) {
        int64_t v;
        std::memcpy(&v, &memory_[i * 8], 8);
        host_[i] = double(v);
      } else {
        float v;
        std::memcpy(&v, &memory_[i * 4], 4);
        host_[i] = v;
      }
    }
  }

 private:
  void* data() const {
    return g_dev.is_cuda() ? device_.data() : const_cast<uint8_t*>(memory_.data());
  }
  std::vector<int64_t> shape_;
  DType dtype_;
  std::vector<double> host_;
  std::vector<uint8_t> memory_;
  cuda::DeviceBuffer device_;
};

int g_failures = 0;

void expect_close(const char* what, double got, double want) {
  if (std::abs(got - want) <= 1e-4 * std::max(1.0, std::abs(want))) return;
  if (g_failures++ < 10) std::printf("  %s: got %.7g, expected %.7g\n", what, got, want);
}

}  // namespace

int main() {
  if (cuda::device_count() > 0) {
    g_dev = Device::cuda(0);
  } else if (jit::cpu::available()) {
    g_dev = Device::cpu();
  } else {
    std::printf("KERF-SKIPPED: no GPU and no CPU back end in this kerf build\n");
    return 0;
  }
  std::mt19937_64 rng(7);
  const double s = 0.5;
  try {
    // ---- DoRA norm: norm = ||W + s B@A|| per row, scale = m / norm; its partial/finish form;
    // grad_m.
    const int64_t out = 64, in = 96, r = 8;
    Tensor W({out, in}), A({r, in}), B({out, r}), m({out}), norm({out}), scale({out});
    W.random(rng);
    A.random(rng);
    B.random(rng);
    m.random(rng);
    ops::dora_norm(W.view(), A.view(), B.view(), m.view(), s, norm.view(), scale.view());
    Tensor sumsq({out}), norm2({out}), scale2({out}), grad_scale({out}), grad_m({out});
    ops::dora_norm_partial(W.view(), A.view(), B.view(), s, sumsq.view());
    ops::dora_norm_finish(sumsq.view(), m.view(), 0.0, norm2.view(), scale2.view());
    grad_scale.random(rng);
    ops::dora_norm_backward(norm.view(), grad_scale.view(), grad_m.view());
    norm.fetch();
    scale.fetch();
    norm2.fetch();
    grad_m.fetch();
    for (int64_t i = 0; i < out; ++i) {
      double ss = 0;
      for (int64_t j = 0; j < in; ++j) {
        double ba = 0;
        for (int64_t k = 0; k < r; ++k) ba += B[i * r + k] * A[k * in + j];
        ss += (W[i * in + j] + s * ba) * (W[i * in + j] + s * ba);
      }
      expect_close("dora_norm norm", norm[i], std::sqrt(ss));
      expect_close("dora_norm scale", scale[i], m[i] / std::sqrt(ss));
      expect_close("dora_norm_partial + finish", norm2[i], std::sqrt(ss));
      expect_close("dora_norm_backward", grad_m[i], grad_scale[i] / norm[i]);
    }

    // ---- LoRA merge then unmerge, in place.
    const std::vector<double> w0(&W[0], &W[0] + W.numel());
    ops::lora_merge(W.view(), A.view(), B.view(), s);
    W.fetch();
    for (int64_t i = 0; i < out; ++i)
      for (int64_t j = 0; j < in; ++j) {
        double ba = 0;
        for (int64_t k = 0; k < r; ++k) ba += B[i * r + k] * A[k * in + j];
        expect_close("lora_merge", W[i * in + j], w0[size_t(i * in + j)] + s * ba);
      }
    ops::lora_unmerge(W.view(), A.view(), B.view(), s);
    W.fetch();
    for (int64_t i = 0; i < W.numel(); ++i) expect_close("lora_unmerge", W[i], w0[size_t(i)]);

    // ---- The Flax layout (MaxText query kernel [emb, heads, head_dim]).
    Tensor K({16, 2, 3}), la({16, 4}), lb({4, 2, 3});
    K.random(rng);
    la.random(rng);
    lb.random(rng);
    const std::vector<double> k0(&K[0], &K[0] + K.numel());
    ops::lora_merge_flax(K.view(), la.view(), lb.view(), s);
    K.fetch();
    for (int64_t e = 0; e < 16; ++e)
      for (int64_t o = 0; o < 6; ++o) {
        double d = 0;
        for (int64_t k = 0; k < 4; ++k) d += la[e * 4 + k] * lb[k * 6 + o];
        expect_close("lora_merge_flax", K[e * 6 + o], k0[size_t(e * 6 + o)] + s * d);
      }

    // ---- MoE: PEFT's flat expert adapters, forward and backward.
    const int64_t E = 3, d1 = 10, d2 = 12, re = 2;
    Tensor We({E, d1, d2}), Weff({E, d1, d2}), lA({re * E, d2}), lB({d1, re * E}), dW({E, d1, d2});
    Tensor glA({re * E, d2}), glB({d1, re * E});
    We.random(rng);
    lA.random(rng);
    lB.random(rng);
    dW.random(rng);
    const ops::MoeLoraViews v = ops::peft_moe_lora_views(We.view(), lA.view(), lB.view());
    ops::moe_lora_materialize(We.view(), v.A, v.B, s, Weff.view());
    const ops::MoeLoraViews g = ops::peft_moe_lora_views(We.view(), glA.view(), glB.view());
    ops::moe_lora_materialize_backward(dW.view(), v.A, v.B, s, g.A, g.B);
    Weff.fetch();
    glA.fetch();
    glB.fetch();
    for (int64_t e = 0; e < E; ++e)
      for (int64_t o = 0; o < d1; ++o)
        for (int64_t i = 0; i < d2; ++i) {
          double d = 0;
          for (int64_t k = 0; k < re; ++k)
            d += lB[o * re * E + k * E + e] * lA[(e * re + k) * d2 + i];
          expect_close("moe_lora_materialize", Weff[(e * d1 + o) * d2 + i],
                       We[(e * d1 + o) * d2 + i] + s * d);
        }
    for (int64_t e = 0; e < E; ++e)
      for (int64_t k = 0; k < re; ++k) {
        for (int64_t i = 0; i < d2; ++i) {
          double acc = 0;
          for (int64_t o = 0; o < d1; ++o)
            acc += lB[o * re * E + k * E + e] * dW[(e * d1 + o) * d2 + i];
          expect_close("moe backward dA", glA[(e * re + k) * d2 + i], s * acc);
        }
        for (int64_t o = 0; o < d1; ++o) {
          double acc = 0;
          for (int64_t i = 0; i < d2; ++i)
            acc += dW[(e * d1 + o) * d2 + i] * lA[(e * re + k) * d2 + i];
          expect_close("moe backward dB", glB[o * re * E + k * E + e], s * acc);
        }
      }

    // ---- LoRA embedding (PEFT: lora_embedding_A [r, vocab], lora_embedding_B [dim, r]).
    const int64_t T = 9, V = 20, D = 16, rr = 4;
    Tensor x({T}, DType::i64), table({V, D}), eA({rr, V}), eB({D, rr}), y({T, D}), gy({T, D}),
        geA({rr, V}), geB({D, rr});
    for (int64_t t = 0; t < T; ++t) x[t] = double((t * 7) % V);
    x.upload();
    table.random(rng);
    eA.random(rng);
    eB.random(rng);
    gy.random(rng);
    ops::lora_embedding(x.view(), table.view(), eA.view(), eB.view(), s, y.view());
    ops::lora_embedding_backward(x.view(), eA.view(), eB.view(), gy.view(), s, geA.view(),
                                 geB.view());
    y.fetch();
    geB.fetch();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        const auto id = int64_t(x[t]);
        double l = 0;
        for (int64_t k = 0; k < rr; ++k) l += eA[k * V + id] * eB[d * rr + k];
        expect_close("lora_embedding", y[t * D + d], table[id * D + d] + s * l);
      }
    for (int64_t d = 0; d < D; ++d)
      for (int64_t k = 0; k < rr; ++k) {
        double acc = 0;
        for (int64_t t = 0; t < T; ++t) acc += gy[t * D + d] * eA[k * V + int64_t(x[t])];
        expect_close("lora_embedding_backward dB", geB[d * rr + k], s * acc);
      }
  } catch (const kerf::Error& e) {
    std::printf("kerf_consumer: %s\n", e.what());
    return 1;
  }
  if (g_failures) {
    std::printf("kerf_consumer: %d results differ on %s\n", g_failures, g_dev.str().c_str());
    return 1;
  }
  std::printf("kerf_consumer: every op matches on %s\n", g_dev.str().c_str());
  return 0;
}
