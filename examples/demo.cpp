// kerf in one page: write a kernel in the DSL, call it, and the first call
// compiles it (CUDA C++ -> NVRTC -> cubin on a GPU, LLVM -> native code on
// the CPU); the second call finds it compiled.
//
// The kernel is the DoRA weight norm: norm[i] = || W[i,:] + s * B[i,:] @ A ||.
//
//   ./kerf_demo          # the GPU if there is one, else the CPU
//   ./kerf_demo --cpu    # the CPU back end
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kerf/kerf.h"

using namespace kerf;
using namespace kerf::dsl;

// One program owns BLOCK_M rows; it walks the columns in BLOCK_K steps.
const Kernel dora_norm("demo_dora_norm", [](Builder& k) {
  const Tensor W = k.tensor("W", 2), A = k.tensor("A", 2), B = k.tensor("B", 2);
  const Value s = k.scalar("s");
  const Tensor norm = k.tensor("norm", 1);
  const int64_t BM = k.meta("BLOCK_M"), BK = k.meta("BLOCK_K"), R = k.meta("R_PAD");

  const Value rows = program_id(0) * BM + arange(BM);
  const Value rk = arange(R);
  const Value row_ok = rows.col() < W.dim(0);
  const Value b = load(B, {rows.col(), rk.row()}, row_ok & (rk.row() < A.dim(0)));  // [BM, R]
  const Value acc = for_range(0, W.dim(1), BK, zeros({BM, BK}), [&](const Value& k0, const Value& acc) {
    const Value cols = k0 + arange(BK);
    const Value col_ok = cols.row() < W.dim(1);
    const Value a = load(A, {rk.col(), cols.row()}, (rk.col() < A.dim(0)) & col_ok);   // [R, BK]
    const Value w = load(W, {rows.col(), cols.row()}, row_ok & col_ok);               // [BM, BK]
    const Value v = w + s * dot(b, a);  // W + s * B @ A, never materialized
    return acc + v * v;
  });
  store(norm, {rows}, sqrt(sum(acc, 1)), rows < W.dim(0));
});

int main(int argc, char** argv) {
  const bool force_cpu = argc > 1 && !std::strcmp(argv[1], "--cpu");
  const int64_t out = 1000, in = 1500, r = 7;  // not multiples of the block sizes
  const double s = 2.0;
  try {
    Device dev = Device::cpu();
    if (!force_cpu && cuda::device_count() > 0) dev = Device::cuda(0);
    if (!dev.is_cuda() && !jit::cpu::available()) {
      std::printf("kerf demo: no GPU (%s) and no CPU back end (built without LLVM)\n",
                  cuda::driver_unavailable_reason().c_str());
      return 1;
    }
    std::printf("kerf demo: DoRA weight norm of a %lldx%lld fp32 W with rank %lld, on %s\n",
                (long long)out, (long long)in, (long long)r,
                dev.is_cuda() ? cuda::device_info(0).name.c_str() : "the CPU");

    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<float> W(size_t(out * in)), A(size_t(r * in)), B(size_t(out * r)), norm(size_t(out), NAN);
    for (float& x : W) x = u(rng);
    for (float& x : A) x = 0.3f * u(rng);
    for (float& x : B) x = 0.3f * u(rng);

    // Tensors on the device (plain host memory for the CPU back end).
    cuda::DeviceBuffer dW, dA, dB, dN;
    void *pW = W.data(), *pA = A.data(), *pB = B.data(), *pN = norm.data();
    if (dev.is_cuda()) {
      dW = cuda::DeviceBuffer(W.size() * 4);
      dA = cuda::DeviceBuffer(A.size() * 4);
      dB = cuda::DeviceBuffer(B.size() * 4);
      dN = cuda::DeviceBuffer(norm.size() * 4);
      dW.copy_from_host(W.data(), W.size() * 4);
      dA.copy_from_host(A.data(), A.size() * 4);
      dB.copy_from_host(B.data(), B.size() * 4);
      pW = dW.data(), pA = dA.data(), pB = dB.data(), pN = dN.data();
    }
    const std::vector<Arg> args = {
        TensorView::contiguous(pW, DType::f32, {out, in}, dev),
        TensorView::contiguous(pA, DType::f32, {r, in}, dev),
        TensorView::contiguous(pB, DType::f32, {out, r}, dev), Scalar(s),
        TensorView::contiguous(pN, DType::f32, {out}, dev)};
    const MetaMap meta = {{"BLOCK_M", 32}, {"BLOCK_K", 64}, {"R_PAD", 16}};
    const Grid grid{uint32_t((out + 31) / 32), 1, 1};

    for (int call = 1; call <= 2; ++call) {
      const auto t0 = std::chrono::steady_clock::now();
      const LaunchInfo info = launch(dora_norm, args, grid, meta);
      if (dev.is_cuda()) cuda::device_synchronize(0);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (info.compiled)
        std::printf("call %d: compiled for %s in %.1f ms (trace, codegen, compile, load), ran in all %.1f ms\n",
                    call, info.backend.c_str(), info.compile_ms, ms);
      else if (info.source == KernelSource::memory)
        std::printf("call %d: reused the compiled kernel (%s); %.3f ms\n", call, info.backend.c_str(), ms);
      else  // an earlier run left it in the disk cache (or a mounted bundle holds it)
        std::printf("call %d: loaded the kernel from the %s (%s) in %.1f ms, no compile; ran in all %.1f ms\n", call,
                    info.source == KernelSource::bundle ? "bundle" : "disk cache", info.backend.c_str(),
                    info.compile_ms, ms);
    }
    if (dev.is_cuda()) dN.copy_to_host(norm.data(), norm.size() * 4);

    double worst = 0;
    for (int64_t i = 0; i < out; ++i) {
      double ss = 0;
      for (int64_t j = 0; j < in; ++j) {
        double ba = 0;
        for (int64_t k = 0; k < r; ++k) ba += double(B[size_t(i * r + k)]) * A[size_t(k * in + j)];
        const double v = W[size_t(i * in + j)] + s * ba;
        ss += v * v;
      }
      worst = std::max(worst, std::abs(norm[size_t(i)] - std::sqrt(ss)) / std::sqrt(ss));
    }
    std::printf("max relative error against a float64 reference: %.2e (%s)\n", worst,
                worst <= 1e-5 ? "ok" : "TOO LARGE");
    return worst <= 1e-5 ? 0 : 1;
  } catch (const kerf::Error& e) {
    std::printf("kerf demo: %s: %s\n", error_kind_name(e.kind()), e.what());
    return 1;
  }
}
