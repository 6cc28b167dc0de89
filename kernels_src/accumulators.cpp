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

// The fills' stores: evict-last with EVICT_LAST (kernels.h), else no hint.
Evict fill_evict(Builder& k) { return k.meta("EVICT_LAST", 0) ? Evict::last : Evict::normal; }

}  // namespace

const dsl::Kernel& fill_3d() {
  static const Kernel k("fill_3d", [](Builder& k) {
    const Tensor out = k.tensor("out", 3);
    const Value value = k.scalar("value", DType::f64);
    if (k.meta("RELEASE", 0)) release_dependents();
    const Tile3 t = tile_of(k, out);
    const Value v = broadcast_to(value.to(out.dtype()), {k.meta("BLOCK_M"), k.meta("BLOCK_K")});
    store(out, {t.i, t.rows, t.cols}, v, t.ok, fill_evict(k));
  });
  return k;
}

const dsl::Kernel& fill_pair() {
  static const Kernel k("fill_pair", [](Builder& k) {
    const Tensor t0 = k.tensor("out0", 3), t1 = k.tensor("out1", 3);
    const Value value = k.scalar("value", DType::f64);
    if (k.meta("RELEASE", 0)) release_dependents();
    const Value p = program_id(0);
    // Program p fills tile p of out0 or, past out0's tiles, tile p - n0 of out1; each
    // tensor's tiles are numbered column block fastest, then row block, then dim 0.
    const auto fill = [&](const Tensor& t, const Value& q, const Value& mine, int64_t BM, int64_t BK) {
      const Value col_blocks = cdiv(t.dim(2), literal(BK)), row_blocks = cdiv(t.dim(1), literal(BM));
      const Value cb = q % col_blocks, rest = q / col_blocks;
      const Value rows = ((rest % row_blocks) * BM + arange(BM)).col();
      const Value cols = (cb * BK + arange(BK)).row();
      const Value ok = mine & (rows < t.dim(1)) & (cols < t.dim(2));
      store(t, {rest / row_blocks, rows, cols}, broadcast_to(value.to(t.dtype()), {BM, BK}), ok, fill_evict(k));
    };
    const int64_t BM0 = k.meta("BLOCK_M0"), BK0 = k.meta("BLOCK_K0");
    const Value n0 = t0.dim(0) * cdiv(t0.dim(1), literal(BM0)) * cdiv(t0.dim(2), literal(BK0));
    fill(t0, minimum(p, n0 - 1), p < n0, BM0, BK0);
    fill(t1, maximum(p - n0, literal(int64_t(0))), p >= n0, k.meta("BLOCK_M1"), k.meta("BLOCK_K1"));
  });
  return k;
}

const dsl::Kernel& flush_accumulator() {
  static const Kernel k("flush_accumulator", [](Builder& k) {
    const Tensor acc = k.tensor("acc", 3, DType::f32), out = k.tensor("out", 3);
    // WAIT_PRIOR: launched to overlap the end of the kernel that adds into acc.
    if (k.meta("WAIT_PRIOR", 0)) wait_prior_grid();
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
    // RELEASE (as fill_3d's): the kernel launched after the cast may start, and read
    // what does not come from it, while the cast runs.
    if (k.meta("RELEASE", 0)) release_dependents();
    const Tile3 t = tile_of(k, out);
    store(out, {t.i, t.rows, t.cols}, load(x, {t.i, t.rows, t.cols}, t.ok).to(out.dtype()), t.ok);
  });
  return k;
}

const dsl::Kernel& transpose_3d() {
  static const Kernel k("transpose_3d", [](Builder& k) {
    const Tensor x = k.tensor("x", 3), out = k.tensor("out", 3);
    // WAIT_PRIOR (a flush): launched to overlap the end of the kernel that adds into x.
    if (k.meta("WAIT_PRIOR", 0)) wait_prior_grid();
    if (k.meta("RELEASE", 0)) release_dependents();  // as cast_3d's
    const int64_t BI = k.meta("BLOCK_M"), BJ = k.meta("BLOCK_K");
    // Program (column block fastest, then dim 0) on grid x, row block on grid y: dim 0 may
    // be longer than grid z allows.
    const Value col_blocks = cdiv(x.dim(2), literal(BJ));
    const Value g = program_id(0) / col_blocks;
    const Value i = program_id(1) * BI + arange(BI), j = (program_id(0) % col_blocks) * BJ + arange(BJ);
    const Value v = load(x, {g, i.col(), j.row()}, (i.col() < x.dim(1)) & (j.row() < x.dim(2)));  // [BI, BJ]
    store(out, {g, j.col(), i.row()}, trans(v).to(out.dtype()), (j.col() < x.dim(2)) & (i.row() < x.dim(1)));
    if (k.meta("FLUSH", 0))
      store(x, {g, i.col(), j.row()}, zeros({BI, BJ}), (i.col() < x.dim(1)) & (j.row() < x.dim(2)));
  });
  return k;
}

}  // namespace kerf::kernels
