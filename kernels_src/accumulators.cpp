// Helpers of the ops that accumulate with atomics (contract in kernels.h):
// zeroing a strided output before the atomics, and turning an fp32
// accumulator into an output of another dtype while zeroing it again; and a
// rank-3 cast (fp32 adapters rounded once to a product's dtype).
#include "kerf/kernels/kernels.h"

namespace kerf::kernels {

using namespace kerf::dsl;

namespace {

// This program's [BLOCK_M, BLOCK_K] tile of a rank-3 view: indices and mask.
struct Tile3 {
  Value i, rows, cols, ok;
};

Tile3 tile_of(Builder& k, const Tensor& t) {
  const int64_t BM = k.meta("BLOCK_M"), BK = k.meta("BLOCK_K");
  Tile3 x;
  x.i = program_id(2);
  x.rows = (program_id(1) * BM + arange(BM)).col();
  x.cols = (program_id(0) * BK + arange(BK)).row();
  x.ok = (x.rows < t.dim(1)) & (x.cols < t.dim(2));
  return x;
}

}  // namespace

const dsl::Kernel& fill_3d() {
  static const Kernel k("fill_3d", [](Builder& k) {
    const Tensor out = k.tensor("out", 3);
    const Value value = k.scalar("value", DType::f64);
    const Tile3 t = tile_of(k, out);
    const Value v = broadcast_to(value.to(out.dtype()), {k.meta("BLOCK_M"), k.meta("BLOCK_K")});
    store(out, {t.i, t.rows, t.cols}, v, t.ok);
  });
  return k;
}

const dsl::Kernel& flush_accumulator() {
  static const Kernel k("flush_accumulator", [](Builder& k) {
    const Tensor acc = k.tensor("acc", 3, DType::f32), out = k.tensor("out", 3);
    const Tile3 t = tile_of(k, out);
    const Value v = load(acc, {t.i, t.rows, t.cols}, t.ok);
    store(out, {t.i, t.rows, t.cols}, v.to(out.dtype()), t.ok);
    store(acc, {t.i, t.rows, t.cols}, zeros({k.meta("BLOCK_M"), k.meta("BLOCK_K")}), t.ok);
  });
  return k;
}

const dsl::Kernel& cast_3d() {
  static const Kernel k("cast_3d", [](Builder& k) {
    const Tensor x = k.tensor("x", 3), out = k.tensor("out", 3);
    const Tile3 t = tile_of(k, out);
    store(out, {t.i, t.rows, t.cols}, load(x, {t.i, t.rows, t.cols}, t.ok).to(out.dtype()), t.ok);
  });
  return k;
}

}  // namespace kerf::kernels
