// LoRA embedding, forward and backward (contract in include/kerf/kernels/kernels.h).
//
//   forward:  out[t, :] = weight[x[t], :] + s * A[:, x[t]] @ B^T
//   backward: dA[:, v] += s * w(v) * sum_{t: x[t] = v, v != padding} (g[t, :] @ B)
//             dB       += s * sum_t g[t, :]^T A[:, x[t]]^T
//             w(v) = 1 / count(v) with scale_grad_by_freq, else 1
//   x [T] i32/i64 ids; weight [V, D]; A [r, V] (PEFT lora_embedding_A);
//   B [D, r] (lora_embedding_B); g, out [T, D]; any strides.
//
// SAVED_ACT: the activations A[:, x[t]]^T are read from `act` [T, r] (the forward's,
// as PEFT's after_A) instead of gathered from A's columns by id; ACT_IN_SHARD (a vocab
// shard): those of tokens whose ids lie outside the shard count as zeros.
//
// Ids are global; this shard holds ids [start, start + V). An id outside the
// shard reads nothing and gives zeros (a sum over vocab shards is the whole
// answer); an id outside [0, total) is also recorded in `err` (i64 [4]:
// count, then the position and value of the first one seen, and total),
// which the op checks. No lane ever reads or writes at an id it has not checked.
#include <bit>
#include <cstdint>

#include "kerf/kernels/kernels.h"
#include "split_range.h"

namespace kerf::kernels {

using namespace kerf::dsl;

namespace {

// This program's tokens and what their ids allow.
struct Tokens {
  Value tok, tok_ok, id, local, in_shard;
};

// Without `err`, nothing is recorded (a kernel after the one that recorded them).
Tokens read_tokens(Builder& k, const Tensor& x, const Value& start, const Value& vocab_local) {
  const int64_t BT = k.meta("BLOCK_T");
  Tokens t;
  t.tok = program_id(0) * BT + arange(BT);
  t.tok_ok = t.tok < x.dim(0);
  t.id = load(x, {t.tok}, t.tok_ok).to(DType::i64);
  t.local = t.id - start;
  t.in_shard = t.tok_ok & (t.local >= 0) & (t.local < vocab_local.to(DType::i64));
  return t;
}

Tokens load_tokens(Builder& k, const Tensor& x, const Tensor& err, const Value& start,
                   const Value& total, const Value& vocab_local) {
  const int64_t BT = k.meta("BLOCK_T");
  Tokens t = read_tokens(k, x, start, vocab_local);
  // An id outside [0, total): count it, and the first one counted leaves its position and value.
  const Value bad = t.tok_ok & ((t.id < 0) | (t.id >= total));
  const Value slot0 = zeros({BT}, DType::i32);
  const Value old = atomic_add(err, {slot0}, full({BT}, 1.0, DType::i64), bad);
  const Value first = bad & (old == 0);
  store(err, {slot0 + 1}, t.tok.to(DType::i64), first);
  store(err, {slot0 + 2}, t.id, first);
  store(err, {slot0 + 3}, broadcast_to(total, {BT}), first);
  return t;
}

// Whether the backward's activations are kept by rank, [R, BLOCK_T] (meta wgmma, Hopper's
// warpgroup dots): dB's product g^T @ act then reads them as wgmma's K-major B operand,
// whose tile needs 64 columns where the rank gives 16 or 32; by token ([BLOCK_T, R]) mma.sync
// keeps their fragments in registers.
bool activations_by_rank(Builder& k) { return k.meta("wgmma", 0) != 0; }

// A [BLOCK_M, BLOCK_K] tile of t [M, K] for the programs after the first `before`:
// program before + q takes tile q, numbered column block fastest.
struct TileAfter {
  Value rows, cols, ok;
};

TileAfter tile_after(Builder& k, const Value& before, const Tensor& t) {
  const int64_t BM = k.meta("BLOCK_M"), BK = k.meta("BLOCK_K");
  const Value q = program_id(0) - before;
  const Value col_blocks = cdiv(t.dim(1), literal(BK));
  TileAfter a;
  a.rows = ((q / col_blocks) * BM + arange(BM)).col();
  a.cols = ((q % col_blocks) * BK + arange(BK)).row();
  a.ok = (q >= 0) & (a.rows < t.dim(0)) & (a.cols < t.dim(1));
  return a;
}

// The parameters the backward's kernels begin with, declared in this order: x, A, B, g,
// s, two f32 accumulators [*, r] (named `acc_a`, `acc_b`), counts, first, err, start,
// total, padding.
struct BackwardParams {
  Tensor x, A, B, g;
  Value s;
  Tensor acc_a, acc_b, counts, first, err;
  Value start, total, padding;
};

BackwardParams backward_params(Builder& k, const char* acc_a, const char* acc_b) {
  BackwardParams p{k.tensor("x", 1), k.tensor("A", 2), k.tensor("B", 2), k.tensor("g", 2), k.scalar("s"),
                   k.tensor(acc_a, 2, DType::f32), k.tensor(acc_b, 2, DType::f32),
                   k.tensor("counts", 1, DType::i32), k.tensor("first", 1, DType::i32),
                   k.tensor("err", 1, DType::i64), k.scalar("start", DType::i64),
                   k.scalar("total", DType::i64), k.scalar("padding", DType::i64)};
  return p;
}

// The backward's pass over g for the tokens `t`, this program's slice of D: returns
// gB = g[t, :] @ B over the slice [BT, R] (f32), and adds dB's rows of the slice,
// s * g^T A, into dB (f32) step by step. ROTATE: each token block starts its steps at
// a different step, so that the token blocks sharing a slice of D do not all add into
// the same rows of dB at once. WAIT_PRIOR: each step's add waits for the grid before.
// `saved`: the activations read ahead (SAVED_ACT), else they are gathered from A here.
Value backward_pass(Builder& k, const Tokens& t, const Tensor& A, const Tensor& B, const Tensor& g, const Value& s,
                    const Tensor& dB, bool wait_fill, const Value& saved) {
  const int64_t BT = k.meta("BLOCK_T"), BD = k.meta("BLOCK_D"), R = k.meta("R_PAD");
  const bool rotate = k.meta("ROTATE", 0) != 0;
  const DotMeta dm = dot_meta(k, DType::f32);
  const DType dot_t = dm.dtype;
  const dsl::DotPrecision precision = dm.precision;
  const Value n_dim = g.dim(1);
  const Value rk = arange(R);
  const Value rk_ok = rk.row() < A.dim(0);  // [1, R]
  // The LoRA activations of these tokens (zero outside the shard): dB's right factor,
  // [BT, R], or [R, BT] read through trans() with warpgroup dots (activations_by_rank).
  // ACT_IN_SHARD: the saved ones of tokens outside a vocab shard are set to zero here (a
  // shard's forward wrote zeros there, but a caller may pass every shard's sum).
  const bool by_rank = activations_by_rank(k);
  Value act = saved;
  if (!saved.valid())
    act = by_rank ? load(A, {rk.col(), t.local.row()}, t.in_shard.row() & (rk.col() < A.dim(0))).to(dot_t)
                  : load(A, {rk.row(), t.local.col()}, t.in_shard.col() & rk_ok).to(dot_t);
  const bool act_in_shard = k.meta("ACT_IN_SHARD", 0) != 0;
  if (saved.valid() && act_in_shard)
    act = by_rank ? where(t.in_shard.row(), act, 0.0) : where(t.in_shard.col(), act, 0.0);
  const Value act_dot = by_rank ? trans(act) : act;  // [BT, R]
  const auto [lo, hi] = split_range(n_dim, BD);
  return for_range(lo, hi, BD, zeros({BT, R}), [&](const Value& iv, const Value& acc) {
    const Value d0 = rotate ? rotated_step(iv, lo, hi, BD, program_id(0)) : iv;
    const Value d = d0 + arange(BD);
    const Value d_ok = d.col() < n_dim;  // [BD, 1]
    const Value gt =
        load(g, {t.tok.col(), d.row()}, t.tok_ok.col() & (d.row() < n_dim)).to(dot_t);  // [BT, BD]
    const Value b = load(B, {d.col(), rk.row()}, d_ok & rk_ok).to(dot_t);               // [BD, R]
    if (wait_fill) wait_prior_grid();
    atomic_add(dB, {d.col(), rk.row()}, dot(trans(gt), act_dot, Value(), 0, precision) * s, d_ok & rk_ok);
    return dot(gt, b, acc, 0, precision);
  });
}

// SAVED_ACT: the activations from `saved` [T, r] (A[:, x[t]]^T, zeros where the forward
// found an id outside the shard), rows by token (or by rank: activations_by_rank), in the
// dots' dtype; read before the ids, which they do not wait for (nor for a gather of r
// scattered elements a token), so that they and the pass's first copies (the kernels'
// meta early_prologue) are on their way together. Else nothing.
Value saved_activations(Builder& k, const Tensor& x, const Tensor& A, const Tensor& saved) {
  if (!k.meta("SAVED_ACT", 0)) return Value();
  const int64_t BT = k.meta("BLOCK_T"), R = k.meta("R_PAD");
  const DType dot_t = dot_meta(k, DType::f32).dtype;
  const Value tok = program_id(0) * BT + arange(BT);
  const Value rk = arange(R);
  if (activations_by_rank(k))
    return load(saved, {tok.row(), rk.col()}, (tok < x.dim(0)).row() & (rk.col() < A.dim(0))).to(dot_t);
  return load(saved, {tok.col(), rk.row()}, (tok < x.dim(0)).col() & (rk.row() < A.dim(0))).to(dot_t);
}

// Columns [v0, v0 + BV) of dA [r, V] (any float dtype) from the sums by id: sums[first[v]
// - 1, :] where first[v] > 0, else zeros; then the sums read, and first and counts of every
// id of the block, back to zero (one store masked by the tile's bounds for dA, so that it
// goes out in 16-byte vectors; first and counts in whole lines).
void write_columns(const Value& v0, int64_t BV, int64_t R, const Tensor& first, const Tensor& counts,
                   const Tensor& sums, const Tensor& dA) {
  const Value v = v0 + arange(BV);
  const Value v_ok = v < dA.dim(1);
  const Value rk = arange(R);
  const Value rk_ok = rk.col() < dA.dim(0);  // [R, 1]
  const Value f = load(first, {v}, v_ok);
  const Value row = f.to(DType::i64) - 1;
  const Value mine = (f > 0).row() & rk_ok;  // [R, BV]
  const Value a = load(sums, {row.row(), rk.col()}, mine);
  store(dA, {rk.col(), v.row()}, a.to(dA.dtype()), v_ok.row() & rk_ok);
  store(sums, {row.row(), rk.col()}, zeros({R, BV}), mine);
  store(first, {v}, zeros({BV}, DType::i32), v_ok);
  store(counts, {v}, zeros({BV}, DType::i32), v_ok);
}

// The [rows, cols] tile of dB (any float dtype) from its f32 accumulator `acc`, which
// goes back to zero; `shape` is the tile's.
void flush_tile(const Tensor& dB, const Tensor& acc, const Value& rows, const Value& cols, const Value& ok,
                const ir::Shape& shape) {
  store(dB, {rows, cols}, load(acc, {rows, cols}, ok).to(dB.dtype()), ok);
  store(acc, {rows, cols}, zeros(shape), ok);
}

// The fused backward's share of dA's columns to zero (only stores) for program `prog`
// of `progs`, BV columns a step.
void zero_columns(const Tensor& dA, const Value& prog, const Value& progs, int64_t BV, int64_t R) {
  const Value rk = arange(R);
  const auto [v_lo, v_hi] = split_range(dA.dim(1), BV, prog, progs);
  for_range(v_lo, v_hi, BV, [&](const Value& v0) {
    const Value v = v0 + arange(BV);
    store(dA, {rk.col(), v.row()}, zeros({R, BV}, dA.dtype()), (rk.col() < dA.dim(0)) & (v.row() < v_hi));
  });
}

// The fused backward's rows of dB from its f32 accumulator (zeroed again) for program
// `prog` of `progs`: BM rows a step (BM * progs covers D, so the loop takes one step).
void flush_rows(const Tensor& dB, const Tensor& db_acc, const Value& prog, const Value& progs, int64_t BM,
                int64_t R) {
  const Value rk = arange(R);
  for_range(prog * BM, dB.dim(0), progs * BM, [&](const Value& d0) {
    const Value d = d0 + arange(BM);
    flush_tile(dB, db_acc, d.col(), rk.row(), (d.col() < dB.dim(0)) & (rk.row() < dB.dim(1)), {BM, R});
  });
}

}  // namespace

const dsl::Kernel& lora_embedding() {
  static const Kernel k("lora_embedding", [](Builder& k) {
    const Tensor x = k.tensor("x", 1), weight = k.tensor("weight", 2);
    const Tensor A = k.tensor("A", 2), B = k.tensor("B", 2);
    const Value s = k.scalar("s");
    const Tensor out = k.tensor("out", 2), err = k.tensor("err", 1, DType::i64);
    const Value start = k.scalar("start", DType::i64), total = k.scalar("total", DType::i64);
    const Tensor act = k.tensor("act", 2);  // STORE_ACT: A[:, x[t]]^T [T, r] written (PEFT's after_A)
    const int64_t BD = k.meta("BLOCK_D"), R = k.meta("R_PAD");
    const bool scale_after = k.meta("SCALE_AFTER", 0) != 0;
    const DotMeta dm = dot_meta(k, DType::f32);
    const DType dot_t = dm.dtype;
    const dsl::DotPrecision precision = dm.precision;
    const int64_t warps_n = k.meta("WARPS_N", 0);  // warps sharing a step's columns (0: kerf's choice)
    const Value n_dim = weight.dim(1), rank = A.dim(0);

    const Tokens t = load_tokens(k, x, err, start, total, weight.dim(0));
    const Value rk = arange(R);
    const Value a_raw =
        load(A, {rk.row(), t.local.col()}, t.in_shard.col() & (rk.row() < rank)).to(DType::f32);
    const Value a = lora_left_operand(a_raw, s, scale_after, dot_t);  // [BT, R]
    // The activations for the backward, by the first program of the token block (zeros
    // for ids outside the shard, as the sum over shards wants).
    if (k.meta("STORE_ACT", 0))
      store(act, {t.tok.col(), rk.row()}, a_raw.to(act.dtype()),
            (t.tok_ok & broadcast_to(program_id(1) == 0, {k.meta("BLOCK_T")})).col() & (rk.row() < rank));
    const auto [lo, hi] = split_range(n_dim, BD);
    for_range(lo, hi, BD, [&](const Value& d0) {
      const Value d = d0 + arange(BD);
      const Value d_ok = d.row() < n_dim;
      const Value e =
          load(weight, {t.local.col(), d.row()}, t.in_shard.col() & d_ok).to(DType::f32);
      const Value bt =
          trans(load(B, {d.col(), rk.row()}, (d.col() < n_dim) & (rk.row() < rank)).to(dot_t));
      const Value v = base_plus_lora(e, a, bt, s, scale_after, warps_n, precision);  // [BT, BD]
      store(out, {t.tok.col(), d.row()}, v.to(out.dtype()), t.tok_ok.col() & d_ok);
    });
  });
  return k;
}

const dsl::Kernel& lora_embedding_backward() {
  static const Kernel k("lora_embedding_backward", [](Builder& k) {
    const BackwardParams p = backward_params(k, "dA", "dB");
    const Tensor &x = p.x, &A = p.A, &B = p.B, &g = p.g, &dA = p.acc_a, &dB = p.acc_b;
    const Tensor &counts = p.counts, &first = p.first, &err = p.err;
    const Value &s = p.s, &start = p.start, &total = p.total, &padding = p.padding;
    const int64_t BT = k.meta("BLOCK_T"), R = k.meta("R_PAD");
    const bool by_freq = k.meta("BY_FREQ", 0) != 0;
    // GROUP_BY_ID: dA is the [T, r] sums by id, row first[v] - 1 for id v (from
    // lora_embedding_group, complete once the prior grid is); else dA itself.
    const bool grouped = k.meta("GROUP_BY_ID", 0) != 0;
    // WAIT_PRIOR: launched to overlap the zero-fill of dA and dB before it, so every
    // atomic comes after a wait for that fill; the loads before it read only inputs.
    const bool wait_fill = k.meta("WAIT_PRIOR", 0) != 0;
    const Value rank = A.dim(0);
    const Tensor saved = k.tensor("act", 2);  // SAVED_ACT: A[:, x[t]]^T [T, r]
    const Value act = saved_activations(k, x, A, saved);

    const Tokens t = load_tokens(k, x, err, start, total, A.dim(1));
    const Value rk = arange(R);
    const Value rk_ok = rk.row() < rank;  // [1, R]
    // gB[t, :] = g[t, :] @ B over this program's slice of D; dB's rows of the slice on the way.
    const Value gB = backward_pass(k, t, A, B, g, s, dB, wait_fill, act);
    // Programs whose share of D is empty met no wait in the loop.
    if (grouped && wait_fill) wait_prior_grid();
    Value w = broadcast_to(s, {BT});
    if (by_freq)
      w = w / maximum(load(counts, {t.local}, t.in_shard, 1.0).to(DType::f32), literal(1.0));
    const Value gets = t.in_shard & (t.id != padding);
    if (grouped) {
      // Every token of an id adds into the row of the id's first token: a token's r sums
      // are one run of r floats, and dA's columns are written once, by lora_embedding_dense_a.
      const Value row = load(first, {t.local}, t.in_shard).to(DType::i64) - 1;
      atomic_add(dA, {row.col(), rk.row()}, gB * w.col(), (gets & (row >= 0)).col() & rk_ok);
    } else {
      atomic_add(dA, {rk.row(), t.local.col()}, gB * w.col(), gets.col() & rk_ok);
    }
    // L2_KEEP: the fill wrote dA (unless grouped) and dB evict-last, so that the zeros met
    // by the atomics above were still in L2 after the stream of g; this program's share of
    // their lines goes back to normal priority (one element per 128-byte line; stride 1
    // along dim 1).
    if (k.meta("L2_KEEP", 0)) {
      const Value prog = program_id(0) * num_programs(1) + program_id(1);
      const Value progs = num_programs(0) * num_programs(1);
      const int64_t BL = 64, per_line = 32;  // f32 elements in a line
      if (!grouped) {
        const auto [c_lo, c_hi] = split_range(dA.dim(1), 1, prog, progs);
        for_range(c_lo, c_hi, BL * per_line, [&](const Value& c0) {
          const Value c = c0 + arange(BL) * per_line;
          l2_evict_normal(dA, {rk.col(), c.row()}, (rk.col() < rank) & (c.row() < c_hi));
        });
        // Each row's last column: its line may lie past the last step of per_line.
        l2_evict_normal(dA, {rk, broadcast_to(c_hi - 1, {R})}, (rk < rank) & (c_hi > c_lo));
      }
      const auto [d_lo, d_hi] = split_range(dB.dim(0), 1, prog, progs);
      const int64_t CB = int64_t(std::bit_ceil(uint64_t(R / per_line + 2)));
      const Value cols = minimum(arange(CB) * per_line, rank - 1);  // a row's lines: 0, 32, ..., r - 1
      for_range(d_lo, d_hi, 64, [&](const Value& d0) {
        const Value dd = d0 + arange(64);
        l2_evict_normal(dB, {dd.col(), cols.row()}, dd.col() < d_hi);
      });
    }
  });
  return k;
}

const dsl::Kernel& lora_embedding_backward_fused() {
  static const Kernel k("lora_embedding_backward_fused", [](Builder& k) {
    const Tensor x = k.tensor("x", 1), A = k.tensor("A", 2), B = k.tensor("B", 2), g = k.tensor("g", 2);
    const Value s = k.scalar("s");
    const Tensor sums = k.tensor("sums", 2, DType::f32), db_acc = k.tensor("db_acc", 2, DType::f32);
    const Tensor counts = k.tensor("counts", 1, DType::i32), err = k.tensor("err", 1, DType::i64);
    const Value start = k.scalar("start", DType::i64), total = k.scalar("total", DType::i64);
    const Value padding = k.scalar("padding", DType::i64);
    const Tensor dA = k.tensor("dA", 2), dB = k.tensor("dB", 2), sync = k.tensor("sync", 1, DType::i32);
    const Tensor saved = k.tensor("act", 2);  // SAVED_ACT: A[:, x[t]]^T [T, r]
    const Value act = saved_activations(k, x, A, saved);
    const int64_t BT = k.meta("BLOCK_T"), R = k.meta("R_PAD"), BV = k.meta("BLOCK_V"), BM = k.meta("BLOCK_M");
    const bool by_freq = k.meta("BY_FREQ", 0) != 0;
    const Value rk = arange(R);
    const Value rk_ok = rk.row() < A.dim(0);  // [1, R]
    const Value prog = program_id(0) * num_programs(1) + program_id(1);
    const Value progs = num_programs(0) * num_programs(1);

    if (k.meta("DIRECT_A", 0)) {
      // dA is f32: the tokens add into it directly. This program's share of it is zeroed
      // and its tokens counted (BY_FREQ) before the pass, and the pass ends with a wait for
      // every program's arrival after that, which has long happened by then.
      zero_columns(dA, prog, progs, BV, R);
      const Tokens t = load_tokens(k, x, err, start, total, A.dim(1));
      const Value counting = t.in_shard & ((t.tok % num_programs(1)) == program_id(1));
      if (by_freq) atomic_add(counts, {t.local}, full({BT}, 1.0, DType::i32), counting);
      grid_arrive(sync);
      const Value gB = backward_pass(k, t, A, B, g, s, db_acc, false, act);
      grid_await(sync);
      Value w = broadcast_to(s, {BT});
      if (by_freq) w = w / maximum(load(counts, {t.local}, t.in_shard, 1.0).to(DType::f32), literal(1.0));
      atomic_add(dA, {rk.row(), t.local.col()}, gB * w.col(), (t.in_shard & (t.id != padding)).col() & rk_ok);
      grid_sync(sync);
      // dB's accumulator is complete, and every count has been read.
      flush_rows(dB, db_acc, prog, progs, BM, R);
      if (by_freq) store(counts, {t.local}, zeros({BT}, DType::i32), counting);
      return;
    }
    // Each token is counted by id by one of the programs that share its block (by its
    // position modulo the slices of D, so that the owners' writes below are spread over
    // all programs); the token that finds its id's count at zero owns the id's column of
    // dA. The old counts are only looked at after the pass, which hides the atomics' wait.
    const Tokens t = load_tokens(k, x, err, start, total, A.dim(1));
    const Value counting = t.in_shard & ((t.tok % num_programs(1)) == program_id(1));
    const Value old = atomic_add(counts, {t.local}, full({BT}, 1.0, DType::i32), counting);
    // The pass over g: dB's shares into its f32 accumulator, then each token's sums (over
    // this slice of D) into its id's row of `sums`.
    const Value gB = backward_pass(k, t, A, B, g, s, db_acc, false, act);
    const Value gets = t.in_shard & (t.id != padding);
    atomic_add(sums, {t.local.col(), rk.row()}, gB, gets.col() & rk_ok);
    // This program's share of dA's columns to zero (only stores; the columns of the ids
    // seen are written over after the grid_sync), while slower programs finish. (Before
    // the pass, in its stream of g, it took 1.4 us more on an H100.)
    zero_columns(dA, prog, progs, BV, R);
    grid_sync(sync);
    // Every sum is in. Each id's owner reads its row (and count) and writes the column,
    // setting the row and count back to zero; the loads of dB's rows go out beside them.
    const Value owner = counting & (old == 0);
    const Value own = owner.col() & rk_ok;  // [BT, R]
    const Value a = load(sums, {t.local.col(), rk.row()}, own);
    Value w = broadcast_to(s, {BT});
    if (by_freq) w = w / maximum(load(counts, {t.local}, owner, 1.0).to(DType::f32), literal(1.0));
    // This program's rows of dB from the accumulator (zeroed again).
    flush_rows(dB, db_acc, prog, progs, BM, R);
    store(dA, {rk.row(), t.local.col()}, (a * w.col()).to(dA.dtype()), own);
    store(sums, {t.local.col(), rk.row()}, zeros({BT, R}), own);
    store(counts, {t.local}, zeros({BT}, DType::i32), owner);
  });
  return k;
}

const dsl::Kernel& lora_embedding_gather() {
  static const Kernel k("lora_embedding_gather", [](Builder& k) {
    const Tensor x = k.tensor("x", 1), A = k.tensor("A", 2), act = k.tensor("act", 2);
    const Tensor err = k.tensor("err", 1, DType::i64);
    const Value start = k.scalar("start", DType::i64), total = k.scalar("total", DType::i64);
    const Value rk = arange(k.meta("R_PAD"));
    const Value rk_ok = rk.row() < A.dim(0);
    const Tokens t = load_tokens(k, x, err, start, total, A.dim(1));
    const Value a = load(A, {rk.row(), t.local.col()}, t.in_shard.col() & rk_ok);  // [BT, R]
    store(act, {t.tok.col(), rk.row()}, a.to(act.dtype()), t.tok_ok.col() & rk_ok);
  });
  return k;
}

const dsl::Kernel& lora_embedding_scatter() {
  static const Kernel k("lora_embedding_scatter", [](Builder& k) {
    const Tensor x = k.tensor("x", 1), gB = k.tensor("gB", 2, DType::f32), act = k.tensor("act", 2);
    const Tensor dA = k.tensor("dA", 2, DType::f32), counts = k.tensor("counts", 1, DType::i32);
    const Value start = k.scalar("start", DType::i64), padding = k.scalar("padding", DType::i64);
    const int64_t BT = k.meta("BLOCK_T"), R = k.meta("R_PAD");
    const Value rk = arange(R);
    const Value rk_ok = rk.row() < dA.dim(0);
    const Tokens t = read_tokens(k, x, start, dA.dim(1));
    const Value mine = t.tok_ok.col() & rk_ok;
    const Value g = load(gB, {t.tok.col(), rk.row()}, mine);  // [BT, R]
    Value w = full({BT}, 1.0, DType::f32);
    if (k.meta("BY_FREQ", 0) != 0)
      w = w / maximum(load(counts, {t.local}, t.in_shard, 1.0).to(DType::f32), literal(1.0));
    atomic_add(dA, {rk.row(), t.local.col()}, g * w.col(), (t.in_shard & (t.id != padding)).col() & rk_ok);
    store(gB, {t.tok.col(), rk.row()}, zeros({BT, R}), mine);
    store(act, {t.tok.col(), rk.row()}, zeros({BT, R}, act.dtype()), mine);
  });
  return k;
}

const dsl::Kernel& lora_embedding_group() {
  static const Kernel k("lora_embedding_group", [](Builder& k) {
    const Tensor x = k.tensor("x", 1), counts = k.tensor("counts", 1, DType::i32);
    const Tensor first = k.tensor("first", 1, DType::i32), dB = k.tensor("dB", 2, DType::f32);
    const Value start = k.scalar("start", DType::i64);
    const int64_t BT = k.meta("BLOCK_T"), BM = k.meta("BLOCK_M"), BK = k.meta("BLOCK_K");
    if (k.meta("RELEASE", 0)) release_dependents();
    // Programs [0, cdiv(T, BLOCK_T)): tokens. The token that finds its id's count at 0
    // leaves its position + 1 as the id's first.
    const Tokens t = read_tokens(k, x, start, counts.dim(0));
    const Value old = atomic_add(counts, {t.local}, full({BT}, 1.0, DType::i32), t.in_shard);
    store(first, {t.local}, (t.tok + 1).to(DType::i32), t.in_shard & (old == 0));
    // The programs after them: a [BLOCK_M, BLOCK_K] tile of dB each, zeroed (FILL_B).
    if (k.meta("FILL_B", 0)) {
      const TileAfter b = tile_after(k, cdiv(x.dim(0), literal(BT)), dB);
      store(dB, {b.rows, b.cols}, zeros({BM, BK}), b.ok, k.meta("EVICT_LAST", 0) ? Evict::last : Evict::normal);
    }
  });
  return k;
}

const dsl::Kernel& lora_embedding_dense_a() {
  static const Kernel k("lora_embedding_dense_a", [](Builder& k) {
    const Tensor first = k.tensor("first", 1, DType::i32), counts = k.tensor("counts", 1, DType::i32);
    const Tensor sums = k.tensor("sums", 2, DType::f32), dA = k.tensor("dA", 2);
    const Tensor db_acc = k.tensor("db_acc", 2, DType::f32), dB = k.tensor("dB", 2);
    const int64_t BV = k.meta("BLOCK_V"), R = k.meta("R_PAD");
    if (k.meta("WAIT_PRIOR", 0)) wait_prior_grid();
    // FLUSH_B: the programs after dA's column blocks turn a [BLOCK_M, BLOCK_K] tile of
    // dB's f32 accumulator each into dB, and zero it again.
    if (k.meta("FLUSH_B", 0)) {
      const TileAfter b = tile_after(k, cdiv(dA.dim(1), literal(BV)), dB);
      flush_tile(dB, db_acc, b.rows, b.cols, b.ok, {k.meta("BLOCK_M"), k.meta("BLOCK_K")});
    }
    write_columns(program_id(0) * BV, BV, R, first, counts, sums, dA);
  });
  return k;
}

const dsl::Kernel& embedding_count_ids() {
  static const Kernel k("embedding_count_ids", [](Builder& k) {
    const Tensor x = k.tensor("x", 1), counts = k.tensor("counts", 1, DType::i32);
    const Value start = k.scalar("start", DType::i64);
    const int64_t BT = k.meta("BLOCK_T");
    const bool clear = k.meta("CLEAR", 0) != 0;
    const Value tok = program_id(0) * BT + arange(BT);
    const Value tok_ok = tok < x.dim(0);
    const Value local = load(x, {tok}, tok_ok).to(DType::i64) - start;
    const Value mine = tok_ok & (local >= 0) & (local < counts.dim(0).to(DType::i64));
    if (clear)
      store(counts, {local}, zeros({BT}, DType::i32), mine);
    else
      atomic_add(counts, {local}, full({BT}, 1.0, DType::i32), mine);
  });
  return k;
}

}  // namespace kerf::kernels
