// The CPU back end's speed on the DoRA weight norm (2048x2048, r=16, fp32)
// beside a plain C++ loop of the same math compiled with -O2, single-threaded
// and with one std::thread per core.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "kerf/kerf.h"

using namespace kerf;
using Clock = std::chrono::steady_clock;

namespace {

// norm[i] = || W[i,:] + s * B[i,:] @ A ||, rows [lo, hi)
void plain_rows(const float* W, const float* A, const float* B, float s, float* norm, int64_t in, int64_t r,
                int64_t lo, int64_t hi) {
  std::vector<float> ba(static_cast<size_t>(in));
  for (int64_t i = lo; i < hi; ++i) {
    std::fill(ba.begin(), ba.end(), 0.0f);
    for (int64_t k = 0; k < r; ++k) {
      const float b = B[i * r + k];
      const float* a = A + k * in;
      for (int64_t j = 0; j < in; ++j) ba[size_t(j)] += b * a[j];
    }
    float ss = 0.0f;
    for (int64_t j = 0; j < in; ++j) {
      const float v = W[i * in + j] + s * ba[size_t(j)];
      ss += v * v;
    }
    norm[i] = std::sqrt(ss);
  }
}

template <class F>
double median_ms(F f, int reps) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main() {
  if (!jit::cpu::available()) {
    std::printf("kerf_bench_cpu: the CPU back end was not built (no LLVM)\n");
    return 1;
  }
  const int64_t out = 2048, in = 2048, r = 16;
  const float s = 2.0f;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> W(size_t(out * in)), A(size_t(r * in)), B(size_t(out * r)), m(size_t(out), 1.0f);
  for (float& x : W) x = u(rng);
  for (float& x : A) x = 0.1f * u(rng);
  for (float& x : B) x = 0.1f * u(rng);
  std::vector<float> norm(static_cast<size_t>(out)), scale(static_cast<size_t>(out)), ref(static_cast<size_t>(out));

  auto kerf_call = [&] {
    ops::dora_norm(TensorView::contiguous(W.data(), DType::f32, {out, in}),
                   TensorView::contiguous(A.data(), DType::f32, {r, in}),
                   TensorView::contiguous(B.data(), DType::f32, {out, r}),
                   TensorView::contiguous(m.data(), DType::f32, {out}), s,
                   TensorView::contiguous(norm.data(), DType::f32, {out}),
                   TensorView::contiguous(scale.data(), DType::f32, {out}));
  };
  const auto t0 = Clock::now();
  kerf_call();  // compiles
  const double first_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  const double kerf_ms = median_ms(kerf_call, 7);

  const double plain_ms = median_ms([&] { plain_rows(W.data(), A.data(), B.data(), s, ref.data(), in, r, 0, out); }, 3);
  const int threads = jit::cpu::thread_count();
  const double plain_mt_ms = median_ms(
      [&] {
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t] {
            plain_rows(W.data(), A.data(), B.data(), s, ref.data(), in, r, out * t / threads, out * (t + 1) / threads);
          });
        for (auto& th : pool) th.join();
      },
      5);
  double worst = 0;
  for (int64_t i = 0; i < out; ++i)
    worst = std::max(worst, double(std::abs(norm[size_t(i)] - ref[size_t(i)]) / ref[size_t(i)]));

  std::printf("DoRA norm %lldx%lld r=%lld fp32 on %d CPU threads (%s)\n", (long long)out, (long long)in,
              (long long)r, threads, jit::cpu::host_cpu().c_str());
  std::printf("  kerf CPU back end      %8.2f ms  (first call %.1f ms, compiles included)\n", kerf_ms, first_ms);
  std::printf("  plain C++ -O2, 1 thread %7.2f ms\n", plain_ms);
  std::printf("  plain C++ -O2, %d threads %5.2f ms\n", threads, plain_mt_ms);
  std::printf("  largest relative difference between the two: %.1e\n", worst);
  return 0;
}
