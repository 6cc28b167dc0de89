// ops::moe_lora_materialize: argument checks, configuration, launch.
#include <algorithm>

#include "kerf/jit/launch.h"
#include "kerf/kernels/kernels.h"
#include "kerf/ops/ops.h"
#include "ops_common.h"

namespace kerf::ops {

using namespace detail;

void moe_lora_materialize(const TensorView& W, const TensorView& A, const TensorView& B, double s,
                          const TensorView& W_eff, void* stream, const Config& config) {
  const char* op = "moe_lora_materialize";
  expect_shape(op, "W", W, {-1, -1, -1});
  const int64_t E = W.shape[0], N = W.shape[1], K = W.shape[2];
  expect_shape(op, "A", A, {E, -1, K});
  const int64_t r = A.shape[1];
  expect_shape(op, "B", B, {E, N, r});
  expect_shape(op, "W_eff", W_eff, {E, N, K});
  const std::vector<DType> floats = {DType::bf16, DType::f16, DType::f32};
  expect_dtype(op, "W", W, floats);
  expect_dtype(op, "A", A, floats);
  expect_dtype(op, "B", B, floats);
  expect_dtype(op, "W_eff", W_eff, {W.dtype});
  expect_device(op, {{"W", &W}, {"A", &A}, {"B", &B}, {"W_eff", &W_eff}});
  if (r > 256) throw InvalidArgument(std::string(op) + ": rank " + std::to_string(r) + " is above the supported 256");
  if (E > 65535) throw InvalidArgument(std::string(op) + ": at most 65535 experts per call, got " + std::to_string(E));
  if (E == 0 || N == 0 || K == 0) return;

  const bool gpu = W.device.is_cuda();
  const DType dot = is_half(W.dtype) ? W.dtype : DType::f32;
  const int64_t r_pad = std::max<int64_t>(16, next_pow2(std::max<int64_t>(r, 1)));
  const int64_t bn = config.block_m ? config.block_m : (gpu ? 64 : 16);
  const int64_t bk = config.block_k ? config.block_k : (gpu ? 128 : 64);
  dsl::MetaMap meta = {{"BLOCK_N", bn}, {"BLOCK_K", bk}, {"R_PAD", r_pad}, {"DOT", int64_t(dot)},
                       {"num_warps", config.num_warps ? config.num_warps : 4}};
  // cp.async pipelining on the GPU; the CPU back end has no use for stages.
  meta["num_stages"] = config.num_stages ? config.num_stages : (gpu ? 3 : 1);
  launch(kernels::moe_lora_materialize(), {W, A, B, Scalar(s), W_eff},
         Grid{uint32_t(cdiv(N, bn)), uint32_t(E), 1}, meta, stream);
}

}  // namespace kerf::ops
