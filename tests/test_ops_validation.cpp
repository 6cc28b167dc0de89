// Every rejected argument of the LoRA ops, with its message: shapes, dtypes
// (TypeError), devices, alignment, overlapping outputs, ids and options. The
// checks run before anything launches, so host views (and views that claim a
// GPU) need no back end; nothing here reads or writes the fake memory.
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <thread>

#include "catch.h"
#include "cpu_test_util.h"
#include "device_tensor.h"
#include "error_test_util.h"
#include "gpu_test_util.h"
#include "kerf/error.h"
#include "kerf/jit/launch_count.h"
#include "kerf/ops/ops.h"
#include "kernels_src/ops_checks.h"

using namespace kerf;

namespace {

// Backing memory for views that are validated and never run.
alignas(64) float g_mem[1 << 16];

TensorView t(std::vector<int64_t> shape, DType d = DType::f32, int64_t offset_elems = 0) {
  return TensorView::contiguous(
      reinterpret_cast<uint8_t*>(g_mem) + offset_elems * dtype_size_bytes(d), d, shape);
}
TensorView at(size_t byte_offset, std::vector<int64_t> shape, std::vector<int64_t> strides,
              DType d = DType::f32) {
  return TensorView::strided(reinterpret_cast<uint8_t*>(g_mem) + byte_offset, d, shape, strides);
}
TensorView on_gpu(TensorView v) {
  v.device = Device::cuda(0);
  return v;
}

using kerf::test::thrown;

#define CHECK_REJECTS(kind, call, text) \
  CHECK_THAT(thrown<kind>([&] { call; }), Catch::Contains(text))

}  // namespace

TEST_CASE("lora_merge rejects bad shapes, dtypes, devices, alignment and overlapping memory",
          "[ops][validation]") {
  // Disjoint regions of g_mem: W at 0, A at 16 KiB, B at 32 KiB (f32 elements).
  const TensorView W = t({8, 12}), A = t({2, 12}, DType::f32, 4096),
                   B = t({8, 2}, DType::f32, 8192);
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(t({8}), A, B, 1.0),
                "lora_merge: W must have shape [*, *], got [8]");
  // A hand-built view whose rank passes the arrays' 8 entries: named, never read past them.
  TensorView rank9 = W, rank_neg = W;
  rank9.rank = 9;
  rank_neg.rank = -1;
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(rank9, A, B, 1.0),
                "lora_merge: W must have shape [*, *], got a view of invalid rank 9");
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(rank_neg, A, B, 1.0),
                "lora_merge: W must have shape [*, *], got a view of invalid rank -1");
  CHECK(rank9.describe() == "f32 view of invalid rank 9 (at most 8) on cpu");
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, t({2, 11}, DType::f32, 4096), B, 1.0),
                "lora_merge: A must have shape [*, 12], got [2, 11]");
  CHECK_REJECTS(InvalidArgument, ops::lora_unmerge(W, A, t({8, 3}, DType::f32, 8192), 1.0),
                "lora_unmerge: B must have shape [8, 2], got [8, 3]");
  CHECK_REJECTS(TypeError, ops::lora_merge(t({8, 12}, DType::i32), A, B, 1.0),
                "lora_merge: W must be one of {bf16, f16, f32}, got i32");
  CHECK_REJECTS(TypeError, ops::lora_merge(W, t({2, 12}, DType::f64, 4096), B, 1.0),
                "lora_merge: A must be one of {bf16, f16, f32}, got f64");
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, on_gpu(A), B, 1.0),
                "lora_merge: A is on cuda:0 but W is on cpu");
  TensorView other_cpu = A;  // a hand-built view of another CPU "device": named apart
  other_cpu.device.index = 1;
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, other_cpu, B, 1.0), "lora_merge: A is on cpu:1 but W is on cpu");
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(at(2, {8, 12}, {12, 1}), A, B, 1.0),
                "lora_merge: W must start at a multiple of its element size (4 bytes for f32)");
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, t({2, 12}, DType::f32, 40), B, 1.0),
                "lora_merge: output W overlaps A in memory");
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(at(0, {8, 12}, {0, 1}), A, B, 1.0),
                "lora_merge: output W (f32[8,12] strides [0,1] on cpu) has strides under which two "
                "indices may reach one element");
  CHECK_REJECTS(
      InvalidArgument,
      ops::lora_merge(W, t({300, 12}, DType::f32, 4096), t({8, 300}, DType::f32, 12000), 1.0),
      "lora_merge: rank 300 is above the supported 256");
}

TEST_CASE("lora_merge_flax rejects kernels that do not match lora_a and lora_b",
          "[ops][validation]") {
  const TensorView K = t({4, 2, 3}), la = t({4, 2}, DType::f32, 4096),
                   lb = t({2, 2, 3}, DType::f32, 8192);
  CHECK_REJECTS(InvalidArgument, ops::lora_merge_flax(t({4, 6}), la, lb, 1.0),
                "lora_merge_flax: kernel must have shape [in..., out...] = [4] + [2, 3] (lora_a's "
                "in dims, lora_b's "
                "out dims), got [4, 6]");
  CHECK_REJECTS(InvalidArgument, ops::lora_merge_flax(K, la, t({3, 2, 3}, DType::f32, 8192), 1.0),
                "lora_merge_flax: lora_b must have shape [2, 2, 3], got [3, 2, 3]");
  CHECK_REJECTS(InvalidArgument, ops::lora_merge_flax(K, t({4}, DType::f32, 4096), lb, 1.0),
                "lora_merge_flax: lora_a must have shape [in..., r] (rank >= 2), got [4]");
  CHECK_REJECTS(InvalidArgument, ops::lora_unmerge_flax(K, la, t({2, 2, 3}, DType::f32, 10), 1.0),
                "lora_unmerge_flax: output kernel overlaps lora_b in memory");
}

TEST_CASE("the DoRA norm ops reject bad shapes, dtypes, eps and overlapping outputs",
          "[ops][validation]") {
  const TensorView W = t({8, 12}), A = t({2, 12}, DType::f32, 4096),
                   B = t({8, 2}, DType::f32, 8192);
  const TensorView sumsq = t({8}, DType::f32, 12000), m = t({8}, DType::f32, 12100);
  const TensorView norm = t({8}, DType::f32, 12200), scale = t({8}, DType::f32, 12300);
  CHECK_REJECTS(InvalidArgument, ops::dora_norm_partial(W, A, B, 1.0, t({9}, DType::f32, 12000)),
                "dora_norm_partial: sumsq must have shape [8], got [9]");
  CHECK_REJECTS(TypeError, ops::dora_norm_partial(W, A, B, 1.0, t({8}, DType::bf16, 24000)),
                "dora_norm_partial: sumsq must be one of {f32}, got bf16");
  CHECK_REJECTS(InvalidArgument, ops::dora_norm_partial(W, A, B, 1.0, t({8}, DType::f32, 4)),
                "dora_norm_partial: output sumsq overlaps W in memory");
  CHECK_REJECTS(InvalidArgument, ops::dora_norm_finish(sumsq, m, -1.0, norm, scale),
                "dora_norm_finish: eps must be >= 0, got -1");
  CHECK_REJECTS(InvalidArgument,
                ops::dora_norm_finish(sumsq, m, 0.0, norm, t({8}, DType::f32, 12204)),
                "dora_norm_finish: output scale overlaps norm in memory");
  CHECK_REJECTS(InvalidArgument,
                ops::dora_norm_finish(sumsq, m, 0.0, t({8}, DType::f32, 12002), scale),
                "dora_norm_finish: output norm overlaps sumsq in memory");
  CHECK_REJECTS(TypeError, ops::dora_norm_finish(sumsq, t({8}, DType::i64, 6100), 0.0, norm, scale),
                "dora_norm_finish: m must be one of {bf16, f16, f32}, got i64");
  CHECK_REJECTS(InvalidArgument, ops::dora_norm_backward(norm, scale, t({7}, DType::f32, 12400)),
                "dora_norm_backward: grad_m must have shape [8], got [7]");
  CHECK_REJECTS(InvalidArgument, ops::dora_norm_backward(norm, scale, t({8}, DType::f32, 12301)),
                "dora_norm_backward: output grad_m overlaps grad_scale in memory");
  CHECK_REJECTS(InvalidArgument,
                ops::dora_norm_backward(norm, scale, on_gpu(t({8}, DType::f32, 12400))),
                "dora_norm_backward: grad_m is on cuda:0 but norm is on cpu");
  // dora_norm's own outputs: each other (the same tensor twice was accepted, and one
  // result lost), and its inputs.
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, norm, norm),
                "dora_norm: output scale overlaps norm in memory");
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, norm, t({8}, DType::f32, 12204)),
                "dora_norm: output scale overlaps norm in memory");
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, t({8}, DType::f32, 12104), scale),
                "dora_norm: output norm overlaps m in memory");
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, norm, t({8}, DType::f32, 90)),
                "dora_norm: output scale overlaps W in memory");
}

TEST_CASE("every op with a scale refuses one that is not finite", "[ops][validation]") {
  // An inf or NaN s writes NaN everywhere (in place for the merges); the check comes first.
  const TensorView W = t({8, 12}), A = t({2, 12}, DType::f32, 4096), B = t({8, 2}, DType::f32, 8192);
  const TensorView m = t({8}, DType::f32, 12100), norm = t({8}, DType::f32, 12200),
                   scale = t({8}, DType::f32, 12300);
  const TensorView W3 = t({2, 8, 12}), A3 = t({2, 2, 12}, DType::f32, 4096), B3 = t({2, 8, 2}, DType::f32, 8192),
                   W3_out = t({2, 8, 12}, DType::f32, 20000);
  const TensorView x = t({4}, DType::i64, 16000), table = t({16, 12}, DType::f32, 36000),
                   A_e = t({2, 16}, DType::f32, 40000), B_e = t({12, 2}, DType::f32, 41000),
                   out = t({4, 12}, DType::f32, 42000), dA_e = t({2, 16}, DType::f32, 43000),
                   dB_e = t({12, 2}, DType::f32, 44000);
  ops::Weight4bit W4{t({48}, DType::u8, 50000), t({2}, DType::f32, 50100), t({16}, DType::f32, 50200), 64};
  // 1e39 and -1e300 are finite doubles but inf as the float the kernels compute in.
  for (const double s : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                         std::numeric_limits<double>::quiet_NaN(), 1e39, -1e300}) {
    INFO("s = " << s);
    CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, A, B, s), "lora_merge: s must be ");
    CHECK_REJECTS(InvalidArgument, ops::lora_unmerge(W, A, B, s), "lora_unmerge: s must be ");
    CHECK_REJECTS(InvalidArgument, ops::lora_merge_flax(t({4, 2, 3}), t({4, 2}, DType::f32, 4096),
                                                        t({2, 2, 3}, DType::f32, 8192), s),
                  "lora_merge_flax: s must be ");
    CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, s, norm, scale), "dora_norm: s must be ");
    CHECK_REJECTS(InvalidArgument, ops::dora_norm_partial(W, A, B, s, t({8}, DType::f32, 12000)),
                  "dora_norm_partial: s must be ");
    CHECK_REJECTS(InvalidArgument, ops::dora_norm_4bit(W4, A, B, m, s, norm, scale),
                  "dora_norm_4bit: s must be ");
    CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize(W3, A3, B3, s, W3_out),
                  "moe_lora_materialize: s must be ");
    CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize_backward(W3_out, A3, B3, s, t({2, 2, 12}, DType::f32, 30000), t({2, 8, 2}, DType::f32, 31000)),
                  "moe_lora_materialize_backward: s must be ");
    CHECK_REJECTS(InvalidArgument, ops::lora_embedding(x, table, A_e, B_e, s, out), "lora_embedding: s must be ");
    CHECK_REJECTS(InvalidArgument, ops::lora_embedding_backward(x, A_e, B_e, out, s, dA_e, dB_e),
                  "lora_embedding_backward: s must be ");
  }
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, A, B, std::numeric_limits<double>::infinity()),
                "lora_merge: s must be finite, got inf");
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, A, B, 1e39),
                "lora_merge: s must be within float32's range (|s| <= 3.40282e+38), got 1e+39");
}

TEST_CASE("the MoE ops reject bad shapes, dtypes and overlapping outputs", "[ops][validation]") {
  const TensorView dW = t({2, 8, 12}), A = t({2, 3, 12}, DType::f32, 4096),
                   B = t({2, 8, 3}, DType::f32, 8192);
  const TensorView dA = t({2, 3, 12}, DType::f32, 12000), dB = t({2, 8, 3}, DType::f32, 13000);
  const auto bwd = [&](const TensorView& w, const TensorView& a, const TensorView& b,
                       const TensorView& ga, const TensorView& gb) {
    ops::moe_lora_materialize_backward(w, a, b, 1.0, ga, gb);
  };
  CHECK_REJECTS(InvalidArgument, bwd(t({2, 8}), A, B, dA, dB),
                "moe_lora_materialize_backward: dW_eff must have shape [*, *, *], got [2, 8]");
  CHECK_REJECTS(InvalidArgument, bwd(dW, t({2, 3, 11}, DType::f32, 4096), B, dA, dB),
                "moe_lora_materialize_backward: A must have shape [2, *, 12], got [2, 3, 11]");
  CHECK_REJECTS(InvalidArgument, bwd(dW, A, B, t({2, 3, 13}, DType::f32, 12000), dB),
                "moe_lora_materialize_backward: dA must have shape [2, 3, 12], got [2, 3, 13]");
  CHECK_REJECTS(TypeError, bwd(dW, A, B, dA, t({2, 8, 3}, DType::i32, 13000)),
                "moe_lora_materialize_backward: dB must be one of {bf16, f16, f32}, got i32");
  CHECK_REJECTS(InvalidArgument, bwd(dW, A, B, t({2, 3, 12}, DType::f32, 100), dB),
                "moe_lora_materialize_backward: output dA overlaps dW_eff in memory");
  CHECK_REJECTS(InvalidArgument, bwd(dW, A, B, dA, t({2, 8, 3}, DType::f32, 12010)),
                "moe_lora_materialize_backward: output dB overlaps dA in memory");
  CHECK_REJECTS(InvalidArgument, bwd(dW, A, B, at(48000, {2, 3, 12}, {36, 0, 1}), dB),
                "moe_lora_materialize_backward: output dA (f32[2,3,12] strides [36,0,1] on cpu) "
                "has strides under which two indices may reach one element");
  CHECK_REJECTS(
      InvalidArgument,
      bwd(t({65536, 1, 1}), t({65536, 0, 1}), t({65536, 1, 0}), t({65536, 0, 1}), t({65536, 1, 0})),
      "moe_lora_materialize_backward: at most 65535 experts per call, got 65536");
  // The forward: W_eff may be W itself, but no other overlap.
  const TensorView W = t({2, 8, 12});
  CHECK_REJECTS(InvalidArgument,
                ops::moe_lora_materialize(W, A, B, 1.0, t({2, 8, 12}, DType::f32, 1)),
                "moe_lora_materialize: output W_eff overlaps W in memory");
  CHECK_REJECTS(InvalidArgument,
                ops::moe_lora_materialize(W, A, B, 1.0, t({2, 8, 12}, DType::f32, 4100)),
                "moe_lora_materialize: output W_eff overlaps A in memory");
}

TEST_CASE("lora_embedding rejects bad ids, shapes, options and overlapping outputs",
          "[ops][validation]") {
  const TensorView x = t({2, 3}, DType::i64), W = t({10, 4}, DType::f32, 4096),
                   A = t({2, 10}, DType::f32, 8192);
  const TensorView B = t({4, 2}, DType::f32, 9000), out = t({2, 3, 4}, DType::f32, 10000);
  CHECK_REJECTS(TypeError, ops::lora_embedding(t({2, 3}), W, A, B, 1.0, out),
                "lora_embedding: x must be one of {i32, i64}, got f32");
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding(t({}, DType::i64), W, A, B, 1.0, out),
                "lora_embedding: x must have at least one dimension, got a scalar");
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding(x, W, A, B, 1.0, t({6, 4}, DType::f32, 10000)),
                "lora_embedding: out must have shape [2, 3, 4], got [6, 4]");
  // Ids whose token dims cannot be one dim (x transposed), and x and out flattening in other orders.
  const TensorView xt = at(0, {2, 3}, {1, 2}, DType::i64);
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding(xt, W, A, B, 1.0, out),
                "lora_embedding: the token dims of x (i64[2,3] strides [1,2] on cpu) do not flatten to one dim");
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding(x, W, A, B, 1.0, at(40000, {2, 3, 4}, {4, 8, 1})),
                "and out (f32[2,3,4] strides [4,8,1] on cpu) must flatten alike");
  CHECK_REJECTS(InvalidArgument,
                ops::lora_embedding(x, W, t({2, 11}, DType::f32, 8192), B, 1.0, out),
                "lora_embedding: A must have shape [*, 10], got [2, 11]");
  CHECK_REJECTS(InvalidArgument,
                ops::lora_embedding(x, W, A, B, 1.0, t({2, 3, 4}, DType::f32, 4100)),
                "lora_embedding: output out overlaps weight in memory");
  // Token dims that do not flatten alike in x and out.
  CHECK_REJECTS(InvalidArgument,
                ops::lora_embedding(at(0, {2, 3}, {1, 2}, DType::i64), W, A, B, 1.0, out),
                "lora_embedding: the token dims of x");
  // after_a in the forward is an output: x's shape + r, overlapping no operand.
  ops::EmbeddingOptions fwd_act;
  fwd_act.after_a = t({2, 3, 3}, DType::f32, 14000);
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding(x, W, A, B, 1.0, out, fwd_act),
                "lora_embedding: after_a must have shape [2, 3, 2], got [2, 3, 3]");
  fwd_act.after_a = t({2, 3, 2}, DType::f32, 10004);
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding(x, W, A, B, 1.0, out, fwd_act),
                "lora_embedding: output out overlaps after_a in memory");
  fwd_act.after_a = t({2, 3, 2}, DType::f32, 8200);
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding(x, W, A, B, 1.0, out, fwd_act),
                "lora_embedding: output after_a overlaps A in memory");
  const TensorView gout = t({2, 3, 4}, DType::f32, 10000), gA = t({2, 10}, DType::f32, 11000);
  const TensorView gB = t({4, 2}, DType::f32, 12000);
  ops::EmbeddingOptions o;
  o.padding_idx = 10;
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding_backward(x, A, B, gout, 1.0, gA, gB, o),
                "lora_embedding_backward: padding_idx 10 is outside the vocabulary [-10, 10)");
  o.padding_idx = -11;
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding_backward(x, A, B, gout, 1.0, gA, gB, o),
                "padding_idx -11 is outside the vocabulary");
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding(x, W, A, B, 1.0, out, o),  // as F.embedding's forward
                "lora_embedding: padding_idx -11 is outside the vocabulary [-10, 10)");
  CHECK_REJECTS(InvalidArgument,
                ops::lora_embedding_backward(x, A, B, gout, 1.0, t({2, 9}, DType::f32, 11000), gB),
                "lora_embedding_backward: grad_A must have shape [2, 10], got [2, 9]");
  CHECK_REJECTS(InvalidArgument,
                ops::lora_embedding_backward(x, A, B, gout, 1.0, gA, t({4, 2}, DType::f32, 11004)),
                "lora_embedding_backward: output grad_B overlaps grad_A in memory");
  CHECK_REJECTS(InvalidArgument,
                ops::lora_embedding_backward(x, A, B, gout, 1.0, t({2, 10}, DType::f32, 8195), gB),
                "lora_embedding_backward: output grad_A overlaps A in memory");
  // The forward's activations (after_a): x's shape + r, an input the outputs must not overlap,
  // and not yet with a sharding layout.
  ops::EmbeddingOptions with_act;
  with_act.after_a = t({6, 2}, DType::f32, 13000);
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding_backward(x, A, B, gout, 1.0, gA, gB, with_act),
                "lora_embedding_backward: after_a must have shape [2, 3, 2], got [6, 2]");
  with_act.after_a = t({2, 3, 2}, DType::i32, 13000);
  CHECK_REJECTS(TypeError, ops::lora_embedding_backward(x, A, B, gout, 1.0, gA, gB, with_act),
                "lora_embedding_backward: after_a must be one of");
  with_act.after_a = t({2, 3, 2}, DType::f32, 11002);
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding_backward(x, A, B, gout, 1.0, gA, gB, with_act),
                "lora_embedding_backward: output grad_A overlaps after_a in memory");
  with_act.after_a = t({2, 3, 2}, DType::f32, 13000);
  // In a sharding layout after_a is split as x's token dims are (and never along r); a
  // layout that names it on a call without it names no operand.
  ops::Layout split_act;
  split_act.mesh = {{"dp", 2}};
  split_act.specs["after_a"] = ops::PartitionSpec{"dp"};
  split_act.coords = {0};
  CHECK_REJECTS(InvalidArgument,
                ops::lora_embedding_backward(x, A, B, gout, 1.0, gA, gB, with_act, nullptr, {}, split_act),
                "lora_embedding_backward: layout: after_a P('dp') and x P() split dimension 'x0' (after_a's dim 0, x's dim 0) differently");
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding_backward(x, A, B, gout, 1.0, gA, gB, {}, nullptr, {}, split_act),
                "lora_embedding_backward: layout: there is no operand 'after_a'");
  split_act.specs["after_a"] = ops::PartitionSpec{"", "", "dp"};
  CHECK_REJECTS(InvalidArgument,
                ops::lora_embedding(x, W, A, B, 1.0, out, with_act, nullptr, {}, split_act),
                "lora_embedding: layout: after_a P(None, None, 'dp')");
}

TEST_CASE("every op refuses views with elements but no memory, or strides that wrap the address space",
          "[ops][validation]") {
  // A null pointer was caught only by the launcher, one kernel at a time: after an
  // earlier launch of the same call had written outputs (the backwards zero their
  // gradients first), or never (the CPU reads the ids before any launch).
  const auto null = [](TensorView v) {
    v.data = nullptr;
    return v;
  };
  const TensorView W = t({8, 12}), A = t({2, 12}, DType::f32, 4096), B = t({8, 2}, DType::f32, 8192);
  const TensorView m = t({8}, DType::f32, 12100), norm = t({8}, DType::f32, 12200),
                   scale = t({8}, DType::f32, 12300);
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(null(W), A, B, 1.0),
                "lora_merge: W (f32[8,12] strides [12,1] on cpu) has a null data pointer");
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, null(B), m, 1.0, norm, scale),
                "dora_norm: B (f32[8,2] strides [2,1] on cpu) has a null data pointer");
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, norm, null(scale)),
                "dora_norm: scale (f32[8] strides [1] on cpu) has a null data pointer");
  CHECK_REJECTS(InvalidArgument, ops::dora_norm_backward(null(norm), scale, m),
                "dora_norm_backward: norm (f32[8] strides [1] on cpu) has a null data pointer");
  const TensorView W3 = t({2, 8, 12}), A3 = t({2, 3, 12}, DType::f32, 4096), B3 = t({2, 8, 3}, DType::f32, 8192);
  const TensorView dA = t({2, 3, 12}, DType::f32, 12000), dB = t({2, 8, 3}, DType::f32, 13000);
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize_backward(W3, A3, B3, 1.0, dA, null(dB)),
                "moe_lora_materialize_backward: dB (f32[2,8,3] strides [24,3,1] on cpu) has a null data pointer");
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize(W3, null(A3), B3, 1.0, W3),
                "moe_lora_materialize: A (f32[2,3,12] strides [36,12,1] on cpu) has a null data pointer");
  const TensorView x = t({2, 3}, DType::i64, 16000), E = t({10, 4}, DType::f32, 4096),
                   eA = t({2, 10}, DType::f32, 8192), eB = t({4, 2}, DType::f32, 9000),
                   out = t({2, 3, 4}, DType::f32, 10000);
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding(null(x), E, eA, eB, 1.0, out),
                "lora_embedding: x (i64[2,3] strides [3,1] on cpu) has a null data pointer");
  const TensorView gA = t({2, 10}, DType::f32, 11000), gB = t({4, 2}, DType::f32, 12000);
  CHECK_REJECTS(InvalidArgument, ops::lora_embedding_backward(x, eA, eB, null(out), 1.0, gA, gB),
                "lora_embedding_backward: grad_out (f32[2,3,4] strides [12,4,1] on cpu) has a null data pointer");
  // Empty views need no memory.
  CHECK_NOTHROW(ops::lora_merge(null(t({0, 12})), null(t({0, 12})), null(t({0, 0})), 1.0));

  // Strides whose byte offsets do not fit in 64 bits (an output's reach wrapped to
  // a small address, or overflowed the overlap check).
  const int64_t huge = int64_t(1) << 61;
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, at(50000, {8}, {huge}), scale),
                "dora_norm: norm (f32[8] strides [2305843009213693952] on cpu) has strides that reach beyond the "
                "address space");
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, at(50000, {8}, {-huge}), scale),
                "has strides that reach beyond the address space");
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(at(0, {8, 12}, {huge / 4, 1}), A, B, 1.0),
                "lora_merge: W (f32[8,12] strides [576460752303423488,1] on cpu) has strides that reach beyond");
}

// Dims past int32 (the kernels index a dim in 32 bits) are refused by name; views of one
// element repeated (zero strides) give them without memory to match.
TEST_CASE("every op family refuses a dim of 2^31 elements or more", "[ops][validation]") {
  const int64_t big = int64_t(1) << 31;
  const TensorView W = at(0, {8, big}, {0, 0}), A = at(4096, {2, big}, {0, 0}),
                   B = t({8, 2}, DType::f32, 8192);
  CHECK_REJECTS(
      InvalidArgument, ops::lora_merge(W, A, B, 1.0),
      "lora_merge: W dimension 1 has 2147483648 elements; at most 2^31 - 1 are supported");
  const TensorView m = t({8}, DType::f32, 12100), norm = t({8}, DType::f32, 12200),
                   scale = t({8}, DType::f32, 12300);
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, norm, scale),
                "dora_norm: W dimension 1 has 2147483648 elements; at most 2^31 - 1 are supported");
  const TensorView W3 = at(0, {2, big, 12}, {0, 0, 1}), A3 = t({2, 3, 12}, DType::f32, 4096),
                   B3 = at(32768, {2, big, 3}, {0, 0, 1});
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize(W3, A3, B3, 1.0, W3),
                "moe_lora_materialize: W dimension 1 has 2147483648 elements; at most 2^31 - 1 are "
                "supported");
  const TensorView x = t({2, 3}, DType::i64, 16000), E = at(0, {10, big}, {0, 0}),
                   eA = t({2, 10}, DType::f32, 8192), eB = at(40000, {big, 2}, {0, 0}),
                   out = at(50000, {2, 3, big}, {0, 0, 0});
  CHECK_REJECTS(
      InvalidArgument, ops::lora_embedding(x, E, eA, eB, 1.0, out),
      "lora_embedding: weight dimension 1 has 2147483648 elements; at most 2^31 - 1 are supported");
  // Tokens: each of x's dims fits, their product does not (one id repeated).
  const int64_t half = int64_t(1) << 16;
  const TensorView many = at(16000 * 4, {half, half}, {0, 0}, DType::i64),
                   table = t({10, 4}, DType::f32, 4096),
                   outs = at(40000 * 4, {half, half, 4}, {0, 0, 1}),
                   gA = t({2, 10}, DType::f32, 11000), gB = t({4, 2}, DType::f32, 12000);
  CHECK_REJECTS(
      InvalidArgument, ops::lora_embedding(many, table, eA, t({4, 2}, DType::f32, 9000), 1.0, outs),
      "lora_embedding: x (i64[65536,65536] strides [0,0] on cpu) holds 4294967296 tokens; at most "
      "2^31 - 1 a call are supported");
  CHECK_REJECTS(
      InvalidArgument,
      ops::lora_embedding_backward(many, eA, t({4, 2}, DType::f32, 9000), outs, 1.0, gA, gB),
      "lora_embedding_backward: x (i64[65536,65536] strides [0,0] on cpu) holds 4294967296 tokens");
}

// Hand-built views the ops cannot take, refused by name before anything reads them: a rank
// past the 8 a view holds, a negative size, and sizes whose product wraps a 64-bit count (to
// 0 it would pass for empty: no memory checks, and a launch over a null W).
TEST_CASE("every op refuses views of invalid rank, negative sizes or uncountable elements",
          "[ops][validation]") {
  const TensorView W = t({8, 12}), A = t({2, 12}, DType::f32, 4096),
                   B = t({8, 2}, DType::f32, 8192);
  TensorView a9 = t({1, 1, 1, 1, 1, 1, 1, 1}, DType::f32, 4096), k9 = t({1, 1, 1, 1, 1, 1, 1, 1});
  a9.rank = 9;
  k9.rank = 9;
  CHECK_REJECTS(InvalidArgument, ops::lora_merge_flax(k9, a9, t({1, 1}, DType::f32, 8192), 1.0),
                "lora_merge_flax: kernel is a f32 view of invalid rank 9 (at most 8) on cpu");
  CHECK_REJECTS(InvalidArgument,
                ops::lora_merge_flax(t({1, 1}), a9, t({1, 1}, DType::f32, 8192), 1.0),
                "lora_merge_flax: lora_a is a f32 view of invalid rank 9 (at most 8) on cpu");
  ops::Weight4bit W4{t({48}, DType::u8, 50000), t({2}, DType::f32, 50100),
                     t({16}, DType::f32, 50200), 64};
  W4.absmax.rank = -3;
  CHECK_REJECTS(
      InvalidArgument,
      ops::dora_norm_4bit(W4, t({2, 8}), t({6, 2}, DType::f32, 8192), t({6}, DType::f32, 12100),
                          1.0, t({6}, DType::f32, 12200), t({6}, DType::f32, 12300)),
      "dora_norm_4bit: absmax is a f32 view of invalid rank -3");

  // (TensorView::strided refuses negative sizes: these are set by hand.)
  const auto sized = [](TensorView v, int d, int64_t n) {
    v.shape[size_t(d)] = n;
    return v;
  };
  CHECK_REJECTS(
      InvalidArgument, ops::lora_merge(sized(W, 0, -3), A, sized(B, 0, -3), 1.0),
      "lora_merge: W (f32[-3,12] strides [12,1] on cpu) has a negative size (-3) along dim 0");
  const TensorView m = t({8}, DType::f32, 12100), norm = t({8}, DType::f32, 12200),
                   scale = t({8}, DType::f32, 12300);
  CHECK_REJECTS(
      InvalidArgument, ops::dora_norm(sized(W, 1, -12), sized(A, 1, -12), B, m, 1.0, norm, scale),
      "dora_norm: W (f32[8,-12] strides [12,1] on cpu) has a negative size (-12) along dim 1");
  const TensorView x = t({2, 3}, DType::i64, 16000), out = t({2, 3, 4}, DType::f32, 10000);
  CHECK_REJECTS(InvalidArgument,
                ops::lora_embedding(x, sized(t({10, 4}, DType::f32, 4096), 0, -10),
                                    sized(t({2, 10}, DType::f32, 8192), 1, -10),
                                    t({4, 2}, DType::f32, 9000), 1.0, out),
                "lora_embedding: weight (f32[-10,4] strides [4,1] on cpu) has a negative size "
                "(-10) along dim 0");

  // 256 x 2^28 x 2^28 elements: 2^64, 0 in 64 bits. W null, its own W_eff (in place).
  const int64_t E = 256, N = int64_t(1) << 28, K = int64_t(1) << 28;
  const TensorView Wn = TensorView::strided(nullptr, DType::f32, {E, N, K}, {N * K, K, 1});
  CHECK(Wn.numel() == 0);  // what the count wraps to
  const TensorView A3 = at(4096 * 4, {E, 1, K}, {0, 0, 0}), B3 = at(8192 * 4, {E, N, 1}, {0, 0, 0});
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize(Wn, A3, B3, 1.0, Wn),
                "moe_lora_materialize: W (f32[256,268435456,268435456] strides "
                "[72057594037927936,268435456,1] "
                "on cpu) has more elements than a 64-bit count holds");
  // The flax merge's kernel of 256^8 elements (null), adapters of one element repeated.
  const std::vector<int64_t> dims(8, 256), zeros(8, 0);
  std::vector<int64_t> row_major(8, 1);
  for (int d = 6; d >= 0; --d) row_major[size_t(d)] = row_major[size_t(d + 1)] * 256;
  const TensorView kernel = TensorView::strided(nullptr, DType::f32, dims, row_major);
  CHECK_REJECTS(InvalidArgument,
                ops::lora_merge_flax(kernel, at(4096 * 4, {256, 256, 256, 256, 1}, {0, 0, 0, 0, 0}),
                                     at(8192 * 4, {1, 256, 256, 256, 256}, {0, 0, 0, 0, 0}), 1.0),
                "has more elements than a 64-bit count holds");
}

// MaxText's kernels flatten their in and out dims, as far as a flattened dim stays within the
// kernels' 32-bit sizes: past it the dims stay apart (a batch the op loops over).
TEST_CASE("merge_dims keeps apart dims whose merged size would pass a limit", "[ops][validation]") {
  const int64_t a = 65536, b = 32769;
  const ops::detail::MergedDims all = ops::detail::merge_dims({a, b, 1}, {{b, 1, 1}});
  CHECK(all.sizes == std::vector<int64_t>{a * b});
  CHECK(all.strides[0] == std::vector<int64_t>{1});
  const ops::detail::MergedDims capped = ops::detail::merge_dims({a, b, 1}, {{b, 1, 1}}, INT32_MAX);
  CHECK(capped.sizes == std::vector<int64_t>{a, b});
  CHECK(capped.strides[0] == std::vector<int64_t>{b, 1});
  // Within the limit they still merge; the limit itself is reachable.
  CHECK(ops::detail::merge_dims({4, 8, 2}, {{16, 2, 1}}, 64).sizes == std::vector<int64_t>{64});
  CHECK(ops::detail::merge_dims({4, 8, 2}, {{16, 2, 1}}, 63).sizes == std::vector<int64_t>{32, 2});
}

TEST_CASE("misaligned and strided views take the general path and give the same answer on the CPU",
          "[cpu][ops][validation]") {
  KERF_REQUIRE_CPU_BACKEND();
  // The same merge through a 16-byte aligned contiguous W and through one starting one element in
  // with padded rows: the specializations differ, the numbers must not.
  const Device cpu = Device::cpu();
  test::TestTensor W1(DType::bf16, {32, 64}, cpu), W2(DType::bf16, {1 + 32 * 72}, cpu);
  test::TestTensor A(DType::f32, {4, 64}, cpu), B(DType::f32, {32, 4}, cpu);
  std::mt19937_64 rng(9100);
  W1.randomize(rng);
  A.randomize(rng);
  B.randomize(rng);
  for (int64_t i = 0; i < 32; ++i)
    for (int64_t j = 0; j < 64; ++j) W2.set(1 + i * 72 + j, W1.get(i * 64 + j));
  ops::lora_merge(W1.view(), A.view(), B.view(), 0.5);
  ops::lora_merge(W2.view_at(1, {32, 64}, {72, 1}), A.view(), B.view(), 0.5);
  for (int64_t i = 0; i < 32; ++i)
    for (int64_t j = 0; j < 64; ++j) CHECK(W2.get(1 + i * 72 + j) == W1.get(i * 64 + j));
}

// Python's bindings bump a torch output's version counter after a call that failed only when
// it launched something (nothing is written but by a launch): a refused call launches nothing.
TEST_CASE(
    "a call its checks refuse launches nothing; one that runs counts its launches on its thread",
    "[cpu][ops][validation]") {
  KERF_REQUIRE_CPU_BACKEND();
  const Device cpu = Device::cpu();
  test::TestTensor W(DType::bf16, {32, 64}, cpu), A(DType::f32, {4, 64}, cpu),
      B(DType::f32, {32, 4}, cpu), bad(DType::f32, {4, 63}, cpu);
  std::mt19937_64 rng(9150);
  W.randomize(rng);
  A.randomize(rng);
  B.randomize(rng);
  const uint64_t before = launches_on_this_thread();
  CHECK_THROWS_AS(ops::lora_merge(W.view(), bad.view(), B.view(), 0.5), InvalidArgument);
  CHECK(launches_on_this_thread() == before);
  ops::lora_merge(W.view(), A.view(), B.view(), 0.5);
  const uint64_t after = launches_on_this_thread();
  CHECK(after > before);
  // Another thread's launches are its own.
  std::thread([&] { ops::lora_merge(W.view(), A.view(), B.view(), 0.5); }).join();
  CHECK(launches_on_this_thread() == after);
}

TEST_CASE("an op refuses Config.meta names it does not take and values out of range", "[ops][validation]") {
  const TensorView W = t({8, 12}), A = t({2, 12}, DType::f32, 4096), B = t({8, 2}, DType::f32, 8192);
  const TensorView m = t({8}, DType::f32, 12100), norm = t({8}, DType::f32, 12200), scale = t({8}, DType::f32, 12300);
  ops::Config rotate;
  rotate.meta["ROTATE"] = 1;
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, norm, scale, 0.0, nullptr, rotate),
                "dora_norm: Config.meta names 'ROTATE', which this op does not take (it takes EVICT, CAST_A, "
                "INTERLEAVE, WARPS_N, L2_PREFETCH, WGMMA, COLS_FIRST, TF32)");
  ops::Config interleave2;
  interleave2.meta["INTERLEAVE"] = 2;
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, norm, scale, 0.0, nullptr, interleave2),
                "dora_norm: Config.meta INTERLEAVE must be in [0, 1], got 2");
  ops::Config cols2;
  cols2.meta["COLS_FIRST"] = 2;
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, A, B, 1.0, nullptr, cols2), "COLS_FIRST");
  CHECK_REJECTS(InvalidArgument,
                ops::dora_norm_partial(W, A, B, 1.0, t({8}, DType::f32, 12400), nullptr, rotate),
                "dora_norm_partial: Config.meta names 'ROTATE', which this op does not take (it takes EVICT, "
                "CAST_A, INTERLEAVE, WARPS_N, L2_PREFETCH, WGMMA, COLS_FIRST, TF32)");
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, A, B, 1.0, nullptr, rotate),
                "lora_merge: Config.meta names 'ROTATE'");
  const TensorView dW = t({2, 8, 12}), mA = t({2, 2, 12}, DType::f32, 4096), mB = t({2, 8, 2}, DType::f32, 8192);
  const TensorView dA = t({2, 2, 12}, DType::f32, 16384), dB = t({2, 8, 2}, DType::f32, 20480);
  ops::Config typo;
  typo.meta["ROTATED"] = 1;
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize_backward(dW, mA, mB, 1.0, dA, dB, nullptr, typo),
                "moe_lora_materialize_backward: Config.meta names 'ROTATED', which this op does not take (it "
                "takes ROTATE, BY_COLUMNS, DB_WORKSPACE, PACK, L2_PREFETCH, WGMMA, WGMMA_SS, CLUSTER, STAGED_ADDS, TF32)");
  ops::Config persistent9;
  persistent9.meta["PERSISTENT"] = 9;
  const TensorView mW_eff = t({2, 8, 12}, DType::f32, 50000);
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize(dW, mA, mB, 1.0, mW_eff, nullptr, persistent9),
                "moe_lora_materialize: Config.meta PERSISTENT must be in [0, 8], got 9");
  ops::Config persistent_stream;
  persistent_stream.meta = {{"PERSISTENT", 1}, {"STREAM", 1}};
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize(dW, mA, mB, 1.0, mW_eff, nullptr, persistent_stream),
                "moe_lora_materialize: Config.meta PERSISTENT (programs that deal out the tiles) and STREAM (one "
                "tile a program) do not go together");
  ops::Config uneven;
  uneven.meta = {{"EXPERT_GROUP", 6}, {"CLUSTER", 4}};
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize(dW, mA, mB, 1.0, mW_eff, nullptr, uneven),
                "moe_lora_materialize: Config.meta CLUSTER 4 must divide EXPERT_GROUP (the experts of a group that "
                "share grid axis 0), got EXPERT_GROUP 6");
  ops::Config groupless;
  groupless.meta = {{"CLUSTER", 2}};
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize(dW, mA, mB, 1.0, mW_eff, nullptr, groupless),
                "moe_lora_materialize: Config.meta CLUSTER 2 must divide EXPERT_GROUP (the experts of a group that "
                "share grid axis 0), got no EXPERT_GROUP");
  ops::Config lone;
  lone.meta = {{"EXPERT_GROUP", 8}, {"EXPERTS_LAST", 1}};
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize(dW, mA, mB, 1.0, mW_eff, nullptr, lone),
                "moe_lora_materialize: Config.meta EXPERTS_LAST (B read by clusters of experts) needs CLUSTER of 2 "
                "or more and EXPERT_GROUP");
  ops::Config nine;
  nine.meta["CLUSTER"] = 9;
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize_backward(dW, mA, mB, 1.0, dA, dB, nullptr, nine),
                "moe_lora_materialize_backward: Config.meta CLUSTER must be in [1, 8], got 9");
  ops::Config early2;
  early2.meta["EARLY_PROLOGUE"] = 2;
  CHECK_REJECTS(InvalidArgument,
                ops::lora_embedding_backward(t({5}, DType::i64, 30000), t({2, 12}, DType::f32, 4096), t({8, 2}, DType::f32, 8192),
                                             t({5, 8}, DType::f32, 31000), 1.0, t({2, 12}, DType::f32, 32000),
                                             t({8, 2}, DType::f32, 33000), {}, nullptr, early2),
                "lora_embedding_backward: Config.meta EARLY_PROLOGUE must be in [0, 1], got 2");
  ops::Config staged;
  staged.meta["STAGED_ADDS"] = 2;
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize_backward(dW, mA, mB, 1.0, dA, dB, nullptr, staged),
                "moe_lora_materialize_backward: Config.meta STAGED_ADDS must be in [0, 1], got 2");
  ops::Config two;
  two.meta["ROTATE"] = 2;
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize_backward(dW, mA, mB, 1.0, dA, dB, nullptr, two),
                "moe_lora_materialize_backward: Config.meta ROTATE must be in [0, 1], got 2");
  ops::Config three;
  three.meta["WARPS_N"] = 3;
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, A, B, 1.0, nullptr, three),
                "lora_merge: Config.meta WARPS_N must be 0 (kerf chooses) or a power of two, got 3");
  ops::Config many;
  many.meta["WARPS_N"] = 64;
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, norm, scale, 0.0, nullptr, many),
                "dora_norm: Config.meta WARPS_N must be in [0, 32], got 64");
  ops::Config prefetch;
  prefetch.meta["L2_PREFETCH"] = 100;
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize_backward(dW, mA, mB, 1.0, dA, dB, nullptr, prefetch),
                "moe_lora_materialize_backward: Config.meta L2_PREFETCH must be 0, 64, 128 or 256 (bytes), got 100");
  // Negative fields and splits beyond a grid's y extent are refused before anything runs
  // (a negative split used to become a grid of 2^32 - 1 programs).
  ops::Config negative;
  negative.split_k = -1;
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize_backward(dW, mA, mB, 1.0, dA, dB, nullptr, negative),
                "moe_lora_materialize_backward: Config.split_k must be >= 0 (0 lets kerf choose), got -1");
  ops::Config huge;
  huge.split_k = 70000;
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, A, B, 1.0, nullptr, huge),
                "lora_merge: Config.split_k must be at most 65535 (programs on grid axis 1), got 70000");
  ops::Config warps;
  warps.num_warps = -8;
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, norm, scale, 0.0, nullptr, warps),
                "dora_norm: Config.num_warps must be >= 0");
  // Tiles and warps are powers of two (a 3-row tile used to fail inside the DSL's arange).
  ops::Config odd;
  odd.block_m = 3;
  CHECK_REJECTS(InvalidArgument, ops::dora_norm(W, A, B, m, 1.0, norm, scale, 0.0, nullptr, odd),
                "dora_norm: Config.block_m must be a power of two up to 1024 (0 lets kerf choose), got 3");
  ops::Config wide;
  wide.block_k = 1 << 20;
  CHECK_REJECTS(InvalidArgument, ops::lora_merge(W, A, B, 1.0, nullptr, wide),
                "lora_merge: Config.block_k must be a power of two up to 1024 (0 lets kerf choose), got 1048576");
  ops::Config six;
  six.num_warps = 6;
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize_backward(dW, mA, mB, 1.0, dA, dB, nullptr, six),
                "moe_lora_materialize_backward: Config.num_warps must be a power of two up to 32");
  // Deeper rings than any kernel takes: refused before a first launch (the backward's
  // fill zeroed dA before the kernel refused num_stages=9 as a DSL definition error).
  ops::Config deep;
  deep.num_stages = 9;
  CHECK_REJECTS(InvalidArgument, ops::moe_lora_materialize_backward(dW, mA, mB, 1.0, dA, dB, nullptr, deep),
                "moe_lora_materialize_backward: Config.num_stages must be at most 8 (0 lets kerf choose), got 9");
}
