// ops::dora_norm: argument checks, variant and configuration, launches.
#include <algorithm>

#include "kerf/jit/launch.h"
#include "kerf/kernels/kernels.h"
#include "kerf/ops/ops.h"
#include "ops_common.h"

namespace kerf::ops {

using namespace detail;

void dora_norm(const TensorView& W, const TensorView& A, const TensorView& B, const TensorView& m,
               double s, const TensorView& norm, const TensorView& scale, double eps, void* stream,
               const Config& config) {
  const char* op = "dora_norm";
  expect_shape(op, "W", W, {-1, -1});
  const int64_t out = W.shape[0], in = W.shape[1];
  expect_shape(op, "A", A, {-1, in});
  const int64_t r = A.shape[0];
  expect_shape(op, "B", B, {out, r});
  expect_shape(op, "m", m, {out});
  expect_shape(op, "norm", norm, {out});
  expect_shape(op, "scale", scale, {out});
  const std::vector<DType> floats = {DType::bf16, DType::f16, DType::f32};
  expect_dtype(op, "W", W, floats);
  expect_dtype(op, "A", A, floats);
  expect_dtype(op, "B", B, floats);
  expect_dtype(op, "m", m, floats);
  expect_dtype(op, "norm", norm, {DType::f32});
  expect_dtype(op, "scale", scale, {DType::f32});
  expect_device(op, {{"W", &W}, {"A", &A}, {"B", &B}, {"m", &m}, {"norm", &norm}, {"scale", &scale}});
  if (r > 256) throw InvalidArgument("dora_norm: rank " + std::to_string(r) + " is above the supported 256");
  if (eps < 0) throw InvalidArgument("dora_norm: eps must be >= 0, got " + std::to_string(eps));
  if (out == 0) return;

  const bool gpu = W.device.is_cuda();
  const DType dot = is_half(W.dtype) ? W.dtype : DType::f32;
  const int64_t r_pad = std::max<int64_t>(16, next_pow2(std::max<int64_t>(r, 1)));
  const int64_t bm = config.block_m ? config.block_m : (gpu ? 64 : 16);
  const int64_t bk = config.block_k ? config.block_k : (gpu ? 128 : 64);
  const int64_t warps = config.num_warps ? config.num_warps : 4;
  const int64_t blocks_m = cdiv(out, bm);
  int64_t split = config.split_k;
  if (split == 0) {
    // Enough programs for several per multiprocessor, in whole BLOCK_K steps.
    const int64_t target = 3 * int64_t(parallelism(W.device));
    split = std::clamp<int64_t>(cdiv(target, blocks_m), 1, std::max<int64_t>(1, cdiv(in, bk)));
  }
  dsl::MetaMap meta = {{"BLOCK_M", bm}, {"BLOCK_K", bk}, {"R_PAD", r_pad},
                       {"DOT", int64_t(dot)}, {"num_warps", warps}};
  // cp.async pipelining on the GPU; the CPU back end has no use for stages.
  meta["num_stages"] = config.num_stages ? config.num_stages : (gpu ? 3 : 1);
  const Grid grid_m{uint32_t(blocks_m), 1, 1};
  if (split == 1) {
    launch(kernels::dora_norm_fused(), {W, A, B, m, Scalar(s), Scalar(eps), norm, scale}, grid_m, meta,
           stream);
    return;
  }
  // One launch: the splits add partial sums into a zeroed workspace and the
  // last split of each row block finishes it (and zeroes it again).
  meta["SPLIT_K"] = split;
  const int64_t ws_floats = (out + 3) / 4 * 4;
  float* ws = static_cast<float*>(workspace(W.device, stream, size_t(ws_floats + blocks_m) * 4));
  const TensorView sumsq = TensorView::contiguous(ws, DType::f32, {out}, W.device);
  const TensorView tickets = TensorView::contiguous(ws + ws_floats, DType::i32, {blocks_m}, W.device);
  launch(kernels::dora_norm_split(), {W, A, B, m, Scalar(s), Scalar(eps), norm, scale, sumsq, tickets},
         Grid{uint32_t(blocks_m), uint32_t(split), 1}, meta, stream);
}

}  // namespace kerf::ops
