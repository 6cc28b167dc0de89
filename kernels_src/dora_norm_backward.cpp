// Backward of the DoRA magnitude scale (contract in include/kerf/kernels/kernels.h).
//
//   scale[i] = m[i] / norm[i], the norm a constant (DoRA, §4.3 of the paper)
//   grad_m[i] = grad_scale[i] / norm[i]
#include "kerf/kernels/kernels.h"

namespace kerf::kernels {

using namespace kerf::dsl;

const dsl::Kernel& dora_norm_backward() {
  static const Kernel k("dora_norm_backward", [](Builder& k) {
    const Tensor norm = k.tensor("norm", 1), grad_scale = k.tensor("grad_scale", 1);
    const Tensor grad_m = k.tensor("grad_m", 1);
    const int64_t BLOCK = k.meta("BLOCK");
    const Value i = program_id(0) * BLOCK + arange(BLOCK);
    const Value ok = i < norm.dim(0);
    const Value g =
        load(grad_scale, {i}, ok).to(DType::f32) / load(norm, {i}, ok, 1.0).to(DType::f32);
    store(grad_m, {i}, g.to(grad_m.dtype()), ok);
  });
  return k;
}

}  // namespace kerf::kernels
