// The LoRA op kernels (merge, MoE backward, embedding, DoRA extras and the
// accumulator helpers) generate CUDA C++ that NVRTC compiles for sm_80 and
// sm_90a (no GPU needed), in the dtypes the ops use, with and without the
// alignment facts (kerf's own library test compiles the library's kernels); and the fast paths use
// what they should (tensor cores, cp.async, also for the in-place merge).
#include <algorithm>
#include <string>
#include <vector>

#include "catch.h"
#include "kerf/cache/cuda_binary.h"
#include "gpu_test_util.h"
#include "kerf/error.h"
#include "kerf/jit/autotune.h"
#include "kerf/jit/launch.h"
#include "kerf/jit/cuda_codegen.h"
#include "kerf/jit/nvrtc.h"
#include "kerf/kernels/kernels.h"
#include "kernels_src/ops_common.h"
#include "smem_fit_util.h"
#include "source_util.h"

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

ArgSpec T(DType d, int rank, bool fast = true) {
  return ArgSpec::tensor(d, rank, fast ? fast_facts(rank) : ir::TensorFacts{});
}
const ArgSpec S = ArgSpec::scalar();

struct Case {
  const Kernel* kernel;
  std::vector<ArgSpec> args;
  MetaMap meta;
  std::string what;
  std::string arch;
};

struct Variant {
  DType w;
  bool fast;
  const char* arch;
  bool tf32 = false;  // fp32 adapters, their products in TF32 (TF32 = 1 where DOT is f32)
};

// Each kernel in three variants (kept few: every one is an NVRTC compile):
// bf16 with the fast-path facts for sm_90a, f32 without them for sm_80, f16
// with them for sm_80; the switches (ids, atomics, by_freq) alternate.
std::vector<Case> op_kernel_cases(const std::vector<Variant>& variants = {Variant{DType::bf16, true, "sm_90a"},
                                                                          Variant{DType::f32, false, "sm_80"},
                                                                          Variant{DType::f16, true, "sm_80"}}) {
  std::vector<Case> c;
  for (const Variant& v : variants) {
    const size_t first = c.size();
    const DType w = v.w, dot = is_half(w) && !v.tf32 ? w : DType::f32;
    const bool fast = v.fast;
    const int64_t stages = fast ? 3 : 1, flag = w == DType::bf16 ? 1 : 0;
    const DType ad = w == DType::f16 && !v.tf32 ? DType::bf16 : DType::f32;  // adapters
    const DType ids = fast ? DType::i64 : DType::i32;
    c.push_back({&kernels::lora_merge(),
                 {T(w, 3, fast), T(ad, 3, fast), T(ad, 3, fast), S},
                 {{"BLOCK_M", 64},
                  {"BLOCK_K", 128},
                  {"R_PAD", 16},
                  {"DOT", int64_t(is_half(ad) ? ad : dot)},
                  {"SCALE_AFTER", is_half(ad) ? 1 : 0},
                  {"EVICT", fast ? 2 : 1},
                  {"num_stages", stages}},
                 "lora_merge",
                 v.arch});
    c.push_back({&kernels::moe_lora_backward(),
                 {T(w, 3, fast), T(ad, 3, fast), T(ad, 3, fast), S, T(DType::f32, 3, fast),
                  T(flag ? DType::f32 : w, 3, fast)},
                 {{"BLOCK_N", 128},
                  {"BLOCK_K", 64},
                  {"R_PAD", 16},
                  {"DOT", int64_t(dot)},
                  {"DB_ATOMIC", flag},
                  {"ROTATE", 1 - flag},
                  {"WAIT_PRIOR", flag},
                  {"num_warps", 8},
                  {"num_stages", stages}},
                 "moe_lora_backward",
                 v.arch});
    c.push_back({&kernels::moe_lora_backward_by_columns(),
                 {T(w, 3, fast), T(ad, 3, fast), T(ad, 3, fast), S, T(flag ? DType::f32 : w, 3, fast),
                  T(DType::f32, 3, fast)},
                 {{"BLOCK_N", 32},
                  {"BLOCK_K", 256},
                  {"R_PAD", 64},
                  {"DOT", int64_t(dot)},
                  {"DA_ATOMIC", flag},
                  {"ROTATE", flag},
                  {"WAIT_PRIOR", 1 - flag},
                  {"num_warps", 8},
                  {"num_stages", stages}},
                 "moe_lora_backward_by_columns",
                 v.arch});
    c.push_back({&kernels::lora_embedding(),
                 {T(ids, 1, fast), T(w, 2, fast), T(ad, 2, fast), T(ad, 2, fast), S, T(w, 2, fast),
                  T(DType::i64, 1), S, S, T(ad, 2, fast)},
                 {{"BLOCK_T", 32},
                  {"BLOCK_D", 128},
                  {"R_PAD", 16},
                  {"DOT", int64_t(dot)},
                  {"STORE_ACT", flag},  // the activations written for the backward
                  {"num_stages", stages}},
                 "lora_embedding",
                 v.arch});
    c.push_back(
        {&kernels::lora_embedding_backward(),
         {T(ids, 1, fast), T(ad, 2, fast), T(ad, 2, fast), T(w, 2, fast), S, T(DType::f32, 2, fast),
          T(DType::f32, 2, fast), T(DType::i32, 1), T(DType::i32, 1), T(DType::i64, 1), S, S, S, T(ad, 2, fast)},
         {{"BLOCK_T", 64},
          {"BLOCK_D", 64},
          {"R_PAD", 16},
          {"DOT", int64_t(dot)},
          {"BY_FREQ", flag},
          {"SAVED_ACT", flag},  // the forward's activations read by token
          {"ACT_IN_SHARD", flag},  // and set to zero outside a vocab shard
          {"ROTATE", 1 - flag},
          {"WAIT_PRIOR", 1 - flag},
          {"L2_KEEP", 1 - flag},
          {"GROUP_BY_ID", flag},
          {"num_stages", stages}},
         "lora_embedding_backward",
         v.arch});
    c.push_back({&kernels::lora_embedding_backward_fused(),
                 {T(ids, 1, fast), T(ad, 2, fast), T(ad, 2, fast), T(w, 2, fast), S, T(DType::f32, 2, fast),
                  T(DType::f32, 2, fast), T(DType::i32, 1), T(DType::i64, 1), S, S, S, T(w, 2, fast),
                  T(w, 2, fast), T(DType::i32, 1), T(ad, 2, fast)},
                 {{"BLOCK_T", 64},
                  {"BLOCK_D", 64},
                  {"R_PAD", 16},
                  {"DOT", int64_t(dot)},
                  // The owners' form (bf16 with BY_FREQ, f16 without) and, f32 grad_A, DIRECT_A with it.
                  {"BY_FREQ", w == DType::f16 ? 0 : 1},
                  {"DIRECT_A", w == DType::f32 ? 1 : 0},
                  {"ROTATE", 1 - flag},
                  {"SAVED_ACT", 1 - flag},
                  {"ACT_IN_SHARD", 1 - flag},
                  {"BLOCK_V", 64},
                  {"BLOCK_M", 64},
                  {"num_stages", stages}},
                 "lora_embedding_backward_fused",
                 v.arch});
    c.push_back({&kernels::lora_embedding_group(),
                 {T(ids, 1, fast), T(DType::i32, 1), T(DType::i32, 1), T(DType::f32, 2, fast), S},
                 flag ? MetaMap{{"BLOCK_T", 256}, {"BLOCK_M", 128}, {"BLOCK_K", 16}}
                      : MetaMap{{"BLOCK_T", 256}, {"BLOCK_M", 128}, {"BLOCK_K", 16}, {"FILL_B", 1},
                                {"RELEASE", 1}, {"EVICT_LAST", 1}},
                 "lora_embedding_group",
                 v.arch});
    c.push_back({&kernels::lora_embedding_dense_a(),
                 {T(DType::i32, 1), T(DType::i32, 1), T(DType::f32, 2, fast), T(w, 2, fast),
                  T(DType::f32, 2, fast), T(w, 2, fast)},
                 flag ? MetaMap{{"BLOCK_V", 128}, {"R_PAD", 16}, {"FLUSH_B", 1}, {"BLOCK_M", 128}, {"BLOCK_K", 16}}
                      : MetaMap{{"BLOCK_V", 64}, {"R_PAD", 16}, {"WAIT_PRIOR", 1}},
                 "lora_embedding_dense_a",
                 v.arch});
    c.push_back({&kernels::embedding_count_ids(),
                 {T(ids, 1, fast), T(DType::i32, 1), S},
                 {{"BLOCK_T", 64}, {"CLEAR", flag}},
                 "embedding_count_ids",
                 v.arch});
    c.push_back({&kernels::dora_norm_backward(),
                 {T(DType::f32, 1, fast), T(w, 1, fast), T(w, 1, fast)},
                 {{"BLOCK", 1024}},
                 "dora_norm_backward",
                 v.arch});
    // 4-bit W: the adapters in `ad`, the product in bf16 (f16 with f16 adapters).
    for (const bool split : {false, true}) {
      std::vector<ArgSpec> args = {T(DType::u8, 2, fast), T(DType::f32, 1, fast), T(DType::f32, 1, fast),
                                   T(ad, 2, fast),        T(ad, 2, fast),         T(w, 1, fast),
                                   S,                     S,                      S,
                                   T(DType::f32, 1),      T(DType::f32, 1)};
      if (split) {
        args.push_back(T(DType::f32, 1));
        args.push_back(T(DType::i32, 1));
      }
      c.push_back({split ? &kernels::dora_norm_4bit_split() : &kernels::dora_norm_4bit(),
                   args,
                   {{"BLOCK_M", 64},
                    {"BLOCK_K", 128},
                    {"R_PAD", 32},
                    {"DOT", int64_t(ad == DType::f16 ? DType::f16 : DType::bf16)},
                    {"num_warps", 8},
                    {"num_stages", stages}},
                   split ? "dora_norm_4bit_split" : "dora_norm_4bit",
                   v.arch});
    }
    c.push_back({&kernels::cast_3d(),
                 {T(DType::f32, 3, fast), T(is_half(w) ? w : DType::bf16, 3, fast)},
                 {{"BLOCK_M", 8}, {"BLOCK_K", 256}},
                 "cast_3d",
                 v.arch});
    c.push_back({&kernels::fill_3d(),
                 {T(w, 3, fast), S},
                 {{"BLOCK_M", 16}, {"BLOCK_K", 128}, {"RELEASE", flag}, {"EVICT_LAST", 1 - flag}},
                 "fill_3d",
                 v.arch});
    c.push_back({&kernels::fill_pair(),
                 {T(w, 3, fast), T(DType::f32, 3), S},
                 {{"BLOCK_M0", 8}, {"BLOCK_K0", 256}, {"BLOCK_M1", 128}, {"BLOCK_K1", 16}, {"RELEASE", 1 - flag}, {"EVICT_LAST", flag}},
                 "fill_pair",
                 v.arch});
    c.push_back({&kernels::lora_embedding_gather(),
                 {T(DType::i64, 1, fast), T(w, 2, fast), T(is_half(w) ? w : DType::f32, 2, fast),
                  T(DType::i64, 1), S, S},
                 {{"BLOCK_T", 128}, {"R_PAD", 32}},
                 "lora_embedding_gather",
                 v.arch});
    c.push_back({&kernels::lora_embedding_scatter(),
                 {T(DType::i64, 1, fast), T(DType::f32, 2, fast), T(is_half(w) ? w : DType::f32, 2, fast),
                  T(DType::f32, 2), T(DType::i32, 1), S, S},
                 {{"BLOCK_T", 128}, {"R_PAD", 32}, {"BY_FREQ", 1}},
                 "lora_embedding_scatter",
                 v.arch});
    c.push_back({&kernels::flush_accumulator(),
                 {T(DType::f32, 3), T(w, 3, fast)},
                 {{"BLOCK_M", 16}, {"BLOCK_K", 128}},
                 "flush_accumulator",
                 v.arch});
    c.push_back({&kernels::transpose_3d(),
                 {T(is_half(w) ? DType::f32 : w, 3, fast), T(w, 3, fast)},
                 {{"BLOCK_M", 64}, {"BLOCK_K", 64}, {"FLUSH", flag}, {"WAIT_PRIOR", 1 - flag}},
                 "transpose_3d",
                 v.arch});
    if (v.tf32)
      for (size_t i = first; i < c.size(); ++i)
        if (c[i].meta.count("DOT") && c[i].meta.at("DOT") == int64_t(DType::f32)) c[i].meta["TF32"] = 1;
  }
  return c;
}

std::string source_of(const Kernel& k, const std::vector<ArgSpec>& args, const MetaMap& meta) {
  return jit::cuda::generate(k.trace(args, meta), "sm_90a").source;
}

// Where NVRTC can be loaded, `src` compiles for sm_90a into a non-empty image.
void check_compiles_for_sm90a_if_nvrtc(const std::string& src, const std::string& name) {
  if (!nvrtc::available()) return;
  nvrtc::Output out;
  REQUIRE_NOTHROW(out = nvrtc::compile(src, name, "sm_90a"));
  CHECK(!out.image.empty());
}

}  // namespace

TEST_CASE("every LoRA op kernel compiles with NVRTC for sm_80 and sm_90a", "[cuda][codegen][ops]") {
  KERF_REQUIRE_NVRTC();
  for (const Case& c : op_kernel_cases()) {
    const ir::Function fn = c.kernel->trace(c.args, c.meta);
    INFO(c.what << " for " << c.arch << "\n" << ir::print(fn));
    const jit::cuda::KernelCode code = jit::cuda::generate(fn, c.arch);
    nvrtc::Output out;
    REQUIRE_NOTHROW(out = nvrtc::compile(code.source, code.entry + ".cu", c.arch));
    CHECK(out.image.size() > 4);
  }
}

// PEFT's usual fp16 setup: an f16 base with fp32 adapters. The products run as TF32 on
// mma.sync (f32's range; an fp32 FMA loop took 232 us against 56 us for f16 adapters at
// DoRA r=64, 8192x8192, on an H100), and the same kernels without TF32 keep the FMA loop.
TEST_CASE("TF32 puts the op kernels' f32 products on mma.sync and compiles for sm_80 and sm_90a",
          "[cuda][codegen][ops]") {
  std::vector<Case> cases = op_kernel_cases({Variant{DType::f16, true, "sm_90a", true}});
  const auto dora_args = [](bool split) {
    std::vector<ArgSpec> a = {T(DType::f16, 2), T(DType::f32, 2), T(DType::f32, 2), T(DType::f32, 1), S, S,
                              T(DType::f32, 1), T(DType::f32, 1)};
    if (split) {
      a.push_back(T(DType::f32, 1));
      a.push_back(T(DType::i32, 1));
    }
    return a;
  };
  for (const bool split : {false, true})
    cases.push_back({split ? &kernels::dora_norm_split() : &kernels::dora_norm_fused(), dora_args(split),
                     {{"BLOCK_M", 128}, {"BLOCK_K", 64}, {"R_PAD", 64}, {"DOT", int64_t(DType::f32)}, {"TF32", 1},
                      {"num_warps", 8}, {"num_stages", 2}},
                     split ? "dora_norm_split" : "dora_norm_fused", "sm_90a"});
  cases.push_back({&kernels::moe_lora_materialize(),
                   {T(DType::f16, 3), T(DType::f32, 3), T(DType::f32, 3), S, T(DType::f16, 3)},
                   {{"BLOCK_N", 64}, {"BLOCK_K", 128}, {"R_PAD", 16}, {"DOT", int64_t(DType::f32)}, {"TF32", 1},
                    {"num_stages", 3}},
                   "moe_lora_materialize", "sm_90a"});
  int with_dots = 0;
  for (const Case& c : cases) {
    if (!c.meta.count("TF32")) continue;
    const std::string src = source_of(*c.kernel, c.args, c.meta);
    if (src.find("// dot ") == std::string::npos) continue;  // no product (a helper kernel)
    ++with_dots;
    INFO(c.what);
    CHECK(src.find("kerf_dev::mma_tf32_1688(") != std::string::npos);
    CHECK(src.find("kerf_dev::round_tf32(") != std::string::npos);
    CHECK(src.find("= fmaf(ar[") == std::string::npos);
    MetaMap ieee = c.meta;
    ieee.erase("TF32");
    const std::string fma = source_of(*c.kernel, c.args, ieee);
    CHECK(fma.find("kerf_dev::mma_tf32_1688(") == std::string::npos);
    CHECK(fma.find("= fmaf(ar[") != std::string::npos);
    if (nvrtc::available())
      for (const char* arch : {"sm_80", "sm_90a"}) {
        INFO(arch);
        const jit::cuda::KernelCode code = jit::cuda::generate(c.kernel->trace(c.args, c.meta), arch);
        nvrtc::Output out;
        REQUIRE_NOTHROW(out = nvrtc::compile(code.source, code.entry + ".cu", arch));
        CHECK(out.image.size() > 4);
      }
  }
  CHECK(with_dots == 9);  // merge, MoE forward, both MoE backwards, the embedding's three, DoRA's two
}

TEST_CASE("dot takes tf32 for f32 operands only, and it is part of the kernel's identity", "[dsl][errors]") {
  static const Kernel k("tf32_dot", [](Builder& b) {
    const Tensor x = b.tensor("x", 2), y = b.tensor("y", 2);
    const DType d = static_cast<DType>(b.meta("D"));
    const Value a = load(x, {arange(16).col(), arange(16).row()}).to(d);
    const DotPrecision p = b.meta("TF32") ? DotPrecision::tf32 : DotPrecision::ieee;
    store(y, {arange(16).col(), arange(16).row()}, dot(a, a, Value(), 0, p));
  });
  const std::vector<ArgSpec> args = {T(DType::f32, 2), T(DType::f32, 2)};
  const ir::Function ieee = k.trace(args, {{"D", int64_t(DType::f32)}, {"TF32", 0}});
  const ir::Function tf32 = k.trace(args, {{"D", int64_t(DType::f32)}, {"TF32", 1}});
  CHECK(ir::print(tf32).find(", tf32") != std::string::npos);
  CHECK(ir::print(ieee).find(", tf32") == std::string::npos);
  CHECK(ir::hash(tf32).hex() != ir::hash(ieee).hex());
  CHECK_THROWS_WITH(k.trace(args, {{"D", int64_t(DType::bf16)}, {"TF32", 1}}),
                    Catch::Contains("tf32 precision takes f32 operands, got bf16"));
}

TEST_CASE("the in-place merge pipelines its W loads and uses tensor cores for bf16",
          "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S};
  const MetaMap meta = {{"BLOCK_M", 64},    {"BLOCK_K", 128},
                        {"R_PAD", 16},      {"DOT", int64_t(DType::bf16)},
                        {"SCALE_AFTER", 1}, {"num_stages", 3}};
  const std::string src = source_of(kernels::lora_merge(), args, meta);
  CHECK(src.find("kerf_dev::mma_bf16_16816(") != std::string::npos);
  // W is read and written: its loads run ahead as cp.async too (each iteration owns its tile).
  CHECK(src.find("prefetch @W") != std::string::npos);
  CHECK(src.find("prefetch @A") != std::string::npos);
}

// Walking the rows, each step still owns its rows, so W's loads run ahead, and B's beside them.
TEST_CASE("the merge walking the rows pipelines its W loads", "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S};
  const MetaMap meta = {{"BLOCK_M", 64},    {"BLOCK_K", 128},  {"R_PAD", 64}, {"DOT", int64_t(DType::bf16)},
                        {"SCALE_AFTER", 1}, {"num_stages", 3}, {"WALK_ROWS", 1}};
  const std::string src = source_of(kernels::lora_merge(), args, meta);
  CHECK(src.find("prefetch @W") != std::string::npos);
  CHECK(src.find("prefetch @B") != std::string::npos);
}

TEST_CASE("the MoE backward reads dW once per tile and feeds both dots from it",
          "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S,
                                     T(DType::f32, 3),  T(DType::bf16, 3)};
  const MetaMap meta = {{"BLOCK_N", 128}, {"BLOCK_K", 64},
                        {"R_PAD", 16},    {"DOT", int64_t(DType::bf16)},
                        {"num_warps", 8}, {"num_stages", 3}};
  const ir::Function fn = kernels::moe_lora_backward().trace(args, meta);
  // One load of dW in the IR, two dots.
  const std::string ir_text = ir::print(fn);
  size_t loads = 0, dots = 0;
  for (size_t p = ir_text.find("load @dW"); p != std::string::npos;
       p = ir_text.find("load @dW", p + 1))
    ++loads;
  for (size_t p = ir_text.find(" dot"); p != std::string::npos; p = ir_text.find(" dot", p + 1))
    ++dots;
  INFO(ir_text);
  CHECK(loads == 1);
  CHECK(dots == 2);
  const std::string src = jit::cuda::generate(fn, "sm_90a").source;
  CHECK(src.find("kerf_dev::mma_bf16_16816(") != std::string::npos);
  CHECK(src.find("prefetch @dW") != std::string::npos);
  // trans(B rows) and trans(A tile) are read transposed from the shared memory
  // their loads already fill: the K loop stages nothing and waits at one barrier.
  const size_t loop = src.find("for (int v");  // the K loop (register loops use r and q)
  const size_t loop_end = src.find("cp_async_wait<0>");
  INFO(src);
  REQUIRE(loop != std::string::npos);
  REQUIRE(loop_end != std::string::npos);
  const std::string body = src.substr(loop, loop_end - loop);
  CHECK(body.find("in shared memory for a dot") == std::string::npos);
  size_t barriers = 0;
  for (size_t p = body.find("__syncthreads"); p != std::string::npos; p = body.find("__syncthreads", p + 1)) ++barriers;
  CHECK(barriers == 1);
  CHECK(src.find("kerf_dev::ldmatrix_x4(bf,") != std::string::npos);
}

TEST_CASE("the 4-bit DoRA norm prefetches its packed bytes and A, and forms the LoRA term on tensor cores",
          "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> args = {T(DType::u8, 2),  T(DType::f32, 1), T(DType::f32, 1), T(DType::f32, 2),
                                     T(DType::f32, 2), T(DType::f32, 1), S,               S,
                                     S,                T(DType::f32, 1), T(DType::f32, 1)};
  const MetaMap meta = {{"BLOCK_M", 64}, {"BLOCK_K", 128}, {"R_PAD", 16}, {"DOT", int64_t(DType::bf16)},
                        {"num_warps", 8}, {"num_stages", 3}};
  const std::string src = source_of(kernels::dora_norm_4bit(), args, meta);
  INFO(src);
  CHECK(src.find("prefetch @packed") != std::string::npos);
  CHECK(src.find("prefetch @A") != std::string::npos);  // A's columns in order: one copy per 4 floats
  CHECK(src.find("kerf_dev::cp_async<16>") != std::string::npos);  // 16 bytes: 32 codes per copy
  CHECK(src.find("kerf_dev::mma_bf16_16816(") != std::string::npos);
  // The codes come from shuffles, the nibbles' weights meet in the accumulator's registers.
  CHECK(src.find("load @code in [16]") != std::string::npos);
  CHECK(src.find("kerf_dev::shfl_idx(") != std::string::npos);
  CHECK(src.find("= (((r) >> 0) & 1) ? ") != std::string::npos);
  // One dot per step, fed from the rings: with bf16 adapters the loop body has
  // one barrier (the pipeline's), none for staging (f32 A is converted through
  // shared memory for the tensor cores).
  std::vector<ArgSpec> half_args = args;
  half_args[3] = T(DType::bf16, 2);
  half_args[4] = T(DType::bf16, 2);
  const std::string hsrc = source_of(kernels::dora_norm_4bit(), half_args, meta);
  const size_t body = hsrc.find("for (int v", hsrc.find("prefetch @packed"));
  REQUIRE(body != std::string::npos);
  const size_t end = hsrc.find("cp_async_wait<0>", body);
  size_t barriers = 0;
  for (size_t at = hsrc.find("__syncthreads()", body); at < end; at = hsrc.find("__syncthreads()", at + 1))
    ++barriers;
  CHECK(barriers == 1);
}

TEST_CASE("rotated column steps still run their loads ahead", "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> moe = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S,
                                    T(DType::f32, 3),  T(DType::bf16, 3)};
  const std::string src = source_of(kernels::moe_lora_backward(), moe,
                                    {{"BLOCK_N", 128}, {"BLOCK_K", 64}, {"R_PAD", 64}, {"DOT", int64_t(DType::bf16)},
                                     {"ROTATE", 1}, {"num_warps", 8}, {"num_stages", 3}});
  INFO(src);
  CHECK(src.find("prefetch @dW") != std::string::npos);
  CHECK(src.find("prefetch @A") != std::string::npos);
  CHECK(src.find("kerf_dev::cp_async<16>") != std::string::npos);  // still whole 16-byte rows
  const std::vector<ArgSpec> emb = {T(DType::i64, 1), T(DType::bf16, 2), T(DType::bf16, 2), T(DType::bf16, 2), S,
                                    T(DType::f32, 2), T(DType::f32, 2), T(DType::i32, 1), T(DType::i32, 1), T(DType::i64, 1), S, S, S,
                                    T(DType::bf16, 2)};
  const std::string esrc = source_of(kernels::lora_embedding_backward(), emb,
                                     {{"BLOCK_T", 128}, {"BLOCK_D", 64}, {"R_PAD", 16}, {"DOT", int64_t(DType::bf16)},
                                      {"ROTATE", 1}, {"num_stages", 3}});
  CHECK(esrc.find("prefetch @g") != std::string::npos);
}

TEST_CASE("the embedding backward with L2_KEEP puts its share of dA and dB back to normal L2 priority",
          "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> emb = {T(DType::i64, 1), T(DType::bf16, 2), T(DType::bf16, 2), T(DType::bf16, 2), S,
                                    T(DType::f32, 2), T(DType::f32, 2), T(DType::i32, 1), T(DType::i32, 1), T(DType::i64, 1), S, S, S,
                                    T(DType::bf16, 2)};
  MetaMap meta = {{"BLOCK_T", 128}, {"BLOCK_D", 128}, {"R_PAD", 16}, {"DOT", int64_t(DType::bf16)},
                  {"ROTATE", 1},    {"WAIT_PRIOR", 1}, {"num_warps", 4}, {"num_stages", 3}};
  const std::string plain = source_of(kernels::lora_embedding_backward(), emb, meta);
  CHECK(plain.find("applypriority") == std::string::npos);
  meta["L2_KEEP"] = 1;
  const std::string src = source_of(kernels::lora_embedding_backward(), emb, meta);
  INFO(src);
  // dA by lines of its rows (and each row's last column), dB by its rows' lines, after the dA atomics.
  const size_t last_add = src.rfind("atomic_add @dA");
  REQUIRE(last_add != std::string::npos);
  CHECK(src.find("// l2_evict_normal @dA in [16,64]", last_add) != std::string::npos);
  CHECK(src.find("// l2_evict_normal @dA in [16]", last_add) != std::string::npos);
  CHECK(src.find("// l2_evict_normal @dB in [64,2]", last_add) != std::string::npos);
  check_compiles_for_sm90a_if_nvrtc(src, "embedding_backward_l2_keep.cu");
  // The fill before it writes evict-last when asked, and only then.
  const std::vector<ArgSpec> fill = {T(DType::f32, 3), S};
  const MetaMap fmeta = {{"BLOCK_M", 8}, {"BLOCK_K", 256}};
  MetaMap kept = fmeta;
  kept["EVICT_LAST"] = 1;
  CHECK(source_of(kernels::fill_3d(), fill, fmeta).find("kerf_pol_last") == std::string::npos);
  CHECK(source_of(kernels::fill_3d(), fill, kept).find("st_hint<float, 4>(p0 + off, pk, kerf_pol_last)") !=
        std::string::npos);
}

TEST_CASE("L2 hints reach the loads, stores and cp.async copies they are given, and nothing else",
          "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S};
  auto meta = [](int64_t evict) {
    return MetaMap{{"BLOCK_M", 64},    {"BLOCK_K", 128},  {"R_PAD", 16},     {"DOT", int64_t(DType::bf16)},
                   {"SCALE_AFTER", 1}, {"EVICT", evict}, {"num_stages", 3}};
  };
  const ir::Function fn = kernels::lora_merge().trace(args, meta(2));
  const std::string ir_text = ir::print(fn);
  INFO(ir_text);
  CHECK(ir_text.find("load @W[") != std::string::npos);
  CHECK(ir_text.find("evict_first") != std::string::npos);
  CHECK(ir_text.find("evict_last") != std::string::npos);
  const std::string hinted = jit::cuda::generate(fn, "sm_90a").source;
  CHECK(hinted.find("kerf_dev::l2_policy_evict_first()") != std::string::npos);
  CHECK(hinted.find("kerf_dev::l2_policy_evict_last()") != std::string::npos);
  CHECK(hinted.find("kerf_dev::cp_async_hint<16>") != std::string::npos);  // W and A run ahead, hinted
  CHECK(hinted.find("kerf_dev::st_hint<") != std::string::npos);           // W written back, hinted
  const std::string plain = source_of(kernels::lora_merge(), args, meta(0));
  CHECK(plain.find("kerf_dev::l2_policy") == std::string::npos);
  CHECK(plain.find("kerf_dev::cp_async_hint<") == std::string::npos);
  CHECK(plain.find("kerf_dev::st_hint<") == std::string::npos);
  CHECK(plain.find("kerf_dev::ld_hint<") == std::string::npos);
  // The hinted kernel compiles (NVRTC runs ptxas on the cache-hint PTX).
  KERF_REQUIRE_NVRTC();
  for (const char* arch : {"sm_80", "sm_90a"}) {
    const jit::cuda::KernelCode code = jit::cuda::generate(fn, arch);
    REQUIRE_NOTHROW(nvrtc::compile(code.source, code.entry + ".cu", arch));
  }
}

TEST_CASE("WARPS_N puts warps on a dot's columns: each reads its share of A's columns", "[cuda][codegen][ops]") {
  KERF_REQUIRE_NVRTC();
  const std::vector<ArgSpec> args = {T(DType::bf16, 2), T(DType::bf16, 2), T(DType::bf16, 2), T(DType::f32, 1),
                                     S,                 S,                 T(DType::f32, 1),  T(DType::f32, 1)};
  MetaMap meta = {{"BLOCK_M", 128}, {"BLOCK_K", 64}, {"R_PAD", 64}, {"DOT", int64_t(DType::bf16)},
                  {"num_warps", 8},  {"num_stages", 3}};
  const std::string rows_first = source_of(kernels::dora_norm_fused(), args, meta);
  CHECK(rows_first.find("const int wm = warp & 7, wn = (warp >> 3) & 0;") != std::string::npos);
  for (const auto& [wn, expect] : {std::pair<int64_t, std::string>{2, "const int wm = warp & 3, wn = (warp >> 2) & 1;"},
                                   {4, "const int wm = warp & 1, wn = (warp >> 1) & 3;"},
                                   {8, "const int wm = warp & 0, wn = (warp >> 0) & 7;"}}) {
    meta["WARPS_N"] = wn;
    const ir::Function fn = kernels::dora_norm_fused().trace(args, meta);
    INFO("WARPS_N=" << wn);
    CHECK(ir::print(fn).find("warps_n=" + std::to_string(wn)) != std::string::npos);
    const jit::cuda::KernelCode code = jit::cuda::generate(fn, "sm_90a");
    CHECK(code.source.find(expect) != std::string::npos);
    // The row sum then crosses warps; NVRTC takes it.
    nvrtc::Output out;
    REQUIRE_NOTHROW(out = nvrtc::compile(code.source, code.entry + ".cu", "sm_90a"));
    CHECK(out.image.size() > 4);
  }
  // More than the tile's 8-column groups allow: as many as there are (BLOCK_K=16: two).
  meta["BLOCK_K"] = 16;
  meta["WARPS_N"] = 8;
  CHECK(source_of(kernels::dora_norm_fused(), args, meta).find("const int wm = warp & 3, wn = (warp >> 2) & 1;") !=
        std::string::npos);
  // Fewer rows than the warps asked for leave on columns: BLOCK_M=16 holds one warp's rows,
  // so WARPS_N=2 becomes 8 warps on columns, none copying another's work.
  meta["BLOCK_K"] = 64;
  meta["BLOCK_M"] = 16;
  meta["WARPS_N"] = 2;
  CHECK(source_of(kernels::dora_norm_fused(), args, meta).find("const int wm = warp & 0, wn = (warp >> 0) & 7;") !=
        std::string::npos);
}

TEST_CASE("dot refuses a warps_n that is not a power of two up to 32", "[dsl][errors]") {
  for (const int64_t bad : {int64_t(3), int64_t(64), int64_t(-1)}) {
    const Kernel k("bad_dot", [bad](Builder& b) {
      const Tensor X = b.tensor("X", 2);
      const Value i = arange(16);
      const Value x = load(X, {i.col(), i.row()}).to(DType::bf16);
      store(X, {i.col(), i.row()}, dot(x, x, Value(), bad));
    });
    try {
      (void)k.trace({T(DType::f32, 2)}, {});
      FAIL("no error for warps_n=" << bad);
    } catch (const Error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find("op 'dot': warps_n must be 0 (kerf chooses) or a power of two up to 32, got " +
                                       std::to_string(bad)) != std::string::npos);
    }
  }
}

TEST_CASE("l2_prefetch gives pipelined copies an L2 prefetch size, and other sizes are refused",
          "[cuda][codegen][ops]") {
  KERF_REQUIRE_NVRTC();
  const std::vector<ArgSpec> args = {T(DType::bf16, 2), T(DType::bf16, 2), T(DType::bf16, 2), T(DType::f32, 1),
                                     S,                 S,                 T(DType::f32, 1),  T(DType::f32, 1)};
  MetaMap meta = {{"BLOCK_M", 64}, {"BLOCK_K", 64}, {"R_PAD", 16}, {"DOT", int64_t(DType::bf16)},
                  {"num_warps", 4}, {"num_stages", 3}};
  CHECK(source_of(kernels::dora_norm_fused(), args, meta).find("kerf_dev::cp_async<16>(") != std::string::npos);
  for (const int64_t bytes : {64, 128, 256}) {
    meta["l2_prefetch"] = bytes;
    const ir::Function fn = kernels::dora_norm_fused().trace(args, meta);
    const jit::cuda::KernelCode code = jit::cuda::generate(fn, "sm_90a");
    INFO("l2_prefetch=" << bytes);
    CHECK(code.source.find("kerf_dev::cp_async<16, " + std::to_string(bytes) + ">(") != std::string::npos);
    nvrtc::Output out;
    REQUIRE_NOTHROW(out = nvrtc::compile(code.source, code.entry + ".cu", "sm_90a"));
    CHECK(out.image.size() > 4);
  }
  meta["l2_prefetch"] = 100;
  try {
    (void)source_of(kernels::dora_norm_fused(), args, meta);
    FAIL("no error for l2_prefetch=100");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("kernel 'dora_norm': l2_prefetch must be 0, 64, 128 or 256 (bytes), got 100") !=
          std::string::npos);
  }
}

TEST_CASE("wgmma=1 puts both MoE backward dots on warpgroup instructions for sm_90a, and only there",
          "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S,
                                     T(DType::f32, 3),  T(DType::bf16, 3)};
  MetaMap meta = {{"BLOCK_N", 256}, {"BLOCK_K", 64}, {"R_PAD", 64}, {"DOT", int64_t(DType::bf16)},
                  {"ROTATE", 1},    {"num_warps", 8}, {"num_stages", 3}, {"wgmma", 1}};
  const ir::Function fn = kernels::moe_lora_backward().trace(args, meta);
  const std::string src = jit::cuda::generate(fn, "sm_90a").source;
  INFO(src);
  // dA = B^T @ dW: dW's tile MN-major, each of the two warpgroups 32 of its 64 columns;
  // dB = dW @ A^T: A's tile K-major, each warpgroup 128 of the 256 rows (two m64 tiles).
  CHECK(src.find("kerf_dev::wgmma_bf16_n32<1>(") != std::string::npos);
  CHECK(src.find("kerf_dev::wgmma_bf16_n64<0>(") != std::string::npos);
  CHECK(src.find("kerf_dev::mma_bf16_16816(&") == std::string::npos);
  // Both rings swizzled and 1024-aligned; the copies made visible to the async proxy.
  CHECK(src.find("kerf_dev::cp_async<16>(ring + kerf_dev::sw128(") != std::string::npos);
  CHECK(src.find("fence.proxy.async.shared::cta") != std::string::npos);
  check_compiles_for_sm90a_if_nvrtc(src, "moe_backward_wgmma.cu");
  // Without the architecture-specific target (sm_90, sm_80) the same meta keeps mma.sync.
  for (const char* arch : {"sm_90", "sm_80"}) {
    const std::string plain = jit::cuda::generate(fn, arch).source;
    CHECK(plain.find("kerf_dev::wgmma_") == std::string::npos);
    CHECK(plain.find("kerf_dev::mma_bf16_16816(&") != std::string::npos);
  }
  meta["wgmma"] = 2;
  CHECK_THROWS_WITH(kernels::moe_lora_backward().trace(args, meta), Catch::Contains("wgmma must be 0 or 1"));
}

TEST_CASE("staged_adds sends an accumulator's f32 atomics through shared memory as whole-line vectors",
          "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S,
                                     T(DType::bf16, 3), T(DType::f32, 3)};
  MetaMap meta = {{"BLOCK_N", 64},  {"BLOCK_K", 256},   {"R_PAD", 64},     {"DOT", int64_t(DType::bf16)},
                  {"ROTATE", 0},    {"num_warps", 8},   {"num_stages", 3}, {"wgmma", 1}};
  const std::string direct = source_of(kernels::moe_lora_backward_by_columns(), args, meta);
  // Without it dB's per-step share goes out of the accumulator's registers, pairs of columns.
  CHECK(direct.find("kerf_dev::red_add<2>(") != std::string::npos);
  CHECK(direct.find("kerf_dev::red_add<4>(") == std::string::npos);
  meta["staged_adds"] = 1;
  const std::string src = source_of(kernels::moe_lora_backward_by_columns(), args, meta);
  INFO(src);
  // With it: 16 threads per 64-column row, 4 floats each, so one instruction adds whole 128-byte lines.
  CHECK(src.find("kerf_dev::red_add<4>(") != std::string::npos);
  CHECK(src.find("kerf_dev::red_add<2>(") == std::string::npos);
  CHECK(src.find("// atomic_add @dB from [64,64]{r:1:1,1:2,0:16,0:32 l:1:4,1:8,1:16,1:32,0:1") != std::string::npos);
  check_compiles_for_sm90a_if_nvrtc(src, "moe_backward_staged.cu");
  meta["staged_adds"] = 2;
  CHECK_THROWS_WITH(kernels::moe_lora_backward_by_columns().trace(args, meta),
                    Catch::Contains("staged_adds must be 0 or 1"));
}

TEST_CASE("acc_store writes an accumulator's values from its registers without shared-memory staging",
          "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S, T(DType::bf16, 3)};
  for (const int64_t wgmma : {0, 1}) {
    CAPTURE(wgmma);
    MetaMap meta = {{"BLOCK_N", 128}, {"BLOCK_K", 128},  {"R_PAD", 64},     {"DOT", int64_t(DType::bf16)},
                    {"SCALE_AFTER", 1}, {"num_warps", 8}, {"num_stages", 3}, {"wgmma", wgmma}};
    const ir::Function staged_fn = kernels::moe_lora_materialize().trace(args, meta);
    const jit::cuda::KernelCode staged = jit::cuda::generate(staged_fn, "sm_90a");
    // Without it the sum goes to a blocked layout through shared memory, 8 elements (16 bytes) a store.
    CHECK(staged.source.find("// store @W_eff from") != std::string::npos);
    CHECK(staged.source.find(", 8-wide") != std::string::npos);
    meta["acc_store"] = 1;
    const ir::Function fn = kernels::moe_lora_materialize().trace(args, meta);
    const jit::cuda::KernelCode direct = jit::cuda::generate(fn, "sm_90a");
    INFO(direct.source);
    // With it: from the accumulator's pairs of adjacent columns, no staging tile.
    const size_t at = direct.source.find("// store @W_eff from");
    REQUIRE(at != std::string::npos);
    CHECK(direct.source.substr(at, direct.source.find('\n', at) - at).find(", 2-wide") != std::string::npos);
    CHECK(direct.smem_bytes < staged.smem_bytes);
    check_compiles_for_sm90a_if_nvrtc(direct.source, "moe_acc_store.cu");
  }
  MetaMap bad = {{"BLOCK_N", 64}, {"BLOCK_K", 64}, {"R_PAD", 16}, {"acc_store", 2}};
  CHECK_THROWS_WITH(kernels::moe_lora_materialize().trace(args, bad), Catch::Contains("acc_store must be 0 or 1"));
}

// W += a @ b tile by tile along W's columns, stored to out, and after it with AGAIN=1 2W, with
// AGAIN=2 a @ b, stored to twice: the W tile is a pipelined load whose slot the sum may pass
// through.
const Kernel& ring_store_kernel() {
  static const Kernel k("ring_store", [](Builder& b) {
    auto W = b.tensor("W", 2), a = b.tensor("a", 2), bt = b.tensor("b", 2);
    auto out = b.tensor("out", 2), twice = b.tensor("twice", 2);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN"), R = b.meta("R"), again = b.meta("AGAIN", 0);
    auto rows = program_id(0) * BM + arange(BM);
    auto rk = arange(R);
    auto av = load(a, {rows.col(), rk.row()}, rows.col() < W.dim(0));
    for_range(0, W.dim(1), BN, [&](const Value& c0) {
      auto cols = c0 + arange(BN);
      auto ok = (rows.col() < W.dim(0)) & (cols.row() < W.dim(1));
      auto w = load(W, {rows.col(), cols.row()}, ok).to(DType::f32);
      auto bv = load(bt, {rk.col(), cols.row()}, cols.row() < W.dim(1));
      store(out, {rows.col(), cols.row()}, (w + dot(av, bv)).to(out.dtype()), ok);
      if (again == 1) store(twice, {rows.col(), cols.row()}, (w * 2.0).to(out.dtype()), ok);
      if (again == 2) store(twice, {rows.col(), cols.row()}, dot(av, bv).to(out.dtype()), ok);
    });
  });
  return k;
}

// The MoE forward's clustered read of B (cluster_load at the kernel's top level) gives its
// buffer back for later regions; a region that needs 1024-byte alignment (a warpgroup
// operand's staging) takes it only at such an offset. With the pipeline's rings allocated
// first (early_prologue), 32-row tiles leave the buffer at an offset that is not a
// multiple of 1024, and B's staging comes after it.
TEST_CASE("a 1024-aligned region that takes a spent cluster_load buffer stays 1024-aligned",
          "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S, T(DType::bf16, 3)};
  for (const int64_t bk : {64, 128}) {
    CAPTURE(bk);
    const MetaMap meta = {{"BLOCK_N", 32},     {"BLOCK_K", bk},   {"R_PAD", 64},       {"DOT", int64_t(DType::bf16)},
                          {"SCALE_AFTER", 1},  {"num_warps", 4},  {"num_stages", 3},   {"wgmma", 1},
                          {"early_prologue", 1}, {"EXPERT_GROUP", 16}, {"EXPERTS_LAST", 1}, {"cluster_size", 8}};
    const std::string src = source_of(kernels::moe_lora_materialize(), args, meta);
    INFO(src);
    REQUIRE(src.find("cluster_load @B") != std::string::npos);
    const std::string tag = "  // 1024-aligned, for wgmma's swizzle";
    int regions = 0;
    for (size_t at = src.find(tag); at != std::string::npos; at = src.find(tag, at + 1)) {
      const size_t eq = src.rfind("= ", at);
      const int offset = std::stoi(src.substr(eq + 2, at - eq - 3));
      CAPTURE(offset);
      CHECK(offset % 1024 == 0);
      ++regions;
    }
    CHECK(regions >= 2);  // the ring's and B's staging
  }
}

// store_in_ring: a store of a dot's sum moves into its store layout through the spent ring
// slot of the weight tile it was computed from (each thread overwrites the elements it read
// there), not a shared-memory buffer of its own; where the tile is read again after the
// store, through its own buffer as before.
TEST_CASE("store_in_ring moves a stored sum through its weight tile's spent ring slot", "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S, T(DType::bf16, 3)};
  for (const int64_t wgmma : {0, 1}) {
    CAPTURE(wgmma);
    MetaMap meta = {{"BLOCK_N", 64},  {"BLOCK_K", 128},  {"R_PAD", 64},     {"DOT", int64_t(DType::bf16)},
                    {"SCALE_AFTER", 1}, {"num_warps", 4}, {"num_stages", 3}, {"wgmma", wgmma}};
    const jit::cuda::KernelCode own =
        jit::cuda::generate(kernels::moe_lora_materialize().trace(args, meta), "sm_90a");
    CHECK(own.source.find("through this iteration's ring slot") == std::string::npos);
    meta["store_in_ring"] = 1;
    const jit::cuda::KernelCode code =
        jit::cuda::generate(kernels::moe_lora_materialize().trace(args, meta), "sm_90a");
    INFO(code.source);
    CHECK(code.source.find("through this iteration's ring slot") != std::string::npos);
    // The 64 x (128 + 8) bf16 buffer is gone: at 64x128 on three stages two programs
    // (110592 bytes each) share an H100's multiprocessor.
    CHECK(code.smem_bytes == own.smem_bytes - 64 * 136 * 2);
    if (wgmma) CHECK(code.smem_bytes == 110592);
    check_compiles_for_sm90a_if_nvrtc(code.source, "moe_store_in_ring.cu");
  }
  // The in-place merge: W's new tile through W's slot, 85760 -> 68352 bytes at 64x128 on
  // three stages (three programs a multiprocessor instead of two).
  const std::vector<ArgSpec> margs = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S};
  MetaMap mmeta = {{"BLOCK_M", 64},    {"BLOCK_K", 128},  {"R_PAD", 16}, {"DOT", int64_t(DType::bf16)},
                   {"SCALE_AFTER", 1}, {"num_stages", 3}, {"num_warps", 4}};
  const jit::cuda::KernelCode merge_own = jit::cuda::generate(kernels::lora_merge().trace(margs, mmeta), "sm_90a");
  mmeta["store_in_ring"] = 1;
  const jit::cuda::KernelCode merge = jit::cuda::generate(kernels::lora_merge().trace(margs, mmeta), "sm_90a");
  CHECK(merge.source.find("through this iteration's ring slot") != std::string::npos);
  CHECK(merge.smem_bytes == merge_own.smem_bytes - 64 * 136 * 2);
  check_compiles_for_sm90a_if_nvrtc(merge.source, "merge_store_in_ring.cu");
  const std::vector<ArgSpec> rs = {T(DType::bf16, 2), T(DType::bf16, 2), T(DType::bf16, 2), T(DType::bf16, 2),
                                   T(DType::bf16, 2)};
  MetaMap meta = {{"BM", 64}, {"BN", 64}, {"R", 16}, {"num_warps", 4}, {"num_stages", 2}, {"store_in_ring", 1}};
  const std::string once = jit::cuda::generate(ring_store_kernel().trace(rs, meta), "sm_80").source;
  CHECK(once.find("through this iteration's ring slot") != std::string::npos);
  meta["AGAIN"] = 1;  // W's tile is read again after the store: its slot stays as it is
  const std::string again = jit::cuda::generate(ring_store_kernel().trace(rs, meta), "sm_80").source;
  INFO(again);
  CHECK(again.find("through this iteration's ring slot") == std::string::npos);
  CHECK(again.find("// store @twice") != std::string::npos);
  // A second sum stored in the same iteration: the first passes through W's slot, the second
  // through its own buffer (other threads may still be reading the first from the slot).
  meta["AGAIN"] = 2;
  const std::string two = jit::cuda::generate(ring_store_kernel().trace(rs, meta), "sm_80").source;
  CHECK(test::occurrences(two, "through this iteration's ring slot") == 1);
  CHECK(two.find("// store @twice") != std::string::npos);
  meta["store_in_ring"] = 2;
  CHECK_THROWS_WITH(ring_store_kernel().trace(rs, meta), Catch::Contains("store_in_ring must be 0 or 1"));
}

// The merge's one-tile form with WAIT_PRIOR (after a cast of A that its launch overlaps) asks
// for W's and B's tiles, then waits for the grid before it, then reads A; without it nothing
// waits and A's columns are asked for before B's rows, as before. The cast and the transpose
// with RELEASE let the kernel after them start before they read anything.
TEST_CASE("the merge's one-tile form with WAIT_PRIOR waits for the prior grid only before reading A",
          "[cuda][codegen][ops][merge]") {
  const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::f32, 3), S};
  const auto source = [&](int64_t wait) {
    MetaMap meta = {{"BLOCK_M", 64}, {"BLOCK_K", 128}, {"R_PAD", 32},    {"DOT", int64_t(DType::bf16)},
                    {"num_warps", 8}, {"num_stages", 1}, {"ONE_TILE", 1}, {"acc_col_run", 8}};
    if (wait) meta["WAIT_PRIOR"] = 1;
    return jit::cuda::generate(kernels::lora_merge().trace(args, meta), "sm_90a").source;
  };
  const std::string waits = source(1);
  const size_t w = waits.find("load @W"), b = waits.find("load @B"), a = waits.find("load @A"),
               wait = waits.find("griddepcontrol.wait;");
  REQUIRE(w != std::string::npos);
  REQUIRE(b != std::string::npos);
  REQUIRE(a != std::string::npos);
  REQUIRE(wait != std::string::npos);
  CHECK(w < b);
  CHECK(b < wait);
  CHECK(wait < a);
  CHECK(waits.find("griddepcontrol.wait;", wait + 1) == std::string::npos);
  const std::string plain = source(0);
  CHECK(plain.find("griddepcontrol") == std::string::npos);
  CHECK(plain.find("load @W") < plain.find("load @A"));
  CHECK(plain.find("load @A") < plain.find("load @B"));
  for (const Kernel* k : {&kernels::cast_3d(), &kernels::transpose_3d()})
    for (const int64_t release : {0, 1}) {
      CAPTURE(k->name(), release);
      MetaMap meta = {{"BLOCK_M", 32}, {"BLOCK_K", 64}};
      if (release) meta["RELEASE"] = 1;
      const std::string src =
          jit::cuda::generate(k->trace({T(DType::f32, 3), T(DType::bf16, 3)}, meta), "sm_90a").source;
      const size_t launch = src.find("griddepcontrol.launch_dependents;");
      if (!release) {
        CHECK(launch == std::string::npos);
        continue;
      }
      REQUIRE(launch != std::string::npos);
      CHECK(launch < src.find("@x"));
    }
}

// PERSISTENT: one loop over the tiles a program deals itself, whose expert, row block and
// column step come from the loop counter; B's rows are copied ahead beside A's columns and W
// (a tile's B differs from the last one's), and the tiles kerf would measure fit an H100.
TEST_CASE("the MoE forward's PERSISTENT programs copy each tile's B, A and W ahead in one loop",
          "[cuda][codegen][ops]") {
  struct Case {
    int64_t bn, warps, stages, r_pad;
    DType ab;
    int64_t wgmma;
  };
  for (const Case& c : {Case{64, 4, 4, 64, DType::bf16, 1}, Case{128, 8, 2, 64, DType::bf16, 1},
                        Case{64, 4, 3, 16, DType::f32, 0}}) {
    CAPTURE(c.bn, c.warps, c.stages, c.r_pad, dtype_name(c.ab), c.wgmma);
    const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(c.ab, 3), T(c.ab, 3), S, T(DType::bf16, 3)};
    MetaMap meta = {{"BLOCK_N", c.bn},      {"BLOCK_K", 128},         {"R_PAD", c.r_pad},
                    {"DOT", int64_t(DType::bf16)}, {"num_warps", c.warps}, {"num_stages", c.stages},
                    {"wgmma", c.wgmma},     {"PERSISTENT", 1}};
    if (c.ab == DType::bf16) meta["SCALE_AFTER"] = 1;
    const jit::cuda::KernelCode code =
        jit::cuda::generate(kernels::moe_lora_materialize().trace(args, meta), "sm_90a");
    INFO(code.source);
    for (const char* t : {"B", "A", "W"})
      CHECK(code.source.find(std::string("// prefetch @") + t + " for iteration") != std::string::npos);
    CHECK(code.smem_bytes <= autotune::typical_max_shared_memory("sm_90a"));
    check_compiles_for_sm90a_if_nvrtc(code.source, "moe_persistent.cu");
  }
}

// Regions that wgmma reads with its 128-byte swizzle start at multiples of 1024 bytes
// into kerf_smem, which the kernel aligns once: one pad, not one per region. The MoE
// backward's 64x512 column tile on two stages (dW and B rings, A's columns staged, the
// staged adds' buffer) then fits an H100's 232448 bytes; with a pad per region it took
// 233472.
TEST_CASE("1024-aligned shared-memory regions share one pad: the MoE backward's 64x512 tile fits an H100",
          "[cuda][codegen][ops]") {
  const std::vector<ArgSpec> args = {T(DType::bf16, 3), T(DType::bf16, 3), T(DType::bf16, 3), S,
                                     T(DType::bf16, 3), T(DType::f32, 3)};
  const MetaMap meta = {{"BLOCK_N", 64},   {"BLOCK_K", 512},  {"R_PAD", 64},        {"DOT", int64_t(DType::bf16)},
                        {"ROTATE", 0},     {"num_warps", 8},  {"num_stages", 2},    {"wgmma", 1},
                        {"wgmma_ss", 1},   {"staged_adds", 1}, {"DA_ATOMIC", 0}};
  const ir::Function fn = kernels::moe_lora_backward_by_columns().trace(args, meta);
  const jit::cuda::KernelCode code = jit::cuda::generate(fn, "sm_90a");
  INFO(code.source);
  // dW ring 2 x 64 KiB, B ring 2 x 8 KiB, A's columns 64 KiB, 64 x 68 floats of staged adds, one pad.
  CHECK(code.smem_bytes == 2 * 65536 + 2 * 8192 + 65536 + 64 * 68 * 4 + 1024);
  CHECK(code.smem_bytes <= autotune::typical_max_shared_memory("sm_90a"));
  CHECK(test::occurrences(code.source, "kerf_smem_window) & 1023u") == 1);
  CHECK(code.source.find("const int sw_base_0 = 0;") != std::string::npos);
  check_compiles_for_sm90a_if_nvrtc(code.source, "moe_backward_wide.cu");
  // With its rows split, dA's columns added to an fp32 accumulator at the end.
  std::vector<ArgSpec> split_args = args;
  split_args[4] = T(DType::f32, 3);
  MetaMap split_meta = meta;
  split_meta["DA_ATOMIC"] = 1;
  CHECK(jit::cuda::generate(kernels::moe_lora_backward_by_columns().trace(split_args, split_meta), "sm_90a").smem_bytes <=
        autotune::typical_max_shared_memory("sm_90a"));
  // A kernel with no such region keeps kerf_smem as the window itself, with no pad.
  MetaMap plain = meta;
  plain.erase("wgmma");
  plain.erase("wgmma_ss");
  plain["BLOCK_K"] = 64;
  const jit::cuda::KernelCode mma = jit::cuda::generate(kernels::moe_lora_backward_by_columns().trace(args, plain), "sm_90a");
  CHECK(mma.source.find("kerf_smem_window") == std::string::npos);
  CHECK(mma.source.find("unsigned char kerf_smem[]") != std::string::npos);
}

// An untuned call (KERF_AUTOTUNE=0, or a capture) runs the op's own tiles: at every
// rank up to 256 and every product (bf16, f16, TF32, fp32 FMA) they fit the shared
// memory of an H100. (fp32 products take four bytes an element: rank 256 on the tiles of
// rank 16 took 573712 bytes, rank 128 338192.)
TEST_CASE("the DoRA norm's default GPU tiles fit an H100's shared memory for every product and rank up to 256",
          "[cuda][codegen][ops]") {
  const autotune::TunableOp op = test::registered_op("dora_norm");
  const int limit = autotune::typical_max_shared_memory("sm_90a");
  CHECK(limit == 232448);
  const Device dev = Device::cuda(0);  // planned and generated only
  void* const p = test::planning_address();
  const int64_t out = 4096, in = 4096;
  for (const auto& [w, ab] : {std::pair{DType::bf16, DType::f32}, {DType::f16, DType::f16}, {DType::f16, DType::f32},
                              {DType::f32, DType::f32}})
    for (const int64_t r : {16, 64, 100, 128, 256}) {
      CAPTURE(dtype_name(w), dtype_name(ab), r);
      const std::vector<TensorView> views = {
          TensorView::contiguous(p, w, {out, in}, dev),          TensorView::contiguous(p, ab, {r, in}, dev),
          TensorView::contiguous(p, ab, {out, r}, dev),          TensorView::contiguous(p, DType::f32, {out}, dev),
          TensorView::contiguous(p, DType::f32, {out}, dev),     TensorView::contiguous(p, DType::f32, {out}, dev)};
      for (const autotune::KernelCall& call : op.kernels(views, {}, 132)) {
        const ir::Function fn = call.kernel->trace(arg_specs(call.args), call.meta);
        const jit::cuda::KernelCode code = jit::cuda::generate(fn, "sm_90a");
        CHECK(code.smem_bytes <= limit);
        if (r == 256 && nvrtc::available()) {  // the tiles chosen for the largest rank compile
          nvrtc::Output o;
          REQUIRE_NOTHROW(o = nvrtc::compile(code.source, code.entry + ".cu", "sm_90a"));
          CHECK(o.image.size() > 4);
        }
      }
    }
}

namespace {

// Compiles planned kernel `call` for sm_90a as kerf's launches do (cache::compile_kernel)
// and checks that ptxas spills nothing and gives no advisories (a warpgroup dot
// serialized); its generated source.
std::string compiles_without_spills(const autotune::KernelCall& call) {
  const jit::cuda::KernelCode code = jit::cuda::generate(call.kernel->trace(arg_specs(call.args), call.meta), "sm_90a");
  const nvrtc::PtxasUsage u = cache::compile_kernel(code, "sm_90a").usage;
  CAPTURE(u.registers);
  CHECK(u.registers > 0);
  CHECK(u.spill_store_bytes == 0);
  for (const std::string& a : u.advisories) FAIL_CHECK(a);
  return code.source;
}

}  // namespace

// What ptxas says of the tiles an untuned GPU call of each op runs (bf16 and f16, ranks 16
// and 64, sizes of 4096): none spills, and none has its warpgroup dots serialized for want
// of registers (ptxas' advisory C7512; the MoE backward's 64x512 tile with dW's tile in
// registers had both: 255 registers, 432 bytes spilled). The merge's f16 tile at rank 64
// spilled 4 bytes at 168 registers until compile_kernel's second compile for the one
// program its shared memory lets a multiprocessor run (178 registers, none spilled).
TEST_CASE("no op's own GPU tiles spill registers or serialize their warpgroup dots", "[cuda][codegen][ops]") {
  KERF_REQUIRE_NVRTC();
  const ops::detail::PlanningArch h100("sm_90a");  // the tiles planned for an H100 on any machine
  void* const p = test::planning_address();
  int compiled = 0;
  for (const autotune::TunableOp& op : autotune::tunable_ops())
    for (const DType dt : {DType::bf16, DType::f16})
      for (const int64_t r : {16, 64}) {
        std::vector<int64_t> shape;
        for (const std::string& n : op.shape_names) shape.push_back(n == "r" ? r : n == "E" ? 8 : 4096);
        std::vector<TensorView> views;
        for (const autotune::Operand& o : op.operands(shape, dt))
          views.push_back(TensorView::contiguous(p, o.dtype, o.shape, Device::cuda(0)));
        for (const autotune::KernelCall& call : op.kernels(views, {}, 132)) {
          CAPTURE(op.name, dtype_name(dt), r, call.kernel->name());
          compiles_without_spills(call);
          ++compiled;
        }
      }
  CHECK(compiled >= 32);  // at least one kernel per op, dtype and rank
}

// The MoE forward's own tiles up to rank 32 on sm_90a (one tile a program in its one-tile form;
// for one large expert too up to rank 16), for W and adapters of one dtype and of two, compile
// without spills.
TEST_CASE("the MoE forward's one-tile own tiles up to rank 32 compile for sm_90a without spills",
          "[cuda][codegen][ops][moe]") {
  KERF_REQUIRE_NVRTC();
  const ops::detail::PlanningArch h100("sm_90a");
  const autotune::TunableOp op = test::registered_op("moe_lora_materialize");
  void* const p = test::planning_address();
  const Device dev = Device::cuda(0);
  // The untuned plan of E experts [N, K] of dtype w, adapters of dtype ab at rank r: one kernel.
  const auto planned = [&](DType w, DType ab, int64_t r, int64_t E, int64_t N, int64_t K) {
    const TensorView W = TensorView::contiguous(p, w, {E, N, K}, dev);
    const TensorView A = TensorView::contiguous(p, ab, {E, r, K}, dev);
    const std::vector<autotune::KernelCall> calls =
        op.kernels({W, A, TensorView::contiguous(p, ab, {E, N, r}, dev), W}, {}, 132);
    REQUIRE(calls.size() == 1);
    CHECK(calls[0].meta.at("ONE_TILE") == 1);
    return calls[0];
  };
  for (const auto& [w, ab] : {std::pair{DType::bf16, DType::bf16}, {DType::f16, DType::f16}, {DType::bf16, DType::f32}})
    for (const int64_t r : {5, 16, 17, 32}) {
      CAPTURE(dtype_name(w), dtype_name(ab), r);
      const autotune::KernelCall many = planned(w, ab, r, 64, 2816, 2048);
      // 64x64 up to rank 16; 32x128 above, 128x64 on 8 warps with fp32 adapters.
      if (r <= 16)
        CHECK(test::is_one_tile(many.meta, "BLOCK_N", 64, 64));
      else if (ab == DType::f32)
        CHECK(test::is_one_tile(many.meta, "BLOCK_N", 128, 64, 8));
      else
        CHECK(test::is_one_tile(many.meta, "BLOCK_N", 32, 128));
      compiles_without_spills(many);
      if (r > 16) continue;
      // One large expert (its 64-row blocks at most one a multiprocessor): 32x256.
      const autotune::KernelCall large = planned(w, ab, r, 1, 8192, 8200);
      CHECK(test::is_one_tile(large.meta, "BLOCK_N", 32, 256));
      compiles_without_spills(large);
    }
}

// The MoE forward reading PEFT's flat lora_B by clusters of 8 experts (EXPERTS_LAST), on the
// own tile's warpgroup ring and a small mma.sync tile, bf16 and fp32 adapters, ranks 16 and
// 64: its exchange (vector loads of the 8 experts, the hand-over through distributed
// shared memory) compiles for sm_90a without spills.
TEST_CASE("the MoE forward's clustered read of PEFT's flat lora_B compiles for sm_90a without spills",
          "[cuda][codegen][ops][moe]") {
  KERF_REQUIRE_NVRTC();
  const ops::detail::PlanningArch h100("sm_90a");
  const autotune::TunableOp op = test::registered_op("moe_lora_materialize");
  void* const p = test::planning_address();
  const Device dev = Device::cuda(0);
  const int64_t E = 32, N = 200, K = 300;
  for (const DType ab : {DType::bf16, DType::f32})
    for (const int64_t r : {16, 64})
      for (const autotune::Config& tile :
           {autotune::Config{{"BLOCK_N", 64}, {"BLOCK_K", 128}, {"num_warps", 4}, {"num_stages", 3}, {"WGMMA", 1},
                             {"STORE_IN_RING", 1}, {"L2_PREFETCH", 128}},
            autotune::Config{{"BLOCK_N", 32}, {"BLOCK_K", 64}, {"num_warps", 4}, {"num_stages", 2}}}) {
        CAPTURE(dtype_name(ab), r, tile.at("BLOCK_N"));
        const TensorView W = TensorView::contiguous(p, DType::bf16, {E, N, K}, dev);
        const ops::MoeLoraViews v = ops::peft_moe_lora_views(W, TensorView::contiguous(p, ab, {r * E, K}, dev),
                                                             TensorView::contiguous(p, ab, {N, r * E}, dev));
        autotune::Config c = tile;
        c.insert({{"EXPERT_GROUP", 16}, {"CLUSTER", 8}, {"EXPERTS_LAST", 1}});
        const std::vector<autotune::KernelCall> calls = op.kernels({W, v.A, v.B, W}, c, 132);
        REQUIRE(calls.size() == 1);
        CHECK(compiles_without_spills(calls[0]).find("cluster_load @B") != std::string::npos);
      }
}

// The merge's own sm_90a tiles for W and adapters of two dtypes, its WALK_ROWS tiles (A's columns
// kept, the rows walked: on the warpgroup ring tile, with A's fragments read from shared memory,
// and on mma.sync) and its CAST_A plan (an fp32 A rounded to bf16 by a launch of its own, then
// the bf16 W merged with it and fp32 B) compile for sm_90a without spills.
TEST_CASE("the merge's mixed-dtype own tiles and its WALK_ROWS and CAST_A plans compile for sm_90a without spills",
          "[cuda][codegen][ops][merge]") {
  KERF_REQUIRE_NVRTC();
  const ops::detail::PlanningArch h100("sm_90a");
  const autotune::TunableOp op = test::registered_op("lora_merge");
  void* const p = test::planning_address();
  const Device dev = Device::cuda(0);
  const autotune::Config ring{{"BLOCK_M", 64}, {"BLOCK_K", 128}, {"num_warps", 4}, {"num_stages", 3},
                              {"WGMMA", 1}, {"STORE_IN_RING", 1}, {"L2_PREFETCH", 128}};
  // The plan of a 4096x4096 W of dtype w, adapters of dtype ab at rank r, under config c.
  const auto planned = [&](DType w, DType ab, int64_t r, const autotune::Config& c) {
    return op.kernels({TensorView::contiguous(p, w, {4096, 4096}, dev), TensorView::contiguous(p, ab, {r, 4096}, dev),
                       TensorView::contiguous(p, ab, {4096, r}, dev)},
                      c, 132);
  };
  // The untuned plans (the op's own tiles: one tile a program at ranks 17 to 32, the ring tile
  // above, or asked for with ONE_TILE=0) of W and adapters of two dtypes; in the one-tile form an
  // fp32 A is cast first, and the merge waits for the cast (WAIT_PRIOR).
  for (const auto& [w, ab] : {std::pair{DType::f16, DType::bf16}, {DType::bf16, DType::f16}, {DType::bf16, DType::f32}})
    for (const int64_t r : {17, 32, 64})
      for (const int64_t one_tile : {1, 0}) {
        CAPTURE(dtype_name(w), dtype_name(ab), r, one_tile);
        const std::vector<autotune::KernelCall> calls =
            planned(w, ab, r, one_tile ? autotune::Config{} : autotune::Config{{"ONE_TILE", 0}});
        const bool cast = r <= 32 && one_tile && ab == DType::f32;
        REQUIRE(calls.size() == (cast ? 2u : 1u));
        const autotune::KernelCall& merge = calls.back();
        CHECK(merge.meta.count("WAIT_PRIOR") == (cast ? 1u : 0u));
        if (r <= 32 && one_tile)
          CHECK(test::is_one_tile(merge.meta, "BLOCK_M", 32, ab == DType::f32 ? 128 : 64));
        else
          CHECK(test::is_ring_tile(merge.meta, "BLOCK_M", r > 32 ? 2 : 3));
        for (const autotune::KernelCall& call : calls) compiles_without_spills(call);
      }
  // Up to rank 16: the 32x128 one-tile form, TF32 products (an f16 W, fp32 adapters) included;
  // 64x128 on 8 warps for a bf16 W with fp32 adapters.
  for (const auto& [w, ab] : {std::pair{DType::bf16, DType::bf16}, {DType::f16, DType::f32}, {DType::bf16, DType::f32}}) {
    CAPTURE(dtype_name(w), dtype_name(ab));
    const std::vector<autotune::KernelCall> calls = planned(w, ab, 16, {});
    REQUIRE(calls.size() == 1);
    if (w == DType::bf16 && ab == DType::f32)
      CHECK(test::is_one_tile(calls[0].meta, "BLOCK_M", 64, 128, 8));
    else
      CHECK(test::is_one_tile(calls[0].meta, "BLOCK_M", 32, 128));
    compiles_without_spills(calls[0]);
  }
  for (const int64_t r : {32, 64}) {
    for (const DType ab : {DType::bf16, DType::f32})
      for (const autotune::Config& extra :
           {autotune::Config{}, autotune::Config{{"WGMMA_SS", 1}}, autotune::Config{{"WGMMA", 0}}}) {
        autotune::Config c = ring;
        for (const auto& [k, v] : extra) c[k] = v;
        c["WALK_ROWS"] = 1;
        CAPTURE(r, dtype_name(ab), c);
        const std::vector<autotune::KernelCall> calls = planned(DType::bf16, ab, r, c);
        REQUIRE(calls.size() == 1);
        CHECK(calls[0].meta.at("WALK_ROWS") == 1);
        compiles_without_spills(calls[0]);
      }
    autotune::Config c = ring;
    c["CAST_A"] = 1;
    CAPTURE(r, c);
    const std::vector<autotune::KernelCall> calls = planned(DType::bf16, DType::f32, r, c);
    REQUIRE(calls.size() == 2);  // A's cast, then the merge reading its bf16 copy
    for (const autotune::KernelCall& call : calls) compiles_without_spills(call);
  }
}

// The same for every op the tuner knows, in bf16, f16 and f32 and with fp32 adapters on a
// half W, at ranks 128 and 256 and sizes that tiles do and do not divide (before, the
// embedding at rank 128 took 280576 bytes, merge and the MoE forward at rank 256 260608 and
// 312320, fp32 ones more; the 4-bit DoRA norm at rank 128 with fp32 adapters, in=130, 312592).
TEST_CASE("every op's default GPU tiles fit an H100's shared memory at ranks 128 and 256", "[cuda][codegen][ops]") {
  const int limit = autotune::typical_max_shared_memory("sm_90a");
  const ops::detail::PlanningArch h100("sm_90a");
  void* const p = test::planning_address();
  int planned = 0;
  for (const autotune::TunableOp& op : autotune::tunable_ops())
    for (const DType t : {DType::bf16, DType::f16, DType::f32})
      for (const int64_t r : {16, 64, 128, 256})
        for (const int64_t size : {1024, 130, 72}) {  // tiles and steps that do not divide every size too
          CAPTURE(op.name, dtype_name(t), r, size);
          std::vector<int64_t> shape;
          for (const std::string& n : op.shape_names) shape.push_back(n == "r" ? r : n == "E" ? 4 : size);
          // As given, and (half W) with fp32 adapters and adapter gradients, PEFT's usual
          // mix: the operands with a dimension of r.
          for (const bool fp32_adapters : {false, true}) {
            if (fp32_adapters && t == DType::f32) continue;
            CAPTURE(fp32_adapters);
            std::vector<TensorView> views;
            for (const autotune::Operand& o : op.operands(shape, t)) {
              const bool adapter = std::find(o.shape.begin(), o.shape.end(), r) != o.shape.end();
              views.push_back(TensorView::contiguous(p, fp32_adapters && adapter ? DType::f32 : o.dtype, o.shape,
                                                     Device::cuda(0)));
            }
            for (const autotune::KernelCall& call : op.kernels(views, {}, 132)) {
              CAPTURE(call.kernel->name());
              CHECK(jit::cuda::generate(call.kernel->trace(arg_specs(call.args), call.meta), "sm_90a").smem_bytes <=
                    limit);
              ++planned;
            }
          }
        }
  CHECK(planned >= 8 * 5 * 4 * 3);  // dora_norm, its 4-bit and partial forms, merge, MoE and its backward, embedding both ways
}
