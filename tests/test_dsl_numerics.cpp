// DSL kernels (vector add, row softmax, tiled matmul with dot and a carried
// accumulator, atomic column sums, an elementwise mix) against float64
// references on fresh random data and odd shapes, in fp32, bf16 and fp16, on
// the CPU back end and on the GPU. Outputs are poisoned before each run, so an
// element left unwritten fails.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <random>

#include "catch.h"
#include "device_tensor.h"
#include "gpu_test_util.h"
#include "kerf/jit/cpu_backend.h"
#include "kerf/jit/launch.h"
#include "sample_kernels.h"

using namespace kerf;
using kerf::test::TestTensor;

namespace {

void sync(Device dev) {
  if (dev.is_cuda()) cuda::device_synchronize(dev.index);
}

uint32_t cdiv(int64_t a, int64_t b) { return uint32_t((a + b - 1) / b); }

void vec_add(Device dev, DType d, int64_t n, uint64_t seed) {
  CAPTURE(dev.str(), dtype_name(d), n, seed);
  std::mt19937_64 rng(seed);
  TestTensor x(d, {n}, dev), y(d, {n}, dev), out(d, {n}, dev);
  x.randomize(rng);
  y.randomize(rng);
  out.poison();
  launch(test::vec_add_kernel(), {x.view(), y.view(), out.view()}, Grid{cdiv(n, 256)}, {{"BLOCK", 256}});
  sync(dev);
  out.download();
  std::vector<double> got, ref;
  for (int64_t i = 0; i < n; ++i) {
    ref.push_back(x.get(i) + y.get(i));
    got.push_back(out.get(i));
  }
  CHECK(test::max_relative_error(got, ref, 1e-3) <= test::tolerance(d));
}

void softmax(Device dev, DType d, int64_t rows, int64_t cols, uint64_t seed) {
  CAPTURE(dev.str(), dtype_name(d), rows, cols, seed);
  std::mt19937_64 rng(seed);
  TestTensor x(d, {rows, cols}, dev), out(d, {rows, cols}, dev);
  x.randomize(rng, -4, 4);
  out.poison();
  launch(test::softmax_kernel(), {x.view(), out.view()}, Grid{cdiv(rows, 4)}, {{"BM", 4}, {"BN", 256}});
  sync(dev);
  out.download();
  std::vector<double> got, ref;
  for (int64_t i = 0; i < rows; ++i) {
    double mx = -1e300, s = 0;
    for (int64_t j = 0; j < cols; ++j) mx = std::max(mx, x.get(i * cols + j));
    for (int64_t j = 0; j < cols; ++j) s += std::exp(x.get(i * cols + j) - mx);
    for (int64_t j = 0; j < cols; ++j) {
      ref.push_back(std::exp(x.get(i * cols + j) - mx) / s);
      got.push_back(out.get(i * cols + j));
    }
  }
  CHECK(test::max_relative_error(got, ref, 1e-3) <= test::tolerance(d));
}

// An operand's value as the dot multiplies it: TF32 (meta TF32 = 1) rounds f32 operands on
// the GPU; the CPU back end multiplies them in f32 as they are.
double as_multiplied(double x, const dsl::MetaMap& meta, Device dev) {
  return meta.count("TF32") && meta.at("TF32") && dev.is_cuda() ? test::tf32(x) : x;
}

// C = A @ B; with `transposed`, A and B are given as At [K, M] and Bt [N, K]
// (matmul_t: both dot operands are trans() of loaded tiles). With TF32 (f32 tiles) the
// reference multiplies the operands as the GPU takes them, so the layouts of the
// instructions' fragments and the rounding are both checked to f32's tolerance.
void matmul(Device dev, DType d, int64_t M, int64_t N, int64_t K, const dsl::MetaMap& meta, uint64_t seed,
            bool transposed = false) {
  CAPTURE(dev.str(), dtype_name(d), M, N, K, seed, transposed, meta.count("TF32"));
  std::mt19937_64 rng(seed);
  TestTensor A(d, transposed ? std::vector<int64_t>{K, M} : std::vector<int64_t>{M, K}, dev),
      B(d, transposed ? std::vector<int64_t>{N, K} : std::vector<int64_t>{K, N}, dev), C(d, {M, N}, dev);
  A.randomize(rng);
  B.randomize(rng);
  C.poison();
  launch(transposed ? test::matmul_t_kernel() : test::matmul_kernel(), {A.view(), B.view(), C.view()},
         Grid{cdiv(M, meta.at("BM")), cdiv(N, meta.at("BN"))}, meta);
  sync(dev);
  C.download();
  const auto a = [&](int64_t i, int64_t k) {
    return as_multiplied(transposed ? A.get(k * M + i) : A.get(i * K + k), meta, dev);
  };
  const auto b = [&](int64_t k, int64_t j) {
    return as_multiplied(transposed ? B.get(j * K + k) : B.get(k * N + j), meta, dev);
  };
  std::vector<double> got, ref;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += a(i, k) * b(k, j);
      ref.push_back(s);
      got.push_back(C.get(i * N + j));
    }
  // Entries near zero are compared against the scale of a row of products.
  CHECK(test::max_relative_error(got, ref, std::sqrt(double(K)) / 4) <= test::tolerance(d));
}

// alternating_matmul: K blocks multiplied by B0, B1 (, B2) in turn.
void alternating_matmul(Device dev, DType d, int64_t M, int64_t N, int64_t K, int64_t ways, const dsl::MetaMap& meta,
                        uint64_t seed) {
  CAPTURE(dev.str(), dtype_name(d), M, N, K, ways, seed);
  std::mt19937_64 rng(seed);
  const int64_t BK = meta.at("BK");
  TestTensor A(d, {M, K}, dev), B0(d, {BK, N}, dev), B1(d, {BK, N}, dev), B2(d, {BK, N}, dev), C(d, {M, N}, dev);
  for (TestTensor* t : {&A, &B0, &B1, &B2}) t->randomize(rng);
  C.poison();
  dsl::MetaMap m = meta;
  m["WAYS"] = ways;
  launch(test::alternating_matmul_kernel(), {A.view(), B0.view(), B1.view(), B2.view(), C.view()},
         Grid{cdiv(M, meta.at("BM")), cdiv(N, meta.at("BN"))}, m);
  sync(dev);
  C.download();
  const TestTensor* bs[] = {&B0, &B1, &B2};
  std::vector<double> got, ref;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += as_multiplied(A.get(i * K + k), meta, dev) *
             as_multiplied(bs[(k / BK) % ways]->get((k % BK) * N + j), meta, dev);
      ref.push_back(s);
      got.push_back(C.get(i * N + j));
    }
  CHECK(test::max_relative_error(got, ref, std::sqrt(double(K)) / 4) <= test::tolerance(d));
}

void column_sums(Device dev, int64_t rows, int64_t cols, uint64_t seed) {
  CAPTURE(dev.str(), rows, cols, seed);
  std::mt19937_64 rng(seed);
  TestTensor x(DType::f32, {rows, cols}, dev), out(DType::f32, {cols}, dev);
  x.randomize(rng);
  for (int64_t j = 0; j < cols; ++j) out.set(j, 0.0);
  out.upload();
  launch(test::column_sum_atomic_kernel(), {x.view(), out.view()}, Grid{cdiv(rows, 16), cdiv(cols, 64)},
         {{"BM", 16}, {"BN", 64}});
  sync(dev);
  out.download();
  std::vector<double> got, ref;
  for (int64_t j = 0; j < cols; ++j) {
    double s = 0;
    for (int64_t i = 0; i < rows; ++i) s += x.get(i * cols + j);
    ref.push_back(s);
    got.push_back(out.get(j));
  }
  CHECK(test::max_relative_error(got, ref, 1.0) <= 1e-5);
}

// cluster_atomic_add: clusters of 1, 2, 3 and 4 programs, the grid's row blocks
// padded to whole clusters (the programs past the rows add nothing).
void cluster_sums(Device dev, DType d, int64_t rows, int64_t cols, int64_t cluster, int64_t warps, uint64_t seed) {
  CAPTURE(dev.str(), dtype_name(d), rows, cols, cluster, warps, seed);
  std::mt19937_64 rng(seed);
  TestTensor x(d, {rows, cols}, dev), out(DType::f32, {cols}, dev), sq(DType::f32, {4}, dev);
  x.randomize(rng);
  for (int64_t j = 0; j < cols; ++j) out.set(j, 0.0);
  for (int64_t j = 0; j < 4; ++j) sq.set(j, 0.0);
  out.upload();
  sq.upload();
  const uint32_t blocks = uint32_t(cdiv(cdiv(rows, 32), cluster) * cluster);
  launch(test::cluster_sum_kernel(), {x.view(), out.view(), sq.view()}, Grid{blocks},
         {{"BM", 32}, {"BN", 64}, {"cluster_size", cluster}, {"num_warps", warps}, {"num_stages", 2}});
  sync(dev);
  out.download();
  sq.download();
  std::vector<double> got, ref, got_sq, ref_sq(4, 0.0);
  for (int64_t j = 0; j < cols; ++j) {
    double s = 0;
    for (int64_t i = 0; i < rows; ++i) s += x.get(i * cols + j);
    ref.push_back(s);
    got.push_back(out.get(j));
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) ref_sq[size_t(i % 4)] += x.get(i * cols + j) * x.get(i * cols + j);
  for (int64_t j = 0; j < 4; ++j) got_sq.push_back(sq.get(j));
  CHECK(test::max_relative_error(got, ref, 1.0) <= 1e-5);
  CHECK(test::max_relative_error(got_sq, ref_sq, 1.0) <= 1e-5);
  // A grid that is not whole clusters is refused before the launch.
  if (cluster > 1)
    CHECK_THROWS_WITH(launch(test::cluster_sum_kernel(), {x.view(), out.view(), sq.view()}, Grid{blocks + 1},
                             {{"BM", 32}, {"BN", 64}, {"cluster_size", cluster}}),
                      Catch::Contains("must be a multiple of its cluster_size " + std::to_string(cluster)));
}

// cluster_load: clusters of 1, 2, 4, 8 and 3 programs over the last dimension of x
// [rows, cols, E]; `pad` widens that dimension in memory (x is a view of [rows, cols,
// E + pad]): with pad 0 each cluster's neighbours are one aligned vector, with an odd pad
// most are not (read one by one). Masked rows and columns past the tile edges read 0 and
// are not written. The grid's first axis is E rounded up to whole clusters: the programs
// past E read zeros (summed into `past`, which must stay 0) and hand the others theirs.
void cluster_gathers(Device dev, DType d, int64_t rows, int64_t cols, int64_t E, int64_t pad, int64_t cluster,
                     int64_t warps, uint64_t seed, int64_t BM = 32, int64_t BN = 16) {
  CAPTURE(dev.str(), dtype_name(d), rows, cols, E, pad, cluster, warps, seed, BM, BN);
  std::mt19937_64 rng(seed);
  TestTensor x(d, {rows, cols, E + pad}, dev), out(d, {E, rows, cols}, dev), past(DType::f32, {cdiv(cols, BN)}, dev);
  x.randomize(rng);
  out.poison();
  for (int64_t j = 0; j < past.numel(); ++j) past.set(j, 0.0);
  past.upload();
  launch(test::cluster_gather_kernel(),
         {x.view({rows, cols, E}, {cols * (E + pad), E + pad, 1}), out.view(), past.view()},
         Grid{uint32_t(cdiv(E, cluster) * cluster), uint32_t(cdiv(rows, BM)), uint32_t(cdiv(cols, BN))},
         {{"BM", BM}, {"BN", BN}, {"cluster_size", cluster}, {"num_warps", warps}});
  sync(dev);
  out.download();
  past.download();
  int64_t wrong = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        wrong += out.get((e * rows + i) * cols + j) != x.get((i * cols + j) * (E + pad) + e);
  CHECK(wrong == 0);
  for (int64_t j = 0; j < past.numel(); ++j) CHECK(past.get(j) == 0.0);
}

void elementwise(Device dev, DType d, int64_t n, uint64_t seed) {
  CAPTURE(dev.str(), dtype_name(d), n, seed);
  std::mt19937_64 rng(seed);
  TestTensor x(d, {n}, dev), y(d, {n}, dev), out(d, {n}, dev), iout(DType::i64, {n}, dev);
  x.randomize(rng, -3, 3);
  y.randomize(rng, -3, 3);
  out.poison();
  iout.poison();
  launch(test::elementwise_kernel(), {x.view(), y.view(), out.view(), iout.view()}, Grid{cdiv(n, 256)},
         {{"BLOCK", 256}});
  sync(dev);
  out.download();
  iout.download();
  std::vector<double> got, ref;
  for (int64_t i = 0; i < n; ++i) {
    const double a = float(x.get(i)), c = float(y.get(i));
    double r = std::max(std::sqrt(std::abs(a)) + 1.0 / std::sqrt(std::abs(c) + 1.0), std::exp(std::min(a, c))) -
               std::log(std::abs(c) + 1.0);
    r = a > c ? r : -r;
    ref.push_back(r);
    got.push_back(out.get(i));
    const int64_t ii = (i * 3 / 2) % 7 - (i >> 1) + (i & 5);
    CHECK(int64_t(iout.get(i)) == ii);
  }
  // The result subtracts terms of size up to e^3; compare against that scale.
  CHECK(test::max_relative_error(got, ref, 20.0) <= test::tolerance(d));
}

// Atomics return old values: tickets are a permutation of 0..P-1 and the old
// values of x are what x held.
void tickets(Device dev, int64_t n, uint64_t seed) {
  CAPTURE(dev.str(), n, seed);
  std::mt19937_64 rng(seed);
  const int64_t programs = (n + 63) / 64;
  TestTensor counter(DType::i32, {1}, dev), tick(DType::i32, {programs}, dev);
  TestTensor x(DType::f32, {n}, dev), old(DType::f32, {n}, dev);
  counter.set(0, 0);
  counter.upload();
  tick.poison();
  x.randomize(rng);
  std::vector<double> x0;
  for (int64_t i = 0; i < n; ++i) x0.push_back(x.get(i));
  old.poison();
  launch(test::ticket_kernel(), {counter.view(), tick.view(), x.view(), old.view()}, Grid{uint32_t(programs)},
         {{"BLOCK", 64}});
  sync(dev);
  counter.download();
  tick.download();
  x.download();
  old.download();
  CHECK(int64_t(counter.get(0)) == programs);
  std::vector<int> seen(size_t(programs), 0);
  for (int64_t p = 0; p < programs; ++p) {
    const int64_t t = int64_t(tick.get(p));
    REQUIRE(t >= 0);
    REQUIRE(t < programs);
    seen[size_t(t)]++;
  }
  for (int s : seen) CHECK(s == 1);
  for (int64_t i = 0; i < n; ++i) {
    CHECK(old.get(i) == x0[size_t(i)]);
    CHECK(x.get(i) == double(float(x0[size_t(i)] + 1.0)));
  }
}

// Loops whose bounds are i64 scalars count in i64: row sums over column blocks (a
// pipelined load per step on the GPU, indices from the i64 counter), and a loop whose
// bounds and step lie outside the i32 range, which counts its steps and sums its counter.
const dsl::Kernel& wide_loop_kernel() {
  using namespace kerf::dsl;
  static const Kernel k("wide_loops", [](Builder& b) {
    const Tensor x = b.tensor("x", 2), out = b.tensor("out", 1), stats = b.tensor("stats", 1, DType::i64);
    const Value lo = b.scalar("lo", DType::i64), hi = b.scalar("hi", DType::i64), step = b.scalar("step", DType::i64);
    const Value big_lo = b.scalar("big_lo", DType::i64), big_hi = b.scalar("big_hi", DType::i64);
    const Value big_step = b.scalar("big_step", DType::i64);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN");
    const Value r = program_id(0) * BM + arange(BM);
    const Value acc = for_range(lo, hi, step, zeros({BM, BN}), [&](const Value& iv, const Value& a) {
      const Value c = iv + arange(BN);
      return a + load(x, {r.col(), c.row()}, (r.col() < x.dim(0)) & (c.row() < x.dim(1)), 0.0);
    });
    store(out, {r}, sum(acc, 1), r < x.dim(0));
    const std::vector<Value> n = for_range(big_lo, big_hi, big_step,
                                           {constant(0, DType::i64), constant(0, DType::i64)},
                                           [&](const Value& iv, const std::vector<Value>& c) {
                                             return std::vector<Value>{c[0] + 1, c[1] + iv};
                                           });
    const Value first = broadcast_to(program_id(0) == 0, {2});
    store(stats, {arange(2)}, where(arange(2) == 0, broadcast_to(n[0], {2}), broadcast_to(n[1], {2})), first);
  });
  return k;
}

void wide_loops(Device dev, int64_t rows, int64_t cols, uint64_t seed) {
  CAPTURE(dev.str(), rows, cols, seed);
  std::mt19937_64 rng(seed);
  TestTensor x(DType::f32, {rows, cols}, dev), out(DType::f32, {rows}, dev), stats(DType::i64, {2}, dev);
  x.randomize(rng);
  struct Big {
    int64_t lo, hi, step;
  };
  for (const Big big : {Big{0, 3000000000, 1000000000}, Big{0, (int64_t(1) << 32) + 5, int64_t(1) << 30},
                        Big{-(int64_t(1) << 32), 0, int64_t(1) << 31}, Big{0, 10, (int64_t(1) << 32) + 1},
                        Big{5, 3, 1}}) {
    CAPTURE(big.lo, big.hi, big.step);
    out.poison();
    stats.poison();
    launch(wide_loop_kernel(),
           {x.view(), out.view(), stats.view(), Scalar(int64_t(0)), Scalar(cols), Scalar(int64_t(32)),
            Scalar(big.lo), Scalar(big.hi), Scalar(big.step)},
           Grid{cdiv(rows, 8)}, {{"BM", 8}, {"BN", 32}, {"num_stages", 3}});
    sync(dev);
    out.download();
    stats.download();
    int64_t count = 0, total = 0;
    for (int64_t i = big.lo; i < big.hi; i += big.step) {
      ++count;
      total += i;
    }
    CHECK(int64_t(stats.get(0)) == count);
    CHECK(int64_t(stats.get(1)) == total);
    // Each row's fp32 sum against its float64 one, relative to the sum of magnitudes (a sum
    // that cancels to near zero keeps the rounding of its terms).
    double worst = 0;
    for (int64_t i = 0; i < rows; ++i) {
      double s = 0, m = 0;
      for (int64_t j = 0; j < cols; ++j) {
        s += x.get(i * cols + j);
        m += std::abs(x.get(i * cols + j));
      }
      worst = std::max(worst, std::abs(out.get(i) - s) / std::max(m, 1e-30));
    }
    CHECK(worst <= test::tolerance(DType::f32));
  }
}

// Eviction hints (evict-last stores, then l2_evict_normal) change no value.
void l2_keep(Device dev, int64_t n, uint64_t seed) {
  CAPTURE(dev.str(), n, seed);
  std::mt19937_64 rng(seed);
  TestTensor x(DType::f32, {n}, dev), y(DType::f32, {n}, dev);
  x.randomize(rng);
  y.poison();
  launch(test::l2_keep_kernel(), {x.view(), y.view()}, Grid{uint32_t((n + 63) / 64)}, {{"BLOCK", 64}});
  sync(dev);
  y.download();
  for (int64_t i = 0; i < n; ++i) CHECK(y.get(i) == double(float(x.get(i) * 2.0 + 1.0)));
}

// x <- 2x + 1 in place (pipelined on the GPU), and the shifted variant whose
// loads must see the data before the store of the same iteration.
void inplace(Device dev, DType d, int64_t rows, int64_t cols, int64_t shift, uint64_t seed) {
  CAPTURE(dev.str(), dtype_name(d), rows, cols, shift, seed);
  std::mt19937_64 rng(seed);
  TestTensor x(d, {rows, cols}, dev);
  x.randomize(rng);
  std::vector<double> x0;
  for (int64_t i = 0; i < rows * cols; ++i) x0.push_back(x.get(i));
  launch(test::inplace_kernel(), {x.view()}, Grid{cdiv(rows, 16)},
         {{"BM", 16}, {"BN", 64}, {"SHIFT", shift}, {"num_stages", 3}});
  sync(dev);
  x.download();
  std::vector<double> got, ref;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      // Tiles are processed left to right; with a shift, column j reads j+1, which
      // a later tile writes only after this one read it.
      const int64_t src = j + shift;
      ref.push_back(src < cols ? 2 * x0[size_t(i * cols + src)] + 1 : x0[size_t(i * cols + j)]);
      got.push_back(x.get(i * cols + j));
    }
  CHECK(test::max_relative_error(got, ref, 1.0) <= test::tolerance(d));
}

void corners(Device dev, DType d, int64_t E, int64_t J, int64_t K, uint64_t seed) {
  CAPTURE(dev.str(), dtype_name(d), E, J, K, seed);
  std::mt19937_64 rng(seed);
  TestTensor x(d, {E, J, K}, dev), g(d, {1}, dev), a(d, {J, K}, dev), b(d, {K, K}, dev), out(d, {J, K}, dev);
  x.randomize(rng);
  g.randomize(rng, 0.5, 2.0);
  a.randomize(rng);
  b.randomize(rng);
  out.poison();
  launch(test::corners_kernel(), {x.view(), g.view(), a.view(), b.view(), out.view()}, Grid{1});
  sync(dev);
  out.download();
  std::vector<double> got, ref;
  for (int64_t j = 0; j < J; ++j)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0, p = 0;
      for (int64_t e = 0; e < E; ++e) s += x.get((e * J + j) * K + k);
      for (int64_t q = 0; q < K; ++q) p += a.get(j * K + q) * b.get(q * K + k);
      ref.push_back(s * g.get(0) + p);
      got.push_back(out.get(j * K + k));
    }
  CHECK(test::max_relative_error(got, ref, 2.0) <= test::tolerance(d));
}

// u8 as a storage type: bytes unpacked into 4-bit codes, a table lookup, and
// bytes written back (truncated to 8 bits). Exact: every value is small.
void nibbles(Device dev, int64_t rows, int64_t cols, uint64_t seed) {
  CAPTURE(dev.str(), rows, cols, seed);
  std::mt19937_64 rng(seed);
  TestTensor packed(DType::u8, {rows, cols}, dev), table(DType::f32, {16}, dev);
  TestTensor out(DType::f32, {rows, 2 * cols}, dev), bytes_out(DType::u8, {rows, cols}, dev);
  for (int64_t i = 0; i < rows * cols; ++i) packed.set(i, double(rng() & 255));
  packed.upload();
  table.randomize(rng, -1, 1);
  out.poison();
  bytes_out.poison();
  launch(test::nibbles_kernel(), {packed.view(), table.view(), out.view(), bytes_out.view()},
         Grid{cdiv(rows, 8), cdiv(cols, 64)}, {{"BM", 8}, {"BC", 64}});
  sync(dev);
  out.download();
  bytes_out.download();
  int64_t wrong = 0;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t q = int64_t(packed.get(i * cols + j));
      wrong += out.get(i * 2 * cols + 2 * j) != table.get(q >> 4);
      wrong += out.get(i * 2 * cols + 2 * j + 1) != double(float(table.get(q & 15) + float(q)));
      wrong += bytes_out.get(i * cols + j) != double((7 * q + 3) & 255);
    }
  CHECK(wrong == 0);
}

// gather(): lookups in a table of T entries through wrapping i32 indices
// (negative and past the end too), u8 bytes and nibbles. Exact up to the one
// rounding of the sum to the output dtype.
void gather(Device dev, DType d, int64_t T, int64_t rows, int64_t cols, int64_t warps, uint64_t seed) {
  CAPTURE(dev.str(), dtype_name(d), T, rows, cols, warps, seed);
  std::mt19937_64 rng(seed);
  TestTensor table(d, {T}, dev), idx(DType::i32, {rows, cols}, dev), bytes(DType::u8, {rows, cols}, dev);
  TestTensor out(d, {rows, cols}, dev);
  table.randomize(rng, -1, 1);
  for (int64_t i = 0; i < rows * cols; ++i) {
    idx.set(i, double(int64_t(rng() % 200) - 100));
    bytes.set(i, double(rng() & 255));
  }
  idx.upload();
  bytes.upload();
  out.poison();
  launch(test::gather_kernel(), {table.view(), idx.view(), bytes.view(), out.view()}, Grid{cdiv(rows, 16)},
         {{"T", T}, {"BM", 16}, {"BN", 64}, {"num_warps", warps}});
  sync(dev);
  out.download();
  const auto tab = [&](int64_t i) { return table.get(i & (T - 1)); };
  std::vector<double> got, ref;
  for (int64_t i = 0; i < rows * cols; ++i) {
    const int64_t q = int64_t(bytes.get(i));
    ref.push_back(tab(int64_t(idx.get(i))) + tab(q) * 0.5 + tab(q >> 4) * 0.25);
    got.push_back(out.get(i));
  }
  CHECK(test::max_relative_error(got, ref, 1.0) <= test::tolerance(d));
}

// interleave(): stored directly, as a dot's accumulator, and over lanes.
void interleave(Device dev, DType d, int64_t rows, int64_t n, int64_t warps, uint64_t seed) {
  CAPTURE(dev.str(), dtype_name(d), rows, n, warps, seed);
  const int64_t BN = 64, K = 16;
  std::mt19937_64 rng(seed);
  TestTensor x(d, {rows, n}, dev), y(d, {rows, n}, dev), p(d, {rows, K}, dev), q(d, {K, 2 * n}, dev);
  TestTensor out(d, {rows, 2 * n}, dev), acc(DType::f32, {rows, 2 * n}, dev), pair(d, {2 * n}, dev);
  for (TestTensor* t : {&x, &y, &p, &q}) t->randomize(rng);
  out.poison();
  acc.poison();
  pair.poison();
  launch(test::interleave_kernel(),
         {x.view(), y.view(), p.view(), q.view(), out.view(), acc.view(), pair.view()}, Grid{cdiv(rows, 16)},
         {{"BM", 16}, {"BN", BN}, {"K", K}, {"num_warps", warps}});
  sync(dev);
  out.download();
  acc.download();
  pair.download();
  std::vector<double> got, ref, got_acc, ref_acc;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < 2 * n; ++j) {
      const double xv = x.get(i * n + j / 2), yv = y.get(i * n + j / 2);
      ref.push_back(j % 2 ? yv + 1 : 2 * xv);
      got.push_back(out.get(i * 2 * n + j));
      double s = j % 2 ? yv : xv;
      for (int64_t k = 0; k < K; ++k) s += p.get(i * K + k) * q.get(k * 2 * n + j);
      ref_acc.push_back(s);
      got_acc.push_back(acc.get(i * 2 * n + j));
    }
  CHECK(test::max_relative_error(got, ref, 1.0) <= test::tolerance(d));
  CHECK(test::max_relative_error(got_acc, ref_acc, 2.0) <= test::tolerance(d));
  int64_t wrong = 0;
  for (int64_t j = 0; j < std::min<int64_t>(2 * n, 64); ++j)
    wrong += pair.get(j) != (j % 2 ? y.get(j / 2) : x.get(j / 2));
  CHECK(wrong == 0);
}

// Where C++ leaves a result undefined and the back ends once disagreed, both give the
// DSL's answer: shifts by the bit width or more, float -> u8 (saturating, NaN -> 0),
// integers and f64 to bf16/f16 rounded once (not through f32), max/min reductions of
// rows with NaNs (NaN only when all are).
void edge_semantics(Device dev) {
  CAPTURE(dev.str());
  using namespace kerf::dsl;
  static const Kernel k("edge_semantics", [](Builder& b) {
    const Tensor xi = b.tensor("xi", 1), si = b.tensor("si", 1), xf = b.tensor("xf", 1), xd = b.tensor("xd", 1),
                 xn = b.tensor("xn", 2), xl = b.tensor("xl", 1), bf_l = b.tensor("bf_l", 1);
    const Tensor shl_o = b.tensor("shl", 1), shr_o = b.tensor("shr", 1), u8_o = b.tensor("u8", 1),
                 bf_i = b.tensor("bf_i", 1), bf_d = b.tensor("bf_d", 1), h_d = b.tensor("h_d", 1),
                 mx = b.tensor("mx", 1), mn = b.tensor("mn", 1);
    const Value i = arange(8), rows = arange(4);
    const Value a = load(xi, {i}), sh = load(si, {i});
    store(shl_o, {i}, a << sh);
    store(shr_o, {i}, a >> sh);
    store(u8_o, {i}, load(xf, {i}).to(DType::u8));
    store(bf_i, {i}, a.to(DType::bf16));
    const Value d = load(xd, {i});
    store(bf_d, {i}, d.to(DType::bf16));
    store(h_d, {i}, d.to(DType::f16));
    store(bf_l, {i}, load(xl, {i}).to(DType::bf16));
    const Value t = load(xn, {rows.col(), i.row()});
    store(mx, {rows}, max(t, 1));
    store(mn, {rows}, min(t, 1));
  });
  const double nan = std::nan(""), inf = INFINITY;
  TestTensor xi(DType::i32, {8}, dev), si(DType::i32, {8}, dev), xf(DType::f32, {8}, dev), xd(DType::f64, {8}, dev),
      xn(DType::f32, {4, 8}, dev);
  const std::vector<double> xi_v = {1, 1, 1, 1, -8, -8, 33685505, 7}, si_v = {0, 31, 32, -1, 2, 40, 0, 3};
  const std::vector<double> xf_v = {300, 3e9, -5, nan, 12.7, 255.5, 0.5, 254.99};
  const std::vector<double> xd_v = {1 + 0x1p-11 + 0x1p-40, 1 + 0x1p-8 + 0x1p-40, 1.0, -2.5, 1e300, -1e300, 65520.0, 3.0};
  const std::vector<double> xn_v = {nan, nan, nan, nan, nan, nan, nan, nan,  //
                                    nan, 1, 3, nan, -2, nan, nan, nan,         //
                                    0, 1, 2, 3, 4, 5, 6, 7,                   //
                                    -inf, nan, 5, 4, nan, 1, 2, -3};
  for (int64_t j = 0; j < 8; ++j) {
    xi.set(j, xi_v[size_t(j)]);
    si.set(j, si_v[size_t(j)]);
    xf.set(j, xf_v[size_t(j)]);
    xd.set(j, xd_v[size_t(j)]);
  }
  for (int64_t j = 0; j < 32; ++j) xn.set(j, xn_v[size_t(j)]);
  // i64 past 2^53 (f64 would round them on the way): just above a bf16 tie, on one, and the ends.
  TestTensor xl(DType::i64, {8}, dev);
  const int64_t p60 = int64_t(1) << 60, p53 = int64_t(1) << 53;
  const std::vector<int64_t> xl_v = {p60 + (p60 >> 8) + 1, -(p60 + (p60 >> 8) + 1), p60 + (p60 >> 8),
                                     INT64_MIN, INT64_MAX, 5, p53 + (p53 >> 8) + 1, -(p53 + 3)};
  for (int64_t j = 0; j < 8; ++j) xl.set_i64(j, xl_v[size_t(j)]);
  for (TestTensor* x : {&xi, &si, &xf, &xd, &xn, &xl}) x->upload();
  TestTensor shl(DType::i32, {8}, dev), shr(DType::i32, {8}, dev), u8(DType::u8, {8}, dev), bf_i(DType::bf16, {8}, dev),
      bf_d(DType::bf16, {8}, dev), h_d(DType::f16, {8}, dev), mx(DType::f32, {4}, dev), mn(DType::f32, {4}, dev),
      bf_l(DType::bf16, {8}, dev);
  for (TestTensor* x : {&shl, &shr, &u8, &bf_i, &bf_d, &h_d, &mx, &mn, &bf_l}) x->poison();
  launch(k, {xi.view(), si.view(), xf.view(), xd.view(), xn.view(), xl.view(), bf_l.view(), shl.view(), shr.view(),
             u8.view(), bf_i.view(), bf_d.view(), h_d.view(), mx.view(), mn.view()},
         Grid{1}, {});
  sync(dev);
  for (TestTensor* x : {&shl, &shr, &u8, &bf_i, &bf_d, &h_d, &mx, &mn, &bf_l}) x->download();
  const auto expect = [](const char* what, TestTensor& got, const std::vector<double>& want) {
    for (size_t j = 0; j < want.size(); ++j) {
      INFO(what << "[" << j << "]: got " << got.get(int64_t(j)) << ", want " << want[j]);
      CHECK((std::isnan(want[j]) ? std::isnan(got.get(int64_t(j))) : got.get(int64_t(j)) == want[j]));
    }
  };
  expect("shl", shl, {1, -2147483648.0, 0, 0, -32, 0, 33685505, 56});
  expect("shr", shr, {1, 0, 0, 0, -2, -1, 33685505, 0});
  expect("u8", u8, {255, 255, 0, 0, 12, 255, 0, 254});
  // 33685505 = 2^25 + 2^17 + 1: just above the midpoint of two bf16 values; through f32 it
  // lands on the midpoint and rounds to even, down.
  expect("bf16 of i32", bf_i, {1, 1, 1, 1, -8, -8, 33816576, 7});
  expect("bf16 of f64", bf_d, {1, 1 + 0x1p-7, 1, -2.5, inf, -inf, 65536, 3});
  expect("f16 of f64", h_d, {1 + 0x1p-10, 1 + 0x1p-8, 1, -2.5, inf, -inf, inf, 3});
  const double q60 = 0x1p60, q53 = 0x1p53;
  expect("bf16 of i64", bf_l, {q60 + 0x1p53, -(q60 + 0x1p53), q60, -0x1p63, 0x1p63, 5, q53 + 0x1p46, -q53});
  expect("max", mx, {nan, 3, 7, 5});
  expect("min", mn, {nan, -2, 0, -inf});
}

void run_all(Device dev) {
  edge_semantics(dev);
  uint64_t seed = 2024;
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    for (int64_t n : {1, 33, 1000, 1024, 4099}) vec_add(dev, d, n, seed++);
  for (DType d : {DType::f32, DType::bf16}) {
    softmax(dev, d, 37, 200, seed++);
    softmax(dev, d, 8, 256, seed++);
  }
  matmul(dev, DType::f32, 77, 45, 130, {{"BM", 32}, {"BN", 32}, {"BK", 16}}, seed++);
  matmul(dev, DType::f32, 64, 64, 64, {{"BM", 32}, {"BN", 32}, {"BK", 16}, {"num_stages", 2}}, seed++);
  matmul(dev, DType::bf16, 100, 72, 130, {{"BM", 64}, {"BN", 64}, {"BK", 32}, {"num_stages", 3}}, seed++);
  matmul(dev, DType::bf16, 128, 128, 256, {{"BM", 64}, {"BN", 64}, {"BK", 32}, {"num_stages", 3}, {"num_warps", 8}},
         seed++);
  matmul(dev, DType::f16, 50, 40, 96, {{"BM", 32}, {"BN", 64}, {"BK", 32}}, seed++);
  // The accumulator in runs of consecutive columns per thread (acc_col_run): a
  // carried accumulator, B staged in the instructions' column order (not
  // pipelined), warps along the columns; an fp32 dot (FMA) and a transposed B
  // (staged as it is) keep their usual layouts; the same answers.
  matmul(dev, DType::bf16, 100, 72, 130, {{"BM", 64}, {"BN", 64}, {"BK", 32}, {"num_stages", 3}, {"acc_col_run", 8}},
         seed++);
  matmul(dev, DType::f16, 70, 200, 96,
         {{"BM", 32}, {"BN", 128}, {"BK", 32}, {"num_warps", 8}, {"acc_col_run", 4}}, seed++);
  matmul(dev, DType::bf16, 64, 64, 48, {{"BM", 64}, {"BN", 32}, {"BK", 16}, {"acc_col_run", 16}}, seed++);
  matmul(dev, DType::f32, 77, 45, 130, {{"BM", 32}, {"BN", 32}, {"BK", 16}, {"acc_col_run", 8}}, seed++);
  matmul(dev, DType::bf16, 77, 45, 130, {{"BM", 32}, {"BN", 32}, {"BK", 32}, {"acc_col_run", 8}}, seed++, true);
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    for (int64_t stages : {1, 3}) {
      matmul(dev, d, 77, 45, 130, {{"BM", 32}, {"BN", 32}, {"BK", 32}, {"num_stages", stages}}, seed++, true);
      matmul(dev, d, 128, 96, 160, {{"BM", 64}, {"BN", 32}, {"BK", 32}, {"num_stages", stages}, {"num_warps", 8}},
             seed++, true);
    }
  alternating_matmul(dev, DType::bf16, 100, 72, 200, 2, {{"BM", 64}, {"BN", 64}, {"BK", 32}, {"num_stages", 3}}, seed++);
  alternating_matmul(dev, DType::f16, 64, 40, 96, 3, {{"BM", 32}, {"BN", 64}, {"BK", 32}}, seed++);
  alternating_matmul(dev, DType::f32, 50, 30, 70, 3, {{"BM", 32}, {"BN", 32}, {"BK", 16}}, seed++);
  // TF32: A's fragments by ldmatrix and B's read alone (matmul), A^T's read alone and
  // B^T's by ldmatrix (matmul_t), pipelined or not, warps on rows or columns, the
  // accumulator in runs of columns, B chosen among tiles staged before the loop
  // (alternating, 3 ways) and B's fragments loaded into registers before it (1 way).
  for (int64_t stages : {1, 3}) {
    matmul(dev, DType::f32, 77, 45, 130, {{"BM", 32}, {"BN", 32}, {"BK", 32}, {"num_stages", stages}, {"TF32", 1}},
           seed++);
    matmul(dev, DType::f32, 77, 45, 130, {{"BM", 32}, {"BN", 32}, {"BK", 32}, {"num_stages", stages}, {"TF32", 1}},
           seed++, true);
    matmul(dev, DType::f32, 128, 96, 160,
           {{"BM", 64}, {"BN", 32}, {"BK", 32}, {"num_stages", stages}, {"num_warps", 8}, {"TF32", 1}}, seed++, true);
  }
  matmul(dev, DType::f32, 100, 200, 96,
         {{"BM", 32}, {"BN", 128}, {"BK", 16}, {"num_warps", 8}, {"num_stages", 2}, {"TF32", 1}}, seed++);
  matmul(dev, DType::f32, 77, 45, 130, {{"BM", 32}, {"BN", 32}, {"BK", 16}, {"acc_col_run", 8}, {"TF32", 1}}, seed++);
  alternating_matmul(dev, DType::f32, 64, 40, 96, 3, {{"BM", 32}, {"BN", 64}, {"BK", 32}, {"TF32", 1}}, seed++);
  alternating_matmul(dev, DType::f32, 70, 30, 96, 1, {{"BM", 32}, {"BN", 32}, {"BK", 16}, {"TF32", 1}}, seed++);
  column_sums(dev, 300, 100, seed++);
  column_sums(dev, 1000, 64, seed++);
  cluster_sums(dev, DType::f32, 300, 100, 1, 4, seed++);
  cluster_sums(dev, DType::f32, 300, 100, 2, 4, seed++);
  cluster_sums(dev, DType::bf16, 1000, 200, 4, 8, seed++);
  cluster_sums(dev, DType::f32, 70, 130, 3, 2, seed++);
  cluster_sums(dev, DType::f16, 257, 64, 8, 4, seed++);
  uint64_t gseed = 7000;  // the cluster_load cases: seeds of their own
  cluster_gathers(dev, DType::bf16, 70, 40, 16, 0, 8, 4, gseed++);
  cluster_gathers(dev, DType::bf16, 70, 40, 16, 3, 8, 4, gseed++);
  cluster_gathers(dev, DType::f32, 33, 17, 8, 0, 8, 2, gseed++);
  cluster_gathers(dev, DType::f32, 64, 32, 12, 1, 4, 4, gseed++);
  cluster_gathers(dev, DType::f16, 40, 20, 6, 0, 2, 1, gseed++);
  cluster_gathers(dev, DType::bf16, 50, 30, 9, 0, 3, 4, gseed++);
  cluster_gathers(dev, DType::bf16, 20, 10, 4, 0, 1, 4, gseed++);
  // Tiles of 32 elements a thread: each program's values come back as vectors of 4 (8: 2 bytes each).
  cluster_gathers(dev, DType::bf16, 100, 70, 16, 0, 8, 4, gseed++, 64, 64);
  cluster_gathers(dev, DType::f32, 100, 70, 8, 0, 4, 4, gseed++, 64, 64);
  cluster_gathers(dev, DType::bf16, 100, 70, 9, 0, 3, 4, gseed++, 64, 64);
  // Programs past E in the last cluster: 10 of 12, 13 of 16, 5 of 8 (one by one: odd pad).
  cluster_gathers(dev, DType::bf16, 100, 70, 10, 0, 4, 4, gseed++, 64, 64);
  cluster_gathers(dev, DType::bf16, 70, 40, 13, 0, 8, 4, gseed++);
  cluster_gathers(dev, DType::f32, 33, 17, 5, 1, 8, 2, gseed++);
  for (DType d : {DType::f32, DType::bf16}) elementwise(dev, d, 1000, seed++);
  corners(dev, DType::f32, 4, 8, 16, seed++);
  corners(dev, DType::bf16, 3, 7, 13, seed++);
  corners(dev, DType::f16, 4, 8, 16, seed++);
  tickets(dev, 1000, seed++);
  for (int64_t shift : {0, 1}) {
    inplace(dev, DType::f32, 100, 1000, shift, seed++);
    inplace(dev, DType::bf16, 64, 4096, shift, seed++);
  }
  tickets(dev, 64 * 300, seed++);
  l2_keep(dev, 1000, seed++);
  wide_loops(dev, 37, 200, seed++);
  nibbles(dev, 13, 100, seed++);
  nibbles(dev, 16, 128, seed++);
  gather(dev, DType::f32, 16, 37, 150, 4, seed++);
  gather(dev, DType::f32, 32, 16, 64, 8, seed++);
  gather(dev, DType::bf16, 16, 20, 100, 4, seed++);
  gather(dev, DType::f16, 8, 9, 70, 2, seed++);
  gather(dev, DType::f32, 1, 5, 10, 4, seed++);
  interleave(dev, DType::f32, 37, 64, 4, seed++);
  interleave(dev, DType::bf16, 16, 50, 4, seed++);
  interleave(dev, DType::f16, 33, 64, 8, seed++);
}

}  // namespace

TEST_CASE("DSL kernels match float64 references on the CPU", "[cpu][numerics]") {
  if (!jit::cpu::available()) {
    std::cout << "KERF-SKIPPED: CPU back end not built (no LLVM)" << std::endl;
    return;
  }
  run_all(Device::cpu());
}

TEST_CASE("DSL kernels match float64 references on the GPU", "[gpu][numerics]") {
  KERF_REQUIRE_GPU();
  run_all(Device::cuda(0));
}

// Each program writes its block of y, then reads the block another program wrote
// (two blocks on, after one grid_sync; its neighbour's z after a second), in two
// launches: the second finds the barrier's counter set back to zero by the first.
TEST_CASE("grid_sync makes every program's writes visible to every program after it", "[gpu][numerics]") {
  KERF_REQUIRE_GPU();
  using namespace kerf::dsl;
  static const Kernel k("rotate_blocks", [](Builder& b) {
    const Tensor x = b.tensor("x", 1), y = b.tensor("y", 1), z = b.tensor("z", 1);
    const Tensor sync = b.tensor("sync", 1, DType::i32);
    const int64_t BLOCK = b.meta("BLOCK");
    const Value n = x.dim(0), progs = num_programs(0);
    const Value i = program_id(0) * BLOCK + arange(BLOCK);
    store(y, {i}, load(x, {i}, i < n) * 2.0 + 1.0, i < n);
    grid_sync(sync);
    const Value j = ((program_id(0) + 2) % progs) * BLOCK + arange(BLOCK);
    store(z, {i}, load(y, {j}, j < n), i < n);
    grid_sync(sync);
    const Value h = ((program_id(0) + 1) % progs) * BLOCK + arange(BLOCK);
    store(y, {i}, load(z, {h}, h < n) - 1.0, i < n);
  });
  const Device dev = Device::cuda(0);
  const int64_t block = 256, progs = 48, n = block * progs;
  std::mt19937_64 rng(7100);
  TestTensor x(DType::f32, {n}, dev), y(DType::f32, {n}, dev), z(DType::f32, {n}, dev), sync(DType::i32, {1}, dev);
  sync.set(0, 0.0);
  sync.upload();
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    x.randomize(rng);
    y.poison();
    z.poison();
    launch(k, {x.view(), y.view(), z.view(), sync.view()}, Grid{uint32_t(progs)}, {{"BLOCK", block}});
    test::sync(dev);
    y.download();
    sync.download();
    int64_t wrong = 0;
    for (int64_t p = 0; p < progs; ++p)
      for (int64_t e = 0; e < block; ++e) {
        const int64_t src = ((p + 3) % progs) * block + e;  // z's block p + 1 holds y's block p + 3
        const double want = double(float(float(x.get(src)) * 2.0f + 1.0f) - 1.0f);
        wrong += y.get(p * block + e) != want;
      }
    CHECK(wrong == 0);
    CHECK(sync.get(0) == 0.0);
  }
}
