// kerf-cache as a user runs it: warm, list, inspect --json, pack, verify, prune.
#include <sys/time.h>
#include <algorithm>
#include <map>
#include <filesystem>
#include <unistd.h>
#include <sys/stat.h>

#include <ctime>
#include <fstream>

#include "catch.h"
#include "kerf/cache/bundle.h"
#include "kerf/cache/disk_cache.h"
#include "kerf/jit/cpu_backend.h"
#include "kerf/jit/autotune.h"
#include "kerf/jit/nvrtc.h"
#include "kerf/runtime/cuda.h"
#include "kernels_src/ops_tune.h"
#include "smem_fit_util.h"
#include "test_cache_util.h"

using namespace kerf;

namespace {

#if defined(KERF_CACHE_TOOL_PATH)
constexpr const char* kTool = KERF_CACHE_TOOL_PATH;
#else
constexpr const char* kTool = "";
#endif

// Runs kerf-cache with `args` on cache directory `dir`; returns the exit status and stdout.
std::pair<int, std::string> tool(const std::string& dir, std::vector<std::string> args) {
  args.insert(args.begin(), {kTool, "--dir", dir});
  test::Child child(args, {{"KERF_LOG", "off"}});
  const int rc = child.wait();
  return {rc, child.output()};
}

// Whether kerf-cache was built with the tests and something here compiles kernels (NVRTC
// or LLVM); says why not as a skip otherwise.
bool tool_can_compile() {
  if (!*kTool) {
    std::printf("KERF-SKIPPED: kerf-cache was not built with the tests\n");
    return false;
  }
  if (!nvrtc::available() && !jit::cpu::available()) {
    std::printf("KERF-SKIPPED: nothing here can compile (no NVRTC, no LLVM)\n");
    return false;
  }
  return true;
}

// Whether kerf-cache was built with the tests and NVRTC compiles here for GPU `arches`;
// says why not as a skip otherwise.
bool tool_can_compile_gpu(const std::string& arches) {
  if (!*kTool) {
    std::printf("KERF-SKIPPED: kerf-cache was not built with the tests\n");
    return false;
  }
  if (!nvrtc::available()) {
    std::printf("KERF-SKIPPED: no NVRTC to compile for %s\n", arches.c_str());
    return false;
  }
  return true;
}

}  // namespace

TEST_CASE("kerf-cache warms, lists, packs, verifies and prunes", "[cache][tool]") {
  if (!tool_can_compile()) return;
  const bool gpu_code = nvrtc::available(), cpu = jit::cpu::available();
  test::TempDir dir;
  const std::string cache_dir = dir / "cache";
  // sm_80 has no device here: compiled, not tuned. The CPU runs (and tunes) the op itself.
  std::vector<std::string> warm = {"warm",       "--op",    "dora_norm", "--shape",
                                   "256x512x16", "--dtype", "f32"};
  if (gpu_code) warm.insert(warm.end(), {"--arch", "sm_80"});
  if (cpu) warm.insert(warm.end(), {"--arch", "cpu"});
  auto [rc, out] = tool(cache_dir, warm);
  INFO(out);
  REQUIRE(rc == 0);
  CHECK(out.find("warmed") != std::string::npos);
  // A second warm finds everything cached.
  std::tie(rc, out) = tool(cache_dir, warm);
  CHECK(rc == 0);
  CHECK(out.find(" 0 kernel(s) compiled") != std::string::npos);

  std::tie(rc, out) = tool(cache_dir, {"list"});
  CHECK(rc == 0);
  if (gpu_code) CHECK(out.find("sm_80") != std::string::npos);
  if (cpu)
    CHECK(out.find("tune-choice") !=
          std::string::npos);  // the CPU run tuned (warm turns tuning on)
  CHECK(out.find("dora_norm") != std::string::npos);

  std::tie(rc, out) = tool(cache_dir, {"inspect", "--json"});
  if (rc == 0) {
    CHECK(out.find("\"entries\"") != std::string::npos);
    CHECK(out.find("\"ir_hash\"") != std::string::npos);
  } else {
    CHECK(out.empty());  // built without nlohmann-json: refused with a message on stderr
  }

  const std::string bundle = dir / "app.kbundle";
  std::tie(rc, out) = tool(cache_dir, {"pack", bundle});
  CHECK(rc == 0);
  const size_t entries = cache::DiskCache(cache_dir, cache::DiskMode::readonly).list().size();
  CHECK(cache::Bundle(bundle).records().size() == entries);
  std::tie(rc, out) = tool(cache_dir, {"list", bundle});
  CHECK(rc == 0);
  CHECK(out.find("# kerf_version") != std::string::npos);
  std::tie(rc, out) = tool(cache_dir, {"verify", bundle});
  CHECK(rc == 0);
  CHECK(out.find(std::to_string(entries) + " valid, 0 bad") != std::string::npos);

  // pack's first argument is the bundle it writes; another version's bundle is not merged.
  std::tie(rc, out) = tool(cache_dir, {"pack", "--add", bundle});
  CHECK(rc == 2);  // stderr: "pack: the first argument is the bundle to write, got '--add'"
  CHECK_FALSE(std::filesystem::exists("--add"));
  {
    cache::BundleWriter old;
    old.add(*cache::read_file(cache::DiskCache(cache_dir, cache::DiskMode::readonly).list().front().path));
    old.write(dir / "old.kbundle", {{"kerf_version", "0.0.9"}});
  }
  std::tie(rc, out) = tool(cache_dir, {"pack", dir / "merged.kbundle", "--add", dir / "old.kbundle"});
  CHECK(rc == 2);  // stderr: "... old.kbundle was packed by kerf 0.0.9, this is kerf ..."
  CHECK_FALSE(std::filesystem::exists(dir / "merged.kbundle"));

  // A flipped bit in one entry: verify names it and fails.
  const std::string victim =
      cache::DiskCache(cache_dir, cache::DiskMode::readonly).list().front().path;
  std::vector<char> bytes = *cache::read_file(victim);
  bytes[bytes.size() / 2] ^= 0x40;
  std::ofstream(victim, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), std::streamsize(bytes.size()));
  std::tie(rc, out) = tool(cache_dir, {"verify"});
  CHECK(rc == 1);
  CHECK(out.find("BAD " + victim) != std::string::npos);
  std::tie(rc, out) = tool(cache_dir, {"list"});  // a listing showing a damaged entry says so by its status too
  CHECK(rc == 1);
  CHECK(out.find("BAD ") != std::string::npos);
  // So does a bundle packed without it.
  std::tie(rc, out) = tool(cache_dir, {"pack", dir / "partial.kbundle"});
  CHECK(rc == 1);
  CHECK(out.find("(1 skipped)") != std::string::npos);
  // A damaged entry of a bundle given to --add is skipped as one on disk is (the
  // whole pack failed): the rest is packed, and the exit status says it is partial.
  {
    const cache::Bundle::Record first = cache::Bundle(bundle).records().front();
    std::vector<char> image = *cache::read_file(bundle, size_t(1) << 30);
    image[size_t(first.offset + first.bytes / 2)] ^= 0x40;
    std::ofstream(dir / "damaged.kbundle", std::ios::binary).write(image.data(), std::streamsize(image.size()));
  }
  std::tie(rc, out) = tool(cache_dir, {"pack", dir / "merged2.kbundle", "--add", dir / "damaged.kbundle"});
  CHECK(rc == 1);
  CHECK(out.find("(2 skipped)") != std::string::npos);
  // A bundle cut short cannot be mounted at all: list, inspect and verify all call it bad (1).
  {
    const std::vector<char> image = *cache::read_file(bundle, size_t(1) << 30);
    std::ofstream(dir / "short.kbundle", std::ios::binary)
        .write(image.data(), std::streamsize(image.size() / 2));
  }
  for (const char* command : {"list", "inspect", "verify"}) {
    CAPTURE(command);
    std::tie(rc, out) = tool(cache_dir, {command, dir / "short.kbundle"});
    CHECK(rc == 1);
    CHECK(out.find("BAD ") != std::string::npos);
  }
  // Each damaged copy has a good one on the other side, unless both are the same entry.
  CHECK(cache::Bundle(dir / "merged2.kbundle").records().size() + 1 >= entries);

  std::tie(rc, out) = tool(cache_dir, {"prune", "--max-size", "0"});
  CHECK(rc == 0);
  CHECK(cache::DiskCache(cache_dir, cache::DiskMode::readonly).list().empty());

  std::tie(rc, out) = tool(cache_dir, {"warm", "--op", "no_such_op", "--shape", "1x2x3"});
  CHECK(rc == 2);
}

TEST_CASE("kerf-cache refuses arguments that would lose entries or store nothing", "[cache][tool]") {
  if (!*kTool) {
    std::printf("KERF-SKIPPED: kerf-cache was not built with the tests\n");
    return;
  }
  test::TempDir dir;
  // An empty --dir (an unset shell variable) is refused, never the default cache.
  CHECK(tool("", {"prune", "--max-size", "0"}).first == 2);
  // Sizes and ages: decimal numbers with a unit (ages need one), nothing else.
  for (const std::vector<std::string>& bad :
       {std::vector<std::string>{"prune", "--max-age", "30"},
        {"prune", "--max-age", "inf"},
        {"prune", "--max-size", "0x10"},
        {"prune", "--max-size", "nan"},
        {"prune", "--max-size", "1e30"},
        {"prune", "--max-size", "-1"},
        {"warm", "--op", "dora_norm", "--shape", "8x8x2", "-j", "abc"},
        {"warm", "--op", "dora_norm", "--shape", "8x8x2", "--arch", "bogus"},
        {"warm", "--op", "dora_norm", "--shape", "8x8x2", "--all-candidates", "--no-tune"},
        {"warm", "--op", "dora_norm", "--shape", "99999999999999999999999x8x2"},
        {"--dir", dir / "b", "list"}}) {
    CAPTURE(bad);
    CHECK(tool(dir / "cache", bad).first == 2);
  }
  // warm on a cache that stores nothing fails instead of reporting success.
  test::Child readonly({kTool, "--dir", dir / "cache", "warm", "--op", "dora_norm", "--shape", "8x8x2"},
                       {{"KERF_LOG", "off"}, {"KERF_CACHE", "readonly"}});
  CHECK(readonly.wait() == 2);
  // Nor with bundles mounted: what they hold would be served from them, not stored.
  cache::BundleWriter().write(dir / "empty.kbundle", {{"kerf_version", cache::kerf_version()}});
  test::Child with_bundles({kTool, "--dir", dir / "cache", "warm", "--op", "dora_norm", "--shape", "8x8x2"},
                           {{"KERF_LOG", "off"}, {"KERF_CACHE_BUNDLES", dir / "empty.kbundle"}});
  CHECK(with_bundles.wait() == 2);

  const bool gpu_code = nvrtc::available(), cpu = jit::cpu::available();
  if (!gpu_code && !cpu) return;
  // What the op would refuse is refused for a target with no device here too (it was
  // compiled and stored, and warm passed): a dtype the op does not take, a rank above
  // 256, more experts than a call takes.
  for (const std::vector<std::string>& refused :
       {std::vector<std::string>{"--op", "dora_norm", "--shape", "8x8x8", "--dtype", "i32"},
        {"--op", "lora_merge", "--shape", "8x8x8", "--dtype", "u8"},
        {"--op", "dora_norm", "--shape", "8x8x300"},
        {"--op", "moe_lora_materialize", "--shape", "70000x8x8x4"},
        {"--op", "lora_embedding", "--shape", "8x8x8x4", "--dtype", "i64"}}) {
    std::vector<std::string> warm = {"warm"};
    warm.insert(warm.end(), refused.begin(), refused.end());
    warm.insert(warm.end(), {"--arch", gpu_code ? "sm_90a" : "cpu"});
    CAPTURE(warm);
    const test::TempDir refused_dir;
    CHECK(tool(refused_dir / "cache", warm).first == 2);
    CHECK(cache::DiskCache(refused_dir / "cache", cache::DiskMode::readonly).list().empty());
  }
  // KERF_AUTOTUNE set blank is unset for warm as for the library: warm tunes (it did not).
  if (cpu) {
    const test::TempDir blank;
    test::Child child({kTool, "--dir", blank / "cache", "warm", "--op", "dora_norm", "--shape", "64x96x4", "--dtype",
                       "f32", "--arch", "cpu"},
                      {{"KERF_LOG", "off"}, {"KERF_AUTOTUNE", " "}});
    CHECK(child.wait() == 0);
    CHECK(tool(blank / "cache", {"list"}).second.find("tune-choice") != std::string::npos);
  }
  // Entries under a directory whose name holds ".tmp-" are entries, not a writer's leftovers.
  const std::string cache_dir = dir / "proj.tmp-x/cache";
  std::vector<std::string> warm = {"warm", "--op", "dora_norm", "--shape", "64x96x4", "--dtype", "f32", "--no-tune",
                                   "--arch", gpu_code ? "sm_80" : "cpu"};
  REQUIRE(tool(cache_dir, warm).first == 0);
  const std::vector<cache::DiskCache::Listed> before = cache::DiskCache(cache_dir, cache::DiskMode::readonly).list();
  REQUIRE_FALSE(before.empty());
  const std::time_t two_hours_ago = std::time(nullptr) - 7200;
  for (const auto& f : before) {
    const struct timeval times[2] = {{two_hours_ago, 0}, {two_hours_ago, 0}};
    REQUIRE(::utimes(f.path.c_str(), times) == 0);
  }
  auto [rc, out] = tool(cache_dir, {"prune", "--max-age", "30d"});
  CHECK(rc == 0);
  CHECK(out.find("removed 0 entries") != std::string::npos);
  CHECK(cache::DiskCache(cache_dir, cache::DiskMode::readonly).list().size() == before.size());
  // A folder of another cache format version: named with its size, removed only when asked.
  std::filesystem::create_directories(cache_dir + "/v0/ab");
  std::ofstream(cache_dir + "/v0/ab/old.kerf") << std::string(5000, 'x');
  std::tie(rc, out) = tool(cache_dir, {"prune", "--max-age", "30d"});
  CHECK(rc == 0);
  CHECK(out.find("in " + cache_dir + "/v0, a folder of another cache format version") != std::string::npos);
  CHECK(std::filesystem::exists(cache_dir + "/v0/ab/old.kerf"));
  std::tie(rc, out) = tool(cache_dir, {"prune", "--max-age", "30d", "--other-versions"});
  CHECK(rc == 0);
  CHECK(out.find("removed " + cache_dir + "/v0") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(cache_dir + "/v0"));
  CHECK(cache::DiskCache(cache_dir, cache::DiskMode::readonly).list().size() == before.size());
}

TEST_CASE("kerf-cache does not pack or verify a cache that is not there, nor one it must not trust",
          "[cache][tool]") {
  if (!*kTool) {
    std::printf("KERF-SKIPPED: kerf-cache was not built with the tests\n");
    return;
  }
  test::TempDir dir;
  // A mistyped --dir: no empty bundle that passes for a shipped cache.
  const std::string bundle = dir / "app.kbundle";
  CHECK(tool(dir / "no-such-cache", {"pack", bundle}).first == 2);
  CHECK_FALSE(std::filesystem::exists(bundle));
  CHECK(tool(dir / "no-such-cache", {"verify"}).first == 2);
  // Nor a directory that is there but holds no cache (the entries' folder itself, its
  // parent, any other folder).
  std::filesystem::create_directories(dir / "other");
  for (const std::string& not_a_cache : {dir / "other", dir.path()}) {
    CAPTURE(not_a_cache);
    const auto [rc, out] = tool(not_a_cache, {"pack", bundle});
    CHECK(rc == 2);
    CHECK(tool(not_a_cache, {"verify"}).first == 2);
  }
  CHECK_FALSE(std::filesystem::exists(bundle));
  // Without a home, the /tmp fallback that another user could have filled: the library
  // leaves it alone, and so do the tools (unless given a directory).
  const std::string fallback = "/tmp/kerf-cache-" + std::to_string(::getuid());
  struct stat before {};
  const bool existed = ::stat(fallback.c_str(), &before) == 0;
  if (!existed) REQUIRE(::mkdir(fallback.c_str(), 0700) == 0);
  REQUIRE(::chmod(fallback.c_str(), 0777) == 0);
  const std::map<std::string, std::string> homeless = {
      {"KERF_LOG", "off"}, {"HOME", ""}, {"XDG_CACHE_HOME", ""}, {"KERF_CACHE_DIR", ""}};
  for (const std::vector<std::string>& command :
       {std::vector<std::string>{"pack", bundle}, {"list"}, {"verify"}, {"prune", "--max-size", "0"},
        {"warm", "--op", "dora_norm", "--shape", "8x8x2"}}) {
    CAPTURE(command);
    std::vector<std::string> argv = {kTool};
    argv.insert(argv.end(), command.begin(), command.end());
    test::Child child(argv, homeless);
    CHECK(child.wait() == 2);
  }
  CHECK_FALSE(std::filesystem::exists(bundle));
  ::chmod(fallback.c_str(), existed ? (before.st_mode & 07777) : 0700);
  if (!existed) ::rmdir(fallback.c_str());
}

TEST_CASE("kerf-cache warms every tunable op, on the CPU back end and for a GPU architecture",
          "[cache][tool]") {
  if (!tool_can_compile()) return;
  const bool gpu_code = nvrtc::available(), cpu = jit::cpu::available();
  test::TempDir dir;
  const std::vector<std::pair<std::string, std::string>> ops = {
      {"lora_merge", "70x90x5"},
      {"moe_lora_materialize", "3x40x72x4"},
      {"moe_lora_materialize_backward", "3x40x72x4"},
      {"lora_embedding", "17x300x48x4"},
      {"lora_embedding_backward", "17x300x48x4"}};
  for (const auto& [op, shape] : ops) {
    std::vector<std::string> warm = {"warm", "--op", op, "--shape", shape, "--dtype", "f32"};
    if (gpu_code) warm.insert(warm.end(), {"--arch", "sm_90a"});
    if (cpu) warm.insert(warm.end(), {"--arch", "cpu"});
    const auto [rc, out] = tool(dir / "cache", warm);
    INFO(op << ": " << out);
    CHECK(rc == 0);
    CHECK(out.find(" 0 failed") != std::string::npos);
  }
  const auto [rc, out] = tool(dir / "cache", {"list"});
  for (const auto& [op, shape] : ops) CHECK(out.find(op) != std::string::npos);
}

// A layout given to warm: the op runs (or its kernels compile) with it, stored under its
// canonical text, which a sharded call of the same local shapes then finds.
TEST_CASE("kerf-cache warm stores a sharded op's kernels under its layout", "[cache][tool][sharding]") {
  if (!tool_can_compile()) return;
  const bool gpu_code = nvrtc::available(), cpu = jit::cpu::available();
  test::TempDir dir;
  const std::string cache_dir = dir / "cache";
  const auto warm = [&](const std::string& op, const std::string& shape, const std::vector<std::string>& layout) {
    // sm_80: compiled only (no such device here); a GPU here runs the op itself.
    std::vector<std::string> args = {"warm", "--op", op, "--shape", shape, "--dtype", "f32"};
    if (gpu_code) args.insert(args.end(), {"--arch", "sm_80"});
    if (gpu_code && cuda::device_count() > 0) args.insert(args.end(), {"--arch", "native"});
    if (cpu) args.insert(args.end(), {"--arch", "cpu"});
    for (const std::string& l : layout) args.insert(args.end(), {"--layout", l});
    return tool(cache_dir, args);
  };
  // Out split over tp (local shards), written in another order and with an unused mesh axis:
  // the same layout as its canonical text.
  auto [rc, out] = warm("dora_norm", "64x96x4", {"mesh(tp=2,dp=4) W[tp] B[tp] m[tp] norm[tp] scale[tp]"});
  INFO(out);
  REQUIRE(rc == 0);
  CHECK(out.find(" 0 failed") != std::string::npos);
  std::tie(rc, out) = warm("dora_norm", "64x96x4", {"mesh(tp=2) B[tp] W[tp] m[tp] norm[tp] scale[tp]"});
  CHECK(rc == 0);
  CHECK(out.find(" 0 kernel(s) compiled") != std::string::npos);
  std::tie(rc, out) = tool(cache_dir, {"inspect"});
  CHECK(out.find("layout: mesh(tp=2) B[tp] W[tp] m[tp] norm[tp] scale[tp]") != std::string::npos);
  // The unsharded op's kernels are other entries (compiled for sm_80 again; a run here
  // finds what its tuning trials compiled, which carry no layout).
  std::tie(rc, out) = warm("dora_norm", "64x96x4", {});
  CHECK(rc == 0);
  if (gpu_code) CHECK(out.find(" 0 kernel(s) compiled") == std::string::npos);
  // W split on in: dora_norm_partial's (row-parallel layers' partial sums).
  std::tie(rc, out) = warm("dora_norm_partial", "64x48x4", {"mesh(tp=2) A[,tp] W[,tp]"});
  CHECK(rc == 0);
  // A vocabulary split over two axes (coordinates 0), experts split.
  std::tie(rc, out) = warm("lora_embedding", "17x300x48x4", {"mesh(dp=2,tp=4) A[,(dp,tp)] weight[(dp,tp)]"});
  CHECK(rc == 0);
  std::tie(rc, out) = warm("moe_lora_materialize_backward", "2x40x72x4",
                           {"mesh(ep=4) A[ep] B[ep] dA[ep] dB[ep] dW_eff[ep]"});
  CHECK(rc == 0);
  // Refused (exit 2, stderr says why): text canonical() would not write, an op that takes
  // no layout, a layout the op refuses (dora_norm with W split on in: dora_norm_partial's),
  // an operand the op lacks.
  for (const auto& [op, layout] : std::vector<std::pair<std::string, std::string>>{
           {"dora_norm", "W[tp]"},
           {"lora_merge", "mesh(tp=2) W[tp]"},
           {"dora_norm", "mesh(tp=2) A[,tp] W[,tp]"},
           {"dora_norm", "mesh(tp=2) X[tp]"}}) {
    std::tie(rc, out) = warm(op, "64x96x4", {layout});
    CAPTURE(op, layout);
    CHECK(rc == 2);
  }
}

// For a GPU whose blocks hold less shared memory than an op's own tiles need (sm_86: 99
// KiB; merge at rank 256 in bf16 takes 145920 bytes), warm compiles what an untuned call
// there runs instead (README, "Untuned calls"), not the tiles that could not launch.
TEST_CASE("kerf-cache warm compiles what an untuned call runs on a GPU with less shared memory",
          "[cache][tool]") {
  if (!tool_can_compile_gpu("sm_86")) return;
  const autotune::TunableOp op = test::registered_op("lora_merge");
  void* const p = reinterpret_cast<void*>(uintptr_t(1) << 20);
  std::vector<TensorView> views;
  for (const autotune::Operand& o : op.operands({1024, 1024, 256}, DType::bf16))
    views.push_back(TensorView::contiguous(p, o.dtype, o.shape, Device::cuda(0)));
  const int limit = autotune::typical_max_shared_memory("sm_86"), sms = autotune::typical_sm_count("sm_86");
  ops::detail::UntunedFit fit;
  const autotune::Config chosen = ops::detail::untuned_candidate(op, views, "sm_86", limit, sms, &fit);
  REQUIRE_FALSE(chosen.empty());
  CHECK(fit.own_bytes > limit);
  const autotune::Config own = op.kernels(views, {}, sms).at(0).meta;
  const autotune::Config runs = op.kernels(views, chosen, sms).at(0).meta;
  REQUIRE(own != runs);
  test::TempDir dir;
  const auto [rc, out] = tool(dir / "cache", {"warm", "--op", "lora_merge", "--shape", "1024x1024x256", "--dtype",
                                              "bf16", "--arch", "sm_86", "--no-tune"});
  INFO(out);
  CHECK(rc == 0);
  CHECK(out.find(" 0 failed") != std::string::npos);
  // The one kernel stored is the fitted one: `list` shows its meta (with the kernel's own
  // defaults for the rest).
  const auto [lrc, listed] = tool(dir / "cache", {"list"});
  INFO(listed);
  CHECK(lrc == 0);
  CHECK(listed.find("1 entries") != std::string::npos);
  const auto shows = [&](const autotune::Config& meta) {
    for (const auto& [name, value] : meta)
      if (listed.find(name + "=" + std::to_string(value) + ",") == std::string::npos &&
          listed.find(name + "=" + std::to_string(value) + "\n") == std::string::npos)
        return false;
    return true;
  };
  CHECK(shows(runs));
  CHECK_FALSE(shows(own));
}

// An op's own tiles depend on the architecture (the MoE forward's are warpgroup tiles on
// sm_90a): warm plans them for its --arch, whatever GPU (or none) the machine has.
TEST_CASE("kerf-cache warm compiles an op's own tiles for the target architecture", "[cache][tool]") {
  if (!tool_can_compile_gpu("sm_90a and sm_80")) return;
  for (const std::string arch : {"sm_90a", "sm_80"}) {
    CAPTURE(arch);
    test::TempDir dir;
    const auto [rc, out] = tool(dir / "cache", {"warm", "--op", "moe_lora_materialize", "--shape", "8x512x1024x64",
                                                "--dtype", "bf16", "--arch", arch, "--no-tune"});
    INFO(out);
    CHECK(rc == 0);
    const auto [lrc, listed] = tool(dir / "cache", {"list"});
    INFO(listed);
    CHECK(lrc == 0);
    CHECK(listed.find("1 entries") != std::string::npos);
    const bool warpgroup_tile = listed.find("store_in_ring=1") != std::string::npos &&
                                listed.find("wgmma=1") != std::string::npos;
    CHECK(warpgroup_tile == (arch == "sm_90a"));
  }
}
