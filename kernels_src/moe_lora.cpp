// MoE LoRA weight materialization (contract in include/kerf/kernels/kernels.h).
//
// One program owns BLOCK_N rows of one expert's weight (grid axis 2 is the
// expert) and a slice of its K columns (the programs of grid axis 1 share
// them, so the last wave of programs can be made fuller). It keeps that
// expert's s*B rows [BLOCK_N, R_PAD] in registers and walks its columns in
// BLOCK_K steps: read W, let a tensor-core dot add (s*B_e) @ A_e to it in
// fp32, round once, write W_eff. W is read once and W_eff written once.
// With the PERSISTENT meta the grid is one axis sized to the GPU and the
// programs deal out all the tiles among themselves instead (below); with
// EXPERT_GROUP neighbouring experts share grid axis 0, so that clusters of them
// (cluster_size) can read an expert-interleaved B together (EXPERTS_LAST).
#include <functional>
#include <utility>

#include "kerf/kernels/kernels.h"
#include "split_range.h"

namespace kerf::kernels {

using namespace kerf::dsl;

const dsl::Kernel& moe_lora_materialize() {
  static const Kernel k("moe_lora_materialize", [](Builder& k) {
    const Tensor W = k.tensor("W", 3), A = k.tensor("A", 3), B = k.tensor("B", 3);
    const Value s = k.scalar("s");
    const Tensor out = k.tensor("W_eff", 3);
    const int64_t BN = k.meta("BLOCK_N"), BK = k.meta("BLOCK_K"), R = k.meta("R_PAD");
    const DotMeta dm = dot_meta(k, DType::f32);
    const DType dot_t = dm.dtype;
    const int64_t evict = k.meta("EVICT", 0);
    const int64_t warps_n = k.meta("WARPS_N", 0);  // warps sharing a step's columns (0: kerf's choice)
    const Value n_rows = W.dim(1), n_cols = W.dim(2), rank = A.dim(1);
    // SCALE_AFTER (adapters of the product's half dtype): B is exact in it and s is
    // applied in fp32 after the dot, as lora_merge does; otherwise s*B rounded once.
    const bool scale_after = k.meta("SCALE_AFTER", 0) != 0;
    // A_e's columns `cols` [R_PAD, BLOCK_K], in the product's dtype.
    const auto a_columns = [&](const Value& e, const Value& rk, const Value& cols, const Value& col_ok) {
      return load(A, {e, rk.col(), cols.row()}, (rk.col() < rank) & col_ok, reused_hint(evict)).to(dot_t);
    };
    // Expert e's tile at `rows` x `cols`: read W, add the product of bs (the dot's left
    // operand, B's rows) and a (A's columns), round once, store W_eff.
    const auto update = [&](const Value& e, const Value& rows, const Value& row_ok, const Value& cols,
                            const Value& col_ok, const Value& bs, const Value& a) {
      const Value ok = row_ok & col_ok;
      const Value w = load(W, {e, rows.col(), cols.row()}, ok, streamed_hint(evict)).to(DType::f32);
      const Value v = base_plus_lora(w, bs, a, s, scale_after, warps_n, dm.precision);  // W + s*B@A
      store(out, {e, rows.col(), cols.row()}, v.to(out.dtype()), ok, streamed_hint(evict));
    };
    // The tile of expert e's rows `rows` (in range where row_ok) at columns [k0, k0+BK).
    const auto tile = [&](const Value& e, const Value& rows, const Value& row_ok, const Value& rk,
                          const Value& k0, const Value& bs) {
      const Value cols = k0 + arange(BK);
      const Value col_ok = cols.row() < n_cols;
      update(e, rows, row_ok, cols, col_ok, bs, a_columns(e, rk, cols, col_ok));
    };
    // WALK_ROWS (as lora_merge's): a program owns BLOCK_K columns of expert e's weight (grid
    // axis 0; the expert on axis 2) and a slice of its rows (axis 1, whole BLOCK_N steps). It
    // keeps A_e's columns for its whole loop and reads B_e's rows beside each W tile: B's
    // [BLOCK_N, R_PAD] a step instead of A's [R_PAD, BLOCK_K].
    if (k.meta("WALK_ROWS", 0)) {
      const Value e = program_id(2);
      const Value cols = program_id(0) * BK + arange(BK);
      const Value col_ok = cols.row() < n_cols;
      const Value rk = arange(R);
      const Value a = a_columns(e, rk, cols, col_ok);
      const auto [lo, hi] = split_range(n_rows, BN, 1);
      for_range(lo, hi, BN, [&](const Value& m0) {
        const Value rows = m0 + arange(BN);
        const Value row_ok = rows.col() < n_rows;
        // B's rows straight into the product's dtype where they are exact in it (no fp32 hop).
        const Value b = load(B, {e, rows.col(), rk.row()}, row_ok & (rk.row() < rank), reused_hint(evict));
        const Value bs = lora_left_operand(scale_after ? b : b.to(DType::f32), s, scale_after, dot_t);
        update(e, rows, row_ok, cols, col_ok, bs, a);
      });
      return;
    }
    // PERSISTENT: a grid of one axis, sized to the GPU, whose programs deal out the
    // tiles (expert, row block, column step; the columns fastest) among themselves: program
    // p takes tiles p, p + P, p + 2P, ... in one pipelined loop, so its copies run ahead
    // from one tile to the next, no program starts a wave late or ends it early, and the
    // programs running together cover neighbouring tiles (A's column tiles and B's rows
    // read from memory once, then from L2). B's rows are read beside each tile.
    if (k.meta("PERSISTENT", 0)) {
      const Value col_steps = cdiv(n_cols, literal(BK));
      const Value per_expert = cdiv(n_rows, literal(BN)) * col_steps;
      for_range(program_id(0), W.dim(0) * per_expert, num_programs(0), [&](const Value& t) {
        const Value e = t / per_expert;
        const Value in_expert = t - e * per_expert;
        const Value rb = in_expert / col_steps;
        const Value rows = rb * BN + arange(BN);
        const Value rk = arange(R);
        const Value row_ok = rows.col() < n_rows;
        Value b = load(B, {e, rows.col(), rk.row()}, row_ok & (rk.row() < rank));
        // Adapters already in the product's dtype go to the dot as they are.
        if (!(scale_after && B.dtype() == dot_t)) b = lora_left_operand(b.to(DType::f32), s, scale_after, dot_t);
        tile(e, rows, row_ok, rk, (in_expert - rb * col_steps) * BK, b);
      });
      return;
    }
    // The program's part: expert e's rows from row block `row_block` (and where `in_range`, a
    // program past the last expert's otherwise), over the columns `slice` gives. `cluster_e`:
    // B is [N, r, E] and read by the cluster's programs together (below).
    const auto own = [&](const Value& e, const Value& in_range, const Value& row_block, const Value& cluster_e,
                         const std::function<std::pair<Value, Value>()>& slice) {
      const Value rows = row_block * BN + arange(BN);
      const Value rk = arange(R);
      const Value row_ok = in_range.valid() ? (rows.col() < n_rows) & in_range : rows.col() < n_rows;
      // The cluster's read takes the mask its programs share: a program past the last
      // expert still hands the others their values (its own, past B's last dimension, are
      // not read).
      const Value b = (cluster_e.valid() ? cluster_load(B, {rows.col(), rk.row()}, cluster_e,
                                                        (rows.col() < n_rows) & (rk.row() < rank))
                                         : load(B, {e, rows.col(), rk.row()}, row_ok & (rk.row() < rank)))
                          .to(DType::f32);
      const Value bs = lora_left_operand(b, s, scale_after, dot_t);
      const auto [lo, hi] = slice();
      for_range(lo, hi, BK, [&](const Value& k0) { tile(e, rows, row_ok, rk, k0, bs); });
    };
    // EXPERT_GROUP G: grid axis 0 is G neighbouring experts, axis 1 the row blocks, axis 2
    // the groups of G experts times the column slices (a group's slices side by side).
    if (const int64_t G = k.meta("EXPERT_GROUP", 0)) {
      const Value groups = cdiv(W.dim(0), literal(G));
      const Value parts = num_programs(2) / groups;
      const Value g = program_id(2) / parts;
      const Value e_g = g * G + program_id(0);
      // A group past the last expert (E not a multiple of G): its rows masked off, and
      // the expert index held in range for A's reads, whose products are not stored.
      // EXPERTS_LAST: B comes as [N, r, E] (PEFT's flat lora_B as it lies, the experts
      // fastest), read by the cluster's programs together (cluster_size neighbouring
      // experts: whole sectors once, not a sector per element per expert). The caller makes
      // G a multiple of the cluster size: e_g is then the cluster's first expert plus the
      // program's rank, the same rows for all.
      own(minimum(e_g, W.dim(0) - 1), e_g < W.dim(0), program_id(1), k.meta("EXPERTS_LAST", 0) ? e_g : Value(),
          [&] { return split_range(n_cols, BK, program_id(2) - g * parts, parts); });
      return;
    }
    const RowSliceAxes axes = row_slice_axes(k);
    if (k.meta("ONE_TILE", 0)) {
      // One tile a program (the op's STREAM plan, as many slices as column blocks), as
      // lora_merge's: W's tile asked for first and read only after the product.
      const Value e = program_id(2);
      const Value rows = program_id(axes.rows) * BN + arange(BN);
      const Value row_ok = rows.col() < n_rows;
      const Value cols = program_id(axes.slices) * BK + arange(BK);
      const Value col_ok = cols.row() < n_cols;
      const Value rk = arange(R);
      const Value ok = row_ok & col_ok;
      const Value w = load(W, {e, rows.col(), cols.row()}, ok, streamed_hint(evict));
      const Value a = a_columns(e, rk, cols, col_ok);
      const Value b = load(B, {e, rows.col(), rk.row()}, row_ok & (rk.row() < rank)).to(DType::f32);
      const Value v = lora_sum_after_product(w, lora_left_operand(b, s, scale_after, dot_t), a, s, scale_after,
                                             warps_n, dm.precision);
      store(out, {e, rows.col(), cols.row()}, v.to(out.dtype()), ok, streamed_hint(evict));
      return;
    }
    own(program_id(2), Value(), program_id(axes.rows), Value(), [&] { return split_range(n_cols, BK, axes.slices); });
  });
  return k;
}

}  // namespace kerf::kernels
