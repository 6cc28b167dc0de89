// LoRA merge / unmerge in place (contract in include/kerf/kernels/kernels.h).
//
//   W[g] <- W[g] + s * B[g] @ A[g]        (the op passes -s to unmerge)
//   W [G, out, in]; A [G, r, in]; B [G, out, r]; any strides.
//
// One program owns BLOCK_M rows of one W[g] and a slice of its
// columns (the programs of grid axis 1 share them). It keeps B's rows [BLOCK_M, R_PAD] in registers
// and per BLOCK_K columns reads W, lets a dot add B@A to it in fp32, rounds once and writes W back
// where it read it. Load and store use the same indices, so each iteration touches its own tile and
// the W loads may run ahead (cp.async).
//
// With WALK_ROWS the roles swap: a program owns BLOCK_K columns (grid axis 0) and a slice of the
// rows (axis 1, in whole BLOCK_M steps). It keeps A's columns [R_PAD, BLOCK_K] for the whole loop
// and per BLOCK_M rows reads B's rows beside W's tile: B's [BLOCK_M, R_PAD] a step, not A's
// [R_PAD, BLOCK_K], and the programs running together cover whole rows of W at a time.
#include "kerf/kernels/kernels.h"
#include "split_range.h"

namespace kerf::kernels {

using namespace kerf::dsl;

const dsl::Kernel& lora_merge() {
  static const Kernel k("lora_merge", [](Builder& k) {
    const Tensor W = k.tensor("W", 3), A = k.tensor("A", 3), B = k.tensor("B", 3);
    const Value s = k.scalar("s");
    const int64_t BM = k.meta("BLOCK_M"), BK = k.meta("BLOCK_K"), R = k.meta("R_PAD");
    const bool scale_after = k.meta("SCALE_AFTER", 0) != 0;
    const DotMeta dm = dot_meta(k, DType::f32);
    const DType dot_t = dm.dtype;
    const int64_t evict = k.meta("EVICT", 0);
    const int64_t warps_n = k.meta("WARPS_N", 0);  // warps sharing a step's columns (0: kerf's choice)
    const Value g = program_id(2);
    const Value n_out = W.dim(1), n_in = W.dim(2), rank = A.dim(1);

    const Value rk = arange(R);
    // A's columns `cols` [R_PAD, BLOCK_K], in the product's dtype.
    const auto a_columns = [&](const Value& cols, const Value& col_ok) {
      return load(A, {g, rk.col(), cols.row()}, (rk.col() < rank) & col_ok, reused_hint(evict)).to(dot_t);
    };
    // W's tile at `rows` x `cols` plus the product of the dot's left operand b (B's rows)
    // and a (A's columns), rounded once and written back where it was read.
    const auto update = [&](const Value& rows, const Value& row_ok, const Value& cols, const Value& col_ok,
                            const Value& b, const Value& a) {
      const Value ok = row_ok & col_ok;
      const Value w = load(W, {g, rows.col(), cols.row()}, ok, streamed_hint(evict)).to(DType::f32);
      const Value v = base_plus_lora(w, b, a, s, scale_after, warps_n, dm.precision);
      store(W, {g, rows.col(), cols.row()}, v.to(W.dtype()), ok, streamed_hint(evict));
    };
    if (k.meta("WALK_ROWS", 0)) {
      const Value cols = program_id(0) * BK + arange(BK);
      const Value col_ok = cols.row() < n_in;
      const Value a = a_columns(cols, col_ok);
      const auto [lo, hi] = split_range(n_out, BM, 1);
      for_range(lo, hi, BM, [&](const Value& m0) {
        const Value rows = m0 + arange(BM);
        const Value row_ok = rows.col() < n_out;
        // B's rows straight into the product's dtype where they are exact in it (no fp32 hop).
        const Value b_raw = load(B, {g, rows.col(), rk.row()}, row_ok & (rk.row() < rank), reused_hint(evict));
        update(rows, row_ok, cols, col_ok,
               lora_left_operand(scale_after ? b_raw : b_raw.to(DType::f32), s, scale_after, dot_t), a);
      });
      return;
    }
    const RowSliceAxes axes = row_slice_axes(k);
    const Value rows = program_id(axes.rows) * BM + arange(BM);
    const Value row_ok = rows.col() < n_out;
    if (k.meta("ONE_TILE", 0)) {
      // One tile a program (the op's STREAM plan, as many slices as column blocks): W's tile is
      // asked for first and converted only where the sum needs it, so its bytes are in flight
      // while the adapters' (A's columns, B's rows, read from L2 by every program of their
      // column or row block) arrive and the product runs.
      const Value cols = program_id(axes.slices) * BK + arange(BK);
      const Value col_ok = cols.row() < n_in;
      const Value ok = row_ok & col_ok;
      const Value w = load(W, {g, rows.col(), cols.row()}, ok, streamed_hint(evict));
      const auto b_rows = [&] {
        return load(B, {g, rows.col(), rk.row()}, row_ok & (rk.row() < rank)).to(DType::f32);
      };
      // WAIT_PRIOR: A is a copy (CAST_A) that the kernel launched before this one writes while
      // this one's programs start; W's and B's tiles are asked for before the wait.
      const bool wait = k.meta("WAIT_PRIOR", 0) != 0;
      Value b_raw;
      if (wait) {
        b_raw = b_rows();
        wait_prior_grid();
      }
      const Value a = a_columns(cols, col_ok);
      if (!wait) b_raw = b_rows();
      const Value b = lora_left_operand(b_raw, s, scale_after, dot_t);
      const Value v = lora_sum_after_product(w, b, a, s, scale_after, warps_n, dm.precision);
      store(W, {g, rows.col(), cols.row()}, v.to(W.dtype()), ok, streamed_hint(evict));
      return;
    }
    const Value b_raw =
        load(B, {g, rows.col(), rk.row()}, row_ok & (rk.row() < rank)).to(DType::f32);
    // SCALE_AFTER: B is exact in the product's dtype, so s is applied in fp32 after
    // the dot; otherwise s*B is rounded once to that dtype and the dot adds onto W.
    const Value b = lora_left_operand(b_raw, s, scale_after, dot_t);

    const auto [lo, hi] = split_range(n_in, BK, axes.slices);
    for_range(lo, hi, BK, [&](const Value& k0) {
      const Value cols = k0 + arange(BK);
      const Value col_ok = cols.row() < n_in;
      update(rows, row_ok, cols, col_ok, b, a_columns(cols, col_ok));
    });
  });
  return k;
}

}  // namespace kerf::kernels
