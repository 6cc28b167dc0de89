// Backward of MoE LoRA weight materialization, one pass over dW_eff
// (contract in include/kerf/kernels/kernels.h):
//
//   dA[e] = s * B[e]^T @ dW[e]      [r, K]
//   dB[e] = s * dW[e] @ A[e]^T      [N, r]
//   dW [E, N, K]; A [E, r, K]; B [E, N, r]; any strides.
//
// One program owns BLOCK_N rows of one expert's dW and a slice of its K
// columns (the programs of grid axis 1 share them). Per BLOCK_K columns it reads the dW tile once
// and feeds it to two dots: (B rows)^T @ tile is this row block's share of dA's columns, added with
// fp32 atomics; tile @ (A columns)^T accumulates dB's rows in registers across the loop, stored
// once at the end (added atomically with DB_ATOMIC, when several column slices each hold a part).
// With ROTATE each row block starts its column steps at a different step (its index), so that
// the row blocks of an expert, which add into the same dA columns, are not all at the same
// columns at once. With WAIT_PRIOR (both kernels) every write comes after a wait for the grid
// launched before, the zero-fill of the gradients, which the kernel may then overlap: each
// step's loads read only inputs and go ahead of it. With RELEASE_END (both kernels) a
// program lets the launch after it start once it has written everything (the flushes of
// the fp32 accumulators, which still wait for the whole grid). With cluster_size C > 1 (both kernels) the
// C programs of a cluster, neighbours on grid axis 0 (the same expert and column or row slice),
// sum the per-step gradient share on chip (cluster_atomic_add) and add it to memory once, not C
// times; they then take their steps in the same order (ROTATE by cluster), and the grid's axis 0
// is a multiple of C, its programs past the end masked off.
#include "kerf/kernels/kernels.h"
#include "split_range.h"

namespace kerf::kernels {

using namespace kerf::dsl;

const dsl::Kernel& moe_lora_backward() {
  static const Kernel k("moe_lora_backward", [](Builder& k) {
    const Tensor dW = k.tensor("dW", 3), A = k.tensor("A", 3), B = k.tensor("B", 3);
    const Value s = k.scalar("s");
    const Tensor dA = k.tensor("dA", 3, DType::f32);
    const Tensor dB = k.tensor("dB", 3);
    const int64_t BN = k.meta("BLOCK_N"), BK = k.meta("BLOCK_K"), R = k.meta("R_PAD");
    const bool db_atomic = k.meta("DB_ATOMIC", 0) != 0;
    const bool rotate = k.meta("ROTATE", 0) != 0;
    const bool wait_fill = k.meta("WAIT_PRIOR", 0) != 0;
    const int64_t cluster = k.meta("cluster_size", 1);
    const DotMeta dm = dot_meta(k, DType::f32);
    const DType dot_t = dm.dtype;
    const Value e = program_id(2);
    const Value n_rows = dW.dim(1), n_cols = dW.dim(2), rank = A.dim(1);

    const Value rows = program_id(0) * BN + arange(BN);
    const Value rk = arange(R);
    const Value row_ok = rows.col() < n_rows;
    const Value rank_ok = rk.col() < rank;  // [R, 1]
    const Value b =
        load(B, {e, rows.col(), rk.row()}, row_ok & (rk.row() < rank)).to(dot_t);  // [BN, R]
    const Value bt = trans(b);                                                     // [R, BN]

    const auto [lo, hi] = split_range(n_cols, BK);
    const Value acc = for_range(lo, hi, BK, zeros({BN, R}), [&](const Value& iv, const Value& acc) {
      const Value k0 = rotate ? rotated_step(iv, lo, hi, BK, program_id(0) / cluster) : iv;
      const Value cols = k0 + arange(BK);
      const Value col_ok = cols.row() < n_cols;
      const Value g = load(dW, {e, rows.col(), cols.row()}, row_ok & col_ok).to(dot_t);  // [BN, BK]
      const Value a = load(A, {e, rk.col(), cols.row()}, rank_ok & col_ok).to(dot_t);    // [R, BK]
      if (wait_fill) wait_prior_grid();
      cluster_atomic_add(dA, {e, rk.col(), cols.row()}, dot(bt, g, Value(), 0, dm.precision) * s, rank_ok & col_ok);
      return dot(g, trans(a), acc, 0, dm.precision);  // [BN, R]
    });
    const Value db_ok = row_ok & (rk.row() < rank);
    if (db_atomic)
      atomic_add(dB, {e, rows.col(), rk.row()}, acc * s, db_ok);
    else
      store(dB, {e, rows.col(), rk.row()}, (acc * s).to(dB.dtype()), db_ok);
    if (k.meta("RELEASE_END", 0)) release_dependents();  // a flush waits for the whole grid
  });
  return k;
}

// The same gradients with the roles of rows and columns swapped: one program
// owns BLOCK_K columns of one expert (up to 512, with A's columns [R_PAD,
// BLOCK_K] read once) and walks a slice of its rows (shared by the programs of
// grid axis 1) BLOCK_N at a time. Per step it reads the dW tile once:
// (B rows)^T @ tile accumulates dA's columns in registers over the loop, stored
// once at the end (added atomically with DA_ATOMIC, when several row slices
// each hold a part); tile @ (A columns)^T is this column block's share of the
// step's dB rows, added with fp32 atomics. dB's atomics per dW element are
// R_PAD / BLOCK_K: with wide column blocks, fewer than the row-owning kernel's
// R_PAD / BLOCK_N for dA, whose accumulator [BLOCK_N, R_PAD] holds B's rows too.
const dsl::Kernel& moe_lora_backward_by_columns() {
  static const Kernel k("moe_lora_backward_by_columns", [](Builder& k) {
    const Tensor dW = k.tensor("dW", 3), A = k.tensor("A", 3), B = k.tensor("B", 3);
    const Value s = k.scalar("s");
    const Tensor dA = k.tensor("dA", 3);
    const Tensor dB = k.tensor("dB", 3, DType::f32);
    const int64_t BN = k.meta("BLOCK_N"), BK = k.meta("BLOCK_K"), R = k.meta("R_PAD");
    const bool da_atomic = k.meta("DA_ATOMIC", 0) != 0;
    const bool rotate = k.meta("ROTATE", 0) != 0;
    const bool wait_fill = k.meta("WAIT_PRIOR", 0) != 0;
    const int64_t cluster = k.meta("cluster_size", 1);
    const DotMeta dm = dot_meta(k, DType::f32);
    const DType dot_t = dm.dtype;
    const Value e = program_id(2);
    const Value n_rows = dW.dim(1), n_cols = dW.dim(2), rank = A.dim(1);

    const Value cols = program_id(0) * BK + arange(BK);
    const Value rk = arange(R);
    const Value col_ok = cols.row() < n_cols;  // [1, BK]
    const Value rank_ok = rk.row() < rank;     // [1, R]
    const Value at =
        trans(load(A, {e, rk.col(), cols.row()}, (rk.col() < rank) & col_ok).to(dot_t));  // [BK, R]

    const auto [lo, hi] = split_range(n_rows, BN);
    const Value acc = for_range(lo, hi, BN, zeros({R, BK}), [&](const Value& iv, const Value& acc) {
      const Value n0 = rotate ? rotated_step(iv, lo, hi, BN, program_id(0) / cluster) : iv;
      const Value rows = n0 + arange(BN);
      const Value row_ok = rows.col() < n_rows;                                           // [BN, 1]
      const Value g = load(dW, {e, rows.col(), cols.row()}, row_ok & col_ok).to(dot_t);  // [BN, BK]
      const Value b = load(B, {e, rows.col(), rk.row()}, row_ok & rank_ok).to(dot_t);     // [BN, R]
      if (wait_fill) wait_prior_grid();
      cluster_atomic_add(dB, {e, rows.col(), rk.row()}, dot(g, at, Value(), 0, dm.precision) * s, row_ok & rank_ok);
      return dot(trans(b), g, acc, 0, dm.precision);  // [R, BK]
    });
    const Value da_ok = (rk.col() < rank) & col_ok;
    if (da_atomic)
      atomic_add(dA, {e, rk.col(), cols.row()}, acc * s, da_ok);
    else
      store(dA, {e, rk.col(), cols.row()}, (acc * s).to(dA.dtype()), da_ok);
    if (k.meta("RELEASE_END", 0)) release_dependents();  // a flush waits for the whole grid
  });
  return k;
}

}  // namespace kerf::kernels
