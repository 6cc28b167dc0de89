// Bundles: many entries and a manifest in one read-only file; damaged bundles
// refused, damaged records skipped; a mounted bundle serves kernels with NVRTC
// disabled (the cubin comes from the bundle and no compiler is called).
#include <sys/stat.h>

#include <fstream>

#include "catch.h"
#include "gpu_test_util.h"
#include "kerf/cache/bundle.h"
#include "kerf/cache/cuda_binary.h"
#include "kerf/cache/disk_cache.h"
#include "kerf/cache/key.h"
#include "kerf/dsl/dsl.h"
#include "test_cache_util.h"

using namespace kerf;
using namespace kerf::dsl;

namespace {

const Kernel& scale_kernel() {
  static const Kernel k("bundle_test_scale", [](Builder& b) {
    auto x = b.tensor("x", 1), out = b.tensor("out", 1);
    auto s = b.scalar("s");
    const int64_t B = b.meta("BLOCK");
    auto i = program_id(0) * B + arange(B);
    auto m = i < x.dim(0);
    store(out, {i}, load(x, {i}, m) * s, m);
  });
  return k;
}

ir::Function traced(int64_t block) {
  ir::TensorFacts f;
  f.contiguous_last = f.aligned16 = true;
  return scale_kernel().trace(
      {ArgSpec::tensor(DType::f32, 1, f), ArgSpec::tensor(DType::f32, 1, f), ArgSpec::scalar()},
      {{"BLOCK", block}});
}

cache::CacheKey test_key(int i) {
  cache::TuneKeyFields f;
  f.op = "bundle_test";
  f.shape_bucket = {i};
  return cache::tune_key(f);
}

cache::Entry test_entry(int i) {
  cache::Entry e;
  e.kind = i % 2 ? cache::EntryKind::cuda_kernel : cache::EntryKind::tune_choice;
  e.props = {{"op", "bundle_test"}, {"index", std::to_string(i)}};
  e.blob.assign(size_t(100 + i), char('a' + i));
  return e;
}

std::string write_bundle(const test::TempDir& dir, int n) {
  cache::BundleWriter w;
  for (int i = 0; i < n; ++i) w.add(cache::encode_entry(test_key(i), test_entry(i)));
  const std::string path = dir / "test.kbundle";
  w.write(path, {{"purpose", "test"}});
  return path;
}

void flip_byte(const std::string& path, size_t at) {
  std::vector<char> b = *cache::read_file(path);
  b.at(at) ^= 0x01;
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(b.data(), std::streamsize(b.size()));
}

}  // namespace

TEST_CASE("a bundle holds many entries and a manifest", "[cache]") {
  test::TempDir dir;
  const std::string path = write_bundle(dir, 5);
  const cache::Bundle b(path);
  CHECK(b.props().at("purpose") == "test");
  REQUIRE(b.records().size() == 5);
  for (int i = 0; i < 5; ++i) {
    CAPTURE(i);
    const std::optional<cache::Entry> e = b.find(test_key(i), false);
    REQUIRE(e);
    CHECK(e->blob == test_entry(i).blob);
    CHECK(e->prop("index") == std::to_string(i));
  }
  CHECK_FALSE(b.find(test_key(9), false));
  // The manifest alone says what is inside.
  int tune = 0;
  for (const cache::Bundle::Record& r : b.records()) {
    tune += r.kind == cache::EntryKind::tune_choice;
    CHECK(r.props.at("op") == "bundle_test");
    CHECK(b.decode(r).ok());
  }
  CHECK(tune == 3);
}

TEST_CASE("a damaged bundle is refused when mounted, naming the problem", "[cache]") {
  test::TempDir dir;
  const std::string path = write_bundle(dir, 3);
  const size_t size = cache::read_file(path)->size();
  SECTION("missing") {
    CHECK_THROWS_AS(cache::mount_bundle(dir / "absent.kbundle"), CacheError);
  }
  SECTION("not a bundle") {
    std::ofstream(dir / "x", std::ios::binary) << std::string(100, 'x');
    CHECK_THROWS_WITH(cache::Bundle(dir / "x"), Catch::Contains("not a kerf bundle"));
  }
  SECTION("header bit flip") {
    flip_byte(path, 17);
    CHECK_THROWS_WITH(cache::Bundle(path), Catch::Contains("header checksum"));
  }
  SECTION("manifest bit flip") {
    flip_byte(path, size - 5);
    CHECK_THROWS_WITH(cache::Bundle(path), Catch::Contains("manifest checksum"));
  }
  SECTION("truncated") {
    std::filesystem::resize_file(path, size - 50);
    CHECK_THROWS_AS(cache::Bundle(path), CacheError);
  }
  SECTION("zero-length") {
    std::filesystem::resize_file(path, 0);
    CHECK_THROWS_AS(cache::Bundle(path), CacheError);
  }
  SECTION("a named pipe: refused, not waited on") {
    REQUIRE(::mkfifo((dir / "pipe").c_str(), 0600) == 0);
    CHECK_THROWS_WITH(cache::Bundle(dir / "pipe"), Catch::Contains("not a regular file"));
    CHECK_FALSE(cache::read_file(dir / "pipe"));  // a disk entry's read neither
  }
}

TEST_CASE("a mounted bundle rewritten in place keeps serving what it held when mounted", "[cache]") {
  test::TempDir dir;
  const std::string path = write_bundle(dir, 3);
  const cache::Bundle b(path);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << "short";  // as `cp other.kbundle` over it
  const auto e = b.find(test_key(1), false);  // a mapping would raise SIGBUS here
  REQUIRE(e);
  CHECK(e->blob == test_entry(1).blob);
}

TEST_CASE("a bundle packed by another kerf version is reported when mounted", "[cache]") {
  test::ScopedEnv env({{"KERF_LOG", "warn"}});
  test::TempDir dir;
  cache::BundleWriter w;
  w.add(cache::encode_entry(test_key(0), test_entry(0)));
  w.write(dir / "old.kbundle", {{"kerf_version", "0.0.9"}});
  test::LogCapture logs;
  const cache::Bundle b(dir / "old.kbundle");
  CHECK(logs.count("was packed by kerf 0.0.9, this is kerf " + cache::kerf_version() +
                   ": none of its entries can be used") == 1);
  w.write(dir / "same.kbundle", {{"kerf_version", cache::kerf_version()}});
  const cache::Bundle same(dir / "same.kbundle");
  CHECK(logs.count("was packed by kerf") == 1);
}

TEST_CASE("a damaged record in a bundle is skipped and reported once", "[cache]") {
  test::ScopedEnv env({{"KERF_LOG", "warn"}});
  test::TempDir dir;
  const std::string path = write_bundle(dir, 3);
  size_t offset = 0;
  {
    const cache::Bundle b(path);
    for (const cache::Bundle::Record& r : b.records())
      if (r.id == test_key(1).id) offset = size_t(r.offset + r.bytes - 3);
  }
  flip_byte(path, offset);  // in record 1's payload
  test::LogCapture logs;
  const cache::Bundle b(path);
  CHECK_FALSE(b.find(test_key(1), false));
  CHECK_FALSE(b.find(test_key(1), false));
  CHECK(logs.count("ignoring an entry of bundle") == 1);
  CHECK(b.find(test_key(0), false));
  CHECK(b.find(test_key(2), false));
}

TEST_CASE("a listed bundle that cannot be read is reported, not fatal", "[cache]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_BUNDLES", dir / "missing.kbundle"}, {"KERF_LOG", "warn"}});
  test::LogCapture logs;
  log::reload();
  cache::reload_settings();
  CHECK(cache::mounted_bundles().empty());
  CHECK_FALSE(cache::lookup(test_key(0)));
  CHECK(logs.count("missing.kbundle") == 1);
}

TEST_CASE("with a bundle mounted and NVRTC disabled, the cubin comes from the bundle",
          "[cache][nvrtc]") {
  KERF_REQUIRE_NVRTC();
  test::TempDir build_dir, run_dir;
  const ir::Function fn = traced(256);
  std::vector<char> cubin;
  {
    // A build machine: compile for sm_90a (no GPU needed) into its cache, pack a bundle.
    test::ScopedEnv env({{"KERF_CACHE_DIR", build_dir.path()}});
    const cache::CudaBinary bin = cache::cuda_binary(fn, "sm_90a", "");
    CHECK(bin.source == KernelSource::compiled);
    cubin = bin.image;
    cache::BundleWriter w;
    for (const cache::DiskCache::Listed& l :
         cache::DiskCache(build_dir.path(), cache::DiskMode::readonly).list())
      w.add(*cache::read_file(l.path));
    REQUIRE(w.size() == 1);
    w.write(build_dir / "app.kbundle", {});
  }
  // The deployment: NVRTC unloadable, an empty cache, the bundle listed in the environment.
  test::ScopedEnv env({{"KERF_CACHE_DIR", run_dir.path()},
                       {"KERF_DISABLE_NVRTC", "1"},
                       {"KERF_CACHE_BUNDLES", build_dir / "app.kbundle"}});
  REQUIRE_FALSE(nvrtc::available());
  REQUIRE(cache::mounted_bundles().size() == 1);
  const cache::Stats before = cache::stats();
  bool compiler_called = false;
  const cache::CudaCompiler spy = [&](const std::string&, const std::string&, const std::string&,
                                      const std::vector<std::string>&) -> nvrtc::Output {
    compiler_called = true;
    throw InternalError("the compiler must not be called");
  };
  const cache::CudaBinary bin = cache::cuda_binary(fn, "sm_90a", "", spy);
  CHECK(bin.source == KernelSource::bundle);
  CHECK(bin.image == cubin);
  CHECK_FALSE(compiler_called);
  // And through the default path, with NVRTC disabled for real:
  CHECK(cache::cuda_binary(fn, "sm_90a", "").source == KernelSource::bundle);
  CHECK(cache::stats().compiles == before.compiles);
  CHECK(cache::stats().bundle_hits == before.bundle_hits + 2);
  // A kernel the bundle lacks cannot be made: the error says where kerf looked.
  CHECK_THROWS_WITH(cache::cuda_binary(traced(512), "sm_90a", ""),
                    Catch::Contains("no mounted bundle") && Catch::Contains("KERF_DISABLE_NVRTC"));
  CHECK_THROWS_AS(cache::cuda_binary(traced(256), "sm_80", ""), NotAvailable);
}

TEST_CASE("a new process reuses a disk entry without NVRTC", "[cache][nvrtc]") {
  KERF_REQUIRE_NVRTC();
  test::TempDir dir;
  {
    test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}});
    REQUIRE(cache::cuda_binary(traced(128), "sm_90a", "").source == KernelSource::compiled);
  }
  test::Child child(test::self_test("[.cache-child-cubin]"),
                    {{"KERF_CACHE_DIR", dir.path()}, {"KERF_DISABLE_NVRTC", "1"}});
  REQUIRE(child.wait() == 0);
  CHECK(child.value("SOURCE") == "disk");
  CHECK(child.value("COMPILES") == "0");
  CHECK(std::stod(child.value("MS")) < 50.0);
  std::printf("KERF-CACHE: a new process got its cubin from disk in %s ms (no NVRTC)\n",
              child.value("MS").c_str());
}

TEST_CASE("child: fetch a cubin from the cache", "[.cache-child-cubin]") {
  const auto t0 = std::chrono::steady_clock::now();
  const cache::CudaBinary bin = cache::cuda_binary(traced(128), "sm_90a", "");
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("SOURCE=%s\nCOMPILES=%llu\nMS=%.3f\n", kernel_source_name(bin.source),
              (unsigned long long)cache::stats().compiles, ms);
}
