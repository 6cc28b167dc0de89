// out[i] = value: zeroes accumulators before split reductions, on any back end.
#include "kerf/kernels/kernels.h"

namespace kerf::kernels {

using namespace kerf::dsl;

const dsl::Kernel& fill() {
  static const Kernel k("fill", [](Builder& k) {
    const Tensor out = k.tensor("out", 1);
    const Value value = k.scalar("value", DType::f64);
    const int64_t BLOCK = k.meta("BLOCK");
    const Value i = program_id(0) * BLOCK + arange(BLOCK);
    store(out, {i}, broadcast_to(value.to(out.dtype()), {BLOCK}), i < out.dim(0));
  });
  return k;
}

}  // namespace kerf::kernels
