// The CPU back end computes what the IR means: numerics against float64
// references on random data and odd shapes, masking that never touches memory
// it should not, half-precision rounding, integer edge cases, atomics across
// threads, and compile times.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch.h"
#include "cpu_test_util.h"
#include "kerf/dsl/dsl.h"
#include "kerf/error.h"
#include "kerf/jit/cpu_backend.h"

using namespace kerf;
using namespace kerf::dsl;
using kerf::testing::cdiv;
using kerf::testing::compile_for;
using kerf::testing::run_on_cpu;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A fresh seed per run, printed with any failure so that it can be replayed.
uint32_t fresh_seed() {
  return std::random_device{}();
}

std::vector<float> random_floats(std::mt19937& rng, size_t n, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
  return out;
}

std::vector<uint16_t> to_f16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_f16(v[i]);
  return out;
}

// ||out - ref|| / ||ref||, with NaN in `out` counting as a failure.
double relative_l2(const std::vector<float>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(out[i])) return std::numeric_limits<double>::infinity();
    num += (double(out[i]) - ref[i]) * (double(out[i]) - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Largest |out - ref| / max(|ref|, floor); NaN where the reference is not NaN fails.
double max_relative(const std::vector<float>& out, const std::vector<double>& ref,
                    double floor = 1e-6) {
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(out[i]) != std::isnan(ref[i])) return std::numeric_limits<double>::infinity();
    if (std::isnan(ref[i])) continue;
    if (std::isinf(ref[i])) {
      if (double(out[i]) != ref[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    worst = std::max(worst, std::abs(double(out[i]) - ref[i]) / std::max(std::abs(ref[i]), floor));
  }
  return worst;
}

TensorView view(std::vector<float>& v, const std::vector<int64_t>& shape) {
  return TensorView::contiguous(v.data(), DType::f32, shape);
}
TensorView view(std::vector<uint16_t>& v, DType t, const std::vector<int64_t>& shape) {
  return TensorView::contiguous(v.data(), t, shape);
}

// ---------------------------------------------------------------- kernels

// out = x + y, one block of BLOCK elements per program.
Kernel vector_add() {
  return Kernel("vec_add", [](Builder& k) {
    auto x = k.tensor("x", 1), y = k.tensor("y", 1), out = k.tensor("out", 1);
    const int64_t B = k.meta("BLOCK");
    auto i = program_id(0) * B + arange(B);
    auto m = i < x.dim(0);
    store(out, {i}, load(x, {i}, m) + load(y, {i}, m), m);
  });
}

// y[r, :] = softmax(x[r, :]) with the row padded to BN lanes and masked.
Kernel row_softmax() {
  return Kernel("row_softmax", [](Builder& k) {
    auto x = k.tensor("x", 2), y = k.tensor("y", 2);
    const int64_t BN = k.meta("BN");
    auto row = program_id(0);
    auto cols = arange(BN);
    auto m = cols < x.dim(1);
    auto v = load(x, {row, cols}, m, -INFINITY).to(DType::f32);
    auto e = exp(v - max(v, 0));
    store(y, {row, cols}, (e / sum(e, 0)).to(y.dtype()), m);
  });
}

// C[M, N] = A[M, K] @ B[K, N], f32 accumulator carried through the K loop.
Kernel tiled_matmul() {
  return Kernel("matmul", [](Builder& k) {
    auto A = k.tensor("A", 2), B = k.tensor("B", 2), C = k.tensor("C", 2);
    const int64_t BM = k.meta("BM"), BN = k.meta("BN"), BK = k.meta("BK");
    auto rows = program_id(0) * BM + arange(BM);
    auto cols = program_id(1) * BN + arange(BN);
    auto M = A.dim(0), K = A.dim(1), N = B.dim(1);
    auto acc = for_range(0, K, BK, zeros({BM, BN}), [&](const Value& k0, const Value& acc) {
      auto ks = k0 + arange(BK);
      auto a = load(A, {rows.col(), ks.row()}, (rows.col() < M) & (ks.row() < K));
      auto b = load(B, {ks.col(), cols.row()}, (ks.col() < K) & (cols.row() < N));
      return dot(a, b, acc);
    });
    store(C, {rows.col(), cols.row()}, acc.to(C.dtype()), (rows.col() < M) & (cols.row() < N));
  });
}

// out[i] = sum_j x[i, j], a [BM, BN] accumulator carried over column blocks.
Kernel row_sums() {
  return Kernel("rowsum", [](Builder& k) {
    auto x = k.tensor("x", 2), out = k.tensor("out", 1);
    const int64_t BM = k.meta("BM"), BN = k.meta("BN");
    auto rows = program_id(0) * BM + arange(BM);
    auto acc = for_range(0, x.dim(1), BN, zeros({BM, BN}), [&](const Value& c0, const Value& a) {
      auto cols = c0 + arange(BN);
      auto m = (rows.col() < x.dim(0)) & (cols.row() < x.dim(1));
      return a + load(x, {rows.col(), cols.row()}, m).to(DType::f32);
    });
    store(out, {rows}, sum(acc, 1), rows < x.dim(0));
  });
}

// ---------------------------------------------------------------- reference helpers

std::vector<double> matmul_reference(const std::vector<float>& a, const std::vector<float>& b,
                                     int64_t M, int64_t K, int64_t N) {
  std::vector<double> c(size_t(M * N), 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t kk = 0; kk < K; ++kk)
      for (int64_t j = 0; j < N; ++j)
        c[size_t(i * N + j)] += double(a[size_t(i * K + kk)]) * double(b[size_t(kk * N + j)]);
  return c;
}

// The bf16 value nearest to x (ties to even), found without the code under test's tricks.
uint16_t bf16_nearest(double x) {
  const uint16_t guess = float_to_bf16(float(x));
  uint16_t best = guess;
  double best_err = std::abs(double(bf16_to_float(guess)) - x);
  for (int delta : {-1, 1}) {
    const uint16_t c = uint16_t(guess + delta);
    const double err = std::abs(double(bf16_to_float(c)) - x);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return best;
}

}  // namespace

// ---------------------------------------------------------------- tests

TEST_CASE("the CPU back end reports what it was built with", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  CHECK(jit::cpu::llvm_version().rfind("14.", 0) == 0);
  CHECK_FALSE(jit::cpu::host_cpu().empty());
  const std::string features = jit::cpu::host_features();
  CHECK(features.find("sse2") != std::string::npos);
  CHECK(jit::cpu::host_features() == features);  // canonical: the same every time
  CHECK(jit::cpu::thread_count() >= 1);
}

TEST_CASE("vector add matches the reference in f32 for odd and round sizes", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  for (int64_t n : {1, 1000, 4096, 100003}) {
    CAPTURE(n);
    auto x = random_floats(rng, size_t(n)), y = random_floats(rng, size_t(n));
    std::vector<float> out(static_cast<size_t>(n), kNaN);
    run_on_cpu(vector_add(), {view(x, {n}), view(y, {n}), view(out, {n})}, {{"BLOCK", 1024}},
               Grid{cdiv(n, 1024)});
    for (int64_t i = 0; i < n; ++i) REQUIRE(out[size_t(i)] == x[size_t(i)] + y[size_t(i)]);
  }
}

TEST_CASE("vector add in bf16 and f16 rounds the f32 sum to nearest even", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const int64_t n = 3001;
  for (DType t : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(t));
    auto xf = random_floats(rng, size_t(n), -100.f, 100.f);
    auto yf = random_floats(rng, size_t(n), -100.f, 100.f);
    auto x = t == DType::bf16 ? to_bf16(xf) : to_f16(xf);
    auto y = t == DType::bf16 ? to_bf16(yf) : to_f16(yf);
    std::vector<uint16_t> out(static_cast<size_t>(n), 0xFFFF);
    run_on_cpu(vector_add(), {view(x, t, {n}), view(y, t, {n}), view(out, t, {n})},
               {{"BLOCK", 256}}, Grid{cdiv(n, 256)});
    auto widen = [&](uint16_t h) { return t == DType::bf16 ? bf16_to_float(h) : f16_to_float(h); };
    auto narrow = [&](float f) { return t == DType::bf16 ? float_to_bf16(f) : float_to_f16(f); };
    std::vector<float> got(static_cast<size_t>(n));
    std::vector<double> ref(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const float sum = widen(x[size_t(i)]) + widen(y[size_t(i)]);
      REQUIRE(out[size_t(i)] == narrow(sum));  // computed in f32, rounded once
      got[size_t(i)] = widen(out[size_t(i)]);
      ref[size_t(i)] = double(widen(x[size_t(i)])) + double(widen(y[size_t(i)]));
    }
    CHECK(relative_l2(got, ref) <= 1e-2);
  }
}

TEST_CASE("a masked row softmax matches the reference", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  struct Case {
    int64_t rows, cols, block;
    DType dtype;
  };
  for (const Case& c : {Case{37, 200, 256, DType::f32}, Case{64, 128, 128, DType::f32},
                        Case{13, 77, 128, DType::bf16}}) {
    CAPTURE(c.rows, c.cols, dtype_name(c.dtype));
    auto xf = random_floats(rng, size_t(c.rows * c.cols), -8.f, 8.f);
    std::vector<double> ref(xf.size());
    std::vector<float> got(xf.size());
    if (c.dtype == DType::bf16)
      for (float& v : xf) v = bf16_to_float(float_to_bf16(v));
    for (int64_t r = 0; r < c.rows; ++r) {
      double mx = -INFINITY, s = 0;
      for (int64_t j = 0; j < c.cols; ++j) mx = std::max(mx, double(xf[size_t(r * c.cols + j)]));
      for (int64_t j = 0; j < c.cols; ++j) s += std::exp(double(xf[size_t(r * c.cols + j)]) - mx);
      for (int64_t j = 0; j < c.cols; ++j)
        ref[size_t(r * c.cols + j)] = std::exp(double(xf[size_t(r * c.cols + j)]) - mx) / s;
    }
    const Grid grid{uint32_t(c.rows)};
    if (c.dtype == DType::f32) {
      std::vector<float> y(xf.size(), kNaN);
      run_on_cpu(row_softmax(), {view(xf, {c.rows, c.cols}), view(y, {c.rows, c.cols})},
                 {{"BN", c.block}}, grid);
      got = y;
      CHECK(max_relative(got, ref) <= 1e-5);
    } else {
      auto x = to_bf16(xf);
      std::vector<uint16_t> y(xf.size(), 0xFFFF);
      run_on_cpu(row_softmax(),
                 {view(x, DType::bf16, {c.rows, c.cols}), view(y, DType::bf16, {c.rows, c.cols})},
                 {{"BN", c.block}}, grid);
      for (size_t i = 0; i < y.size(); ++i) got[i] = bf16_to_float(y[i]);
      CHECK(max_relative(got, ref) <= 1e-2);
    }
  }
}

TEST_CASE("a tiled matmul with a carried accumulator matches the reference", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  struct Case {
    int64_t M, K, N;
    DType in;
  };
  for (const Case& c : {Case{77, 130, 45, DType::f32}, Case{128, 96, 64, DType::f32},
                        Case{77, 130, 45, DType::bf16}, Case{33, 17, 70, DType::f16},
                        Case{20, 40, 9, DType::f64}}) {
    CAPTURE(c.M, c.K, c.N, dtype_name(c.in));
    auto a = random_floats(rng, size_t(c.M * c.K));
    auto b = random_floats(rng, size_t(c.K * c.N));
    if (c.in == DType::bf16)
      for (auto* v : {&a, &b})
        for (float& x : *v) x = bf16_to_float(float_to_bf16(x));
    if (c.in == DType::f16)
      for (auto* v : {&a, &b})
        for (float& x : *v) x = f16_to_float(float_to_f16(x));
    // f64 operands are converted to f32 (exactly, for these values) before the product.
    std::vector<double> ad(a.begin(), a.end()), bd(b.begin(), b.end());
    const auto ref = matmul_reference(a, b, c.M, c.K, c.N);
    std::vector<float> out(size_t(c.M * c.N), kNaN);
    const dsl::MetaMap meta{{"BM", 32}, {"BN", 32}, {"BK", 16}};
    const Grid grid{cdiv(c.M, 32), cdiv(c.N, 32)};
    if (c.in == DType::f32) {
      run_on_cpu(tiled_matmul(), {view(a, {c.M, c.K}), view(b, {c.K, c.N}), view(out, {c.M, c.N})},
                 meta, grid);
    } else if (c.in == DType::f64) {
      run_on_cpu(tiled_matmul(),
                 {TensorView::contiguous(ad.data(), DType::f64, {c.M, c.K}),
                  TensorView::contiguous(bd.data(), DType::f64, {c.K, c.N}), view(out, {c.M, c.N})},
                 meta, grid);
    } else {
      auto ah = c.in == DType::bf16 ? to_bf16(a) : to_f16(a);
      auto bh = c.in == DType::bf16 ? to_bf16(b) : to_f16(b);
      run_on_cpu(tiled_matmul(),
                 {view(ah, c.in, {c.M, c.K}), view(bh, c.in, {c.K, c.N}), view(out, {c.M, c.N})},
                 meta, grid);
    }
    // The operands are exact in f32, so only the f32 accumulation differs from the reference.
    CHECK(relative_l2(out, ref) <= 1e-5);
  }
}

TEST_CASE("dot reads a transposed tile", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  // C[16, 8] = A[16, 32] @ B[8, 32]^T
  Kernel k("dot_bt", [](Builder& b) {
    auto A = b.tensor("A", 2), B = b.tensor("B", 2), C = b.tensor("C", 2);
    auto r16 = arange(16), r8 = arange(8), r32 = arange(32);
    auto a = load(A, {r16.col(), r32.row()});
    auto bt = load(B, {r8.col(), r32.row()});
    store(C, {r16.col(), r8.row()}, dot(a, trans(bt)));
  });
  auto a = random_floats(rng, 16 * 32), bt = random_floats(rng, 8 * 32);
  std::vector<float> b(32 * 8);
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 32; ++j) b[size_t(j * 8 + i)] = bt[size_t(i * 32 + j)];
  std::vector<float> out(16 * 8, kNaN);
  run_on_cpu(k, {view(a, {16, 32}), view(bt, {8, 32}), view(out, {16, 8})}, {}, Grid{});
  CHECK(relative_l2(out, matmul_reference(a, b, 16, 32, 8)) <= 1e-5);
}

TEST_CASE("row sums carry a tile accumulator through a loop, also over strided views", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const int64_t R = 45, C = 301;
  auto x = random_floats(rng, size_t(R * C));
  std::vector<double> ref(static_cast<size_t>(R), 0.0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) ref[size_t(r)] += x[size_t(r * C + c)];
  const dsl::MetaMap meta{{"BM", 16}, {"BN", 64}};

  std::vector<float> out(static_cast<size_t>(R), kNaN);
  run_on_cpu(row_sums(), {view(x, {R, C}), view(out, {R})}, meta, Grid{cdiv(R, 16)});
  CHECK(relative_l2(out, ref) <= 1e-5);

  // The same numbers stored column-major: a [R, C] view with strides [1, R].
  std::vector<float> xt(size_t(R * C));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) xt[size_t(c * R + r)] = x[size_t(r * C + c)];
  std::vector<float> out2(static_cast<size_t>(R), kNaN);
  auto strided = TensorView::strided(xt.data(), DType::f32, {R, C}, {1, R});
  CHECK_FALSE(testing::facts_of(strided).contiguous_last);
  run_on_cpu(row_sums(), {strided, view(out2, {R})}, meta, Grid{cdiv(R, 16)});
  CHECK(relative_l2(out2, ref) <= 1e-5);
}

TEST_CASE("reductions over either axis; half types accumulate in f32 and round once", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  Kernel k("reductions", [](Builder& b) {
    auto x = b.tensor("x", 2), s0 = b.tensor("s0", 1), mx1 = b.tensor("mx1", 1),
         mn0 = b.tensor("mn0", 1), total = b.tensor("total", 1);
    auto r = arange(8), c = arange(64);
    auto v = load(x, {r.col(), c.row()});
    store(s0, {c}, sum(v, 0));
    store(mx1, {r}, max(v, 1));
    store(mn0, {c}, min(v, 0));
    store(total, {constant(0, DType::i32)}, sum(sum(v, 1), 0));
  });
  for (DType t : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(t));
    auto xf = random_floats(rng, 8 * 64, -4.f, 4.f);
    for (float& v : xf) v = bf16_to_float(float_to_bf16(v));
    std::vector<uint16_t> xh = to_bf16(xf);
    std::vector<float> s0(64, kNaN), mx1(8, kNaN), mn0(64, kNaN), total(1, kNaN);
    std::vector<uint16_t> s0h(64, 0xFFFF), mx1h(8, 0xFFFF), mn0h(64, 0xFFFF), totalh(1, 0xFFFF);
    if (t == DType::f32) {
      run_on_cpu(
          k, {view(xf, {8, 64}), view(s0, {64}), view(mx1, {8}), view(mn0, {64}), view(total, {1})},
          {}, Grid{});
    } else {
      run_on_cpu(k,
                 {view(xh, t, {8, 64}), view(s0h, t, {64}), view(mx1h, t, {8}), view(mn0h, t, {64}),
                  view(totalh, t, {1})},
                 {}, Grid{});
    }
    std::vector<double> rs0(64, 0.0), rmx1(8, -INFINITY), rmn0(64, INFINITY), rtotal(1, 0.0);
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 64; ++j) {
        const double v = xf[size_t(i * 64 + j)];
        rs0[size_t(j)] += v;
        rmx1[size_t(i)] = std::max(rmx1[size_t(i)], v);
        rmn0[size_t(j)] = std::min(rmn0[size_t(j)], v);
      }
    if (t == DType::f32) {
      for (double v : rs0) rtotal[0] += v;
      CHECK(max_relative(s0, rs0, 1e-3) <= 1e-5);
      CHECK(max_relative(mx1, rmx1) == 0.0);
      CHECK(max_relative(mn0, rmn0) == 0.0);
      CHECK(max_relative(total, rtotal, 1e-3) <= 1e-5);
    } else {
      std::vector<float> g(64);
      for (int j = 0; j < 64; ++j) {
        // One rounding of the f32 sum: the result is the bf16 nearest the exact sum, or next to it.
        const float want = bf16_to_float(bf16_nearest(rs0[size_t(j)]));
        g[size_t(j)] = bf16_to_float(s0h[size_t(j)]);
        CHECK(std::abs(g[size_t(j)] - want) <= std::abs(want) * 0x1p-7 + 1e-30);
      }
      CHECK(max_relative(g, rs0, 1e-2) <= 1e-2);
      for (int i = 0; i < 8; ++i) CHECK(bf16_to_float(mx1h[size_t(i)]) == float(rmx1[size_t(i)]));
      for (int j = 0; j < 64; ++j) CHECK(bf16_to_float(mn0h[size_t(j)]) == float(rmn0[size_t(j)]));
      // sum(sum(v, 1), 0): the inner sums are rounded to bf16 before the outer sum.
      double inner_total = 0;
      for (int i = 0; i < 8; ++i) {
        double row = 0;
        for (int j = 0; j < 64; ++j) row += xf[size_t(i * 64 + j)];
        inner_total += bf16_to_float(bf16_nearest(row));
      }
      CHECK(std::abs(bf16_to_float(totalh[0]) - inner_total) <=
            std::abs(inner_total) * 1e-2 + 0.05);
    }
  }
}

TEST_CASE("a kernel with grid_sync or grid_arrive is refused by the CPU back end with its name", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  Kernel k("phased", [](Builder& b) {
    auto x = b.tensor("x", 1), sync = b.tensor("sync", 1, DType::i32);
    auto i = program_id(0) * 16 + arange(16);
    store(x, {i}, zeros({16}), i < x.dim(0));
    grid_sync(sync);
  });
  std::vector<float> x(40, 1.f);
  std::vector<int32_t> sync(1, 0);
  const TensorView s = TensorView::contiguous(sync.data(), DType::i32, {1});
  CHECK_THROWS_WITH(run_on_cpu(k, {view(x, {40}), s}, {}, Grid{3, 1, 1}),
                    Catch::Matchers::Contains("'phased' uses grid_sync") &&
                        Catch::Matchers::Contains("CPU back end does not run"));
  CHECK(x[0] == 1.f);  // nothing ran
  Kernel split("split_phase", [](Builder& b) {
    auto x = b.tensor("x", 1), sync = b.tensor("sync", 1, DType::i32);
    auto i = program_id(0) * 16 + arange(16);
    grid_arrive(sync);
    store(x, {i}, zeros({16}), i < x.dim(0));
    grid_await(sync);
  });
  CHECK_THROWS_WITH(run_on_cpu(split, {view(x, {40}), s}, {}, Grid{3, 1, 1}),
                    Catch::Matchers::Contains("'split_phase' uses grid_arrive"));
  CHECK(x[0] == 1.f);
}

TEST_CASE("atomic_add sums contributions from many programs running in parallel", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);

  SECTION("f32 column sums: every row block adds into the same outputs") {
    Kernel k("colsum", [](Builder& b) {
      auto x = b.tensor("x", 2), out = b.tensor("out", 1);
      const int64_t BM = b.meta("BM"), BN = b.meta("BN");
      auto rows = program_id(0) * BM + arange(BM);
      auto cols = program_id(1) * BN + arange(BN);
      auto m = (rows.col() < x.dim(0)) & (cols.row() < x.dim(1));
      atomic_add(out, {cols}, sum(load(x, {rows.col(), cols.row()}, m), 0), cols < x.dim(1));
    });
    const int64_t R = 1003, C = 77;
    auto x = random_floats(rng, size_t(R * C));
    std::vector<double> ref(static_cast<size_t>(C), 0.0);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) ref[size_t(c)] += x[size_t(r * C + c)];
    std::vector<float> out(static_cast<size_t>(C), 0.f);
    run_on_cpu(k, {view(x, {R, C}), view(out, {C})}, {{"BM", 8}, {"BN", 32}},
               Grid{cdiv(R, 8), cdiv(C, 32)});
    CHECK(relative_l2(out, ref) <= 1e-5);
  }

  SECTION("integer and 16-bit float histograms count every element exactly") {
    Kernel k("histogram", [](Builder& b) {
      auto x = b.tensor("x", 1), bins = b.tensor("bins", 1), hbins = b.tensor("hbins", 1);
      const int64_t B = b.meta("BLOCK");
      auto i = program_id(0) * B + arange(B);
      auto m = i < x.dim(0);
      auto v = load(x, {i}, m) % bins.dim(0);
      atomic_add(bins, {v}, full({B}, 1.0, DType::i32), m);
      atomic_add(hbins, {v}, full({B}, 1.0, hbins.dtype()), m);
    });
    const int64_t n = 4999, nbins = 16;
    std::uniform_int_distribution<int32_t> dist(0, 1 << 20);
    std::vector<int32_t> x(static_cast<size_t>(n));
    std::vector<int32_t> want(static_cast<size_t>(nbins), 0);
    for (int32_t& v : x) {
      v = dist(rng);
      want[size_t(v % nbins)]++;
    }
    for (DType ht : {DType::bf16, DType::f16}) {
      CAPTURE(dtype_name(ht));
      std::vector<int32_t> bins(static_cast<size_t>(nbins), 0);
      std::vector<uint16_t> hbins(static_cast<size_t>(nbins), 0);  // +0.0 in both formats
      // bf16 counts only up to 256 exactly: give it fewer elements.
      const int64_t used = ht == DType::bf16 ? 1500 : n;
      std::vector<int32_t> expect(static_cast<size_t>(nbins), 0);
      for (int64_t i = 0; i < used; ++i) expect[size_t(x[size_t(i)] % nbins)]++;
      run_on_cpu(
          k,
          {TensorView::contiguous(x.data(), DType::i32, {used}),
           TensorView::contiguous(bins.data(), DType::i32, {nbins}), view(hbins, ht, {nbins})},
          {{"BLOCK", 64}}, Grid{cdiv(used, 64)});
      for (int64_t j = 0; j < nbins; ++j) {
        CHECK(bins[size_t(j)] == expect[size_t(j)]);
        const float h =
            ht == DType::bf16 ? bf16_to_float(hbins[size_t(j)]) : f16_to_float(hbins[size_t(j)]);
        CHECK(h == float(expect[size_t(j)]));
      }
    }
  }
}

TEST_CASE("where selects elementwise between tiles and literals", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  Kernel k("select", [](Builder& b) {
    auto x = b.tensor("x", 1), y = b.tensor("y", 1), out = b.tensor("out", 1),
         lo = b.tensor("lo", 1);
    auto i = program_id(0) * 128 + arange(128);
    auto m = i < x.dim(0);
    auto xv = load(x, {i}, m), yv = load(y, {i}, m);
    store(out, {i}, where(xv > 0, xv, yv * 2.0), m);
    auto xi = xv.to(DType::i32), yi = yv.to(DType::i32);
    store(lo, {i},
          where(xi < yi, xi, yi) + where(m, constant(0, DType::i32), constant(1, DType::i32)), m);
  });
  const int64_t n = 1000;
  auto x = random_floats(rng, size_t(n), -50.f, 50.f),
       y = random_floats(rng, size_t(n), -50.f, 50.f);
  std::vector<float> out(static_cast<size_t>(n), kNaN);
  std::vector<int32_t> lo(static_cast<size_t>(n), -12345);
  run_on_cpu(k,
             {view(x, {n}), view(y, {n}), view(out, {n}),
              TensorView::contiguous(lo.data(), DType::i32, {n})},
             {}, Grid{cdiv(n, 128)});
  for (int64_t i = 0; i < n; ++i) {
    const float xv = x[size_t(i)], yv = y[size_t(i)];
    REQUIRE(out[size_t(i)] == (xv > 0 ? xv : yv * 2.0f));
    REQUIRE(lo[size_t(i)] == std::min(int32_t(xv), int32_t(yv)));
  }
}

TEST_CASE("casts among f64, f32, bf16, f16, i32, i64 and i1 round and truncate as specified",
          "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  Kernel k("casts", [](Builder& b) {
    auto x = b.tensor("x", 1), d = b.tensor("d", 1);
    auto o_bf16 = b.tensor("o_bf16", 1), o_f16 = b.tensor("o_f16", 1), o_i32 = b.tensor("o_i32", 1),
         o_i64 = b.tensor("o_i64", 1), o_i1 = b.tensor("o_i1", 1),
         o_bf16_f16 = b.tensor("o_bf16_f16", 1), o_i32_f32 = b.tensor("o_i32_f32", 1),
         o_i64_f16 = b.tensor("o_i64_f16", 1), o_d_bf16 = b.tensor("o_d_bf16", 1),
         o_i1_f32 = b.tensor("o_i1_f32", 1);
    auto i = program_id(0) * 64 + arange(64);
    auto m = i < x.dim(0);
    auto v = load(x, {i}, m);
    store(o_bf16, {i}, v.to(DType::bf16), m);
    store(o_f16, {i}, v.to(DType::f16), m);
    store(o_i32, {i}, v.to(DType::i32), m);
    store(o_i64, {i}, v.to(DType::i64), m);
    store(o_i1, {i}, v.to(DType::i1), m);
    store(o_bf16_f16, {i}, v.to(DType::bf16).to(DType::f16), m);
    store(o_i32_f32, {i}, v.to(DType::i32).to(DType::f32), m);
    store(o_i64_f16, {i}, v.to(DType::i64).to(DType::f16), m);
    store(o_d_bf16, {i}, load(d, {i}, m).to(DType::bf16), m);
    store(o_i1_f32, {i}, v.to(DType::i1).to(DType::f32), m);
  });
  std::vector<float> x = {0.f,
                          -0.f,
                          0.5f,
                          -2.5f,
                          2.99f,
                          -2.99f,
                          65504.f,
                          65519.f,
                          65520.f,
                          1e-7f,
                          6e-8f,
                          2.9e-8f,
                          kNaN,
                          kInf,
                          -kInf,
                          3.0e38f,
                          -3.0e9f,
                          bf16_to_float(0x3F80) + 0x1p-8f,  // bf16 halfway, rounds to even (down)
                          1.0f + 3 * 0x1p-8f,               // bf16 halfway, rounds to even (up)
                          1.0f + 0x1p-11f,
                          1.0f + 3 * 0x1p-11f};  // the same for f16
  for (float v : random_floats(rng, 200, -1000.f, 1000.f)) x.push_back(v);
  const int64_t n = int64_t(x.size());
  std::vector<double> d(static_cast<size_t>(n));
  std::uniform_real_distribution<double> dd(-1000.0, 1000.0);
  for (double& v : d) v = dd(rng);
  d[0] = 1.0 + 0x1p-8 + 0x1p-40;  // just above a bf16 tie: a double rounding would go to even
  std::vector<uint16_t> o_bf16(static_cast<size_t>(n), 0xFFFF),
      o_f16(static_cast<size_t>(n), 0xFFFF), o_bf16_f16(size_t(n), 0xFFFF),
      o_i64_f16(size_t(n), 0xFFFF), o_d_bf16(size_t(n), 0xFFFF);
  std::vector<int32_t> o_i32(static_cast<size_t>(n), -1);
  std::vector<int64_t> o_i64(static_cast<size_t>(n), -1);
  std::vector<uint8_t> o_i1(static_cast<size_t>(n), 0xFF);
  std::vector<float> o_i32_f32(static_cast<size_t>(n), kNaN),
      o_i1_f32(static_cast<size_t>(n), kNaN);
  run_on_cpu(
      k,
      {view(x, {n}), TensorView::contiguous(d.data(), DType::f64, {n}),
       view(o_bf16, DType::bf16, {n}), view(o_f16, DType::f16, {n}),
       TensorView::contiguous(o_i32.data(), DType::i32, {n}),
       TensorView::contiguous(o_i64.data(), DType::i64, {n}),
       TensorView::contiguous(o_i1.data(), DType::i1, {n}), view(o_bf16_f16, DType::f16, {n}),
       view(o_i32_f32, {n}), view(o_i64_f16, DType::f16, {n}), view(o_d_bf16, DType::bf16, {n}),
       view(o_i1_f32, {n})},
      {}, Grid{cdiv(n, 64)});
  auto to_i64 = [](float v) -> int64_t {  // truncation toward zero, saturating, NaN -> 0
    if (std::isnan(v)) return 0;
    if (v >= 0x1p63f) return std::numeric_limits<int64_t>::max();
    if (v <= -0x1p63f) return std::numeric_limits<int64_t>::min();
    return int64_t(v);
  };
  auto to_i32 = [](float v) -> int32_t {
    if (std::isnan(v)) return 0;
    if (v >= 0x1p31f) return std::numeric_limits<int32_t>::max();
    if (v <= -0x1p31f) return std::numeric_limits<int32_t>::min();
    return int32_t(v);
  };
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[size_t(i)];
    CAPTURE(i, v);
    if (std::isnan(v)) {
      CHECK(std::isnan(bf16_to_float(o_bf16[size_t(i)])));
      CHECK(std::isnan(f16_to_float(o_f16[size_t(i)])));
    } else {
      CHECK(o_bf16[size_t(i)] == float_to_bf16(v));
      CHECK(o_f16[size_t(i)] == float_to_f16(v));
      CHECK(o_bf16_f16[size_t(i)] == float_to_f16(bf16_to_float(float_to_bf16(v))));
    }
    CHECK(o_i32[size_t(i)] == to_i32(v));
    CHECK(o_i64[size_t(i)] == to_i64(v));
    CHECK(int(o_i1[size_t(i)]) == (v != 0.f ? 1 : 0));  // NaN != 0
    CHECK(o_i1_f32[size_t(i)] == (v != 0.f ? 1.f : 0.f));
    CHECK(o_i32_f32[size_t(i)] == float(to_i32(v)));
    CHECK(o_i64_f16[size_t(i)] == float_to_f16(float(to_i64(v))));
    CHECK(o_d_bf16[size_t(i)] == bf16_nearest(d[size_t(i)]));
  }
}

TEST_CASE("sqrt, rsqrt, exp, log, abs, maximum and minimum match libm", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  Kernel k("math", [](Builder& b) {
    auto x = b.tensor("x", 1), y = b.tensor("y", 1);
    std::vector<Tensor> o;
    for (const char* name : {"sqrt", "rsqrt", "exp", "log", "abs", "max", "min"})
      o.push_back(b.tensor(name, 1));
    auto i = program_id(0) * 32 + arange(32);
    auto m = i < x.dim(0);
    auto xv = load(x, {i}, m, 1.0), yv = load(y, {i}, m);
    store(o[0], {i}, sqrt(xv), m);
    store(o[1], {i}, rsqrt(xv), m);
    store(o[2], {i}, exp(yv), m);
    store(o[3], {i}, log(xv), m);
    store(o[4], {i}, abs(yv), m);
    store(o[5], {i}, maximum(xv, yv), m);
    store(o[6], {i}, minimum(xv, yv), m);
  });
  const int64_t n = 517;
  auto x = random_floats(rng, size_t(n), 0.01f, 100.f),
       y = random_floats(rng, size_t(n), -20.f, 20.f);
  y[3] = kNaN;  // maximum/minimum give the other operand
  y[5] = -kInf;
  std::vector<std::vector<float>> outs(7, std::vector<float>(size_t(n), -12345.f));
  std::vector<Arg> args = {view(x, {n}), view(y, {n})};
  for (auto& o : outs) args.push_back(view(o, {n}));
  run_on_cpu(k, args, {}, Grid{cdiv(n, 32)});
  std::vector<std::vector<double>> ref(7, std::vector<double>(static_cast<size_t>(n)));
  for (int64_t i = 0; i < n; ++i) {
    const double xv = x[size_t(i)], yv = y[size_t(i)];
    ref[0][size_t(i)] = std::sqrt(xv);
    ref[1][size_t(i)] = 1.0 / std::sqrt(xv);
    ref[2][size_t(i)] = std::exp(yv);
    ref[3][size_t(i)] = std::log(xv);
    ref[4][size_t(i)] = std::abs(yv);
    ref[5][size_t(i)] = std::isnan(yv) ? xv : std::max(xv, yv);
    ref[6][size_t(i)] = std::isnan(yv) ? xv : std::min(xv, yv);
  }
  const char* names[] = {"sqrt", "rsqrt", "exp", "log", "abs", "maximum", "minimum"};
  for (size_t j = 0; j < 7; ++j) {
    CAPTURE(names[j]);
    CHECK(max_relative(outs[j], ref[j], 1e-6) <= 1e-6);
  }
}

TEST_CASE("f16 math computes in f32 and rounds after every op", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  Kernel k("half_chain", [](Builder& b) {
    auto x = b.tensor("x", 1), out = b.tensor("out", 1);
    auto i = arange(256);
    auto m = i < x.dim(0);
    auto v = load(x, {i}, m);
    store(out, {i}, sqrt(v * v + 1.0) * 3.0, m);
  });
  const int64_t n = 200;
  auto xf = random_floats(rng, size_t(n), -300.f, 300.f);
  for (DType t : {DType::f16, DType::bf16}) {
    CAPTURE(dtype_name(t));
    auto x = t == DType::f16 ? to_f16(xf) : to_bf16(xf);
    std::vector<uint16_t> out(static_cast<size_t>(n), 0xFFFF);
    run_on_cpu(k, {view(x, t, {n}), view(out, t, {n})}, {}, Grid{});
    auto r = [&](float f) {
      return t == DType::f16 ? f16_to_float(float_to_f16(f)) : bf16_to_float(float_to_bf16(f));
    };
    for (int64_t i = 0; i < n; ++i) {
      const float v = t == DType::f16 ? f16_to_float(x[size_t(i)]) : bf16_to_float(x[size_t(i)]);
      const float want = r(r(std::sqrt(r(r(v * v) + 1.0f))) * 3.0f);
      const float got =
          t == DType::f16 ? f16_to_float(out[size_t(i)]) : bf16_to_float(out[size_t(i)]);
      CAPTURE(i, v);
      CHECK(got == want);  // v*v overflows f16 (to inf) for |v| > 256, as it must
    }
  }
}

TEST_CASE("integer division by zero gives 0, never a trap; shifts are arithmetic", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  Kernel k("int_ops", [](Builder& b) {
    auto a = b.tensor("a", 1), d = b.tensor("d", 1), q = b.tensor("q", 1), r = b.tensor("r", 1),
         sh = b.tensor("sh", 1), q64 = b.tensor("q64", 1);
    auto i = program_id(0) * 64 + arange(64);
    auto m = i < a.dim(0);
    auto av = load(a, {i}, m), dv = load(d, {i}, m);
    store(q, {i}, av / dv, m);
    store(r, {i}, av % dv, m);
    store(sh, {i}, (av >> (dv & 63)) + (av << 40), m);  // shifts past the width: 0 / sign fill
    store(q64, {i}, av.to(DType::i64) / dv.to(DType::i64), m);
  });
  const int64_t n = 300;
  std::uniform_int_distribution<int32_t> dist(-20, 20);
  std::vector<int32_t> a(static_cast<size_t>(n)), d(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    a[size_t(i)] = dist(rng) * 1000 + dist(rng);
    d[size_t(i)] = dist(rng) / 4;  // about a fifth are zero
  }
  a[0] = std::numeric_limits<int32_t>::min();
  d[0] = -1;
  d[1] = 0;
  std::vector<int32_t> q(static_cast<size_t>(n), 7), r(static_cast<size_t>(n), 7),
      sh(static_cast<size_t>(n), 7);
  std::vector<int64_t> q64(static_cast<size_t>(n), 7);
  auto i32 = [](std::vector<int32_t>& v) {
    return TensorView::contiguous(v.data(), DType::i32, {int64_t(v.size())});
  };
  run_on_cpu(k,
             {i32(a), i32(d), i32(q), i32(r), i32(sh),
              TensorView::contiguous(q64.data(), DType::i64, {n})},
             {}, Grid{cdiv(n, 64)});
  for (int64_t i = 0; i < n; ++i) {
    const int32_t av = a[size_t(i)], dv = d[size_t(i)];
    CAPTURE(i, av, dv);
    const bool bad = dv == 0 || (av == std::numeric_limits<int32_t>::min() && dv == -1);
    CHECK(q[size_t(i)] == (bad ? 0 : av / dv));
    CHECK(r[size_t(i)] == (bad ? 0 : av % dv));
    const int32_t amount = dv & 63;
    const int32_t shr = amount >= 32 ? (av < 0 ? -1 : 0) : (av >> amount);
    CHECK(sh[size_t(i)] == shr);  // av << 40 is 0
    CHECK(q64[size_t(i)] == (dv == 0 ? 0 : int64_t(av) / int64_t(dv)));
  }
}

TEST_CASE("masked loads never touch memory past the tensor and give 'other' there", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  // Two pages: the second is inaccessible, and the tensor ends exactly where it begins.
  void* base = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(base != MAP_FAILED);
  REQUIRE(mprotect(static_cast<char*>(base) + page, page, PROT_NONE) == 0);
  struct Unmap {
    void* p;
    size_t n;
    ~Unmap() { munmap(p, n); }
  } unmap{base, 2 * page};

  for (int64_t n : {37, 64, 1}) {
    CAPTURE(n);
    float* x = reinterpret_cast<float*>(static_cast<char*>(base) + page) - n;
    for (int64_t i = 0; i < n; ++i) x[i] = float(i) * 0.5f;
    Kernel k("guarded", [](Builder& b) {
      auto xt = b.tensor("x", 1), out = b.tensor("out", 1);
      auto i = arange(256);
      store(out, {i}, load(xt, {i}, i < xt.dim(0), -7.0));
    });
    std::vector<float> out(256, kNaN);
    run_on_cpu(k, {TensorView::contiguous(x, DType::f32, {n}), view(out, {256})}, {}, Grid{});
    for (int64_t i = 0; i < 256; ++i) REQUIRE(out[size_t(i)] == (i < n ? float(i) * 0.5f : -7.f));
  }

  // Masked stores leave the masked-off elements alone.
  Kernel k("masked_store", [](Builder& b) {
    auto out = b.tensor("out", 1);
    auto i = arange(64);
    store(out, {i}, full({64}, 3.0, DType::f32), (i % 3) == 0);
  });
  std::vector<float> out(64, -1.f);
  run_on_cpu(k, {view(out, {64})}, {}, Grid{});
  for (int i = 0; i < 64; ++i) CHECK(out[size_t(i)] == (i % 3 == 0 ? 3.f : -1.f));
}

TEST_CASE("a 3-D grid runs every program once with its ids and the grid size", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  Kernel k("grid3d", [](Builder& b) {
    auto out = b.tensor("out", 3), sizes = b.tensor("sizes", 1);
    auto x = program_id(0), y = program_id(1), z = program_id(2);
    // Scalar indices: an access of shape [] (one element per program).
    atomic_add(out, {z, y, x}, x + y * 10 + z * 100 + 1);
    auto first = (x == 0) & (y == 0) & (z == 0);
    auto axis = arange(4);
    auto nprog = where(axis == 0, num_programs(0),
                       where(axis == 1, num_programs(1),
                             where(axis == 2, num_programs(2), constant(0, DType::i32))));
    store(sizes, {axis}, nprog, first & (axis < 3));
  });
  const Grid grid{7, 3, 5};
  std::vector<int32_t> out(7 * 3 * 5, 0), sizes(4, -1);
  run_on_cpu(k,
             {TensorView::contiguous(out.data(), DType::i32, {5, 3, 7}),
              TensorView::contiguous(sizes.data(), DType::i32, {4})},
             {}, grid);
  for (int z = 0; z < 5; ++z)
    for (int y = 0; y < 3; ++y)
      for (int x = 0; x < 7; ++x)
        CHECK(out[size_t((z * 3 + y) * 7 + x)] == x + y * 10 + z * 100 + 1);
  CHECK(sizes == std::vector<int32_t>{7, 3, 5, -1});
}

TEST_CASE("loops with a step <= 0 run no iteration; scalars can be carried", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  Kernel k("loop_steps", [](Builder& b) {
    auto out = b.tensor("out", 1), tile_out = b.tensor("tile_out", 1);
    auto step = b.scalar("step", DType::i32);
    auto hi = b.scalar("hi", DType::i32);
    auto results = for_range(0, hi, step, {constant(0, DType::i32), full({8}, 2.0, DType::f32)},
                             [&](const Value& iv, const std::vector<Value>& c) {
                               return std::vector<Value>{c[0] + 1, c[1] + iv.to(DType::f32)};
                             });
    store(out, {constant(0, DType::i32)}, results[0]);
    store(tile_out, {arange(8)}, results[1]);
  });
  struct Case {
    int step, hi, count;
    float tile;
  };
  for (const Case& c : {Case{1, 10, 10, 2.f + 45.f}, Case{3, 10, 4, 2.f + 18.f},
                        Case{0, 10, 0, 2.f}, Case{-1, 10, 0, 2.f}, Case{1, -5, 0, 2.f},
                        Case{1 << 30, 2147483647, 2, 2.f + float(1 << 30)}}) {
    CAPTURE(c.step, c.hi);
    std::vector<int32_t> out(1, -1);
    std::vector<float> tile(8, kNaN);
    run_on_cpu(k,
               {TensorView::contiguous(out.data(), DType::i32, {1}), view(tile, {8}),
                Scalar(c.step), Scalar(c.hi)},
               {}, Grid{});
    CHECK(out[0] == c.count);
    for (float v : tile) CHECK(v == c.tile);
  }
}

TEST_CASE("scalar arguments reach the kernel in their declared dtypes", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  Kernel k("scalars", [](Builder& b) {
    auto x = b.tensor("x", 1), out = b.tensor("out", 1);
    auto s = b.scalar("s", DType::f32), h = b.scalar("h", DType::bf16),
         n = b.scalar("n", DType::i64), c = b.scalar("c", DType::i32);
    auto i = arange(16);
    auto v = load(x, {i}) * s + h.to(DType::f32) + n.to(DType::f32) + c.to(DType::f32);
    store(out, {i}, v);
  });
  std::vector<float> x(16), out(16, kNaN);
  for (int i = 0; i < 16; ++i) x[size_t(i)] = float(i);
  run_on_cpu(k,
             {view(x, {16}), view(out, {16}), Scalar(0.5), Scalar(1.5), Scalar(int64_t(1) << 40),
              Scalar(-3)},
             {}, Grid{});
  for (int i = 0; i < 16; ++i) CHECK(out[size_t(i)] == float(i) * 0.5f + 1.5f + 0x1p40f - 3.f);
}

TEST_CASE("scalar arguments are rounded once to their declared float dtypes", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  Kernel k("scalars_rounded_once", [](Builder& b) {
    auto out = b.tensor("out", 1);
    auto h = b.scalar("h", DType::bf16), g = b.scalar("g", DType::f16), f = b.scalar("f", DType::f32),
         hi = b.scalar("hi", DType::bf16), hn = b.scalar("hn", DType::bf16);
    const Value i = arange(8);
    Value v = full({8}, 0.0, DType::f32);
    const Value parts[] = {h.to(DType::f32), g.to(DType::f32), f, hi.to(DType::f32), hn.to(DType::f32)};
    for (int j = 0; j < 5; ++j) v = where(i == j, broadcast_to(parts[j], {8}), v);
    store(out, {i}, v);
  });
  std::vector<float> out(8, kNaN);
  const int64_t p60 = int64_t(1) << 60;
  // Each just above a tie of its dtype, by less than the next wider float keeps: a rounding
  // through f32 (or through f64, for the integers) lands on the tie and goes to even.
  run_on_cpu(k,
             {view(out, {8}), Scalar(1 + 0x1p-8 + 0x1p-30), Scalar(1 + 0x1p-11 + 0x1p-40),
              Scalar(p60 + (int64_t(1) << 36) + 1), Scalar(p60 + (int64_t(1) << 52) + 1),
              Scalar(-(p60 + (int64_t(1) << 52) + 1))},
             {}, Grid{});
  CHECK(out[0] == 1 + 0x1p-7f);
  CHECK(out[1] == 1 + 0x1p-10f);
  CHECK(out[2] == 0x1p60f + 0x1p37f);
  CHECK(out[3] == 0x1p60f + 0x1p53f);
  CHECK(out[4] == -(0x1p60f + 0x1p53f));
}

TEST_CASE("an integer scalar argument must be a whole number its dtype holds", "[cpu][errors]") {
  KERF_REQUIRE_CPU_BACKEND();
  Kernel k("int_scalars", [](Builder& b) {
    auto out = b.tensor("out", 1, DType::i64);
    auto c = b.scalar("c", DType::i32), n = b.scalar("n", DType::i64);
    store(out, {arange(2)}, where(arange(2) == 0, broadcast_to(c.to(DType::i64), {2}), broadcast_to(n, {2})));
  });
  std::vector<int64_t> out(2, -1);
  const auto call = [&](Scalar c, Scalar n) {
    kerf::launch(k, {TensorView::contiguous(out.data(), DType::i64, {2}), c, n}, Grid{}, dsl::MetaMap{});
  };
  // Whole numbers in range pass, given as integers or as doubles.
  call(Scalar(-7), Scalar(int64_t(1) << 40));
  CHECK(out == std::vector<int64_t>{-7, int64_t(1) << 40});
  call(Scalar(2147483647.0), Scalar(-9223372036854775807.0 - 1.0));
  CHECK(out == std::vector<int64_t>{2147483647, std::numeric_limits<int64_t>::min()});
  // Any integer type makes a Scalar (size_t and unsigned were ambiguous before).
  call(Scalar(size_t(7)), Scalar(static_cast<unsigned long long>(1) << 40));
  CHECK(out == std::vector<int64_t>{7, int64_t(1) << 40});
  CHECK_FALSE(Scalar(std::numeric_limits<uint64_t>::max()).is_int);  // past INT64_MAX: a double only
  const auto refused = [&](Scalar c, Scalar n, const std::string& what) {
    out.assign(2, -1);
    try {
      call(c, n);
      FAIL("no error for " << what);
    } catch (const InvalidArgument& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find("int_scalars") != std::string::npos);
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
    CHECK(out == std::vector<int64_t>{-1, -1});  // nothing ran
  };
  refused(Scalar(int64_t(3000000000)), Scalar(1), "'c' is i32, and 3000000000 does not fit it");
  refused(Scalar(2.7), Scalar(1), "'c' is i32, and 2.7000000000000002 is not a whole number");
  refused(Scalar(-2147483649.0), Scalar(1), "does not fit it");
  refused(Scalar(1), Scalar(std::nan("")), "'n' is i64, and nan is not a whole number");
  refused(Scalar(1), Scalar(std::numeric_limits<double>::infinity()), "'n' is i64, and inf does not fit it");
  refused(Scalar(1), Scalar(9223372036854775808.0), "'n' is i64, and 9.2233720368547758e+18 does not fit it");
  refused(Scalar(1), Scalar(std::numeric_limits<uint64_t>::max()), "'n' is i64, and 1.8446744073709552e+19 does not fit it");
  refused(Scalar(1e20), Scalar(1), "'c' is i32, and 1e+20 does not fit it");
}

TEST_CASE("several threads can launch at once", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const int64_t n = 50000;
  std::vector<float> x(static_cast<size_t>(n), 1.f), y(static_cast<size_t>(n), 2.f);
  auto compiled =
      compile_for(vector_add(), {view(x, {n}), view(y, {n}), view(x, {n})}, {{"BLOCK", 512}});
  std::vector<std::vector<float>> outs(4, std::vector<float>(size_t(n), kNaN));
  std::vector<std::thread> threads;
  for (auto& out : outs)
    threads.emplace_back([&] {
      for (int rep = 0; rep < 25; ++rep)
        compiled.run({view(x, {n}), view(y, {n}), view(out, {n})}, Grid{cdiv(n, 512)});
    });
  for (auto& t : threads) t.join();
  for (const auto& out : outs)
    for (float v : out) REQUIRE(v == 3.f);
}

TEST_CASE("compiled kernels free their code and the LLVM IR can be inspected", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  std::vector<float> x(8), y(8), out(8);
  const std::vector<Arg> args = {view(x, {8}), view(y, {8}), view(out, {8})};
  for (int i = 0; i < 20; ++i) {
    x[0] = float(i);
    run_on_cpu(vector_add(), args, {{"BLOCK", 8}}, Grid{});
    CHECK(out[0] == float(i));
  }
  const ir::Function f = vector_add().trace(kerf::arg_specs(args), {{"BLOCK", 8}});
  const std::string text = jit::cpu::emit_llvm_ir(f);
  INFO(text);
  CHECK(text.find("define void @kerf_vec_add(") != std::string::npos);
  CHECK(text.find("masked.load") != std::string::npos);
}

TEST_CASE("kernels compile within the time budget", "[cpu][compile-time]") {
  KERF_REQUIRE_CPU_BACKEND();
  std::vector<float> a(128 * 128), b(128 * 128), c(128 * 128);
  // The first compile also starts the JIT; time the ones after it.
  auto best_ms = [](const std::function<double()>& compile_once) {
    double best = 1e9;
    for (int i = 0; i < 3; ++i) best = std::min(best, compile_once());
    return best;
  };
  const std::vector<Arg> mm_args = {view(a, {128, 128}), view(b, {128, 128}), view(c, {128, 128})};
  compile_for(tiled_matmul(), mm_args, {{"BM", 64}, {"BN", 64}, {"BK", 32}});
  const double matmul_ms = best_ms([&] {
    return compile_for(tiled_matmul(), mm_args, {{"BM", 64}, {"BN", 64}, {"BK", 32}})
        .kernel->compile_ms;
  });
  const double softmax_ms = best_ms([&] {
    return compile_for(row_softmax(), {view(a, {128, 128}), view(b, {128, 128})}, {{"BN", 128}})
        .kernel->compile_ms;
  });
  std::vector<uint16_t> ah(128 * 128);
  const double matmul_bf16_ms = best_ms([&] {
    return compile_for(tiled_matmul(),
                       {view(ah, DType::bf16, {128, 128}), view(ah, DType::bf16, {128, 128}),
                        view(c, {128, 128})},
                       {{"BM", 64}, {"BN", 64}, {"BK", 32}})
        .kernel->compile_ms;
  });
  std::printf(
      "KERF-CPU-COMPILE-MS: matmul_f32_64x64x32=%.1f matmul_bf16_64x64x32=%.1f softmax_128=%.1f\n",
      matmul_ms, matmul_bf16_ms, softmax_ms);
  CHECK(matmul_ms < 200.0);
  CHECK(matmul_bf16_ms < 200.0);
  CHECK(softmax_ms < 200.0);
}

TEST_CASE("exp is within one ulp over the whole f32 range, with IEEE special cases", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  Kernel k("exp_sweep", [](Builder& b) {
    auto x = b.tensor("x", 1), y = b.tensor("y", 1);
    auto i = program_id(0) * 1024 + arange(1024);
    auto m = i < x.dim(0);
    store(y, {i}, exp(load(x, {i}, m)), m);
  });
  std::vector<float> x;
  for (uint32_t bits = 0; bits < 0x42D00000u; bits += 4099) {  // |x| from 0 to 104
    float v;
    std::memcpy(&v, &bits, sizeof v);
    x.push_back(v);
    x.push_back(-v);
  }
  for (float v : {kNaN, kInf, -kInf, 88.72283f, 88.72284f, -87.33654f, -103.97208f, -104.5f})
    x.push_back(v);
  const int64_t n = int64_t(x.size());
  std::vector<float> y(static_cast<size_t>(n), -1.f);
  run_on_cpu(k, {view(x, {n}), view(y, {n})}, {}, Grid{cdiv(n, 1024)});
  double worst_ulp = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double want = std::exp(double(x[size_t(i)]));
    const float got = y[size_t(i)];
    CAPTURE(x[size_t(i)], got, want);
    if (std::isnan(want)) {
      CHECK(std::isnan(got));
    } else if (want > double(std::numeric_limits<float>::max())) {
      CHECK(got == kInf);
    } else if (want < double(std::numeric_limits<float>::min())) {  // subnormal results
      CHECK(std::abs(double(got) - want) <= 0x1p-149);
    } else {
      int e;
      std::frexp(want, &e);
      worst_ulp = std::max(worst_ulp, std::abs(double(got) - want) / std::ldexp(1.0, e - 24));
    }
  }
  INFO("worst error " << worst_ulp << " ulp");
  CHECK(worst_ulp <= 1.0);
}

// norm[i] = || W[i,:] + s * (B[i,:] @ A) ||_2 and scale[i] = m[i] / norm[i] (the DoRA weight norm).
Kernel dora_norm() {
  return Kernel("dora_norm", [](Builder& k) {
    auto W = k.tensor("W", 2), A = k.tensor("A", 2), B = k.tensor("B", 2);
    auto m = k.tensor("m", 1), scale = k.tensor("scale", 1);
    auto s = k.scalar("s", DType::f32);
    const int64_t BM = k.meta("BLOCK_M"), BK = k.meta("BLOCK_K"), R = k.meta("R_PAD");
    auto rows = program_id(0) * BM + arange(BM);
    auto rk = arange(R);
    auto row_ok = rows.col() < W.dim(0);
    auto b = load(B, {rows.col(), rk.row()}, row_ok & (rk.row() < B.dim(1)));  // [BM, R]
    auto acc = for_range(0, W.dim(1), BK, zeros({BM}), [&](const Value& k0, const Value& acc) {
      auto cols = k0 + arange(BK);
      auto a = load(A, {rk.col(), cols.row()}, (rk.col() < A.dim(0)) & (cols.row() < W.dim(1)));
      auto w = load(W, {rows.col(), cols.row()}, row_ok & (cols.row() < W.dim(1)));
      auto c = w.to(DType::f32) + s * dot(b, a);
      return acc + sum(c * c, 1);
    });
    store(scale, {rows}, load(m, {rows}, rows < W.dim(0)) / sqrt(acc), rows < W.dim(0));
  });
}

TEST_CASE("a DoRA weight norm (dot, reductions, loop, scalar) matches the reference", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const uint32_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  const int64_t out_f = 75, in_f = 301, r = 12;
  for (DType t : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(t));
    auto W = random_floats(rng, size_t(out_f * in_f)), A = random_floats(rng, size_t(r * in_f)),
         B = random_floats(rng, size_t(out_f * r)),
         m = random_floats(rng, size_t(out_f), 0.5f, 2.f);
    if (t == DType::bf16)
      for (auto* v : {&W, &A, &B})
        for (float& x : *v) x = bf16_to_float(float_to_bf16(x));
    const float s = 0.75f;
    std::vector<double> ref(static_cast<size_t>(out_f));
    for (int64_t i = 0; i < out_f; ++i) {
      double norm2 = 0;
      for (int64_t j = 0; j < in_f; ++j) {
        double ba = 0;
        for (int64_t q = 0; q < r; ++q)
          ba += double(B[size_t(i * r + q)]) * A[size_t(q * in_f + j)];
        const double c = W[size_t(i * in_f + j)] + double(s) * ba;
        norm2 += c * c;
      }
      ref[size_t(i)] = m[size_t(i)] / std::sqrt(norm2);
    }
    std::vector<float> scale(static_cast<size_t>(out_f), kNaN);
    auto Wh = to_bf16(W), Ah = to_bf16(A), Bh = to_bf16(B);
    const std::vector<Arg> args =
        t == DType::f32
            ? std::vector<Arg>{view(W, {out_f, in_f}), view(A, {r, in_f}),   view(B, {out_f, r}),
                               view(m, {out_f}),       view(scale, {out_f}), Scalar(s)}
            : std::vector<Arg>{view(Wh, t, {out_f, in_f}), view(Ah, t, {r, in_f}),
                               view(Bh, t, {out_f, r}),    view(m, {out_f}),
                               view(scale, {out_f}),       Scalar(s)};
    const double ms =
        run_on_cpu(dora_norm(), args, {{"BLOCK_M", 16}, {"BLOCK_K", 64}, {"R_PAD", 16}},
                   Grid{cdiv(out_f, 16)});
    std::printf("KERF-CPU-COMPILE-MS: dora_norm_%s=%.1f\n", dtype_name(t), ms);
    CHECK(max_relative(scale, ref) <= 1e-5);
  }
}

TEST_CASE("kernels can be compiled from several threads at once", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      const int64_t n = 300 + t;
      std::vector<float> x(static_cast<size_t>(n), float(t)), y(static_cast<size_t>(n), 1.f),
          out(static_cast<size_t>(n), kNaN);
      run_on_cpu(vector_add(), {view(x, {n}), view(y, {n}), view(out, {n})},
                 {{"BLOCK", int64_t(32) << t}}, Grid{cdiv(n, int64_t(32) << t)});
      ok[size_t(t)] =
          std::all_of(out.begin(), out.end(), [&](float v) { return v == float(t) + 1.f; });
    });
  for (auto& th : threads) th.join();
  CHECK(ok == std::vector<int>{1, 1, 1, 1});
}

TEST_CASE("big tiles run on the workers' stacks; tiles beyond the budget are refused", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  auto carried_tile = [](int64_t side) {
    return Kernel("big_tile", [side](Builder& b) {
      auto out = b.tensor("out", 1);
      auto acc = for_range(0, 3, 1, zeros({side, side}),
                           [&](const Value& iv, const Value& a) { return a + iv.to(DType::f32); });
      store(out, {arange(side)}, sum(acc, 1));
    });
  };
  // 1 MiB of tile state: more than the launching thread is trusted with.
  std::vector<float> out(512, kNaN);
  auto compiled = compile_for(carried_tile(512), {view(out, {512})}, {});
  CHECK(compiled.kernel->stack_bytes >= (int64_t(1) << 20));
  compiled.run({view(out, {512})}, Grid{});
  for (float v : out) CHECK(v == 512.f * 3.f);

  std::vector<float> big(4096);
  try {
    compile_for(carried_tile(4096), {view(big, {4096})}, {});
    FAIL("a 64 MiB tile was accepted");
  } catch (const CompileError& e) {
    CHECK(std::string(e.what()).find("MiB") != std::string::npos);
  }
}

// After fork() the pool's workers exist only in the parent: the child runs the programs
// itself, on a thread of a worker's stack where they need more than its own (8 MiB here).
TEST_CASE("a forked child runs kernels whose tiles need more than its own stack", "[cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const Kernel k("forked_tile", [](Builder& b) {
    auto out = b.tensor("out", 1);
    auto acc = for_range(0, 2, 1, zeros({4096, 1024}),
                         [&](const Value& iv, const Value& a) { return a + iv.to(DType::f32); });
    store(out, {arange(4096)}, sum(acc, 1));
  });
  std::vector<float> out(4096, kNaN);
  auto compiled = compile_for(k, {view(out, {4096})}, {});
  REQUIRE(compiled.kernel->stack_bytes > (int64_t(16) << 20));
  compiled.run({view(out, {4096})}, Grid{2});  // the parent's workers run it
  CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 1024.f; }));
  const pid_t child = fork();
  if (child == 0) {
    std::fill(out.begin(), out.end(), kNaN);
    compiled.run({view(out, {4096})}, Grid{2});
    _exit(std::all_of(out.begin(), out.end(), [](float v) { return v == 1024.f; }) ? 0 : 1);
  }
  REQUIRE(child > 0);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));  // not killed by a signal (a stack overflow's SIGSEGV)
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("without LLVM the CPU back end says it is off and how to get it", "[cpu]") {
  if (jit::cpu::available()) return;  // the other tests cover the built back end
  CHECK(jit::cpu::llvm_version().empty());
  const ir::Function f =
      vector_add().trace({ArgSpec::tensor(DType::f32, 1), ArgSpec::tensor(DType::f32, 1),
                          ArgSpec::tensor(DType::f32, 1)},
                         {{"BLOCK", 64}});
  try {
    jit::cpu::compile(f);
    FAIL("compile succeeded without LLVM");
  } catch (const NotAvailable& e) {
    CHECK(std::string(e.what()).find("llvm-14-dev") != std::string::npos);
  }
}
