// Host-side cost of a cached kerf::launch next to the bare launch of the same
// kernel, so that the in-memory hot path (no tracing, no hashing of source or
// IR, no disk) stays cheap: the difference must stay under 1 us.
//
//   GPU (when a device is present): kerf::launch vs cuda::launch (a direct
//       cuLaunchKernel through the driver table) of the same CUfunction.
//   CPU back end: kerf::launch vs jit::cpu::run_grid of the same compiled
//       kernel (one program, run on the calling thread), i.e. kerf's dispatch.
//
// Each figure is the median over batches of the mean time per call in a batch;
// on the GPU the two launches are timed in alternating batches and their
// difference is the median of the per-batch differences. Exit status 1 when a
// difference is 1 us or more. KERF_BENCH_BREAKDOWN=1 adds a whole op's host
// time, its parts, and the driver's launch of empty kernels by parameter
// bytes, threads and shared memory.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "kerf/cache/cuda_binary.h"
#include "kerf/dsl/dsl.h"
#include "kerf/jit/abi.h"
#include "kerf/jit/cpu_backend.h"
#include "kerf/jit/launch.h"
#include "kerf/jit/nvrtc.h"
#include "kerf/kernels/kernels.h"
#include "kerf/ops/ops.h"
#include "kerf/runtime/cuda.h"

using namespace kerf;
using namespace kerf::dsl;

namespace {

constexpr int kBatches = 21;

const Kernel& axpb() {
  static const Kernel k("bench_axpb", [](Builder& b) {
    auto x = b.tensor("x", 1), out = b.tensor("out", 1);
    auto a = b.scalar("a"), c = b.scalar("b");
    const int64_t B = b.meta("BLOCK");
    auto i = program_id(0) * B + arange(B);
    auto m = i < x.dim(0);
    store(out, {i}, load(x, {i}, m) * a + c, m);
  });
  return k;
}

// Median over batches of ns per call; `after_batch` runs untimed (e.g. a sync).
double ns_per_call(int per_batch, const std::function<void()>& call,
                   const std::function<void()>& after_batch) {
  std::vector<double> ns;
  for (int b = 0; b < kBatches; ++b) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < per_batch; ++i) call();
    const auto t1 = std::chrono::steady_clock::now();
    if (after_batch) after_batch();
    ns.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / per_batch);
  }
  std::sort(ns.begin(), ns.end());
  return ns[ns.size() / 2];
}

// Two calls timed in alternating batches: the medians of each and of the
// per-batch differences (on a VM whose launch cost drifts by a microsecond
// within a process, the paired difference moves far less than either).
struct Paired {
  double a_ns, b_ns, diff_ns;
};
Paired ns_per_call_paired(int per_batch, const std::function<void()>& a, const std::function<void()>& b,
                          const std::function<void()>& after_batch) {
  std::vector<double> na, nb, nd;
  const auto batch = [&](const std::function<void()>& call) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < per_batch; ++i) call();
    const auto t1 = std::chrono::steady_clock::now();
    if (after_batch) after_batch();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / per_batch;
  };
  for (int i = 0; i < kBatches; ++i) {
    na.push_back(batch(a));
    nb.push_back(batch(b));
    nd.push_back(na.back() - nb.back());
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  return {median(na), median(nb), median(nd)};
}

bool report(const char* what, double kerf_ns, double bare_ns, double diff) {
  std::printf("%-4s  kerf::launch %8.1f ns   bare %8.1f ns   difference %7.1f ns   %s\n", what,
              kerf_ns, bare_ns, diff, diff < 1000.0 ? "ok (< 1 us)" : "TOO SLOW (>= 1 us)");
  return diff < 1000.0;
}

bool bench_cpu() {
  if (!jit::cpu::available()) {
    std::printf("cpu   skipped: the CPU back end is not built\n");
    return true;
  }
  const int64_t n = 256;
  std::vector<float> x(static_cast<size_t>(n), 1.0f), out(static_cast<size_t>(n));
  const std::vector<Arg> args = {TensorView::contiguous(x.data(), DType::f32, {n}),
                                 TensorView::contiguous(out.data(), DType::f32, {n}), Scalar(2.0),
                                 Scalar(1.0)};
  const dsl::MetaMap meta = {{"BLOCK", 256}};
  launch(axpb(), args, Grid{1}, meta);  // compile or load once

  const ir::Function fn = axpb().trace(arg_specs(args), meta);
  const std::unique_ptr<jit::cpu::CpuKernel> k = jit::cpu::compile(fn);
  std::vector<jit::Slot> slots(jit::slot_count(fn.params));
  jit::pack_args(fn.params, args, slots.data());

  const double kerf_ns = ns_per_call(20000, [&] { launch(axpb(), args, Grid{1}, meta); }, {});
  const double bare_ns =
      ns_per_call(20000, [&] { jit::cpu::run_grid(*k, Grid{1}, slots.data()); }, {});
  const double prepare_ns = ns_per_call(20000, [&] { prepare(axpb(), args, meta); }, {});
  std::printf("cpu   kerf::prepare (the lookup alone) %.1f ns\n", prepare_ns);
  const bool ok = report("cpu", kerf_ns, bare_ns, kerf_ns - bare_ns);

  // A whole op next to the one launch it makes: what the op adds (checks, plan
  // lookup, arguments) is the same host code on the GPU.
  const int64_t R = 16, C = 64, r = 4;  // one program: run on the calling thread
  std::vector<float> w(size_t(R * C), 0.5f), a(size_t(r * C), 0.25f), b(size_t(R * r), 0.25f), mag(size_t(R), 1.0f);
  std::vector<float> nrm(static_cast<size_t>(R)), scl(static_cast<size_t>(R));
  const TensorView W = TensorView::contiguous(w.data(), DType::f32, {R, C});
  const TensorView A = TensorView::contiguous(a.data(), DType::f32, {r, C});
  const TensorView B = TensorView::contiguous(b.data(), DType::f32, {R, r});
  const TensorView m = TensorView::contiguous(mag.data(), DType::f32, {R});
  const TensorView norm = TensorView::contiguous(nrm.data(), DType::f32, {R});
  const TensorView scale = TensorView::contiguous(scl.data(), DType::f32, {R});
  ops::Config cfg;
  cfg.block_m = 16;
  cfg.block_k = 64;
  cfg.split_k = 1;
  cfg.num_warps = 4;
  cfg.num_stages = 1;
  const auto op = [&] { ops::dora_norm(W, A, B, m, 0.5, norm, scale, 0.0, nullptr, cfg); };
  const std::vector<Arg> dargs = {W, A, B, m, Scalar(0.5), Scalar(0.0), norm, scale};
  const dsl::MetaMap dmeta = {{"BLOCK_M", 16}, {"BLOCK_K", 64}, {"R_PAD", 16},
                              {"DOT", int64_t(DType::f32)}, {"num_warps", 4}, {"num_stages", 1}};
  const auto l = [&] { launch(kernels::dora_norm_fused(), dargs, Grid{1}, dmeta); };
  op();
  l();
  const double op_ns = ns_per_call(20000, op, {}), launch_ns = ns_per_call(20000, l, {});
  std::printf("cpu   ops::dora_norm f32[%lld,%lld] r=%lld %8.1f ns; its launch alone %8.1f ns; the op adds %7.1f ns\n",
              static_cast<long long>(R), static_cast<long long>(C), static_cast<long long>(r), op_ns, launch_ns,
              op_ns - launch_ns);
  return ok;
}

bool bench_gpu() {
  if (cuda::device_count() == 0) {
    std::printf("gpu   skipped: %s\n", cuda::driver_unavailable_reason().c_str());
    return true;
  }
  const int64_t n = 1 << 12;
  cuda::DeviceBuffer dx(size_t(n) * 4), dout(size_t(n) * 4);
  dx.fill_bytes(0);
  const Device dev = Device::cuda(0);
  const std::vector<Arg> args = {TensorView::contiguous(dx.data(), DType::f32, {n}, dev),
                                 TensorView::contiguous(dout.data(), DType::f32, {n}, dev),
                                 Scalar(2.0), Scalar(1.0)};
  const dsl::MetaMap meta = {{"BLOCK", 256}};
  const Grid grid{uint32_t(n / 256)};
  cuda::Stream stream(0);
  LaunchOptions options;
  options.stream = stream.handle();
  launch(axpb(), args, grid, meta, options);  // compile or load once
  stream.synchronize();

  // The same kernel, loaded by hand, with its argument slots packed once.
  const ir::Function fn = axpb().trace(arg_specs(args), meta);
  const cache::CudaBinary bin = cache::cuda_binary(fn, device_arch(0), "");
  cuda::Module module(bin.image.data(), 0);
  void* function = module.function(bin.entry);
  std::vector<jit::Slot> slots(jit::slot_count(fn.params));
  jit::pack_args(fn.params, args, slots.data());
  void* params[] = {slots.data()};

  const auto sync = [&] { stream.synchronize(); };
  const int per_batch = 500;  // well under the launch queue's depth
  const Paired lb = ns_per_call_paired(
      per_batch, [&] { launch(axpb(), args, grid, meta, options); },
      [&] { cuda::launch(function, grid, bin.threads, bin.smem_bytes, stream.handle(), params); }, sync);
  const bool ok = report("gpu", lb.a_ns, lb.b_ns, lb.diff_ns);
  // The bare launch above asks the driver for the stream's context first; kerf's launches
  // make the module's context current instead (one query when it already is).
  const double bare_in_ns = ns_per_call(
      per_batch,
      [&] {
        cuda::launch_in(module.context(), function, grid, bin.threads, bin.smem_bytes, stream.handle(), params);
      },
      sync);
  std::printf("gpu   bare launch in the module's context (no stream lookup) %8.1f ns\n", bare_in_ns);
  const double legacy_ns = ns_per_call(
      per_batch, [&] { cuda::launch(function, grid, bin.threads, bin.smem_bytes, nullptr, params); },
      [] { cuda::device_synchronize(0); });
  std::printf("gpu   bare launch on the legacy default stream %8.1f ns\n", legacy_ns);

  // A whole op, as kerf.ops.dora_norm calls it from Python (python_overhead.py's
  // shape): checks, plan lookup, workspace, launch. Random inputs.
  const int64_t R = 256, C = 256, r = 16;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> w_host(size_t(R * C));
  for (auto& x : w_host) {
    const float f = nd(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    x = uint16_t(u >> 16);  // bf16
  }
  std::vector<float> a_host(size_t(r * C)), b_host(size_t(R * r)), m_host(static_cast<size_t>(R));
  for (auto& x : a_host) x = nd(rng) / 16;
  for (auto& x : b_host) x = nd(rng);
  for (auto& x : m_host) x = 0.5f + std::abs(nd(rng));
  cuda::DeviceBuffer dW(w_host.size() * 2), dA(a_host.size() * 4), dB(b_host.size() * 4),
      dm(m_host.size() * 4), dnorm(size_t(R) * 4), dscale(size_t(R) * 4);
  dW.copy_from_host(w_host.data(), dW.bytes());
  dA.copy_from_host(a_host.data(), dA.bytes());
  dB.copy_from_host(b_host.data(), dB.bytes());
  dm.copy_from_host(m_host.data(), dm.bytes());
  const TensorView W = TensorView::contiguous(dW.data(), DType::bf16, {R, C}, dev);
  const TensorView A = TensorView::contiguous(dA.data(), DType::f32, {r, C}, dev);
  const TensorView B = TensorView::contiguous(dB.data(), DType::f32, {R, r}, dev);
  const TensorView m = TensorView::contiguous(dm.data(), DType::f32, {R}, dev);
  const TensorView norm = TensorView::contiguous(dnorm.data(), DType::f32, {R}, dev);
  const TensorView scale = TensorView::contiguous(dscale.data(), DType::f32, {R}, dev);
  const auto op = [&] { ops::dora_norm(W, A, B, m, 0.5, norm, scale, 0.0, stream.handle()); };
  op();
  stream.synchronize();
  const double op_ns = ns_per_call(per_batch, op, sync);
  std::printf("gpu   ops::dora_norm bf16[%lld,%lld] r=%lld: %8.1f ns per call (host)\n",
              static_cast<long long>(R), static_cast<long long>(C), static_cast<long long>(r), op_ns);
  if (std::getenv("KERF_BENCH_BREAKDOWN")) {
    ops::Config cfg;
    cfg.block_m = 64;
    cfg.block_k = 128;
    cfg.split_k = 2;
    cfg.num_warps = 4;
    cfg.num_stages = 3;
    const auto op2 = [&] { ops::dora_norm(W, A, B, m, 0.5, norm, scale, 0.0, stream.handle(), cfg); };
    op2();
    std::printf("gpu   ops::dora_norm, config given: %8.1f ns\n", ns_per_call(per_batch, op2, sync));
    ops::Config fused = cfg;
    fused.split_k = 1;  // one launch of the fused kernel: 8 tensor arguments, a 1-D grid
    const auto op3 = [&] { ops::dora_norm(W, A, B, m, 0.5, norm, scale, 0.0, stream.handle(), fused); };
    op3();
    std::printf("gpu   ops::dora_norm, fused config (split 1): %8.1f ns\n", ns_per_call(per_batch, op3, sync));
    // Everything but the launch: on zero rows the op returns after its checks.
    const auto rows0 = [](const TensorView& t) {
      TensorView v = t;
      v.shape[0] = 0;
      return v;
    };
    const TensorView W0 = rows0(W), B0 = rows0(B), m0 = rows0(m), norm0 = rows0(norm), scale0 = rows0(scale);
    const auto op0 = [&] { ops::dora_norm(W0, A, B0, m0, 0.5, norm0, scale0, 0.0, stream.handle()); };
    std::printf("gpu   ops::dora_norm on 0 rows (checks, no launch): %8.1f ns\n", ns_per_call(per_batch, op0, {}));
    cuda::DeviceBuffer ws(4096);
    ws.fill_bytes(0);
    float* f = static_cast<float*>(ws.data());
    const std::vector<Arg> dargs = {
        W, A, B, m, Scalar(0.5), Scalar(0.0), norm, scale,
        TensorView::contiguous(f, DType::f32, {R}, dev),
        TensorView::contiguous(f + 256, DType::i32, {4}, dev)};
    const dsl::MetaMap dmeta = {{"BLOCK_M", 64}, {"BLOCK_K", 128}, {"R_PAD", 16},
                                {"DOT", int64_t(DType::bf16)}, {"num_warps", 4}, {"num_stages", 3}};
    const Grid dgrid{4, 2, 1};
    const auto l = [&] { launch(kernels::dora_norm_split(), dargs, dgrid, dmeta, options); };
    l();
    std::printf("gpu   kerf::launch(dora_norm_split): %8.1f ns\n", ns_per_call(per_batch, l, sync));
    const ir::Function dfn = kernels::dora_norm_split().trace(arg_specs(dargs), dmeta);
    const cache::CudaBinary dbin = cache::cuda_binary(dfn, device_arch(0), "");
    cuda::Module dmodule(dbin.image.data(), 0);
    void* dfunction = dmodule.function(dbin.entry);
    if (dbin.smem_bytes > 48 * 1024) cuda::set_max_dynamic_smem(dfunction, dbin.smem_bytes);
    std::vector<jit::Slot> dslots(jit::slot_count(dfn.params));
    jit::pack_args(dfn.params, dargs, dslots.data());
    void* dparams[] = {dslots.data()};
    const auto bare2 = [&] {
      cuda::launch(dfunction, dgrid, dbin.threads, dbin.smem_bytes, stream.handle(), dparams);
    };
    std::printf("gpu   bare launch of dora_norm_split (%zu param bytes, %d smem): %8.1f ns\n",
                dslots.size() * 8, dbin.smem_bytes, ns_per_call(per_batch, bare2, sync));
    // What the driver's launch costs by what the kernel takes: the same empty
    // kernel with 8 to 512 bytes of parameters, one block of 32 or 128 threads,
    // with and without 85 KB of dynamic shared memory.
    const std::string src = R"(
template <int N> struct P { unsigned long long v[N]; };
template <int N> __device__ void body(const P<N>& p) { if (p.v[N - 1] == 12345) asm volatile("trap;"); }
extern "C" __global__ void k1(const __grid_constant__ P<1> p) { body(p); }
extern "C" __global__ void k8(const __grid_constant__ P<8> p) { body(p); }
extern "C" __global__ void k32(const __grid_constant__ P<32> p) { body(p); }
extern "C" __global__ void k64(const __grid_constant__ P<64> p) { body(p); }
extern "C" __global__ void k32s(const __grid_constant__ P<32> p) { extern __shared__ char sm[]; body(p); if (p.v[0] == 7) sm[threadIdx.x] = 1; }
)";
    const nvrtc::Output probe = nvrtc::compile(src, "launch_probe.cu", device_arch(0));
    cuda::Module pm(probe.image.data(), 0);
    std::vector<unsigned long long> pbuf(64, 0);
    void* pparams[] = {pbuf.data()};
    struct Probe { const char* name; int bytes, threads, smem; };
    for (const Probe& pr : {Probe{"k1", 8, 32, 0}, Probe{"k8", 64, 32, 0}, Probe{"k32", 256, 32, 0},
                            Probe{"k64", 512, 32, 0}, Probe{"k32", 256, 128, 0}, Probe{"k32s", 256, 128, 85 * 1024}}) {
      void* pf = pm.function(pr.name);
      if (pr.smem > 48 * 1024) cuda::set_max_dynamic_smem(pf, pr.smem);
      const auto go = [&] {
        cuda::launch_in(pm.context(), pf, Grid{1, 1, 1}, pr.threads, pr.smem, stream.handle(), pparams);
      };
      go();
      std::printf("gpu   bare launch of an empty kernel, %3d param bytes, %3d threads, %5d smem: %8.1f ns\n",
                  pr.bytes, pr.threads, pr.smem, ns_per_call(per_batch, go, sync));
    }
    std::printf("gpu   kerf::prepare(dora_norm_split): %8.1f ns\n",
                ns_per_call(per_batch, [&] { prepare(kernels::dora_norm_split(), dargs, dmeta, options); }, {}));
  }
  return ok;
}

}  // namespace

int main() {
  try {
    const bool cpu_ok = bench_cpu();
    const bool gpu_ok = bench_gpu();
    return cpu_ok && gpu_ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_launch_overhead: %s\n", e.what());
    return 2;
  }
}
