// Every kernel of the suite and of kernels_src/ is generated as CUDA C++ and
// compiled by NVRTC for sm_80 and sm_90a, on any machine (NVRTC needs no GPU).
#include <string>
#include <tuple>
#include <vector>

#include "catch.h"
#include "kerf/cache/cuda_binary.h"
#include "gpu_test_util.h"
#include "kerf/jit/cuda_codegen.h"
#include "kerf/jit/launch.h"
#include "kerf/jit/nvrtc.h"
#include "kerf/kernels/kernels.h"
#include "kerf/kernels/library.h"
#include "sample_kernels.h"
#include "source_util.h"
#include "test_cache_util.h"

using namespace kerf;
using namespace kerf::dsl;

namespace {

ir::TensorFacts fast_facts(int rank) {
  ir::TensorFacts f;
  f.contiguous_last = true;
  f.aligned16 = true;
  f.dims_div16 = (1u << rank) - 1;
  f.strides_div16 = (1u << (rank - 1)) - 1;
  return f;
}

ArgSpec t(DType d, int rank, bool fast = true) {
  return ArgSpec::tensor(d, rank, fast ? fast_facts(rank) : ir::TensorFacts{});
}

// The vector width of the first access in generated code whose comment starts with
// `what` ("load @A in ", "// store @dA from"): the N of its "N-wide".
int access_width(const std::string& src, const std::string& what) {
  const size_t at = src.find(what);
  REQUIRE(at != std::string::npos);
  const size_t end = src.find("-wide", at);
  REQUIRE(end != std::string::npos);
  const size_t start = src.rfind(' ', end) + 1;
  return std::stoi(src.substr(start, end - start));
}

struct Case {
  const Kernel* kernel;
  std::vector<ArgSpec> args;
  MetaMap meta;
  std::string what;
};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    for (bool fast : {true, false}) {
      cases.push_back({&test::vec_add_kernel(), {t(d, 1, fast), t(d, 1, fast), t(d, 1, fast)}, {{"BLOCK", 1024}},
                       "vec_add"});
      cases.push_back({&test::softmax_kernel(), {t(d, 2, fast), t(d, 2, fast)}, {{"BM", 4}, {"BN", 256}}, "softmax"});
      cases.push_back({&test::matmul_kernel(), {t(d, 2, fast), t(d, 2, fast), t(d, 2, fast)},
                       {{"BM", 64}, {"BN", 64}, {"BK", 32}, {"num_stages", fast ? 3 : 1}}, "matmul"});
      cases.push_back({&test::matmul_t_kernel(), {t(d, 2, fast), t(d, 2, fast), t(d, 2, fast)},
                       {{"BM", 64}, {"BN", 64}, {"BK", 32}, {"num_stages", fast ? 3 : 1}}, "matmul_t"});
      cases.push_back({&test::column_sum_atomic_kernel(), {t(d, 2, fast), t(d, 1, fast)}, {{"BM", 16}, {"BN", 64}},
                       "column_sum_atomic"});
      cases.push_back({&test::elementwise_kernel(),
                       {t(d, 1, fast), t(d, 1, fast), t(d, 1, fast), t(DType::i64, 1, fast)},
                       {{"BLOCK", 256}},
                       "elementwise"});
    }
  // The kernel library, in each dtype it supports, pipelined and not.
  for (DType w : {DType::bf16, DType::f16, DType::f32}) {
    const DType dot = is_half(w) ? w : DType::f32;
    for (int64_t stages : {1, 3}) {
      const MetaMap dora = {{"BLOCK_M", 64}, {"BLOCK_K", 64}, {"R_PAD", 16}, {"DOT", int64_t(dot)}, {"num_stages", stages}};
      cases.push_back({&kernels::dora_norm_fused(),
                       {t(w, 2), t(w, 2), t(w, 2), t(DType::f32, 1), ArgSpec::scalar(), ArgSpec::scalar(),
                        t(DType::f32, 1), t(DType::f32, 1)},
                       dora, "dora_norm_fused"});
      cases.push_back({&kernels::dora_norm_split(),
                       {t(w, 2), t(w, 2), t(w, 2), t(DType::f32, 1), ArgSpec::scalar(), ArgSpec::scalar(),
                        t(DType::f32, 1), t(DType::f32, 1), t(DType::f32, 1), t(DType::i32, 1)},
                       dora, "dora_norm_split"});
      const MetaMap& partial = dora;
      cases.push_back({&kernels::dora_norm_partial(),
                       {t(w, 2), t(DType::f32, 2), t(DType::f32, 2), ArgSpec::scalar(), t(DType::f32, 1)}, partial,
                       "dora_norm_partial"});
      cases.push_back({&kernels::moe_lora_materialize(),
                       {t(w, 3), t(w, 3), ArgSpec::tensor(w, 3), ArgSpec::scalar(), t(w, 3)},
                       {{"BLOCK_N", 64}, {"BLOCK_K", 128}, {"R_PAD", 32}, {"DOT", int64_t(dot)}, {"num_stages", stages}},
                       "moe_lora_materialize"});
    }
  }
  // The merge with its accumulator in runs of 16 bytes per thread (STREAM), both product forms.
  for (DType w : {DType::bf16, DType::f16, DType::f32})
    for (int64_t scale_after : {0, 1})
      cases.push_back({&kernels::lora_merge(),
                       {t(w, 3), t(is_half(w) ? w : DType::bf16, 3), t(is_half(w) ? w : DType::bf16, 3),
                        ArgSpec::scalar()},
                       {{"BLOCK_M", 64}, {"BLOCK_K", 128}, {"R_PAD", 16},
                        {"DOT", int64_t(is_half(w) ? w : DType::bf16)}, {"SCALE_AFTER", scale_after},
                        {"COLS_FIRST", 1}, {"acc_col_run", 16 / dtype_size_bytes(w)}},
                       "lora_merge acc_col_run"});
  // Its one-tile form (ONE_TILE: W's tile asked for first, the product added to it after).
  for (DType w : {DType::bf16, DType::f32})
    cases.push_back({&kernels::lora_merge(),
                     {t(w, 3), t(is_half(w) ? w : DType::bf16, 3), t(is_half(w) ? w : DType::bf16, 3),
                      ArgSpec::scalar()},
                     {{"BLOCK_M", 64}, {"BLOCK_K", 128}, {"R_PAD", 64},
                      {"DOT", int64_t(is_half(w) ? w : DType::bf16)}, {"SCALE_AFTER", is_half(w) ? 1 : 0},
                      {"COLS_FIRST", 1}, {"acc_col_run", 16 / dtype_size_bytes(w)}, {"ONE_TILE", 1}},
                     "lora_merge one tile"});
  for (int64_t stages : {1, 3})
    cases.push_back({&test::matmul_kernel(), {t(DType::bf16, 2), t(DType::bf16, 2), t(DType::bf16, 2)},
                     {{"BM", 64}, {"BN", 128}, {"BK", 32}, {"num_stages", stages}, {"num_warps", 8},
                      {"acc_col_run", 8}},
                     "matmul acc_col_run"});
  cases.push_back({&kernels::dora_norm_finish(),
                   {t(DType::f32, 1), t(DType::bf16, 1), ArgSpec::scalar(), t(DType::f32, 1), t(DType::f32, 1)},
                   {{"BLOCK", 1024}}, "dora_norm_finish"});
  cases.push_back({&kernels::fill(), {t(DType::f32, 1), ArgSpec::scalar()}, {{"BLOCK", 1024}}, "fill"});
  for (DType d : {DType::f32, DType::bf16})
    cases.push_back({&test::corners_kernel(), {t(d, 3), t(d, 1), t(d, 2), t(d, 2), t(d, 2)}, {}, "corners"});
  for (int64_t shift : {0, 1})
    cases.push_back({&test::inplace_kernel(), {t(DType::bf16, 2)},
                     {{"BM", 16}, {"BN", 64}, {"SHIFT", shift}, {"num_stages", 3}}, "inplace"});
  for (bool fast : {true, false})
    cases.push_back({&test::nibbles_kernel(),
                     {t(DType::u8, 2, fast), t(DType::f32, 1, fast), t(DType::f32, 2, fast), t(DType::u8, 2, fast)},
                     {{"BM", 8}, {"BC", 64}},
                     "nibbles"});
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    for (bool fast : {true, false})
      cases.push_back({&test::interleave_kernel(),
                       {t(d, 2, fast), t(d, 2, fast), t(d, 2, fast), t(d, 2, fast), t(d, 2, fast),
                        t(DType::f32, 2, fast), t(d, 1, fast)},
                       {{"BM", 16}, {"BN", 64}, {"K", 16}, {"num_warps", fast ? 4 : 8}},
                       "interleave"});
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    cases.push_back({&test::gather_kernel(), {t(d, 1), t(DType::i32, 2), t(DType::u8, 2), t(d, 2)},
                     {{"T", d == DType::f32 ? 32 : 16}, {"BM", 16}, {"BN", 64}, {"num_warps", d == DType::f16 ? 8 : 4}},
                     "gather"});
  for (int64_t wait : {1, 2})
    cases.push_back({&test::overlap_consumer_kernel(), {t(DType::bf16, 2), t(DType::bf16, 2), t(DType::f32, 1)},
                     {{"BM", 16}, {"BN", 128}, {"WAIT", wait}, {"num_stages", 3}}, "overlap_consumer"});
  cases.push_back({&test::overlap_producer_kernel(), {t(DType::f32, 2), t(DType::f32, 2)},
                   {{"BM", 16}, {"BN", 128}, {"REPEAT", 2}, {"RELEASE", 1}}, "overlap_producer"});
  cases.push_back({&test::l2_keep_kernel(), {t(DType::f32, 1), t(DType::f32, 1)}, {{"BLOCK", 64}}, "l2_keep"});
  for (int64_t cluster : {1, 2, 4})
    cases.push_back({&test::cluster_sum_kernel(), {t(DType::bf16, 2), t(DType::f32, 1), t(DType::f32, 1)},
                     {{"BM", 32}, {"BN", 64}, {"cluster_size", cluster}, {"num_stages", 2}}, "cluster_sum"});
  // The MoE backward's step atomics summed over clusters, mma.sync and warpgroup dots (A's
  // fragments in registers, or A from shared memory too).
  for (int64_t wgmma : {0, 1, 2})
    cases.push_back({&kernels::moe_lora_backward(),
                     {t(DType::bf16, 3), t(DType::bf16, 3), t(DType::bf16, 3), ArgSpec::scalar(), t(DType::f32, 3),
                      t(DType::bf16, 3)},
                     {{"BLOCK_N", 128}, {"BLOCK_K", 64}, {"R_PAD", 64}, {"DOT", int64_t(DType::bf16)},
                      {"ROTATE", 1}, {"cluster_size", 2}, {"num_warps", 8}, {"num_stages", 3},
                      {"wgmma", wgmma ? 1 : 0}, {"wgmma_ss", wgmma == 2 ? 1 : 0}},
                     "moe_lora_backward"});
  // The column-owning 64x256 tile with warpgroup dots reading both operands from shared memory.
  cases.push_back({&kernels::moe_lora_backward_by_columns(),
                   {t(DType::bf16, 3), t(DType::bf16, 3), t(DType::bf16, 3), ArgSpec::scalar(), t(DType::bf16, 3),
                    t(DType::f32, 3)},
                   {{"BLOCK_N", 64}, {"BLOCK_K", 256}, {"R_PAD", 64}, {"DOT", int64_t(DType::bf16)},
                    {"staged_adds", 1}, {"num_warps", 8}, {"num_stages", 3}, {"wgmma", 1}, {"wgmma_ss", 1}},
                   "moe_lora_backward_by_columns"});
  cases.push_back({&kernels::moe_lora_backward_by_columns(),
                   {t(DType::bf16, 3), t(DType::bf16, 3), t(DType::bf16, 3), ArgSpec::scalar(), t(DType::bf16, 3),
                    t(DType::f32, 3)},
                   {{"BLOCK_N", 32}, {"BLOCK_K", 256}, {"R_PAD", 16}, {"DOT", int64_t(DType::bf16)},
                    {"cluster_size", 4}, {"num_warps", 8}, {"num_stages", 2}},
                   "moe_lora_backward_by_columns"});
  // The embedding backward's products as warpgroup dots with both operands in shared memory.
  for (int64_t ss : {0, 1}) {
    const kernels::LibraryEntry* e = kernels::find_in_library("lora_embedding_backward_fused");
    cases.push_back({&e->kernel(), e->example_args(DType::bf16),
                     {{"BLOCK_T", 128}, {"BLOCK_D", 128}, {"R_PAD", 16}, {"DOT", int64_t(DType::bf16)},
                      {"ROTATE", 1}, {"staged_adds", 1}, {"BLOCK_V", 64}, {"BLOCK_M", 64}, {"num_warps", 4},
                      {"num_stages", 3}, {"wgmma", 1}, {"wgmma_ss", ss}},
                     "lora_embedding_backward_fused"});
  }
  cases.push_back({&test::ticket_kernel(), {t(DType::i32, 1), t(DType::i32, 1), t(DType::f32, 1), t(DType::f32, 1)},
                   {{"BLOCK", 64}}, "ticket"});
  return cases;
}

}  // namespace

TEST_CASE("every sample and library kernel compiles with NVRTC for sm_80 and sm_90a", "[cuda][codegen]") {
  KERF_REQUIRE_NVRTC();
  for (const Case& c : all_cases()) {
    const ir::Function fn = c.kernel->trace(c.args, c.meta);
    for (const char* arch : {"sm_80", "sm_90a"}) {
      INFO(c.what << " for " << arch << "\n" << ir::print(fn));
      const jit::cuda::KernelCode code = jit::cuda::generate(fn, arch);
      CHECK(code.source.find("extern \"C\" __global__") != std::string::npos);
      nvrtc::Output out;
      REQUIRE_NOTHROW(out = nvrtc::compile(code.source, code.entry + ".cu", arch));
      CHECK(out.is_cubin);
      CHECK(out.image.size() > 4);
    }
  }
}

TEST_CASE("ptxas_usage reads registers, spills and advisories from an NVRTC log", "[cuda]") {
  // A log as NVRTC 13 gives it with --ptxas-options=-v (a compiler warning first).
  const std::string log =
      "k.cu(709): warning #177-D: variable \"wm\" was declared but never referenced\n"
      "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
      "insufficient register resources for the function 'k'\n"
      "ptxas info    : 1 bytes gmem\n"
      "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
      "ptxas info    : Function properties for k\n"
      "ptxas         .     432 bytes stack frame, 432 bytes spill stores, 428 bytes spill loads\n"
      "ptxas info    : Used 255 registers, used 1 barriers, 432 bytes cumulative stack size\n"
      "ptxas info    : Compile time = 873.469 ms";
  const nvrtc::PtxasUsage u = nvrtc::ptxas_usage(log);
  CHECK(u.registers == 255);
  CHECK(u.spill_store_bytes == 432);
  CHECK(u.spill_load_bytes == 428);
  CHECK(u.stack_frame_bytes == 432);
  REQUIRE(u.advisories.size() == 1);
  CHECK(u.advisories[0].rfind("(C7512) Potential Performance Loss: wgmma.mma_async", 0) == 0);
  // Nothing said: nothing known.
  const nvrtc::PtxasUsage none = nvrtc::ptxas_usage("k.cu(3): warning #177-D: unused");
  CHECK(none.registers == -1);
  CHECK(none.spill_store_bytes == -1);
  CHECK(none.advisories.empty());
  // From NVRTC itself, where it is installed: a kernel's own figures.
  if (!nvrtc::available()) return;
  const Case c = all_cases().front();
  const jit::cuda::KernelCode code = jit::cuda::generate(c.kernel->trace(c.args, c.meta), "sm_90a");
  const nvrtc::PtxasUsage real =
      nvrtc::ptxas_usage(nvrtc::compile(code.source, code.entry + ".cu", "sm_90a", {nvrtc::kPtxasVerbose}).log);
  INFO(c.what);
  CHECK(real.registers > 0);
  CHECK(real.spill_store_bytes == 0);
}

namespace {

// A log as ptxas -v writes it for one kernel: `regs` registers, `spill` bytes spilled.
std::string ptxas_log(int regs, int spill) {
  return "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
         "ptxas         .     " + std::to_string(spill) + " bytes stack frame, " + std::to_string(spill) +
         " bytes spill stores, " + std::to_string(spill) + " bytes spill loads\n"
         "ptxas info    : Used " + std::to_string(regs) + " registers, used 1 barriers";
}

}  // namespace

TEST_CASE("programs_per_multiprocessor counts what shared memory and threads allow", "[cuda]") {
  // An H100: 228 KB a multiprocessor, 1 KB reserved for each program, 2048 threads.
  CHECK(cache::programs_per_multiprocessor(128, 131072, "sm_90a") == 1);
  CHECK(cache::programs_per_multiprocessor(128, 110592, "sm_90a") == 2);
  CHECK(cache::programs_per_multiprocessor(128, 0, "sm_90a") == 16);   // threads: 2048 / 128
  CHECK(cache::programs_per_multiprocessor(256, 193536, "sm_90a") == 1);
  CHECK(cache::programs_per_multiprocessor(128, 240000, "sm_90a") == 0);  // does not fit
  CHECK(cache::programs_per_multiprocessor(128, 110592, "sm_80") == 1);   // 164 KB
  CHECK(cache::programs_per_multiprocessor(512, 0, "sm_89") == 3);       // 1536 threads
}

TEST_CASE("compile_kernel compiles a spilling kernel again for the programs its shared memory allows",
          "[cuda]") {
  jit::cuda::KernelCode code;
  code.source = "// kernel";
  code.entry = "k";
  code.threads = 128;
  code.smem_bytes = 131072;  // one program a multiprocessor on an H100
  // A fake NVRTC: the first compile answers `first`, one with KERF_MIN_PROGRAMS `second`.
  std::vector<std::vector<std::string>> calls;
  const auto compiler = [&](const std::string& first, const std::string& second) {
    return [&, first, second](const std::string& src, const std::string& name, const std::string& arch,
                              const std::vector<std::string>& options) {
      CHECK(src == code.source);
      CHECK(name == "k.cu");
      CHECK(arch == "sm_90a");
      calls.push_back(options);
      nvrtc::Output out;
      const bool again = options.size() > 1;
      out.log = again ? second : first;
      out.image = {again ? '2' : '1'};
      out.compile_ms = 1.0;
      return out;
    };
  };
  // 168 registers leave room for 3 programs, the shared memory for 1: compiled again with
  // 1, and that image kept, since it spills nothing.
  cache::CompiledKernel k = cache::compile_kernel(code, "sm_90a", compiler(ptxas_log(168, 4), ptxas_log(178, 0)));
  REQUIRE(calls.size() == 2);
  CHECK(calls[0] == std::vector<std::string>{nvrtc::kPtxasVerbose});
  CHECK(calls[1] == std::vector<std::string>{nvrtc::kPtxasVerbose, "-DKERF_MIN_PROGRAMS=1"});
  CHECK(k.out.image == std::vector<char>{'2'});
  CHECK(k.min_programs == 1);
  CHECK(k.usage.registers == 178);
  CHECK(k.first.registers == 168);
  CHECK(k.first.spill_store_bytes == 4);
  CHECK(k.out.compile_ms == 2.0);  // both compiles
  // A second compile that spills as much: the first image stays.
  calls.clear();
  k = cache::compile_kernel(code, "sm_90a", compiler(ptxas_log(168, 4), ptxas_log(178, 4)));
  CHECK(calls.size() == 2);
  CHECK(k.out.image == std::vector<char>{'1'});
  CHECK(k.min_programs == 0);
  CHECK(k.usage.registers == 168);
  // No second compile: nothing spilled; all 255 registers used; registers that already
  // allow no more programs than the shared memory (2 of 256 threads at 128 registers:
  // the shared memory of the case below lets 2 run); a PTX target.
  for (const auto& [first, threads, smem, arch] :
       std::vector<std::tuple<std::string, int, int, std::string>>{{ptxas_log(168, 0), 128, 131072, "sm_90a"},
                                                                   {ptxas_log(255, 900), 128, 131072, "sm_90a"},
                                                                   {ptxas_log(128, 4), 256, 100000, "sm_90a"},
                                                                   {"", 128, 131072, "compute_90"}}) {
    CAPTURE(first, threads, smem, arch);
    calls.clear();
    code.threads = threads;
    code.smem_bytes = smem;
    const auto once = [&](const std::string& src, const std::string& name, const std::string& a,
                          const std::vector<std::string>& options) {
      nvrtc::Output out = compiler(first, "")(src, name, "sm_90a", options);
      out.is_cubin = a.rfind("sm_", 0) == 0;
      return out;
    };
    k = cache::compile_kernel(code, arch, once);
    CHECK(calls.size() == 1);
    CHECK(k.min_programs == 0);
    CHECK(k.out.image == std::vector<char>{'1'});
  }
  // With NVRTC: the merge's own f16 tile at rank 64 (64x128 on 3 stages, 128 KB of shared
  // memory) that ptxas spills 4 bytes of at 168 registers compiles without spills.
  if (!nvrtc::available()) return;
  const kernels::LibraryEntry* merge = kernels::find_in_library("lora_merge");
  REQUIRE(merge != nullptr);
  dsl::MetaMap meta = merge->example_meta(DType::f16);
  for (const auto& [k, v] : dsl::MetaMap{{"BLOCK_M", 64}, {"BLOCK_K", 128}, {"R_PAD", 64}, {"num_warps", 4},
                                         {"num_stages", 3}})
    meta[k] = v;
  const jit::cuda::KernelCode real =
      jit::cuda::generate(merge->kernel().trace(merge->example_args(DType::f16), meta), "sm_90a");
  CHECK(real.source.find("#define KERF_LAUNCH_BOUNDS __launch_bounds__(128, KERF_MIN_PROGRAMS)") !=
        std::string::npos);
  const cache::CompiledKernel r = cache::compile_kernel(real, "sm_90a");
  CAPTURE(r.first.registers, r.first.spill_store_bytes, r.usage.registers);
  CHECK(r.usage.spill_store_bytes == 0);
  CHECK(r.out.image.size() > 4);
}

TEST_CASE("KERF_DISABLE_NVRTC turns NVRTC off for 1/yes/on and leaves it on for 0/false/no/off", "[cuda]") {
  KERF_REQUIRE_NVRTC();
  for (const char* off : {"1", "yes", "ON", "true", "anything"}) {
    test::ScopedEnv env({{"KERF_DISABLE_NVRTC", off}});
    INFO(off);
    CHECK_FALSE(nvrtc::available());
  }
  for (const char* on : {"", "0", "false", "No", " off "}) {
    test::ScopedEnv env({{"KERF_DISABLE_NVRTC", on}});
    INFO("'" << on << "'");
    CHECK(nvrtc::available());  // "false" disabled it before
  }
}

TEST_CASE("a tile far beyond a GPU thread's registers is refused before NVRTC would spend minutes on it",
          "[cuda][codegen]") {
  const dsl::Kernel huge("huge_tile", [](dsl::Builder& b) {
    auto x = b.tensor("x", 1);
    const int64_t n = b.meta("N");
    auto i = dsl::arange(n);
    dsl::store(x, {i}, dsl::load(x, {i}, i < x.dim(0)) * 2.0, i < x.dim(0));
  });
  const auto trace = [&](int64_t n, int64_t warps) {
    return huge.trace({t(DType::f32, 1)}, {{"N", n}, {"num_warps", warps}});
  };
  CHECK_THROWS_WITH(jit::cuda::generate(trace(1 << 20, 4), "sm_90a"),
                    Catch::Contains("kernel 'huge_tile': a tile i32[1048576] over 128 GPU threads needs 8192 "
                                    "registers per thread; at most 1024"));
  CHECK_NOTHROW(jit::cuda::generate(trace(1 << 17, 4), "sm_90a"));  // 1024 a thread: allowed
  CHECK_NOTHROW(jit::cuda::generate(trace(1 << 18, 8), "sm_90a"));  // more warps share it
}

TEST_CASE("code is generated only for a GPU architecture's name", "[cuda][codegen]") {
  const ir::Function fn = test::matmul_kernel().trace({t(DType::bf16, 2), t(DType::bf16, 2), t(DType::bf16, 2)},
                                                      {{"BM", 64}, {"BN", 64}, {"BK", 32}});
  for (const char* arch : {"sm_80", "sm_90a", "sm_100f", "sm_120a"}) CHECK(jit::cuda::is_gpu_arch(arch));
  for (const char* arch : {"", "banana", "sm_", "sm_9", "sm_90b", "sm_90aa", "compute_90", "90"}) {
    INFO(arch);
    CHECK_FALSE(jit::cuda::is_gpu_arch(arch));
    CHECK_THROWS_WITH(jit::cuda::generate(fn, arch), Catch::Contains("is not a GPU architecture"));
  }
  // The compute capability as one number, which both the generator and the tuner's device limits read.
  CHECK(jit::cuda::arch_number("sm_80") == 80);
  CHECK(jit::cuda::arch_number("sm_90a") == 90);
  CHECK(jit::cuda::arch_number("sm_100f") == 100);
  CHECK(jit::cuda::arch_number("sm_120a") == 120);
}

TEST_CASE("bf16 dots use tensor cores and pipelined loops use cp.async", "[cuda][codegen]") {
  const ir::Function fn = test::matmul_kernel().trace(
      {t(DType::bf16, 2), t(DType::bf16, 2), t(DType::bf16, 2)}, {{"BM", 64}, {"BN", 64}, {"BK", 32}, {"num_stages", 3}});
  const std::string src = jit::cuda::generate(fn, "sm_90a").source;
  CHECK(src.find("kerf_dev::mma_bf16_16816(") != std::string::npos);
  CHECK(src.find("kerf_dev::cp_async<16>(") != std::string::npos);
  // Without alignment facts the loads fall back to scalar accesses (and are not pipelined).
  const ir::Function slow = test::matmul_kernel().trace(
      {t(DType::bf16, 2, false), t(DType::bf16, 2, false), t(DType::bf16, 2, false)},
      {{"BM", 64}, {"BN", 64}, {"BK", 32}, {"num_stages", 3}});
  const std::string slow_src = jit::cuda::generate(slow, "sm_90a").source;
  CHECK(slow_src.find("kerf_dev::cp_async<") == std::string::npos);
  CHECK(slow_src.find("1-wide") != std::string::npos);
}

TEST_CASE("rows whose length is a multiple of 8 but not 16 still move in 16-byte vectors", "[cuda][codegen]") {
  // The launcher's own facts of real tensor views (row-major, 16-byte aligned, never read).
  void* base = reinterpret_cast<void*>(uintptr_t(1) << 20);
  const auto matmul_args = [&](int64_t K) {
    return arg_specs({TensorView::contiguous(base, DType::bf16, {64, K}),
                      TensorView::contiguous(base, DType::bf16, {K, 64}),
                      TensorView::contiguous(base, DType::bf16, {64, 64})});
  };
  // The vector width of the first load of `tensor` in the generated code.
  const auto width = [](const std::string& src, const std::string& tensor) {
    return access_width(src, "load @" + tensor + " in ");
  };
  const auto matmul_src = [&](int64_t K) {
    return jit::cuda::generate(test::matmul_kernel().trace(matmul_args(K), {{"BM", 64}, {"BN", 64}, {"BK", 32}}),
                               "sm_90a").source;
  };
  // A [64, 8200]: bit d of each mask is dimension d.
  const ir::TensorFacts f8200 = matmul_args(8200)[0].facts;
  CHECK(f8200.dims_div16 == 0b01);
  CHECK(f8200.dims_div8 == 0b11);
  CHECK(f8200.strides_div16 == 0b00);
  CHECK(f8200.strides_div8 == 0b01);
  CHECK(width(matmul_src(8200), "A") == 8);  // 8 bf16: 16 bytes
  CHECK(matmul_args(8192)[0].facts.dims_div8 == 0b11);  // div16 implies div8
  CHECK(width(matmul_src(8192), "A") == 8);
  // 8196 columns: divisible by 4 only, so element by element.
  CHECK(matmul_args(8196)[0].facts.dims_div8 == 0b01);
  CHECK(width(matmul_src(8196), "A") == 1);
  // One-byte elements: 8 of them are 8 bytes, short of a 16-byte vector.
  static const Kernel copy("copy_rows", [](Builder& b) {
    auto x = b.tensor("x", 2), y = b.tensor("y", 2);
    auto rows = program_id(0) * 16 + arange(16), cols = program_id(1) * 256 + arange(256);
    auto m = (rows.col() < x.dim(0)) & (cols.row() < x.dim(1));
    store(y, {rows.col(), cols.row()}, load(x, {rows.col(), cols.row()}, m), m);
  });
  const auto u8_src = [&](int64_t K) {
    const TensorView x = TensorView::contiguous(base, DType::u8, {64, K});
    return jit::cuda::generate(copy.trace(arg_specs({x, x}), {}), "sm_90a").source;
  };
  CHECK(width(u8_src(8200), "x") == 8);
  CHECK(width(u8_src(8208), "x") == 16);
  // The facts are in the printed IR, so in the kernel's identity.
  const std::string text = ir::print(test::matmul_kernel().trace(matmul_args(8200), {{"BM", 64}, {"BN", 64}, {"BK", 32}}));
  CHECK(text.find("div8=") != std::string::npos);
  CHECK(text.find("sdiv8=") != std::string::npos);
}

TEST_CASE("a bound that is the minimum of two multiples of 16 still lets accesses under it be vectors",
          "[cuda][codegen]") {
  // Each program zeroes its share of a row's columns, a slice [lo, hi) with hi = min(n, lo + share):
  // a minimum of two values divisible by 16 is divisible by 16, so `col < hi` is constant over
  // runs of 16 columns starting at multiples of 16.
  static const Kernel share("zero_share", [](Builder& b) {
    auto y = b.tensor("y", 2);
    const int64_t BC = 256;
    const Value per = cdiv(cdiv(y.dim(1), literal(BC)), num_programs(0)) * BC;
    const Value lo = minimum(y.dim(1), program_id(0) * per), hi = minimum(y.dim(1), lo + per);
    const Value rows = arange(16);
    for_range(lo, hi, BC, [&](const Value& c0) {
      const Value cols = c0 + arange(BC);
      store(y, {rows.col(), cols.row()}, zeros({16, BC}, y.dtype()), (rows.col() < y.dim(0)) & (cols.row() < hi));
    });
  });
  const std::string src = jit::cuda::generate(share.trace({t(DType::bf16, 2)}, {}), "sm_90a").source;
  INFO(src);
  CHECK(access_width(src, "// store @y from") == 8);  // 16 bytes
  // Without the dims' divisibility the minimum is known to be divisible by nothing.
  const std::string plain = jit::cuda::generate(share.trace({t(DType::bf16, 2, false)}, {}), "sm_90a").source;
  CHECK(access_width(plain, "// store @y from") == 1);
}

TEST_CASE("a mask is taken as one per vector only where every element of the vector agrees",
          "[cuda][codegen]") {
  // cols > 0 differs between column 0 and columns 1..7 of the first vector (so does cols <= c
  // at c itself); cols < c and cols >= c agree over runs aligned like c, as do their mirrors.
  const auto width = [](const std::function<Value(const Value& cols, const Value& n)>& mask) {
    const Kernel k("masked_copy", [&](Builder& b) {
      auto x = b.tensor("x", 2), out = b.tensor("out", 2);
      const Value r = arange(16), c = arange(64);
      const Value m = (r.col() < x.dim(0)) & mask(c, x.dim(1)).row();
      store(out, {r.col(), c.row()}, load(x, {r.col(), c.row()}, m, 7.0), m);
    });
    const std::string src = jit::cuda::generate(k.trace({t(DType::bf16, 2), t(DType::bf16, 2)}, {}), "sm_90a").source;
    INFO(src);
    return access_width(src, "// store @out from");
  };
  CHECK(width([](const Value& c, const Value&) { return c > 0; }) == 1);
  CHECK(width([](const Value& c, const Value& n) { return c <= n; }) == 1);
  CHECK(width([](const Value& c, const Value&) { return literal(int64_t(0)) < c; }) == 1);
  CHECK(width([](const Value& c, const Value& n) { return n >= c; }) == 1);
  CHECK(width([](const Value& c, const Value& n) { return c < n; }) == 8);
  CHECK(width([](const Value& c, const Value& n) { return c >= n; }) == 8);
  CHECK(width([](const Value& c, const Value& n) { return n > c; }) == 8);
  CHECK(width([](const Value& c, const Value& n) { return n <= c; }) == 8);
}

TEST_CASE("a pipelined load of a loop with an i64 counter prefetches with the i64 counter", "[cuda][codegen]") {
  static const Kernel k("flat_sum", [](Builder& b) {
    auto x = b.tensor("x", 2), out = b.tensor("out", 1);
    auto lo = b.scalar("lo", DType::i64), hi = b.scalar("hi", DType::i64);
    const Value C = x.dim(1).to(DType::i64);
    const Value acc = for_range(lo, hi, 128, zeros({128}), [&](const Value& i0, const Value& a) {
      const Value i = i0 + arange(128);
      return a + load(x, {i / C, i % C}, i < hi);
    });
    store(out, {arange(128)}, acc);
  });
  const std::string src =
      jit::cuda::generate(k.trace({t(DType::f32, 2), t(DType::f32, 1), ArgSpec::scalar(),
                                   ArgSpec::scalar()},
                                  {{"num_stages", 3}}),
                          "sm_90a")
          .source;
  INFO(src);
  REQUIRE(src.find("cp_async") != std::string::npos);  // the load is pipelined
  CHECK(src.find("for (long long v") != std::string::npos);
  size_t at = 0, prefetches = 0;
  while ((at = src.find("// prefetch @x for iteration", at)) != std::string::npos) {
    ++prefetches;
    const size_t next = src.find('\n', at) + 1;
    CHECK(src.substr(next, src.find('\n', next) - next).find("const long long v") != std::string::npos);
    at = next;
  }
  CHECK(prefetches == 3);  // two in the prologue, one in the loop
}

TEST_CASE("grid_sync waits for every program's arrivals and the kernel's end resets its counter",
          "[cuda][codegen]") {
  static const Kernel k("phased", [](Builder& b) {
    auto x = b.tensor("x", 1), y = b.tensor("y", 1), sync = b.tensor("sync", 1, DType::i32);
    auto i = program_id(0) * 128 + arange(128);
    atomic_add(x, {i}, full({128}, 1.0, DType::f32), i < x.dim(0));
    grid_sync(sync);
    store(x, {i}, load(x, {i}, i < x.dim(0)) * 2.0, i < x.dim(0));
    grid_sync(sync);
    store(y, {i}, load(x, {i}, i < x.dim(0)), i < x.dim(0));
  });
  const std::string src =
      jit::cuda::generate(k.trace({t(DType::f32, 1), t(DType::f32, 1), t(DType::i32, 1)}, {}), "sm_90a").source;
  INFO(src);
  const size_t first = src.find("kerf_dev::grid_sync(p2, 1);"), second = src.find("kerf_dev::grid_sync(p2, 2);"),
               count = src.find("kerf_grid_exit = kerf_dev::grid_exit_count(p2);"),
               finish = src.find("kerf_dev::grid_exit_finish(p2, kerf_grid_exit, 3);");
  REQUIRE(first != std::string::npos);
  REQUIRE(second != std::string::npos);
  REQUIRE(count != std::string::npos);
  REQUIRE(finish != std::string::npos);
  CHECK(src.find("atomic_add @x") < first);
  CHECK(first < src.find("load @x"));  // the read comes after the first barrier
  // The exit is counted once, right after the last barrier (not at the end, where the
  // add's round trip would follow the work after it), and the counter reset at the end.
  CHECK(second < count);
  CHECK(src.find("grid_exit_count(", src.find(';', count)) == std::string::npos);
  CHECK(count < src.find("store @y"));
  CHECK(src.find("store @y") < finish);
  CHECK(src.find("ld.acquire.gpu") != std::string::npos);
  if (nvrtc::available()) CHECK_NOTHROW(nvrtc::compile(src, "phased.cu", "sm_90a"));
}

TEST_CASE("grid_arrive counts an arrival without waiting and grid_await waits for the arrivals so far",
          "[cuda][codegen]") {
  static const Kernel k("split_phase", [](Builder& b) {
    auto x = b.tensor("x", 1), sync = b.tensor("sync", 1, DType::i32);
    auto i = program_id(0) * 128 + arange(128);
    store(x, {i}, zeros({128}), i < x.dim(0));
    grid_arrive(sync);
    grid_arrive(sync);
    auto v = load(x, {i}, i < x.dim(0));
    grid_await(sync);
    store(x, {i}, v + 1.0, i < x.dim(0));
    grid_sync(sync);
  });
  const std::string src = jit::cuda::generate(k.trace({t(DType::f32, 1), t(DType::i32, 1)}, {}), "sm_90a").source;
  INFO(src);
  const size_t arrive = src.find("kerf_dev::grid_arrive(p1);"), await = src.find("kerf_dev::grid_await(p1, 2);"),
               sync = src.find("kerf_dev::grid_sync(p1, 3);"),
               exit = src.find("kerf_dev::grid_exit_finish(p1, kerf_grid_exit, 4);");
  REQUIRE(arrive != std::string::npos);
  REQUIRE(await != std::string::npos);
  REQUIRE(sync != std::string::npos);
  REQUIRE(exit != std::string::npos);
  CHECK(src.find("store @x") < arrive);
  CHECK(arrive < src.find("load @x"));
  CHECK(src.find("load @x") < await);
  CHECK(await < sync);
  CHECK(src.find("red.release.gpu") != std::string::npos);
  if (nvrtc::available()) CHECK_NOTHROW(nvrtc::compile(src, "split_phase.cu", "sm_90a"));
}

TEST_CASE("in-place updates are pipelined only when iterations touch disjoint tiles", "[cuda][codegen]") {
  const std::vector<ArgSpec> args = {t(DType::f32, 2)};
  const std::string same = jit::cuda::generate(
      test::inplace_kernel().trace(args, {{"BM", 16}, {"BN", 64}, {"num_stages", 3}}), "sm_90a").source;
  CHECK(same.find("kerf_dev::cp_async<16>(") != std::string::npos);
  const std::string shifted = jit::cuda::generate(
      test::inplace_kernel().trace(args, {{"BM", 16}, {"BN", 64}, {"SHIFT", 1}, {"num_stages", 3}}), "sm_90a").source;
  CHECK(shifted.find("kerf_dev::cp_async<") == std::string::npos);
}

TEST_CASE("a dot's accumulator in runs of columns moves W in 16-byte vectors with no shared-memory round trip",
          "[cuda][codegen]") {
  // The merge's step: W read into the product's accumulator, W + s*B@A written from it.
  const auto merge_src = [](DType w, int64_t run, int64_t scale_after) {
    const DType dot = is_half(w) ? w : DType::bf16;
    return jit::cuda::generate(
               kernels::lora_merge().trace({t(w, 3), t(dot, 3), t(dot, 3), ArgSpec::scalar()},
                                           {{"BLOCK_M", 64}, {"BLOCK_K", 128}, {"R_PAD", 16}, {"DOT", int64_t(dot)},
                                            {"SCALE_AFTER", scale_after}, {"acc_col_run", run}}),
               "sm_90a")
        .source;
  };
  for (int64_t scale_after : {0, 1}) {
    CAPTURE(scale_after);
    const std::string src = merge_src(DType::bf16, 8, scale_after);
    INFO(src);
    // Both in the accumulator's runs layout, 8 bf16 at a time; no conversion of W's tile.
    const size_t load = src.find("load @W in [64,128]{r:1:1,1:2,1:4,");
    CHECK(load != std::string::npos);
    CHECK(src.find("8-wide", load) == src.find('\n', load) - 6);
    CHECK(src.find("store @W from [64,128]{r:1:1,1:2,1:4,") != std::string::npos);
    CHECK(src.find("// %") == std::string::npos);  // layout conversions through shared memory
    CHECK(src.find("kerf_dev::cp_async") == std::string::npos);
    CHECK(src.find("kerf_dev::mma_bf16_16816(") != std::string::npos);
    // Without the meta: W through shared memory as before.
    const std::string plain = merge_src(DType::bf16, 0, scale_after);
    CHECK(plain.find("// %") != std::string::npos);
  }
  // fp32 W: runs of 4.
  const std::string f32 = merge_src(DType::f32, 4, 1);
  CHECK(f32.find("load @W in [64,128]{r:1:1,1:2,0:8,") != std::string::npos);
  CHECK(f32.find("// %") == std::string::npos);
  // The meta is checked.
  CHECK_THROWS_WITH(merge_src(DType::bf16, 3, 1), Catch::Contains("acc_col_run must be 0 or a power of two <= 16"));
}

TEST_CASE("the merge's one-tile form asks for W's tile before the adapters' and reads it after the product",
          "[cuda][codegen]") {
  // ONE_TILE (a STREAM plan with a program for every column block): W's loads go out first and
  // nothing waits for them until the product is done, so they are in flight while A's columns
  // and B's rows arrive and are staged for it; both product forms, bf16 and fp32 W.
  for (const DType w : {DType::bf16, DType::f32})
    for (const int64_t scale_after : {0, 1}) {
      CAPTURE(w, scale_after);
      const DType dot = is_half(w) ? w : DType::bf16;
      const std::string src =
          jit::cuda::generate(kernels::lora_merge().trace({t(w, 3), t(dot, 3), t(dot, 3), ArgSpec::scalar()},
                                                          {{"BLOCK_M", 64},
                                                           {"BLOCK_K", 128},
                                                           {"R_PAD", 64},
                                                           {"DOT", int64_t(dot)},
                                                           {"SCALE_AFTER", scale_after},
                                                           {"COLS_FIRST", 1},
                                                           {"acc_col_run", 16 / dtype_size_bytes(w)},
                                                           {"ONE_TILE", 1}}),
                              "sm_90a")
              .source;
      INFO(src);
      const size_t load_w = src.find("// load @W"), load_a = src.find("// load @A"), load_b = src.find("// load @B");
      REQUIRE(load_w != std::string::npos);
      REQUIRE(load_a != std::string::npos);
      REQUIRE(load_b != std::string::npos);
      CHECK(load_w < load_a);
      CHECK(load_w < load_b);
      CHECK(src.find("for (int v") == std::string::npos);  // no loop over column steps
      // The register array W's tile is loaded into (`vN_M[` on the load's line), and the first
      // place it is read rather than written by the load's own loop.
      const size_t line = src.rfind('\n', load_w) + 1, open = src.find('[', line);
      const std::string regs = src.substr(src.rfind(' ', open) + 1, open - src.rfind(' ', open) - 1) + "[";
      size_t read = src.find(regs, load_w);
      while (read != std::string::npos && src.compare(src.find(']', read) + 1, 3, " = ") == 0)
        read = src.find(regs, read + 1);
      const size_t product = src.find("kerf_dev::mma_bf16_16816(");
      REQUIRE(product != std::string::npos);
      REQUIRE(read != std::string::npos);
      CHECK(read > product);
      CHECK(src.find("// %") == std::string::npos);  // no layout conversion through shared memory
    }
}

TEST_CASE("the grouped embedding backward writes grad_A in 16-byte vectors and adds in 4-wide ones",
          "[cuda][codegen]") {
  // A store or add whose mask changes from element to element goes out one element at
  // a time; these masks are the tiles' bounds only (docs/cuda-backend.md, vector_width).
  // bf16 gradients: the library's example arguments, the 128x128 tile of docs/performance.md.
  const auto source = [](const std::string& name, const MetaMap& meta) {
    const kernels::LibraryEntry* e = kernels::find_in_library(name);
    REQUIRE(e != nullptr);
    return jit::cuda::generate(e->kernel().trace(e->example_args(DType::bf16), meta), "sm_90a").source;
  };
  const std::string dense = source(
      "lora_embedding_dense_a", {{"BLOCK_V", 64}, {"R_PAD", 16}, {"FLUSH_B", 1}, {"BLOCK_M", 128}, {"BLOCK_K", 16}});
  INFO(dense);
  CHECK(access_width(dense, "// store @dA from") == 8);
  CHECK(access_width(dense, "// store @dB from") == 8);
  const std::string main_src =
      source("lora_embedding_backward",
             {{"BLOCK_T", 128}, {"BLOCK_D", 128}, {"R_PAD", 16}, {"DOT", int64_t(DType::bf16)}, {"GROUP_BY_ID", 1},
              {"ROTATE", 1}, {"WAIT_PRIOR", 1}, {"staged_adds", 1}, {"num_warps", 4}, {"num_stages", 3}});
  INFO(main_src);
  CHECK(access_width(main_src, "// atomic_add @dA from") == 4);  // each token's sums, a run of r floats
  CHECK(access_width(main_src, "// atomic_add @dB from") == 4);
}

TEST_CASE("a dot's B operand defined before its loop has its fragments loaded once before the loop",
          "[cuda][codegen]") {
  // The embedding backward's activations [BLOCK_T, r] are dB's right factor at every
  // step over D: 8 k steps x 2 n tiles x 2 registers = 32 registers a thread, loaded once.
  const kernels::LibraryEntry* e = kernels::find_in_library("lora_embedding_backward");
  REQUIRE(e != nullptr);
  const std::string src =
      jit::cuda::generate(e->kernel().trace(e->example_args(DType::bf16),
                                            {{"BLOCK_T", 128}, {"BLOCK_D", 128}, {"R_PAD", 16},
                                             {"DOT", int64_t(DType::bf16)}, {"ROTATE", 1}, {"staged_adds", 1},
                                             {"num_warps", 4}, {"num_stages", 3}}),
                          "sm_90a")
          .source;
  INFO(src);
  const size_t frags = src.find("unsigned bfrag_");
  const size_t loop_wait = src.find("kerf_dev::cp_async_wait<1>();  // this iteration's copies have landed");
  REQUIRE(frags != std::string::npos);
  REQUIRE(loop_wait != std::string::npos);
  CHECK(frags < loop_wait);
  const auto count = [&](const std::string& what) { return test::occurrences(src, what, loop_wait); };
  CHECK(count("const unsigned* bf = bfrag_") == 1);  // the dot with the activations
  CHECK(count("kerf_dev::ldmatrix_x4_trans(bf, sb + ") == 1);  // g @ B still reads B's step tile
}

TEST_CASE("with wgmma_ss the embedding backward's two products read both operands from shared memory",
          "[cuda][codegen]") {
  // g's step tile [BLOCK_T, BLOCK_D] is A of g @ B (K-major) and, through its transpose, of
  // g^T @ act (MN-major), 128-byte swizzled in its ring; B's step tile [BLOCK_D, 16] is an
  // MN-major B in the 32-byte swizzle; the activations [16, BLOCK_T] (kept by rank) a
  // K-major B. No ldmatrix fragments and no mma.sync remain in the loop; without wgmma_ss
  // the same meta keeps A in registers and B's step tile on mma.sync.
  const kernels::LibraryEntry* e = kernels::find_in_library("lora_embedding_backward_fused");
  REQUIRE(e != nullptr);
  const auto source = [&](int64_t ss, int64_t warps, int64_t bt) {
    return jit::cuda::generate(e->kernel().trace(e->example_args(DType::bf16),
                                                 {{"BLOCK_T", bt}, {"BLOCK_D", 128}, {"R_PAD", 16},
                                                  {"DOT", int64_t(DType::bf16)}, {"ROTATE", 1},
                                                  {"staged_adds", 1}, {"BLOCK_V", 64}, {"BLOCK_M", 64},
                                                  {"num_warps", warps}, {"num_stages", 3}, {"wgmma", 1},
                                                  {"wgmma_ss", ss}}),
                               "sm_90a")
        .source;
  };
  for (const auto& [warps, bt] : {std::pair<int64_t, int64_t>{4, 128}, {8, 128}, {4, 64}}) {
    CAPTURE(warps, bt);
    const std::string src = source(1, warps, bt);
    INFO(src);
    const size_t loop = src.find("// this iteration's copies have landed");
    REQUIRE(loop != std::string::npos);
    const std::string body = src.substr(loop);
    CHECK(body.find("kerf_dev::wgmma_ss_bf16_n16<1, 0>(") != std::string::npos);  // g^T @ act
    CHECK(body.find("kerf_dev::wgmma_ss_bf16_n16<0, 1>(") != std::string::npos);  // g @ B
    CHECK(body.find("kerf_dev::wgmma_desc32(sb_addr") != std::string::npos);
    CHECK(body.find("kerf_dev::ldmatrix_x") == std::string::npos);
    CHECK(body.find("kerf_dev::mma_bf16_16816(") == std::string::npos);
    CHECK(src.find("kerf_dev::cp_async<16>(ring + kerf_dev::sw32(") != std::string::npos);
    const std::string rs = source(0, warps, bt);
    CHECK(rs.find("kerf_dev::wgmma_ss_bf16") == std::string::npos);
    CHECK(rs.find("kerf_dev::mma_bf16_16816(") != std::string::npos);
    CHECK(rs.find("kerf_dev::sw32(") == std::string::npos);
  }
}

TEST_CASE("with early_prologue a pipelined loop's first copies go out before loads they do not need",
          "[cuda][codegen]") {
  // The fused embedding backward with the forward's activations: the pass's copies of g and
  // B depend on the token block and the steps, not on the ids, so they go out before the
  // ids' load (and the activations' one), instead of after the atomics that wait for the ids.
  const kernels::LibraryEntry* e = kernels::find_in_library("lora_embedding_backward_fused");
  REQUIRE(e != nullptr);
  MetaMap meta = e->example_meta(DType::bf16);
  meta["SAVED_ACT"] = 1;
  const auto source = [&](int64_t early) {
    meta["early_prologue"] = early;
    return jit::cuda::generate(e->kernel().trace(e->example_args(DType::bf16), meta), "sm_90a").source;
  };
  const std::string late = source(0), early = source(1);
  INFO(early);
  const auto at = [](const std::string& src, const std::string& what) {
    const size_t p = src.find(what);
    REQUIRE(p != std::string::npos);
    return p;
  };
  CHECK(at(late, "// prefetch @g for iteration pf_iv_0") > at(late, "// load @x in"));
  CHECK(at(early, "// prefetch @g for iteration pf_iv_0") < at(early, "// load @act in"));
  CHECK(at(early, "// prefetch @B for iteration pf_iv_1") < at(early, "// load @x in"));
  CHECK(at(early, "// load @x in") < at(early, "// atomic_add @counts"));  // loads and atomics keep their order
  // Each of the first two iterations' copies once, and the loop's own later.
  CHECK(early.find("// prefetch @g for iteration pf_iv_0", at(early, "// load @x in")) == std::string::npos);
}

TEST_CASE("early_prologue moves a loop's first copies up to what they need and no further",
          "[cuda][codegen]") {
  // Row sums of a [N, K] over a loop of 64-column steps, after an atomic the loop does not
  // need; MODE 1: the loop's bound is a scalar loaded from n; MODE 2: a wait for the
  // prior grid comes before the loop.
  static const Kernel k("early_rows", [](Builder& b) {
    auto a = b.tensor("a", 2), o = b.tensor("o", 1), w = b.tensor("w", 1), n = b.tensor("n", 1, DType::i32);
    const int64_t mode = b.meta("MODE", 0);
    auto rows = program_id(0) * 32 + arange(32);
    auto rows_ok = rows < a.dim(0);
    auto old = atomic_add(w, {rows}, full({32}, 1.0, DType::f32), rows_ok);
    Value hi = a.dim(1);
    if (mode == 1) hi = minimum(hi, load(n, {literal(int64_t(0))}));
    if (mode == 2) wait_prior_grid();
    auto acc = for_range(literal(int64_t(0)), hi, 64, zeros({32}), [&](const Value& iv, const Value& acc) {
      auto cols = iv + arange(64);
      return acc + sum(load(a, {rows.col(), cols.row()}, rows_ok.col() & (cols.row() < hi)), 1);
    });
    store(o, {rows}, acc + old, rows_ok);
  });
  const auto source = [&](int64_t mode, int64_t early) {
    return jit::cuda::generate(k.trace({t(DType::f32, 2), t(DType::f32, 1), t(DType::f32, 1), t(DType::i32, 1)},
                                       {{"MODE", mode}, {"num_stages", 3}, {"early_prologue", early}}),
                               "sm_90a")
        .source;
  };
  const auto at = [](const std::string& src, const std::string& what) {
    const size_t p = src.find(what);
    REQUIRE(p != std::string::npos);
    return p;
  };
  const std::string first = "// prefetch @a for iteration ";  // the prologue's first copies come first
  for (const int64_t mode : {0, 1, 2}) {
    const std::string late = source(mode, 0), early = source(mode, 1);
    INFO("MODE=" << mode << "\n" << early);
    CHECK(at(late, first) > at(late, "// atomic_add @w"));
    if (mode == 0) CHECK(at(early, first) < at(early, "// atomic_add @w"));  // it needs nothing before
    if (mode == 1) {  // after the bound's load, which keeps its place after the atomic
      CHECK(at(early, first) > at(early, "= p3[(long long)"));
      CHECK(at(early, "= p3[(long long)") > at(early, "// atomic_add @w"));
    }
    if (mode == 2) CHECK(at(early, first) > at(early, "griddepcontrol.wait"));  // never ahead of the wait
    if (nvrtc::available()) CHECK_NOTHROW(nvrtc::compile(early, "early_rows.cu", "sm_90a"));
  }
}

TEST_CASE("fp32 dots use fp32 FMA, not tensor cores", "[cuda][codegen]") {
  const ir::Function fn = test::matmul_kernel().trace(
      {t(DType::f32, 2), t(DType::f32, 2), t(DType::f32, 2)}, {{"BM", 32}, {"BN", 32}, {"BK", 16}});
  const std::string src = jit::cuda::generate(fn, "sm_90a").source;
  CHECK(src.find("kerf_dev::mma_bf16_16816(&") == std::string::npos);
  CHECK(src.find("fmaf(") != std::string::npos);
}

TEST_CASE("gather looks up with warp shuffles from a table made once, outside the loop", "[cuda][codegen]") {
  const ir::Function fn = test::gather_kernel().trace(
      {t(DType::bf16, 1), t(DType::i32, 2), t(DType::u8, 2), t(DType::bf16, 2)}, {{"T", 16}, {"BM", 16}, {"BN", 64}});
  const std::string src = jit::cuda::generate(fn, "sm_90a").source;
  INFO(src);
  const size_t loop = src.find("for (int v");  // the column loop
  REQUIRE(loop != std::string::npos);
  const size_t table = src.find("load @table");
  REQUIRE(table != std::string::npos);
  CHECK(table < loop);  // the table is read once per program
  size_t shuffles = 0;
  for (size_t at = src.find("kerf_dev::shfl_idx(", loop); at != std::string::npos;
       at = src.find("kerf_dev::shfl_idx(", at + 1))
    ++shuffles;
  CHECK(shuffles == 3);  // one per gather, in the loop
}

TEST_CASE("gather refuses what it cannot look up in, with messages", "[dsl][errors]") {
  auto traced = [](int64_t T, bool scalar_index, DType index_dtype) {
    const Kernel k("bad_gather", [&](Builder& b) {
      auto table = b.tensor("table", 1), out = b.tensor("out", 1);
      auto tab = load(table, {arange(0, T)});
      Value i = scalar_index ? literal(int64_t(3)) : arange(0, 8).to(index_dtype);
      store(out, {arange(0, 8)}, broadcast_to(gather(tab, i), {8}));
    });
    return k.trace({t(DType::f32, 1), t(DType::f32, 1)}, {});
  };
  CHECK_NOTHROW(traced(16, false, DType::i32));
  CHECK_THROWS_WITH(traced(64, false, DType::i32), Catch::Contains("at most 32 elements"));
  CHECK_THROWS_WITH(traced(16, true, DType::i32), Catch::Contains("the index must be a tile"));
  CHECK_THROWS_WITH(traced(16, false, DType::f32), Catch::Contains("integer tile"));
}

TEST_CASE("interleave into a dot's accumulator picks registers, over lanes it picks by lane", "[cuda][codegen]") {
  const ir::Function fn = test::interleave_kernel().trace(
      {t(DType::bf16, 2), t(DType::bf16, 2), t(DType::bf16, 2), t(DType::bf16, 2), t(DType::bf16, 2),
       t(DType::f32, 2), t(DType::bf16, 1)},
      {{"BM", 16}, {"BN", 64}, {"K", 16}});
  const std::string src = jit::cuda::generate(fn, "sm_90a").source;
  INFO(src);
  // The accumulator's neighbouring columns are registers of one thread: a
  // register bit chooses, and the operands are computed in place.
  CHECK(src.find("= (((r) >> 0) & 1) ? ") != std::string::npos);
  // The 1-D pair of 64 spreads over lanes: lane bit 0 chooses.
  CHECK(src.find("= ((lane >> 0) & 1) ? ") != std::string::npos);
}

TEST_CASE("cluster_atomic_add sums over the cluster in distributed shared memory on sm_90, atomics elsewhere",
          "[cuda][codegen]") {
  const std::vector<ArgSpec> args = {t(DType::bf16, 2), t(DType::f32, 1), t(DType::f32, 1)};
  const auto source = [&](int64_t cluster, const char* arch) {
    const ir::Function fn =
        test::cluster_sum_kernel().trace(args, {{"BM", 32}, {"BN", 64}, {"cluster_size", cluster}});
    return jit::cuda::generate(fn, arch).source;
  };
  const std::string two = source(2, "sm_90a");
  INFO(two);
  CHECK(two.find("summed over clusters of 2 programs first") != std::string::npos);
  CHECK(two.find("kerf_dev::ld_cluster_pack<float, ") != std::string::npos);
  CHECK(two.find("kerf_cphase1") != std::string::npos);  // one double buffer per cluster sum
  // Each sum arrives at a cluster barrier and waits at the end of its block (the
  // loop body, or the kernel), and the kernel ends with one more, so that no
  // program leaves while its cluster still reads its shared memory.
  const auto count = [&](const std::string& what) { return test::occurrences(two, what); };
  CHECK(count("kerf_dev::cluster_arrive();") == 3);
  CHECK(count("kerf_dev::cluster_wait();") == 3);
  const size_t last = two.rfind("kerf_dev::cluster_wait();");
  CHECK(two.find("kerf_dev::red_add<", last) == std::string::npos);
  // In the loop, the column sums' wait comes after the work that follows the add
  // (the sum of squares), and before the carried value is updated.
  const size_t arrive = two.find("kerf_dev::cluster_arrive();"), wait = two.find("kerf_dev::cluster_wait();");
  CHECK(arrive < wait);
  CHECK(two.find("__shfl_xor_sync", arrive) < wait);
  // Without clusters (size 1, or before sm_90) it is a plain atomic.
  for (const std::string& plain : {source(1, "sm_90a"), source(4, "sm_80")}) {
    CHECK(plain.find("cluster_wait") == std::string::npos);
    CHECK(plain.find("ld_cluster") == std::string::npos);
    CHECK(plain.find("atomic_add @out") != std::string::npos);
  }
}

TEST_CASE("cluster_load hands each program its values through distributed shared memory on sm_90, a load elsewhere",
          "[cuda][codegen]") {
  const auto source = [&](int64_t cluster, const char* arch, DType d, bool fast) {
    const ir::Function fn = test::cluster_gather_kernel().trace({t(d, 3, fast), t(d, 3), t(DType::f32, 1)},
                                                                {{"BM", 64}, {"BN", 64}, {"cluster_size", cluster}});
    return jit::cuda::generate(fn, arch).source;
  };
  const std::string eight = source(8, "sm_90a", DType::bf16, true);
  INFO(eight);
  CHECK(eight.find("cluster_load @x in ") != std::string::npos);
  CHECK(eight.find("shared over clusters of 8 programs") != std::string::npos);
  // A program reads its share of the elements for the cluster, 8 bf16 neighbours in one
  // 16-byte vector where aligned and inside the last dimension, one by one (those inside
  // it) where not; every program's values come back in one 8-byte vector each (4
  // elements of the 32 a thread holds).
  CHECK(eight.find("if (r % 8 != int(kerf_crank)) continue;") != std::string::npos);
  CHECK(eight.find("kerf_dev::ld<unsigned short, 8>(b0 + c)") != std::string::npos);
  CHECK(eight.find("nb[c] = j0 + c >= 0 && j0 + c < (long long)args.s[3] ? b0[c] : (unsigned short)0;") !=
        std::string::npos);
  CHECK(eight.find("kerf_dev::ld_cluster_pack<unsigned short, 4>") != std::string::npos);
  // Two cluster barriers: the values written before the reads (a release of the program's
  // shared memory), the reads before the buffer is reused (a full release: the reads are
  // of the others' memory); no third one at the kernel's end: no buffer is read then.
  const auto count = [&](const std::string& what) { return test::occurrences(eight, what); };
  CHECK(count("kerf_dev::cluster_arrive();") == 1);
  CHECK(count("kerf_dev::cluster_arrive_release();") == 1);
  CHECK(count("kerf_dev::cluster_wait();") == 2);
  CHECK(eight.find("kerf_dev::cluster_arrive();") < eight.find("ld_cluster_pack<unsigned short, 4>(cld"));
  CHECK(eight.find("ld_cluster_pack<unsigned short, 4>(cld") < eight.find("kerf_dev::cluster_arrive_release();"));
  // fp32 at 8: two 16-byte vectors; without 16-byte alignment: one element at a time.
  CHECK(source(8, "sm_90a", DType::f32, true).find("kerf_dev::ld<float, 4>(b0 + c)") != std::string::npos);
  const std::string slow = source(8, "sm_90a", DType::bf16, false);
  CHECK(slow.find("shared over clusters of 8 programs") != std::string::npos);
  CHECK(slow.find("b0 + c)") == std::string::npos);
  // Without clusters (size 1, or before sm_90) it is a plain load.
  for (const std::string& plain : {source(1, "sm_90a", DType::bf16, true), source(8, "sm_80", DType::bf16, true)}) {
    CHECK(plain.find("cluster_wait") == std::string::npos);
    CHECK(plain.find("ld_cluster") == std::string::npos);
    CHECK(plain.find("load @x in ") != std::string::npos);
    CHECK(plain.find(" >= 0 && (long long)v") != std::string::npos);  // the last index's range, checked
  }
  if (nvrtc::available())
    for (const DType d : {DType::bf16, DType::f32, DType::f16})
      for (const int64_t cluster : {2, 3, 8}) {
        CAPTURE(dtype_name(d), cluster);
        const ir::Function fn = test::cluster_gather_kernel().trace(
            {t(d, 3), t(d, 3), t(DType::f32, 1)}, {{"BM", 32}, {"BN", 16}, {"cluster_size", cluster}});
        const jit::cuda::KernelCode code = jit::cuda::generate(fn, "sm_90a");
        CHECK_NOTHROW(nvrtc::compile(code.source, code.entry + ".cu", "sm_90a"));
      }
}

TEST_CASE("l2_evict_normal is one applypriority per element held, from sm_80", "[cuda][codegen]") {
  const ir::Function fn = test::l2_keep_kernel().trace({t(DType::f32, 1), t(DType::f32, 1)}, {{"BLOCK", 128}});
  const std::string src = jit::cuda::generate(fn, "sm_90a").source;
  INFO(src);
  const std::string hint = "applypriority.global.L2::evict_normal";
  const size_t at = src.find(hint);
  REQUIRE(at != std::string::npos);
  CHECK(src.find(hint, at + 1) == std::string::npos);  // one statement, in a loop over the elements held
  CHECK(src.find("// l2_evict_normal @y in [4]") != std::string::npos);
  CHECK(src.find("st_hint") < at);  // after the evict-last store
  CHECK(jit::cuda::generate(fn, "sm_80").source.find(hint) != std::string::npos);
  CHECK(jit::cuda::generate(fn, "sm_75").source.find(hint) == std::string::npos);
}

TEST_CASE("a wait for the prior grid is griddepcontrol on sm_90, and nothing after it is issued ahead",
          "[cuda][codegen]") {
  const std::vector<ArgSpec> args = {t(DType::bf16, 2), t(DType::bf16, 2), t(DType::f32, 1)};
  const auto source = [&](int64_t wait, const char* arch) {
    const ir::Function fn =
        test::overlap_consumer_kernel().trace(args, {{"BM", 16}, {"BN", 128}, {"WAIT", wait}, {"num_stages", 3}});
    return jit::cuda::generate(fn, arch).source;
  };
  // In the loop, between the loads: x (before it) is prefetched, y (after it) is read in place.
  const std::string in_loop = source(2, "sm_90a");
  CHECK(in_loop.find("griddepcontrol.wait;") != std::string::npos);
  CHECK(in_loop.find("prefetch @x") != std::string::npos);
  CHECK(in_loop.find("prefetch @y") == std::string::npos);
  // At the top level, before the loop: both prefetched, every prefetch after the wait.
  const std::string top = source(1, "sm_90a");
  const size_t wait_at = top.find("griddepcontrol.wait;");
  REQUIRE(wait_at != std::string::npos);
  CHECK(top.find("prefetch @x") > wait_at);
  CHECK(top.find("prefetch @y") != std::string::npos);
  CHECK(top.find("prefetch @y") > wait_at);
  // No wait: both prefetched, no griddepcontrol.
  const std::string none = source(0, "sm_90a");
  CHECK(none.find("griddepcontrol") == std::string::npos);
  CHECK(none.find("prefetch @y") != std::string::npos);
  // sm_80 has no programmatic dependent launch: the op emits nothing there.
  CHECK(source(2, "sm_80").find("griddepcontrol") == std::string::npos);
  const ir::Function producer = test::overlap_producer_kernel().trace(
      {t(DType::f32, 2), t(DType::f32, 2)}, {{"BM", 16}, {"BN", 128}, {"RELEASE", 1}});
  CHECK(jit::cuda::generate(producer, "sm_90a").source.find("griddepcontrol.launch_dependents;") !=
        std::string::npos);
}

TEST_CASE("a dot operand chosen among tiles defined before its loop is staged once and not every iteration",
          "[cuda][codegen]") {
  const std::vector<ArgSpec> args(5, t(DType::bf16, 2));
  for (const int64_t ways : {2, 3}) {
    const std::string src =
        jit::cuda::generate(test::alternating_matmul_kernel().trace(
                                args, {{"BM", 64}, {"BN", 64}, {"BK", 32}, {"num_stages", 3}, {"WAYS", ways}}),
                            "sm_90a")
            .source;
    INFO("WAYS=" << ways << "\n" << src);
    const size_t loop = src.find("this iteration's copies have landed");  // the loop body's first line
    REQUIRE(loop != std::string::npos);
    // Each of the tiles that may be chosen is staged before the loop, and nothing in it.
    size_t staged_before = 0;
    for (size_t at = src.find("// stage %"); at != std::string::npos && at < loop; at = src.find("// stage %", at + 1))
      ++staged_before;
    CHECK(staged_before == size_t(ways));
    CHECK(src.find("// stage %", loop) == std::string::npos);
    CHECK(src.find(" ? (", loop) != std::string::npos);  // the dot reads the tile chosen
    if (nvrtc::available()) CHECK_NOTHROW(nvrtc::compile(src, "alternating_matmul.cu", "sm_90a"));
  }
}
