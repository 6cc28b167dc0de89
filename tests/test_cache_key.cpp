// Cache keys: every field changes the key, the encoding is pinned, and equal
// inputs give equal keys in another process.
#include <cstring>
#include <functional>
#include <set>

#include "catch.h"
#include "kerf/cache/cuda_binary.h"
#include "kerf/cache/key.h"
#include "kerf/jit/cuda_codegen.h"
#include "kerf/kernels/library.h"
#include "test_cache_util.h"

using namespace kerf;

namespace {

// Run by hand (not by ctest), the tests would fill the user's cache: give them
// one of their own unless the caller chose a directory.
const bool kTestCacheDir = [] {
  if (!std::getenv("KERF_CACHE_DIR"))
    ::setenv("KERF_CACHE_DIR", ("/tmp/kerf-tests-" + std::to_string(::getuid())).c_str(), 1);
  return true;
}();

cache::KernelKeyFields base_kernel_fields() {
  cache::KernelKeyFields f;
  f.kernel = "dora_norm";
  f.ir_hash = {1, 2};
  f.code_hash = {3, 4};
  f.meta = {{"BLOCK_M", 64}, {"num_warps", 4}};
  ir::TensorFacts facts;
  facts.contiguous_last = true;
  facts.aligned16 = true;
  facts.dims_div16 = 3;
  facts.strides_div16 = 1;
  f.args = {dsl::ArgSpec::tensor(DType::bf16, 2, facts), dsl::ArgSpec::scalar()};
  f.layout = "mesh(tp=2) W:[tp,_]";
  f.target = {"cuda", "sm_90a", "nvrtc 13.0", "", ""};
  f.kerf_version = "0.1.0";
  return f;
}

cache::TuneKeyFields base_tune_fields() {
  cache::TuneKeyFields f;
  f.op = "dora_norm";
  f.shape_bucket = {4096, 4096, 16};
  f.dtypes = {DType::bf16, DType::f32};
  f.layout = "";
  f.target = {"cuda", "sm_90a", "", "", "NVIDIA H100 80GB HBM3"};
  f.kerf_version = "0.1.0";
  return f;
}

// The key of the library's dora_norm for sm_90a, as a launch would compute it.
std::string library_kernel_key() {
  const kernels::LibraryEntry* e = kernels::find_in_library("dora_norm");
  const ir::Function fn =
      e->kernel().trace(e->example_args(DType::bf16), e->example_meta(DType::bf16));
  const std::string source = jit::cuda::generate(fn, "sm_90a").source;
  cache::Target t{"cuda", "sm_90a", "nvrtc 13.0", "", ""};
  const cache::CacheKey k = cache::kernel_key(
      cache::kernel_fields(fn, ir::hash_bytes(source.data(), source.size()), "", t));
  return k.id.hex() + "/" + k.family.hex();
}

}  // namespace

TEST_CASE("every field of a kernel key changes the key", "[cache]") {
  const cache::KernelKeyFields base = base_kernel_fields();
  using Edit = std::function<void(cache::KernelKeyFields&)>;
  const std::vector<std::pair<const char*, Edit>> edits = {
      {"kernel name", [](auto& f) { f.kernel = "dora_norm_split"; }},
      {"IR hash", [](auto& f) { f.ir_hash.lo ^= 1; }},
      {"generated code", [](auto& f) { f.code_hash.hi ^= 1; }},
      {"meta value", [](auto& f) { f.meta[0].value = 128; }},
      {"meta name", [](auto& f) { f.meta[0].name = "BLOCK_N"; }},
      {"one more meta",
       [](auto& f) {
         f.meta.push_back({"num_stages", 3});
       }},
      {"dtype", [](auto& f) { f.args[0].dtype = DType::f16; }},
      {"rank", [](auto& f) { f.args[0].rank = 3; }},
      {"contiguity", [](auto& f) { f.args[0].facts.contiguous_last = false; }},
      {"alignment", [](auto& f) { f.args[0].facts.aligned16 = false; }},
      {"divisible dims", [](auto& f) { f.args[0].facts.dims_div16 = 1; }},
      {"divisible strides", [](auto& f) { f.args[0].facts.strides_div16 = 0; }},
      {"dims divisible by 8", [](auto& f) { f.args[0].facts.dims_div8 = 1; }},
      {"strides divisible by 8", [](auto& f) { f.args[0].facts.strides_div8 = 1; }},
      {"tensor for scalar", [](auto& f) { f.args[1] = dsl::ArgSpec::tensor(DType::f32, 1); }},
      {"one more argument", [](auto& f) { f.args.push_back(dsl::ArgSpec::scalar()); }},
      {"layout", [](auto& f) { f.layout = "mesh(tp=4) W:[tp,_]"; }},
      {"no layout", [](auto& f) { f.layout.clear(); }},
      {"backend", [](auto& f) { f.target.backend = "cpu"; }},
      {"arch", [](auto& f) { f.target.arch = "sm_90"; }},
      {"compiler", [](auto& f) { f.target.compiler = "nvrtc 12.8"; }},
      {"CPU features", [](auto& f) { f.target.features = "+avx2"; }},
      {"kerf version", [](auto& f) { f.kerf_version = "0.2.0"; }},
  };
  std::set<std::string> ids = {cache::kernel_key(base).id.hex()};
  for (const auto& [what, edit] : edits) {
    CAPTURE(what);
    cache::KernelKeyFields f = base;
    edit(f);
    const cache::CacheKey k = cache::kernel_key(f);
    CHECK(ids.insert(k.id.hex()).second);
    // The family leaves out the compiler only.
    CHECK((k.family == cache::kernel_key(base).family) == (std::string(what) == "compiler"));
  }
  // A scalar's dtype is not part of a specialization (the kernel fixes it).
  cache::KernelKeyFields f = base;
  f.args[1].dtype = DType::i64;
  CHECK(cache::kernel_key(f).id == cache::kernel_key(base).id);
}

TEST_CASE("every field of an autotune key changes the key", "[cache][autotune]") {
  const cache::TuneKeyFields base = base_tune_fields();
  using Edit = std::function<void(cache::TuneKeyFields&)>;
  const std::vector<std::pair<const char*, Edit>> edits = {
      {"op", [](auto& f) { f.op = "moe_lora_materialize"; }},
      {"shape bucket", [](auto& f) { f.shape_bucket[1] = 8192; }},
      {"shape rank", [](auto& f) { f.shape_bucket.push_back(1); }},
      {"dtype", [](auto& f) { f.dtypes[0] = DType::f16; }},
      {"layout", [](auto& f) { f.layout = "mesh(tp=2) W:[_,tp]"; }},
      {"backend", [](auto& f) { f.target.backend = "cpu"; }},
      {"arch", [](auto& f) { f.target.arch = "sm_80"; }},
      {"device", [](auto& f) { f.target.device = "NVIDIA H200"; }},
      {"CPU features", [](auto& f) { f.target.features = "+avx512f"; }},
      {"kerf version", [](auto& f) { f.kerf_version = "0.2.0"; }},
  };
  std::set<std::string> ids = {cache::tune_key(base).id.hex()};
  for (const auto& [what, edit] : edits) {
    CAPTURE(what);
    cache::TuneKeyFields f = base;
    edit(f);
    CHECK(ids.insert(cache::tune_key(f).id.hex()).second);
  }
  // Kernel and tune keys never collide, even from look-alike fields.
  CHECK(cache::tune_key(base).id != cache::kernel_key(base_kernel_fields()).id);
}

TEST_CASE("the key encoding is versioned and pinned", "[cache]") {
  const cache::CacheKey k = cache::kernel_key(base_kernel_fields());
  REQUIRE(k.encoding.size() > 13);
  CHECK(k.encoding.substr(0, 8) == "kerf-key");
  uint32_t version = 0;
  std::memcpy(&version, k.encoding.data() + 8, 4);
  CHECK(version == cache::kKeyEncodingVersion);
  CHECK(k.id == ir::hash_bytes(k.encoding.data(), k.encoding.size()));
  // Pinned: if this changes, the encoding changed; bump kKeyEncodingVersion with it.
  CHECK(k.id.hex() == "84495510177a5d0cd89fbaad206c445d");
  CHECK(cache::tune_key(base_tune_fields()).id.hex() == "b358d53d8abf4020a6d3d24ff1dd0fed");
}

TEST_CASE("equal inputs give equal keys in another process", "[cache]") {
  const std::string mine = library_kernel_key();
  test::Child child(test::self_test("[.cache-child-key]"), {});
  REQUIRE(child.wait() == 0);
  CHECK(child.value("KEY") == mine);
}

TEST_CASE("child: print the library kernel's key", "[.cache-child-key]") {
  std::printf("KEY=%s\n", library_kernel_key().c_str());
}
