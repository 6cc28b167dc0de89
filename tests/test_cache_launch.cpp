// kerf::launch with the cache tiers: a kernel compiled in one process loads in
// the next, eight processes warming the same keys, failed compiles never
// cached, the in-memory hot path touching nothing, layouts in the key.
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "catch.h"
#include "cpu_test_util.h"
#include "error_test_util.h"
#include "gpu_test_util.h"
#include "kerf/cache/bundle.h"
#include "kerf/cache/cuda_binary.h"
#include "kerf/cache/disk_cache.h"
#include "kerf/dsl/dsl.h"
#include "kerf/ops/ops.h"
#include "test_cache_util.h"

using namespace kerf;
using namespace kerf::dsl;

namespace {

// out = x * a + b, over BLOCK-element programs.
const Kernel& axpb_kernel() {
  static const Kernel k("cache_test_axpb", [](Builder& b) {
    auto x = b.tensor("x", 1), out = b.tensor("out", 1);
    auto a = b.scalar("a"), c = b.scalar("b");
    const int64_t B = b.meta("BLOCK");
    auto i = program_id(0) * B + arange(B);
    auto m = i < x.dim(0);
    store(out, {i}, load(x, {i}, m) * a + c, m);
  });
  return k;
}

// Runs axpb on the CPU with BLOCK `block`; true when every output is right.
bool run_axpb_cpu(int64_t block, LaunchInfo* info = nullptr, std::string_view layout = {}) {
  const int64_t n = 1000;
  std::vector<float> x(static_cast<size_t>(n)), out(static_cast<size_t>(n), -1.0f);
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = float(i);
  LaunchOptions options;
  options.layout = layout;
  const LaunchInfo li =
      launch(axpb_kernel(),
             {TensorView::contiguous(x.data(), DType::f32, {n}),
              TensorView::contiguous(out.data(), DType::f32, {n}), Scalar(2.0), Scalar(1.0)},
             Grid{uint32_t((n + block - 1) / block)}, {{"BLOCK", block}}, options);
  if (info) *info = li;
  for (int64_t i = 0; i < n; ++i)
    if (out[size_t(i)] != 2.0f * float(i) + 1.0f) return false;
  return true;
}

size_t valid_entries(const std::string& dir, size_t* bad = nullptr) {
  size_t ok = 0;
  for (const cache::DiskCache::Listed& l :
       cache::DiskCache(dir, cache::DiskMode::readonly).list()) {
    if (l.decoded.ok())
      ++ok;
    else if (bad)
      ++*bad;
  }
  return ok;
}

// A kernel whose tiles cannot fit the CPU back end's stack: its compile always fails.
const Kernel& huge_tile_kernel() {
  static const Kernel k("cache_test_huge", [](Builder& b) {
    auto out = b.tensor("out", 1);
    const int64_t side = 4096;  // a 64 MiB carried tile: above the CPU back end's stack budget
    auto acc = for_range(0, 3, 1, zeros({side, side}),
                         [&](const Value& iv, const Value& a) { return a + iv.to(DType::f32); });
    auto i = arange(side);
    store(out, {i}, sum(acc, 1), i < out.dim(0));
  });
  return k;
}

}  // namespace

TEST_CASE("a CPU kernel compiled by one process is loaded from disk by the next", "[cache][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  {
    test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
    LaunchInfo info;
    REQUIRE(run_axpb_cpu(128, &info));
    CHECK(info.source == KernelSource::compiled);
    CHECK(info.compiled);
    REQUIRE(run_axpb_cpu(128, &info));
    CHECK(info.source == KernelSource::memory);
    CHECK(valid_entries(dir.path()) == 1);
  }
  test::Child child(test::self_test("[.cache-child-launch]"), {{"KERF_CACHE_DIR", dir.path()}});
  REQUIRE(child.wait() == 0);
  CHECK(child.value("SOURCE") == "disk");
  CHECK(child.value("COMPILES") == "0");
  CHECK(child.value("RIGHT") == "1");
  std::printf("KERF-CACHE: a new process loaded a CPU kernel from disk in %s ms\n",
              child.value("MS").c_str());
}

TEST_CASE("child: launch axpb on the CPU", "[.cache-child-launch]") {
  LaunchInfo info;
  const bool right = run_axpb_cpu(128, &info);
  std::printf("SOURCE=%s\nCOMPILES=%llu\nRIGHT=%d\nMS=%.2f\n", kernel_source_name(info.source),
              (unsigned long long)cache::stats().compiles, int(right), info.compile_ms);
}

TEST_CASE("eight processes warming the same keys at once all succeed and leave valid entries",
          "[cache]") {
  const bool cpu = jit::cpu::available(), gpu_code = nvrtc::available();
  if (!cpu && !gpu_code) {
    std::printf("KERF-SKIPPED: neither the CPU back end nor NVRTC is here to compile anything\n");
    return;
  }
  test::TempDir dir;
  std::vector<std::unique_ptr<test::Child>> children;
  for (int i = 0; i < 8; ++i)
    children.push_back(std::make_unique<test::Child>(
        test::self_test("[.cache-child-warm]"),
        std::map<std::string, std::string>{{"KERF_CACHE_DIR", dir.path()}}));
  size_t distinct = 0;
  for (auto& c : children) {
    CHECK(c->wait() == 0);
    INFO(c->output());
    CHECK(c->value("RIGHT") == "1");
    distinct = std::stoul(c->value("DISTINCT"));
    // Four threads asked for each key; this process compiled each at most once.
    CHECK(std::stoul(c->value("COMPILES")) <= distinct);
  }
  size_t bad = 0;
  CHECK(valid_entries(dir.path(), &bad) == distinct);
  CHECK(bad == 0);
}

TEST_CASE("child: warm three CPU kernels from four threads and two cubins", "[.cache-child-warm]") {
  std::atomic<bool> right{true};
  size_t distinct = 0;
  if (jit::cpu::available()) {
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&] {
        for (int64_t block : {64, 128, 256})
          if (!run_axpb_cpu(block)) right = false;
      });
    for (std::thread& t : threads) t.join();
    distinct += 3;
  }
  if (nvrtc::available()) {
    ir::TensorFacts f;
    f.contiguous_last = f.aligned16 = true;
    const ir::Function fn =
        axpb_kernel().trace({ArgSpec::tensor(DType::f32, 1, f), ArgSpec::tensor(DType::f32, 1, f),
                             ArgSpec::scalar(), ArgSpec::scalar()},
                            {{"BLOCK", 256}});
    for (const char* arch : {"sm_80", "sm_90a"}) cache::cuda_binary(fn, arch, "");
    distinct += 2;
  }
  std::printf("RIGHT=%d\nCOMPILES=%llu\nDISTINCT=%zu\n", int(right.load()),
              (unsigned long long)cache::stats().compiles, distinct);
}

TEST_CASE("a failed compile is never cached as a success", "[cache]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
  ir::TensorFacts f;
  f.contiguous_last = f.aligned16 = true;
  const ir::Function fn =
      axpb_kernel().trace({ArgSpec::tensor(DType::f32, 1, f), ArgSpec::tensor(DType::f32, 1, f),
                           ArgSpec::scalar(), ArgSpec::scalar()},
                          {{"BLOCK", 64}});
  const cache::Stats before = cache::stats();
  int calls = 0;
  const cache::CudaCompiler failing = [&](const std::string& src, const std::string&, const std::string&,
                                          const std::vector<std::string>&) -> nvrtc::Output {
    ++calls;
    throw CompileError("NVRTC could not compile (test)", "error: test", src);
  };
  CHECK_THROWS_AS(cache::cuda_binary(fn, "sm_90a", "", failing), CompileError);
  CHECK_THROWS_AS(cache::cuda_binary(fn, "sm_90a", "", failing), CompileError);
  CHECK(calls == 2);  // asked again: the failure was not kept
  CHECK(cache::stats().compile_failures == before.compile_failures + 2);
  CHECK(valid_entries(dir.path()) == 0);
  CHECK(cache::DiskCache(dir.path(), cache::DiskMode::readonly).list().empty());

  const cache::CudaCompiler working = [&](const std::string&, const std::string&, const std::string&,
                                          const std::vector<std::string>&) {
    ++calls;
    nvrtc::Output out;
    out.image = {'c', 'u', 'b', 'i', 'n'};
    return out;
  };
  CHECK(cache::cuda_binary(fn, "sm_90a", "", working).source == KernelSource::compiled);
  CHECK(cache::cuda_binary(fn, "sm_90a", "", working).source == KernelSource::disk);
  CHECK(calls == 3);
}

TEST_CASE("a CPU kernel that fails to compile is tried again and never stored", "[cache][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
  std::vector<float> out(16);
  const std::vector<Arg> args = {TensorView::contiguous(out.data(), DType::f32, {16})};
  const cache::Stats before = cache::stats();
  CHECK_THROWS_AS(launch(huge_tile_kernel(), args, Grid{1}), CompileError);
  CHECK_THROWS_AS(launch(huge_tile_kernel(), args, Grid{1}), CompileError);
  CHECK(cache::stats().compile_failures == before.compile_failures + 2);
  CHECK(cache::DiskCache(dir.path(), cache::DiskMode::readonly).list().empty());
}

TEST_CASE("a launch whose kernel is in memory touches neither the cache tiers nor the disk",
          "[cache][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  const std::string cache_dir = dir / "cache";
  test::ScopedEnv env({{"KERF_CACHE_DIR", cache_dir}});
  REQUIRE(run_axpb_cpu(64));
  std::filesystem::remove_all(cache_dir);
  const cache::Stats before = cache::stats();
  for (int i = 0; i < 20; ++i) {
    LaunchInfo info;
    REQUIRE(run_axpb_cpu(64, &info));
    CHECK(info.source == KernelSource::memory);
    CHECK(info.compile_ms == 0.0);
  }
  const cache::Stats after = cache::stats();
  CHECK(after.misses == before.misses);
  CHECK(after.disk_hits == before.disk_hits);
  CHECK(after.bundle_hits == before.bundle_hits);
  CHECK(after.compiles == before.compiles);
  CHECK_FALSE(std::filesystem::exists(cache_dir));
}

TEST_CASE("the sharding layout is part of a kernel's key", "[cache][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
  LaunchInfo info;
  REQUIRE(run_axpb_cpu(32, &info));
  CHECK(info.source == KernelSource::compiled);
  REQUIRE(run_axpb_cpu(32, &info, "mesh(tp=2) x:[tp] out:[tp]"));
  CHECK(info.source == KernelSource::compiled);  // another key, another entry
  REQUIRE(run_axpb_cpu(32, &info, "mesh(tp=2) x:[tp] out:[tp]"));
  CHECK(info.source == KernelSource::memory);
  CHECK(valid_entries(dir.path()) == 2);
  size_t with_layout = 0;
  for (const auto& l : cache::DiskCache(dir.path(), cache::DiskMode::readonly).list())
    with_layout += l.decoded.entry.prop("layout") == "mesh(tp=2) x:[tp] out:[tp]";
  CHECK(with_layout == 1);
}

TEST_CASE("prepare readies a kernel without running it", "[cache][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
  std::vector<float> x(100, 1.0f), out(100, -7.0f);
  const std::vector<Arg> args = {TensorView::contiguous(x.data(), DType::f32, {100}),
                                 TensorView::contiguous(out.data(), DType::f32, {100}), Scalar(2.0),
                                 Scalar(0.0)};
  CHECK(prepare(axpb_kernel(), args, {{"BLOCK", 32}}).source == KernelSource::compiled);
  CHECK(out[0] == -7.0f);
  CHECK(launch(axpb_kernel(), args, Grid{4}, {{"BLOCK", 32}}).source == KernelSource::memory);
  CHECK(out[99] == 2.0f);
}

TEST_CASE("a launch memo keeps kernels apart by specialization and layout and forgets them on a cache clear",
          "[cache][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
  const int64_t n = 100;
  std::vector<float> x32(static_cast<size_t>(n)), out32(static_cast<size_t>(n));
  std::vector<double> x64(static_cast<size_t>(n)), out64(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x32[size_t(i)] = float(x64[size_t(i)] = double(i) * 0.5 + 1.0);
  const dsl::MetaMap meta = {{"BLOCK", 32}};  // one map for the memo's life, as a plan holds it
  LaunchMemo memo;
  const auto run = [&](DType dtype, std::string_view layout) {
    void* x = dtype == DType::f32 ? static_cast<void*>(x32.data()) : static_cast<void*>(x64.data());
    void* out = dtype == DType::f32 ? static_cast<void*>(out32.data()) : static_cast<void*>(out64.data());
    std::fill(out32.begin(), out32.end(), -1.0f);
    std::fill(out64.begin(), out64.end(), -1.0);
    LaunchOptions options;
    options.layout = layout;
    options.memo = &memo;
    const LaunchInfo info =
        launch(axpb_kernel(),
               {TensorView::contiguous(x, dtype, {n}), TensorView::contiguous(out, dtype, {n}), Scalar(3.0), Scalar(-2.0)},
               Grid{4}, meta, options);
    for (int64_t i = 0; i < n; ++i) {
      const double want = 3.0 * x64[size_t(i)] - 2.0;
      const double got = dtype == DType::f32 ? double(out32[size_t(i)]) : out64[size_t(i)];
      if (got != want) FAIL("element " << i << " is " << got << ", want " << want);
    }
    return info.source;
  };
  CHECK(run(DType::f32, "") == KernelSource::compiled);
  CHECK(run(DType::f32, "") == KernelSource::memory);
  // Another dtype is another specialization: the memo must not hand out the f32 kernel.
  CHECK(run(DType::f64, "") == KernelSource::compiled);
  CHECK(run(DType::f32, "") == KernelSource::memory);
  CHECK(run(DType::f64, "") == KernelSource::memory);
  CHECK(run(DType::f32, "mesh(tp=2) x:[tp] out:[tp]") == KernelSource::compiled);
  CHECK(run(DType::f32, "mesh(tp=2) x:[tp] out:[tp]") == KernelSource::memory);
  // After a clear the memo's kernels are gone too: the next call loads from the disk tier.
  clear_kernel_cache();
  CHECK(run(DType::f32, "") == KernelSource::disk);
  CHECK(run(DType::f32, "") == KernelSource::memory);
  // More kernels than the memo holds: each call is still right.
  for (int round = 0; round < 2; ++round)
    for (const char* layout : {"", "mesh(tp=2) x:[tp] out:[tp]", "mesh(dp=2) x:[dp] out:[dp]"})
      for (DType t : {DType::f32, DType::f64}) CHECK(run(t, layout) != KernelSource::bundle);
  // A temporary meta map at a reused address with other contents is another kernel (the
  // memo compared the address alone and ran the old one).
  for (const int64_t block : {8, 16, 32}) {
    std::fill(out32.begin(), out32.end(), -1.0f);
    LaunchOptions options;
    options.memo = &memo;
    const dsl::MetaMap temporary = {{"BLOCK", block}};
    launch(axpb_kernel(), {TensorView::contiguous(x32.data(), DType::f32, {n}),
                           TensorView::contiguous(out32.data(), DType::f32, {n}), Scalar(3.0), Scalar(-2.0)},
           Grid{1}, temporary, options);
    // One program of `block` elements: exactly the first `block` are written.
    CHECK(out32[size_t(block - 1)] == float(3.0 * x64[size_t(block - 1)] - 2.0));
    CHECK(out32[size_t(block)] == -1.0f);
  }
  // A memo copied or assigned over starts empty: the next launch finds its kernel in
  // the process's cache and remembers it again.
  memo = LaunchMemo(memo);
  CHECK(run(DType::f64, "") == KernelSource::memory);
  CHECK(run(DType::f64, "") == KernelSource::memory);
}

namespace {

// A kernel kept from one launch (ResolvedKernel), launched again on other data:
// right answers from the new data, its argument checks, and lapsing on a cache clear.
void check_resolved_kernel(const Device& dev) {
  const int64_t n = 300;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  // Two inputs and two outputs: the second launch reads and writes other memory.
  std::vector<std::vector<float>> host(4, std::vector<float>(size_t(n)));
  for (auto& v : host)
    for (float& x : v) x = u(rng);
  std::vector<cuda::DeviceBuffer> buffers;
  std::vector<TensorView> views;
  for (auto& v : host) {
    void* data = v.data();
    if (dev.is_cuda()) {
      buffers.emplace_back(size_t(n) * 4, dev.index);
      buffers.back().copy_from_host(v.data(), size_t(n) * 4);
      data = buffers.back().data();
    }
    views.push_back(TensorView::contiguous(data, DType::f32, {n}, dev));
  }
  const auto output = [&](size_t i) {
    std::vector<float> out = host[i];
    if (dev.is_cuda()) {
      cuda::device_synchronize(dev.index);
      buffers[i].copy_to_host(out.data(), size_t(n) * 4);
    }
    return out;
  };
  const auto expect_axpb = [&](size_t in, size_t out, double a, double b) {
    const std::vector<float> got = output(out);
    for (int64_t i = 0; i < n; ++i) {
      const double want = a * double(host[in][size_t(i)]) + b;
      if (std::abs(double(got[size_t(i)]) - want) > 1e-5 * (1.0 + std::abs(want)))
        FAIL("element " << i << " is " << got[size_t(i)] << ", want " << want);
    }
  };
  const dsl::MetaMap meta = {{"BLOCK", 64}};
  const Grid grid{uint32_t((n + 63) / 64)};
  ResolvedKernel rk;
  CHECK_FALSE(rk.usable());
  CHECK_THAT(test::thrown<InvalidArgument>([&] { launch(rk, {views[0], views[2], Scalar(1.0), Scalar(0.0)}, grid, {}); }),
             Catch::Contains("holds no kernel"));
  LaunchOptions options;
  options.resolved = &rk;
  launch(axpb_kernel(), {views[0], views[2], Scalar(3.0), Scalar(-1.0)}, grid, meta, options);
  REQUIRE(rk.usable());
  expect_axpb(0, 2, 3.0, -1.0);
  // Other memory, other scalars, the same specialization.
  const LaunchInfo info = launch(rk, {views[1], views[3], Scalar(-0.5), Scalar(2.0)}, grid, {});
  CHECK(info.backend == (dev.is_cuda() ? device_arch(dev.index) : "cpu"));
  expect_axpb(1, 3, -0.5, 2.0);
  // An empty grid runs nothing.
  launch(rk, {views[0], views[3], Scalar(7.0), Scalar(7.0)}, Grid{0}, {});
  expect_axpb(1, 3, -0.5, 2.0);
  // Its checks.
  CHECK_THAT(test::thrown<InvalidArgument>([&] { launch(rk, {views[0], views[2], Scalar(1.0)}, grid, {}); }),
             Catch::Contains("takes 4 arguments, got 3"));
  CHECK_THAT(test::thrown<InvalidArgument>(
                 [&] { launch(rk, {views[0], Scalar(1.0), Scalar(1.0), Scalar(0.0)}, grid, {}); }),
             Catch::Contains("argument 1 must be a tensor"));
  CHECK_THAT(test::thrown<InvalidArgument>([&] { launch(rk, {views[0], views[2], views[1], Scalar(0.0)}, grid, {}); }),
             Catch::Contains("argument 2 must be a scalar"));
  TensorView null_out = views[2];
  null_out.data = nullptr;
  CHECK_THAT(test::thrown<InvalidArgument>([&] { launch(rk, {views[0], null_out, Scalar(1.0), Scalar(0.0)}, grid, {}); }),
             Catch::Contains("argument 1 has a null data pointer"));
  // A pointer off its element size: refused (a GPU faults on it, ending the context).
  TensorView skewed = views[2];
  skewed.data = static_cast<char*>(skewed.data) + 2;
  skewed.shape[0] -= 1;
  CHECK_THAT(test::thrown<InvalidArgument>([&] { launch(rk, {views[0], skewed, Scalar(1.0), Scalar(0.0)}, grid, {}); }),
             Catch::Contains("argument 1 starts at address") &&
                 Catch::Contains("not a multiple of its element size (4 bytes for f32)"));
  CHECK_THAT(test::thrown<InvalidArgument>(
                 [&] { launch(axpb_kernel(), {views[0], skewed, Scalar(1.0), Scalar(0.0)}, grid, meta); }),
             Catch::Contains("argument 1 starts at address") && Catch::Contains("not a multiple of its element size (4 bytes for f32)"));
  // Another dtype, rank or kind of device than it was resolved for: refused (a u8 input
  // was read as floats, past its end).
  TensorView bytes = views[0];
  bytes.dtype = DType::u8;
  CHECK_THAT(test::thrown<InvalidArgument>([&] { launch(rk, {bytes, views[2], Scalar(1.0), Scalar(0.0)}, grid, {}); }),
             Catch::Contains("argument 0 'x' was resolved as f32 of rank 1, got u8 of rank 1"));
  TensorView elsewhere = views[0];
  elsewhere.device = dev.is_cuda() ? Device::cpu() : Device::cuda(0);
  CHECK_THAT(test::thrown<InvalidArgument>([&] { launch(rk, {elsewhere, views[2], Scalar(1.0), Scalar(0.0)}, grid, {}); }),
             Catch::Contains("but the kernel was resolved for"));
  // Views without the facts it was resolved for (a contiguous, 16-byte aligned x): refused,
  // for its code would read them as if they had them; one with more facts runs.
  CHECK_THAT(test::thrown<InvalidArgument>([&] {
               launch(rk, {TensorView::strided(views[0].data, DType::f32, {n / 2}, {2}, dev), views[2], Scalar(1.0),
                           Scalar(0.0)},
                      grid, {});
             }),
             Catch::Contains("argument 0 'x' lacks what the kernel was resolved for: a last dimension of stride 1"));
  CHECK_THAT(test::thrown<InvalidArgument>([&] {
               launch(rk, {TensorView::contiguous(static_cast<float*>(views[0].data) + 1, DType::f32, {n - 1}, dev),
                           views[2], Scalar(1.0), Scalar(0.0)},
                      grid, {});
             }),
             Catch::Contains("lacks what the kernel was resolved for: a 16-byte aligned data pointer"));
  CHECK_NOTHROW(launch(rk, {TensorView::contiguous(views[0].data, DType::f32, {n - 4}, dev), views[3], Scalar(1.0),
                            Scalar(0.0)},
                       grid, {}));
  CHECK_THAT(test::thrown<InvalidArgument>(
                 [&] { launch(rk, {views[0], views[2], Scalar(1.0), Scalar(0.0)}, Grid{1u << 31}, {}); }),
             Catch::Contains("has an axis past 2147483647 programs"));
  // Sizes past 32 bits, as launch() refuses them (read as 32-bit, 2^32 + n ran as n).
  TensorView wide = views[0];
  wide.shape[0] += int64_t(1) << 32;
  CHECK_THAT(test::thrown<InvalidArgument>([&] {
               launch(rk, {wide, views[2], Scalar(1.0), Scalar(0.0)}, grid, {});
             }),
             Catch::Contains("kerf kernels index dimensions with 32-bit integers"));
  // A cache clear drops it.
  clear_kernel_cache();
  CHECK_FALSE(rk.usable());
  CHECK_THAT(test::thrown<InvalidArgument>([&] { launch(rk, {views[0], views[2], Scalar(1.0), Scalar(0.0)}, grid, {}); }),
             Catch::Contains("clear_kernel_cache"));
  launch(axpb_kernel(), {views[1], views[2], Scalar(2.0), Scalar(0.25)}, grid, meta, options);
  CHECK(rk.usable());
  expect_axpb(1, 2, 2.0, 0.25);
  rk.reset();
  CHECK_FALSE(rk.usable());
}

}  // namespace

TEST_CASE("a resolved kernel launches again on new data, checks its arguments and lapses on a cache clear",
          "[cache][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
  check_resolved_kernel(Device::cpu());
}

TEST_CASE("an empty grid runs nothing yet checks its arguments; a grid axis past INT32_MAX is refused",
          "[cache]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
  std::vector<float> x(100, 1.0f), out(100, -3.0f);
  const TensorView xv = TensorView::contiguous(x.data(), DType::f32, {100});
  const TensorView ov = TensorView::contiguous(out.data(), DType::f32, {100});
  const dsl::MetaMap meta = {{"BLOCK", 64}};
  for (const Grid empty : {Grid{0}, Grid{4, 0}, Grid{4, 1, 0}}) {
    CHECK_NOTHROW(launch(axpb_kernel(), {xv, ov, Scalar(2.0), Scalar(1.0)}, empty, meta));
    CHECK_THAT(test::thrown<DefinitionError>([&] { launch(axpb_kernel(), {xv, Scalar(2.0)}, empty, meta); }),
               Catch::Contains("axpb"));
    CHECK_THAT(test::thrown<DefinitionError>(
                   [&] { launch(axpb_kernel(), {xv, Scalar(1.0), Scalar(2.0), Scalar(1.0)}, empty, meta); }),
               Catch::Contains("axpb"));
    CHECK_THAT(test::thrown<DefinitionError>(
                   [&] { launch(axpb_kernel(), {xv, ov, Scalar(2.0), Scalar(1.0)}, empty, {}); }),
               Catch::Contains("BLOCK"));
    // Checked again on every call (a call that passed is remembered, not one that failed).
    CHECK_THROWS_AS(launch(axpb_kernel(), {xv, Scalar(2.0)}, empty, meta), DefinitionError);
  }
  for (float v : out) CHECK(v == -3.0f);
  for (const Grid big : {Grid{1u << 31}, Grid{1, 1u << 31}, Grid{0, 1, 0xFFFFFFFFu}})
    CHECK_THAT(test::thrown<InvalidArgument>([&] { launch(axpb_kernel(), {xv, ov, Scalar(2.0), Scalar(1.0)}, big, meta); }),
               Catch::Contains("has an axis past 2147483647 programs"));
}

TEST_CASE("a resolved kernel launches again on new data on the GPU", "[cache][gpu]") {
  KERF_REQUIRE_GPU();
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
  check_resolved_kernel(Device::cuda(0));
}

TEST_CASE("a launch leaves a context the caller made current as it was", "[cache][gpu]") {
  KERF_REQUIRE_GPU();
  // The driver's own entry points, to make and inspect a context kerf does not own.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  REQUIRE(lib != nullptr);
  const auto get_current = reinterpret_cast<int (*)(void**)>(dlsym(lib, "cuCtxGetCurrent"));
  const auto device_get = reinterpret_cast<int (*)(int*, int)>(dlsym(lib, "cuDeviceGet"));
  const auto create = reinterpret_cast<int (*)(void**, unsigned, int)>(dlsym(lib, "cuCtxCreate_v2"));
  const auto destroy = reinterpret_cast<int (*)(void*)>(dlsym(lib, "cuCtxDestroy_v2"));
  REQUIRE((get_current && device_get && create && destroy));
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
  const int64_t n = 1000;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n)), out(static_cast<size_t>(n));
  for (float& v : x) v = u(rng);
  cuda::DeviceBuffer dx(size_t(n) * 4), dout(size_t(n) * 4);
  dx.copy_from_host(x.data(), size_t(n) * 4);
  const auto run = [&](double a) {
    launch(axpb_kernel(),
           {TensorView::contiguous(dx.data(), DType::f32, {n}, Device::cuda(0)),
            TensorView::contiguous(dout.data(), DType::f32, {n}, Device::cuda(0)), Scalar(a), Scalar(0.5)},
           Grid{uint32_t((n + 255) / 256)}, {{"BLOCK", 256}});
  };
  run(1.0);  // compiled and loaded in device 0's primary context
  cuda::device_synchronize(0);
  int device = 0;
  REQUIRE(device_get(&device, 0) == 0);
  void* mine = nullptr;
  REQUIRE(create(&mine, 0, device) == 0);  // made current on this thread
  run(-2.0);
  void* after = nullptr;
  REQUIRE(get_current(&after) == 0);
  CHECK(after == mine);
  // So do kerf's other driver calls: memory, copies, streams, events, and an op whose
  // id check copies a record back (PyTorch and CuPy follow the current context: a
  // call that left device 0's primary context current moved their current device).
  {
    cuda::DeviceBuffer scratch(256, 0);
    scratch.fill_bytes(1);
    std::vector<char> host(256);
    scratch.copy_to_host(host.data(), host.size());
    cuda::Stream stream(0);
    cuda::Event event(0);
    event.record(stream.handle());
    cuda::device_synchronize(0);
    cuda::DeviceBuffer ids(2 * 8, 0), table(10 * 4 * 4, 0), a(2 * 10 * 4, 0), b(4 * 2 * 4, 0), o(2 * 4 * 4, 0);
    const int64_t id_values[2] = {3, 7};
    ids.copy_from_host(id_values, sizeof id_values);
    ops::lora_embedding(TensorView::contiguous(ids.data(), DType::i64, {2}, Device::cuda(0)),
                        TensorView::contiguous(table.data(), DType::f32, {10, 4}, Device::cuda(0)),
                        TensorView::contiguous(a.data(), DType::f32, {2, 10}, Device::cuda(0)),
                        TensorView::contiguous(b.data(), DType::f32, {4, 2}, Device::cuda(0)), 1.0,
                        TensorView::contiguous(o.data(), DType::f32, {2, 4}, Device::cuda(0)), {},
                        stream.handle());
    REQUIRE(get_current(&after) == 0);
    CHECK(after == mine);
  }
  REQUIRE(get_current(&after) == 0);
  CHECK(after == mine);  // and the buffers' frees
  cuda::device_synchronize(0);
  dout.copy_to_host(out.data(), size_t(n) * 4);
  for (int64_t i = 0; i < n; ++i)
    if (std::abs(out[size_t(i)] - (-2.0f * x[size_t(i)] + 0.5f)) > 1e-6f)
      FAIL("element " << i << " is " << out[size_t(i)] << ", want " << -2.0f * x[size_t(i)] + 0.5f);
  CHECK(destroy(mine) == 0);
}

// ---------------------------------------------------------------- on a GPU
namespace {

// Runs axpb on device 0; returns whether the output is right, and the first launch's time.
bool run_axpb_gpu(LaunchInfo* info, double* first_ms) {
  const int64_t n = 1 << 16;
  std::vector<float> x(static_cast<size_t>(n)), out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = float(i % 1000);
  cuda::DeviceBuffer dx(size_t(n) * 4), dout(size_t(n) * 4);
  dx.copy_from_host(x.data(), size_t(n) * 4);
  cuda::device_synchronize(0);  // the context exists: time the launch, not the driver's start
  const auto t0 = std::chrono::steady_clock::now();
  *info = launch(axpb_kernel(),
                 {TensorView::contiguous(dx.data(), DType::f32, {n}, Device::cuda(0)),
                  TensorView::contiguous(dout.data(), DType::f32, {n}, Device::cuda(0)),
                  Scalar(2.0), Scalar(1.0)},
                 Grid{uint32_t(n / 256)}, {{"BLOCK", 256}});
  cuda::device_synchronize(0);
  *first_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  dout.copy_to_host(out.data(), size_t(n) * 4);
  for (int64_t i = 0; i < n; ++i)
    if (out[size_t(i)] != 2.0f * float(i % 1000) + 1.0f) return false;
  return true;
}

}  // namespace

TEST_CASE("a new process runs a cached kernel without NVRTC, its first call in under 5 ms",
          "[cache][gpu]") {
  KERF_REQUIRE_GPU();
  KERF_REQUIRE_NVRTC();
  test::TempDir dir;
  {
    test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
    LaunchInfo info;
    double ms = 0;
    REQUIRE(run_axpb_gpu(&info, &ms));
    CHECK(info.source == KernelSource::compiled);
    std::printf("KERF-CACHE: first call that compiled: %.2f ms\n", ms);
  }
  // Three new processes, each timing its first call; the median is checked, so that one
  // process slowed by the machine's other work does not decide it.
  std::vector<double> times;
  for (int i = 0; i < 3; ++i) {
    test::Child child(test::self_test("[.cache-child-gpu-first-call]"),
                      {{"KERF_CACHE_DIR", dir.path()}, {"KERF_DISABLE_NVRTC", "1"}});
    REQUIRE(child.wait() == 0);
    CHECK(child.value("SOURCE") == "disk");
    CHECK(child.value("RIGHT") == "1");
    times.push_back(std::stod(child.value("MS")));
    std::printf(
        "KERF-CACHE: first call in a new process, kernel from disk, NVRTC disabled: %.3f ms "
        "(finding and loading the kernel %.3f ms)\n",
        times.back(), std::stod(child.value("LOAD_MS")));
  }
  std::sort(times.begin(), times.end());
  if (test::timing_checks_apply()) CHECK(times[1] < 5.0);
}

TEST_CASE("child: first GPU call from the disk cache", "[.cache-child-gpu-first-call]") {
  KERF_REQUIRE_GPU();  // its parent needs a GPU too; run alone without one, it says so
  LaunchInfo info;
  double ms = 0;
  const bool right = run_axpb_gpu(&info, &ms);
  std::printf("SOURCE=%s\nRIGHT=%d\nMS=%.3f\nLOAD_MS=%.3f\n", kernel_source_name(info.source), int(right), ms,
              info.compile_ms);
}

TEST_CASE("a GPU kernel runs from a mounted bundle with NVRTC disabled", "[cache][gpu]") {
  KERF_REQUIRE_GPU();
  KERF_REQUIRE_NVRTC();
  test::TempDir build_dir, run_dir;
  {
    test::ScopedEnv env({{"KERF_CACHE_DIR", build_dir.path()}});
    LaunchInfo info;
    double ms = 0;
    REQUIRE(run_axpb_gpu(&info, &ms));
    cache::BundleWriter w;
    for (const auto& l : cache::DiskCache(build_dir.path(), cache::DiskMode::readonly).list())
      w.add(*cache::read_file(l.path));
    w.write(build_dir / "app.kbundle", {});
  }
  test::ScopedEnv env({{"KERF_CACHE_DIR", run_dir.path()}, {"KERF_DISABLE_NVRTC", "1"}});
  cache::mount_bundle(build_dir / "app.kbundle");
  LaunchInfo info;
  double ms = 0;
  REQUIRE(run_axpb_gpu(&info, &ms));
  CHECK(info.source == KernelSource::bundle);
  std::printf("KERF-CACHE: first call from a bundle, NVRTC disabled: %.3f ms\n", ms);
}
