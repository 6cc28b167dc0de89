// DSL kernels that exercise the language, shared by tests that run them (CPU,
// GPU) and by the test that compiles every generated kernel with NVRTC.
#pragma once

#include <string>
#include <vector>

#include "kerf/dsl/dsl.h"
#include "kerf/kernels/kernels.h"

namespace kerf::test {

using namespace kerf::dsl;

// out[i] = x[i] + y[i]
inline const Kernel& vec_add_kernel() {
  static const Kernel k("vec_add", [](Builder& b) {
    auto x = b.tensor("x", 1), y = b.tensor("y", 1), out = b.tensor("out", 1);
    const int64_t B = b.meta("BLOCK");
    auto i = program_id(0) * B + arange(B);
    auto m = i < x.dim(0);
    store(out, {i}, load(x, {i}, m) + load(y, {i}, m), m);
  });
  return k;
}

// out = softmax(x) along rows, computed in f32; one program per BM rows.
inline const Kernel& softmax_kernel() {
  static const Kernel k("row_softmax", [](Builder& b) {
    auto x = b.tensor("x", 2), out = b.tensor("out", 2);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN");
    auto rows = program_id(0) * BM + arange(BM);
    auto cols = arange(BN);
    auto m = (rows.col() < x.dim(0)) & (cols.row() < x.dim(1));
    auto v = where(m, load(x, {rows.col(), cols.row()}, m).to(DType::f32), -1e30);
    auto e = exp(v - max(v, 1).col());
    store(out, {rows.col(), cols.row()}, (e / sum(e, 1).col()).to(out.dtype()), m);
  });
  return k;
}

// C = A @ B with a K loop carrying the accumulator (TF32 = 1: f32 tiles as TF32, as for
// the next two kernels).
inline const Kernel& matmul_kernel() {
  static const Kernel k("matmul", [](Builder& b) {
    auto A = b.tensor("A", 2), B = b.tensor("B", 2), C = b.tensor("C", 2);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN"), BK = b.meta("BK");
    auto rm = program_id(0) * BM + arange(BM);
    auto rn = program_id(1) * BN + arange(BN);
    const DotPrecision precision = b.meta("TF32", 0) ? DotPrecision::tf32 : DotPrecision::ieee;
    auto acc = for_range(0, A.dim(1), BK, zeros({BM, BN}), [&](const Value& k0, const Value& acc) {
      auto rk = k0 + arange(BK);
      auto a = load(A, {rm.col(), rk.row()}, (rm.col() < A.dim(0)) & (rk.row() < A.dim(1)));
      auto bb = load(B, {rk.col(), rn.row()}, (rk.col() < B.dim(0)) & (rn.row() < B.dim(1)));
      return dot(a, bb, acc, 0, precision);
    });
    store(C, {rm.col(), rn.row()}, acc.to(C.dtype()), (rm.col() < C.dim(0)) & (rn.row() < C.dim(1)));
  });
  return k;
}

// C = sum over K blocks kb of A[:, block kb] @ Bs[kb % WAYS], with Bs = B0, B1, B2
// ([BK, N] each; WAYS 2 or 3) loaded before the loop: the dot's B operand is chosen
// among tiles defined outside the loop by a condition the same in every thread.
inline const Kernel& alternating_matmul_kernel() {
  static const Kernel k("alternating_matmul", [](Builder& b) {
    auto A = b.tensor("A", 2), B0 = b.tensor("B0", 2), B1 = b.tensor("B1", 2), B2 = b.tensor("B2", 2);
    auto C = b.tensor("C", 2);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN"), BK = b.meta("BK"), ways = b.meta("WAYS");
    auto rm = program_id(0) * BM + arange(BM);
    auto rn = program_id(1) * BN + arange(BN);
    auto rb = arange(BK);
    const DotPrecision precision = b.meta("TF32", 0) ? DotPrecision::tf32 : DotPrecision::ieee;
    std::vector<Value> bs;
    for (const Tensor& t : {B0, B1, B2})
      bs.push_back(load(t, {rb.col(), rn.row()}, (rb.col() < t.dim(0)) & (rn.row() < t.dim(1))));
    auto acc = for_range(0, A.dim(1), BK, zeros({BM, BN}), [&](const Value& k0, const Value& acc) {
      auto rk = k0 + arange(BK);
      auto a = load(A, {rm.col(), rk.row()}, (rm.col() < A.dim(0)) & (rk.row() < A.dim(1)));
      auto way = (k0 / BK) % ways;
      Value bb = bs[size_t(ways - 1)];
      for (int64_t q = ways - 2; q >= 0; --q) bb = where(way == q, bs[size_t(q)], bb);
      return dot(a, bb, acc, 0, precision);
    });
    store(C, {rm.col(), rn.row()}, acc.to(C.dtype()), (rm.col() < C.dim(0)) & (rn.row() < C.dim(1)));
  });
  return k;
}

// C = At^T @ Bt^T with At [K, M] and Bt [N, K]: both dot operands are transposes
// of loaded tiles (read transposed from shared memory on the GPU).
inline const Kernel& matmul_t_kernel() {
  static const Kernel k("matmul_t", [](Builder& b) {
    auto At = b.tensor("At", 2), Bt = b.tensor("Bt", 2), C = b.tensor("C", 2);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN"), BK = b.meta("BK");
    auto rm = program_id(0) * BM + arange(BM);
    auto rn = program_id(1) * BN + arange(BN);
    const DotPrecision precision = b.meta("TF32", 0) ? DotPrecision::tf32 : DotPrecision::ieee;
    auto acc = for_range(0, At.dim(0), BK, zeros({BM, BN}), [&](const Value& k0, const Value& acc) {
      auto rk = k0 + arange(BK);
      auto at = load(At, {rk.col(), rm.row()}, (rk.col() < At.dim(0)) & (rm.row() < At.dim(1)));  // [BK, BM]
      auto bt = load(Bt, {rn.col(), rk.row()}, (rn.col() < Bt.dim(0)) & (rk.row() < Bt.dim(1)));  // [BN, BK]
      return dot(trans(at), trans(bt), acc, 0, precision);
    });
    store(C, {rm.col(), rn.row()}, acc.to(C.dtype()), (rm.col() < C.dim(0)) & (rn.row() < C.dim(1)));
  });
  return k;
}

// out[j] += sum over this program's rows of x[i, j]: many programs add into one output.
inline const Kernel& column_sum_atomic_kernel() {
  static const Kernel k("column_sum_atomic", [](Builder& b) {
    auto x = b.tensor("x", 2), out = b.tensor("out", 1);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN");
    auto rows = program_id(0) * BM + arange(BM);
    auto cols = program_id(1) * BN + arange(BN);
    auto m = (rows.col() < x.dim(0)) & (cols.row() < x.dim(1));
    atomic_add(out, {cols}, sum(load(x, {rows.col(), cols.row()}, m), 0), cols < x.dim(1));
  });
  return k;
}

// Column sums and sums of squares of x [M, N] over clusters: program i owns rows
// [i*BM, (i+1)*BM) and walks the columns BN at a time, adding each step's column
// sums with cluster_atomic_add (the cluster's programs sum on chip first), then
// its rows' total of squares once (a second cluster sum, outside the loop).
inline const Kernel& cluster_sum_kernel() {
  static const Kernel k("cluster_sum", [](Builder& b) {
    auto x = b.tensor("x", 2), out = b.tensor("out", 1, DType::f32), sq = b.tensor("sq", 1, DType::f32);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN");
    auto rows = program_id(0) * BM + arange(BM);
    auto row_ok = rows.col() < x.dim(0);
    auto total = for_range(literal(int64_t(0)), x.dim(1), BN, zeros({BM}), [&](const Value& c0, const Value& acc) {
      auto cols = c0 + arange(BN);
      auto m = row_ok & (cols.row() < x.dim(1));
      auto tile = load(x, {rows.col(), cols.row()}, m).to(DType::f32);
      cluster_atomic_add(out, {cols}, sum(tile, 0), cols < x.dim(1));
      return acc + sum(tile * tile, 1);
    });
    cluster_atomic_add(sq, {arange(BM) % 4}, total, rows < x.dim(0));
  });
  return k;
}

// cluster_load: x [R, C, E] with its last dimension the one the cluster's programs
// share; program (e, i, j) reads tile [BM, BN] at rows i*BM.., columns j*BN.. of x[..., e]
// (e = program_id(0): the cluster's first program's e plus the program's rank) and
// writes it to out[e] ([E, R, C]), where e < E; a program past it (the grid's first axis
// rounded up to whole clusters) adds up what it read into past[j] (zeros).
inline const Kernel& cluster_gather_kernel() {
  static const Kernel k("cluster_gather", [](Builder& b) {
    auto x = b.tensor("x", 3), out = b.tensor("out", 3), past = b.tensor("past", 1, DType::f32);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN");
    auto e = program_id(0);
    auto rows = program_id(1) * BM + arange(BM);
    auto cols = program_id(2) * BN + arange(BN);
    auto m = (rows.col() < x.dim(0)) & (cols.row() < x.dim(1));
    auto v = cluster_load(x, {rows.col(), cols.row()}, e, m);
    store(out, {e, rows.col(), cols.row()}, v, m & (e < x.dim(2)));
    atomic_add(past, {program_id(2)}, sum(sum(abs(v.to(DType::f32)), 1), 0), e >= x.dim(2));
  });
  return k;
}

// A grab bag of elementwise ops, casts and selects over one tile.
inline const Kernel& elementwise_kernel() {
  static const Kernel k("elementwise_mix", [](Builder& b) {
    auto x = b.tensor("x", 1), y = b.tensor("y", 1), out = b.tensor("out", 1), iout = b.tensor("iout", 1);
    const int64_t B = b.meta("BLOCK");
    auto i = program_id(0) * B + arange(B);
    auto m = i < x.dim(0);
    auto a = load(x, {i}, m, 1.0).to(DType::f32);
    auto c = load(y, {i}, m, 2.0).to(DType::f32);
    auto r = maximum(sqrt(abs(a)) + rsqrt(abs(c) + 1.0f), exp(minimum(a, c))) - log(abs(c) + 1.0f);
    r = where(a > c, r, -r);
    store(out, {i}, r.to(out.dtype()), m);
    auto ii = i.to(DType::i64) * 3 / 2 % 7 - (i >> 1) + (i & 5);
    store(iout, {i}, where(m, ii.to(DType::i32), 0).to(iout.dtype()), m);
  });
  return k;
}

// In place, tile by tile along the columns: x <- 2x + 1 (or, with SHIFT = 1,
// x[:, j] <- 2 x[:, j+1] + 1, which reads what a later iteration has not yet written).
inline const Kernel& inplace_kernel() {
  static const Kernel k("inplace_update", [](Builder& b) {
    auto x = b.tensor("x", 2);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN"), shift = b.meta("SHIFT", 0);
    auto rows = program_id(0) * BM + arange(BM);
    for_range(0, x.dim(1), BN, [&](const Value& c0) {
      auto cols = c0 + arange(BN);
      auto src = shift ? cols + shift : cols;
      auto m = (rows.col() < x.dim(0)) & (src.row() < x.dim(1));
      auto v = load(x, {rows.col(), src.row()}, m);
      store(x, {rows.col(), cols.row()}, v * 2 + 1, m);
    });
  });
  return k;
}

// Language corners in one kernel: a rank-3 tile reduced along axis 0, a scalar
// load broadcast into a tile, and a dot too small for tensor cores.
//   out[j, k] = sum_e x[e, j, k] * g[0] + (a @ b)[j, k]
// x [E, J, K] with E=4, J=8, K=16 tiles; a [8, 16], b [16, 16] (any float dtype).
inline const Kernel& corners_kernel() {
  static const Kernel k("language_corners", [](Builder& b) {
    auto x = b.tensor("x", 3), g = b.tensor("g", 1), a = b.tensor("a", 2), bb = b.tensor("b", 2);
    auto out = b.tensor("out", 2);
    auto e = arange(4), j = arange(8), kk = arange(16), k2 = arange(16);
    auto e3 = e[{_, newaxis, newaxis}], j3 = j[{newaxis, _, newaxis}], k3 = kk[{newaxis, newaxis, _}];
    auto m3 = (e3 < x.dim(0)) & (j3 < x.dim(1)) & (k3 < x.dim(2));
    auto t = load(x, {e3, j3, k3}, m3).to(DType::f32);          // [4, 8, 16]
    auto gain = load(g, {literal(int64_t(0))}).to(DType::f32);  // a scalar
    auto at = load(a, {j.col(), k2.row()}, (j.col() < a.dim(0)) & (k2.row() < a.dim(1)));
    auto bt = load(bb, {k2.col(), kk.row()}, (k2.col() < bb.dim(0)) & (kk.row() < bb.dim(1)));
    auto r = sum(t, 0) * gain + dot(at, bt);                      // [8, 16]
    auto m2 = (j.col() < out.dim(0)) & (kk.row() < out.dim(1));
    store(out, {j.col(), kk.row()}, r.to(out.dtype()), m2);
  });
  return k;
}

// Each program takes a ticket (old counter value, acquire-release) and records
// it; then adds its values into x and records the old values of x.
inline const Kernel& ticket_kernel() {
  static const Kernel k("ticket", [](Builder& b) {
    auto counter = b.tensor("counter", 1), tickets = b.tensor("tickets", 1);
    auto x = b.tensor("x", 1), old = b.tensor("old", 1);
    const int64_t B = b.meta("BLOCK");
    auto pid = program_id(0);
    auto t = atomic_add(counter, {literal(int64_t(0))}, literal(int64_t(1)), Value(), MemoryOrder::acq_rel);
    store(tickets, {pid}, t);
    auto i = pid * B + arange(B);
    auto m = i < x.dim(0);
    store(old, {i}, atomic_add(x, {i}, broadcast_to(literal(1.0), {B}), m), m);
  });
  return k;
}

// Bytes as storage: each u8 of `packed` [rows, cols] holds two 4-bit codes
// (high nibble first) looked up in `table` [16] into out [rows, 2*cols] (the
// second one plus the byte's value); bytes_out = (7 * byte + 3) mod 256.
inline const Kernel& nibbles_kernel() {
  static const Kernel k("nibbles", [](Builder& b) {
    auto packed = b.tensor("packed", 2), table = b.tensor("table", 1);
    auto out = b.tensor("out", 2), bytes_out = b.tensor("bytes_out", 2);
    const int64_t BM = b.meta("BM"), BC = b.meta("BC");
    auto r = program_id(0) * BM + arange(BM);
    auto c = program_id(1) * BC + arange(BC);
    auto ok = (r.col() < packed.dim(0)) & (c.row() < packed.dim(1));
    auto q = load(packed, {r.col(), c.row()}, ok);  // u8 [BM, BC]
    auto hi = q >> 4, lo = q & 15;                  // i32: u8 meets integers as i32
    store(out, {r.col(), 2 * c.row()}, load(table, {hi}, ok), ok);
    store(out, {r.col(), 2 * c.row() + 1}, load(table, {lo}, ok) + q.to(DType::f32), ok);
    store(bytes_out, {r.col(), c.row()}, (q * 7 + 3).to(DType::u8), ok);
  });
  return k;
}

// interleave(): out[i, 2j] = 2 x[i, j], out[i, 2j+1] = y[i, j] + 1 (stored as
// is), acc = p @ q + interleave(x, y) (a dot's accumulator), and the 1-D
// pair = interleave(x[0, :H], y[0, :H]) for H = 32 (spread over lanes).
inline const Kernel& interleave_kernel() {
  static const Kernel k("interleave", [](Builder& b) {
    auto x = b.tensor("x", 2), y = b.tensor("y", 2), p = b.tensor("p", 2), q = b.tensor("q", 2);
    auto out = b.tensor("out", 2), acc = b.tensor("acc", 2), pair = b.tensor("pair", 1);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN"), K = b.meta("K");
    auto r = program_id(0) * BM + arange(BM);
    auto c = arange(BN), c2 = arange(2 * BN), kk = arange(K);
    auto ok = (r.col() < x.dim(0)) & (c.row() < x.dim(1));
    auto ok2 = (r.col() < x.dim(0)) & (c2.row() < 2 * x.dim(1));
    auto xv = load(x, {r.col(), c.row()}, ok).to(DType::f32), yv = load(y, {r.col(), c.row()}, ok).to(DType::f32);
    store(out, {r.col(), c2.row()}, interleave(xv * 2.0, yv + 1.0).to(out.dtype()), ok2);
    auto pv = load(p, {r.col(), kk.row()}, r.col() < x.dim(0));
    auto qv = load(q, {kk.col(), c2.row()}, c2.row() < 2 * x.dim(1));
    store(acc, {r.col(), c2.row()}, dot(pv, qv, interleave(xv, yv)).to(acc.dtype()), ok2);
    auto h = arange(32);
    auto first = program_id(0) == 0;
    auto hx = load(x, {literal(int64_t(0)), h}, (h < x.dim(1)) & first).to(DType::f32);
    auto hy = load(y, {literal(int64_t(0)), h}, (h < x.dim(1)) & first).to(DType::f32);
    auto h2 = arange(64);
    store(pair, {h2}, interleave(hx, hy).to(pair.dtype()), (h2 < 2 * x.dim(1)) & first);
  });
  return k;
}

// Table lookups with gather(): the table (T entries, loaded once) is read
// through i32 indices (any value: they wrap), u8 bytes and their high nibbles,
// inside a loop over column tiles. out = tab[i] + tab[b]/2 + tab[b >> 4]/4.
inline const Kernel& gather_kernel() {
  static const Kernel k("gather", [](Builder& b) {
    auto table = b.tensor("table", 1), idx = b.tensor("idx", 2), bytes = b.tensor("bytes", 2);
    auto out = b.tensor("out", 2);
    const int64_t T = b.meta("T"), BM = b.meta("BM"), BN = b.meta("BN");
    auto t = arange(0, T);
    auto tab = load(table, {t}, t < table.dim(0));
    auto r = program_id(0) * BM + arange(BM);
    for_range(0, out.dim(1), BN, [&](const Value& j0) {
      auto c = j0 + arange(BN);
      auto ok = (r.col() < out.dim(0)) & (c.row() < out.dim(1));
      auto i = load(idx, {r.col(), c.row()}, ok);
      auto q = load(bytes, {r.col(), c.row()}, ok);  // u8
      auto v = gather(tab, i).to(DType::f32) + gather(tab, q).to(DType::f32) * 0.5 +
               gather(tab, q >> 4).to(DType::f32) * 0.25;
      store(out, {r.col(), c.row()}, v.to(out.dtype()), ok);
    });
  });
  return k;
}

// y = 2x + 1 stored evict-last, then the lines of this program's y put back to
// normal priority, one element per 128-byte line (BLOCK a multiple of 32): the
// hints change no value.   x [N] f32, y [N] f32
inline const Kernel& l2_keep_kernel() {
  static const Kernel k("l2_keep", [](Builder& b) {
    auto x = b.tensor("x", 1), y = b.tensor("y", 1);
    const int64_t BLOCK = b.meta("BLOCK");
    auto i = program_id(0) * BLOCK + arange(BLOCK);
    auto ok = i < x.dim(0);
    store(y, {i}, load(x, {i}, ok) * 2.0 + 1.0, ok, Evict::last);
    auto line = program_id(0) * BLOCK + arange(BLOCK / 32) * 32;
    l2_evict_normal(y, {line}, line < y.dim(0));
  });
  return k;
}

// A pair for programmatic dependent launch. The producer's programs each own BM
// rows of y and, after REPEAT passes over their rows of x (work that keeps it
// running), store y = 2x + 1 (RELEASE: its dependents may start as it begins).
// The consumer sums x * y per row: x is read before the wait (an input of
// both), y after it. WAIT: 0 none, 1 at the top level before the loop, 2 in
// the loop body between the loads of x and y.
//   producer: x [M, N], y [M, N]      consumer: x [M, N], y [M, N], out [M] f32
inline const Kernel& overlap_producer_kernel() {
  static const Kernel k("overlap_producer", [](Builder& b) {
    auto x = b.tensor("x", 2), y = b.tensor("y", 2);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN"), repeat = b.meta("REPEAT", 1);
    if (b.meta("RELEASE", 0)) release_dependents();
    auto rows = program_id(0) * BM + arange(BM);
    auto row_ok = rows.col() < x.dim(0);
    auto scale = for_range(0, int(repeat), 1, zeros({BM, 1}), [&](const Value&, const Value& acc) {
      return for_range(0, x.dim(1), BN, acc, [&](const Value& c0, const Value& a) {
        auto cols = c0 + arange(BN);
        auto v = load(x, {rows.col(), cols.row()}, row_ok & (cols.row() < x.dim(1))).to(DType::f32);
        return a + expand_dims(sum(v * 0.0, 1), 1);  // 0, but only after reading the row
      });
    });
    for_range(0, x.dim(1), BN, [&](const Value& c0) {
      auto cols = c0 + arange(BN);
      auto m = row_ok & (cols.row() < x.dim(1));
      auto v = load(x, {rows.col(), cols.row()}, m).to(DType::f32);
      store(y, {rows.col(), cols.row()}, (v * 2.0 + 1.0 + scale).to(y.dtype()), m);
    });
  });
  return k;
}

inline const Kernel& overlap_consumer_kernel() {
  static const Kernel k("overlap_consumer", [](Builder& b) {
    auto x = b.tensor("x", 2), y = b.tensor("y", 2), out = b.tensor("out", 1, DType::f32);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN"), wait = b.meta("WAIT", 0);
    auto rows = program_id(0) * BM + arange(BM);
    auto row_ok = rows.col() < x.dim(0);
    if (wait == 1) wait_prior_grid();
    auto acc = for_range(0, x.dim(1), BN, zeros({BM, BN}), [&](const Value& c0, const Value& a) {
      auto cols = c0 + arange(BN);
      auto m = row_ok & (cols.row() < x.dim(1));
      auto xv = load(x, {rows.col(), cols.row()}, m).to(DType::f32);
      if (wait == 2) wait_prior_grid();
      auto yv = load(y, {rows.col(), cols.row()}, m).to(DType::f32);
      return a + xv * yv;
    });
    store(out, {rows}, sum(acc, 1), rows < x.dim(0));
  });
  return k;
}

}  // namespace kerf::test
