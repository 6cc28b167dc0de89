// out[i] = value: zeroes accumulators before split reductions, on any back end;
// and a 2-D cast (fp32 adapters rounded once to the dtype of a product).
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

const dsl::Kernel& cast_2d() {
  static const Kernel k("cast_2d", [](Builder& k) {
    const Tensor x = k.tensor("x", 2), out = k.tensor("out", 2);
    const Value rows = program_id(1) * k.meta("BLOCK_M") + arange(k.meta("BLOCK_M"));
    const Value cols = program_id(0) * k.meta("BLOCK_K") + arange(k.meta("BLOCK_K"));
    const Value ok = (rows.col() < x.dim(0)) & (cols.row() < x.dim(1));
    store(out, {rows.col(), cols.row()}, load(x, {rows.col(), cols.row()}, ok).to(out.dtype()), ok);
  });
  return k;
}

}  // namespace kerf::kernels
