// DoRA weight norm (see include/kerf/kernels/kernels.h for the contract).
//
// One program owns BLOCK_M rows of W and one of the slices of the in-features
// that the programs of grid axis 1 share. It keeps s*B's rows [BLOCK_M, R_PAD]
// in registers, and per BLOCK_K columns forms V = W + (s*B) @ A with a
// tensor-core dot that starts from W, squares V and accumulates per element;
// the row sum is taken once, after the loop. (s*B is rounded once to the
// product's dtype: for bf16 that is a relative error of 2^-9 in the LoRA term,
// as for B itself.)
#include <tuple>

#include "kerf/kernels/kernels.h"
#include "split_range.h"

namespace kerf::kernels {
namespace {

using namespace kerf::dsl;

// The columns a program sums over: for_range(lo, hi, step) gives each step's first column.
struct ColumnSteps {
  Value lo, hi, step;
};

// This program's columns of [0, n_in) in whole BLOCK_K blocks: all of them; with
// `split`, a slice for each program of the slices' grid axis, either one range or,
// with INTERLEAVE, every split-th block (the splits of a row block then read
// neighbouring blocks of each row at a time).
ColumnSteps column_steps(Builder& k, const Value& n_in, bool split) {
  const int64_t BK = k.meta("BLOCK_K");
  if (split && k.meta("INTERLEAVE", 0)) {
    const int axis = row_slice_axes(k).slices;
    return {program_id(axis) * BK, n_in, num_programs(axis) * BK};
  }
  if (!split) return {literal(int64_t(0)), n_in, literal(BK)};
  const auto [lo, hi] = split_range(n_in, BK, row_slice_axes(k).slices);
  return {lo, hi, literal(BK)};
}

// Sum over this program's columns (`range`) of (W + s*B@A)^2, for its BLOCK_M rows.
Value row_sum_of_squares(Builder& k, const Tensor& W, const Tensor& A, const Tensor& B, const Value& s,
                         const Value& rows, const ColumnSteps& range) {
  const int64_t BM = k.meta("BLOCK_M"), BK = k.meta("BLOCK_K"), R = k.meta("R_PAD");
  const DotMeta dm = dot_meta(k, DType::f32);
  const DType dot_t = dm.dtype;
  const int64_t evict = k.meta("EVICT", 0);
  const int64_t warps_n = k.meta("WARPS_N", 0);  // warps sharing a step's columns (0: kerf's choice)
  const Value n_out = W.dim(0), n_in = W.dim(1), rank = A.dim(0);

  const Value rk = arange(R);
  const Value row_ok = rows.col() < n_out;
  // s * B rounded once to the product's dtype, or B itself with SCALE_AFTER (f16
  // adapters), as lora_left_operand says.
  const bool scale_after = k.meta("SCALE_AFTER", 0) != 0;
  const Value b = load(B, {rows.col(), rk.row()}, row_ok & (rk.row() < rank)).to(DType::f32);
  const Value bs = lora_left_operand(b, s, scale_after, dot_t);

  const Value acc = for_range(range.lo, range.hi, range.step, zeros({BM, BK}), [&](const Value& k0, const Value& acc) {
    const Value cols = k0 + arange(BK);
    const Value col_ok = cols.row() < n_in;
    const Value a = load(A, {rk.col(), cols.row()}, (rk.col() < rank) & col_ok, reused_hint(evict)).to(dot_t);
    const Value w = load(W, {rows.col(), cols.row()}, row_ok & col_ok, streamed_hint(evict)).to(DType::f32);
    const Value v = base_plus_lora(w, bs, a, s, scale_after, warps_n, dm.precision);  // W + s * B @ A
    return acc + v * v;
  });
  return sum(acc, 1);
}

// The same sum for W given as 4-bit codes (bitsandbytes' NF4/FP4 layout):
// element f = i*in + j of the row-major weight is code[q] * absmax[f >> shift],
// q the high nibble of byte f/2 for even f and the low nibble for odd f. Per
// step a [BLOCK_M, BLOCK_K/2] tile of bytes is decoded into its high and low
// nibbles' weights, which interleave() puts back in column order as the
// [BLOCK_M, BLOCK_K] tile the dot starts from; A's columns are read as they
// lie. The 16 codes are read once per program and a nibble's value is a
// gather() from them (a warp shuffle on the GPU), not a memory read. Both
// halves of a byte share its absmax block (in and the block size are even).
// With SCALE_PER_STEP (in and the block size are multiples of BLOCK_K) a
// step's columns lie in one block per row: its scales are one [BLOCK_M, 1]
// load instead of one per byte.
Value row_sum_of_squares_4bit(Builder& k, const Tensor& packed, const Tensor& absmax, const Tensor& code,
                              const Value& shift, const Tensor& A, const Tensor& B, const Value& s,
                              const Value& rows, bool split) {
  const int64_t BM = k.meta("BLOCK_M"), BK = k.meta("BLOCK_K"), R = k.meta("R_PAD");
  const int64_t BH = BK / 2;  // bytes per row and step
  const bool per_step = k.meta("SCALE_PER_STEP", 0) != 0;
  const int64_t evict = k.meta("EVICT", 0);
  const int64_t warps_n = k.meta("WARPS_N", 0);
  const DotMeta dm = dot_meta(k, DType::bf16);
  const DType dot_t = dm.dtype;
  const Value n_out = packed.dim(0), n_half = packed.dim(1), rank = A.dim(0);
  const Value n_in = n_half.to(DType::i64) * 2;

  const Value rk = arange(R);
  const Value row_ok = rows.col() < n_out;
  const Value rank_ok = rk.col() < rank;  // [R, 1]
  const bool scale_after = k.meta("SCALE_AFTER", 0) != 0;
  const Value b = load(B, {rows.col(), rk.row()}, row_ok & (rk.row() < rank)).to(DType::f32);
  const Value bs = lora_left_operand(b, s, scale_after, dot_t);
  const Value row_base = rows.col().to(DType::i64) * n_in;  // [BM, 1]
  const Value c16 = arange(16);
  const Value codes = load(code, {c16}, c16 < code.dim(0));  // [16]

  Value lo = literal(int64_t(0)), hi = n_half;
  if (split) std::tie(lo, hi) = split_range(n_half, BH, row_slice_axes(k).slices);
  const Value acc = for_range(lo, hi, BH, zeros({BM, BK}), [&](const Value& h0, const Value& acc) {
    const Value h = h0 + arange(BH);  // byte columns
    const Value ok = row_ok & (h.row() < n_half);
    const Value byte = load(packed, {rows.col(), h.row()}, ok, streamed_hint(evict));  // u8 [BM, BH]
    // A masked-off byte reads as 0, a code like any other; its scale is 0
    // instead (per byte: loaded under the same mask; per step: rows under
    // row_ok, and every step is whole), so its weight is 0.
    const Value scale = per_step ? load(absmax, {(row_base + 2 * h0) >> shift}, row_ok)  // [BM, 1]
                                 : load(absmax, {(row_base + 2 * h.row()) >> shift}, ok);
    const Value w = interleave(gather(codes, byte >> 4) * scale, gather(codes, byte & 15) * scale);
    const Value cols = 2 * h0 + arange(BK);
    const Value a = load(A, {rk.col(), cols.row()}, rank_ok & (cols.row() < n_in), reused_hint(evict)).to(dot_t);
    const Value v = base_plus_lora(w, bs, a, s, scale_after, warps_n, dm.precision);  // W + s * B @ A, [BM, BK]
    return acc + v * v;
  });
  return sum(acc, 1);
}

// norm = sqrt(sum of squares + eps) and scale = m / norm, for the rows `mask` selects.
// m is read before either store: dora_norm_finish lets norm or scale be m itself (in place).
void store_norm_and_scale(const Tensor& norm, const Tensor& scale, const Tensor& m,
                          const Value& rows, const Value& sum_of_squares, const Value& eps,
                          const Value& mask) {
  const Value n = sqrt(sum_of_squares + eps);
  const Value mag = load(m, {rows}, mask).to(DType::f32);
  store(norm, {rows}, n, mask);
  store(scale, {rows}, mag / n, mask);
}

// The split kernels' ending: this split's partial sums go into sumsq, and the
// split that arrives last for its row block sees every partial sum, finishes
// norm and scale, and leaves the workspace zero as it found it.
void add_and_finish_last(Builder& k, const Tensor& norm, const Tensor& scale, const Tensor& m,
                         const Tensor& sumsq, const Tensor& tickets, const Value& block, const Value& rows,
                         const Value& partial, const Value& eps, const Value& ok) {
  const int64_t BM = k.meta("BLOCK_M");
  atomic_add(sumsq, {rows}, partial, ok);
  const Value ticket =
      atomic_add(tickets, {block}, literal(int64_t(1)), Value(), MemoryOrder::acq_rel);
  const Value last = ticket == num_programs(row_slice_axes(k).slices) - 1;
  const Value mine = ok & last;
  const Value total = atomic_add(sumsq, {rows}, zeros({BM}), mine);  // a coherent read
  store_norm_and_scale(norm, scale, m, rows, total, eps, mine);
  store(sumsq, {rows}, zeros({BM}), mine);
  store(tickets, {block}, literal(int64_t(0)), last);
}

}  // namespace

const dsl::Kernel& dora_norm_fused() {
  static const Kernel k("dora_norm", [](Builder& k) {
    const Tensor W = k.tensor("W", 2), A = k.tensor("A", 2), B = k.tensor("B", 2);
    const Tensor m = k.tensor("m", 1);
    const Value s = k.scalar("s"), eps = k.scalar("eps");
    const Tensor norm = k.tensor("norm", 1, DType::f32), scale = k.tensor("scale", 1, DType::f32);
    const Value rows = program_id(0) * k.meta("BLOCK_M") + arange(k.meta("BLOCK_M"));
    const Value sumsq = row_sum_of_squares(k, W, A, B, s, rows, column_steps(k, W.dim(1), false));
    store_norm_and_scale(norm, scale, m, rows, sumsq, eps, rows < W.dim(0));
  });
  return k;
}

const dsl::Kernel& dora_norm_split() {
  static const Kernel k("dora_norm_split", [](Builder& k) {
    const Tensor W = k.tensor("W", 2), A = k.tensor("A", 2), B = k.tensor("B", 2);
    const Tensor m = k.tensor("m", 1);
    const Value s = k.scalar("s"), eps = k.scalar("eps");
    const Tensor norm = k.tensor("norm", 1, DType::f32), scale = k.tensor("scale", 1, DType::f32);
    const Tensor sumsq = k.tensor("sumsq", 1, DType::f32),
                 tickets = k.tensor("tickets", 1, DType::i32);
    const Value block = program_id(row_slice_axes(k).rows);
    const Value rows = block * k.meta("BLOCK_M") + arange(k.meta("BLOCK_M"));
    add_and_finish_last(k, norm, scale, m, sumsq, tickets, block, rows,
                        row_sum_of_squares(k, W, A, B, s, rows, column_steps(k, W.dim(1), true)), eps,
                        rows < W.dim(0));
  });
  return k;
}

// The 4-bit kernels' arguments up to the outputs, declared in this order.
struct Args4bit {
  Tensor packed, absmax, code, A, B, m;
  Value s, eps, shift;
  Tensor norm, scale;
};

Args4bit args_4bit(Builder& k) {
  return Args4bit{k.tensor("packed", 2, DType::u8), k.tensor("absmax", 1, DType::f32),
                  k.tensor("code", 1, DType::f32),  k.tensor("A", 2),
                  k.tensor("B", 2),                 k.tensor("m", 1),
                  k.scalar("s"),                    k.scalar("eps"),
                  k.scalar("block_shift", DType::i32), k.tensor("norm", 1, DType::f32),
                  k.tensor("scale", 1, DType::f32)};
}

const dsl::Kernel& dora_norm_4bit() {
  static const Kernel k("dora_norm_4bit", [](Builder& k) {
    const Args4bit a = args_4bit(k);
    const Value rows = program_id(0) * k.meta("BLOCK_M") + arange(k.meta("BLOCK_M"));
    const Value sumsq = row_sum_of_squares_4bit(k, a.packed, a.absmax, a.code, a.shift, a.A, a.B, a.s, rows, false);
    store_norm_and_scale(a.norm, a.scale, a.m, rows, sumsq, a.eps, rows < a.packed.dim(0));
  });
  return k;
}

const dsl::Kernel& dora_norm_4bit_split() {
  static const Kernel k("dora_norm_4bit_split", [](Builder& k) {
    const Args4bit a = args_4bit(k);
    const Tensor sumsq = k.tensor("sumsq", 1, DType::f32), tickets = k.tensor("tickets", 1, DType::i32);
    const Value block = program_id(row_slice_axes(k).rows);
    const Value rows = block * k.meta("BLOCK_M") + arange(k.meta("BLOCK_M"));
    add_and_finish_last(k, a.norm, a.scale, a.m, sumsq, tickets, block, rows,
                        row_sum_of_squares_4bit(k, a.packed, a.absmax, a.code, a.shift, a.A, a.B, a.s, rows, true),
                        a.eps, rows < a.packed.dim(0));
  });
  return k;
}

const dsl::Kernel& dora_norm_partial() {
  static const Kernel k("dora_norm_partial", [](Builder& k) {
    const Tensor W = k.tensor("W", 2), A = k.tensor("A", 2), B = k.tensor("B", 2);
    const Value s = k.scalar("s");
    const Tensor sumsq = k.tensor("sumsq", 1, DType::f32);
    const Value rows = program_id(row_slice_axes(k).rows) * k.meta("BLOCK_M") + arange(k.meta("BLOCK_M"));
    atomic_add(sumsq, {rows}, row_sum_of_squares(k, W, A, B, s, rows, column_steps(k, W.dim(1), true)),
               rows < W.dim(0));
  });
  return k;
}

const dsl::Kernel& dora_norm_finish() {
  static const Kernel k("dora_norm_finish", [](Builder& k) {
    const Tensor sumsq = k.tensor("sumsq", 1, DType::f32), m = k.tensor("m", 1);
    const Value eps = k.scalar("eps");
    const Tensor norm = k.tensor("norm", 1, DType::f32), scale = k.tensor("scale", 1, DType::f32);
    const int64_t BLOCK = k.meta("BLOCK");
    const Value i = program_id(0) * BLOCK + arange(BLOCK);
    const Value ok = i < sumsq.dim(0);
    store_norm_and_scale(norm, scale, m, i, load(sumsq, {i}, ok), eps, ok);
  });
  return k;
}

}  // namespace kerf::kernels
