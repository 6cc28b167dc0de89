// ops::dora_norm_4bit: the DoRA norm of a weight kept as 4-bit codes in blocks
// (bitsandbytes' NF4 layout), against float64 references on random codes and
// scales, odd shapes, partial last blocks, every adapter dtype and split, a
// scale per element and a scale per row and step (in and the block size
// multiples of BLOCK_K); the tuner's candidates; and
// the arguments it refuses, with their messages.
#include <cmath>
#include <random>
#include <string>

#include "catch.h"
#include "cpu_test_util.h"
#include "device_tensor.h"
#include "error_test_util.h"
#include "gpu_test_util.h"
#include "kerf/error.h"
#include "kerf/jit/autotune.h"
#include "test_cache_util.h"
#include "kerf/ops/ops.h"

using namespace kerf;
using kerf::test::TestTensor;

namespace {

struct Case4 {
  int64_t out, in, r, blocksize;
  DType ab, m;
  ops::Config config;
};

// A random 4-bit weight: every byte random (both nibbles), absmax in [0.5, 2).
struct Quantized {
  TestTensor packed, absmax, code;
  Quantized(int64_t out, int64_t in, int64_t blocksize, Device dev, std::mt19937_64& rng)
      : packed(DType::u8, {out * in / 2, 1}, dev),
        absmax(DType::f32, {(out * in + blocksize - 1) / blocksize}, dev),
        code(DType::f32, {16}, dev) {
    for (int64_t i = 0; i < packed.numel(); ++i) packed.set(i, double(rng() & 255));
    packed.upload();
    absmax.randomize(rng, 0.5, 2.0);
    for (int q = 0; q < 16; ++q) code.set(q, ops::nf4_code()[size_t(q)]);
    code.upload();
  }
  // Element f of the row-major weight, dequantized exactly.
  double w(int64_t f, int64_t blocksize) const {
    const int byte = int(packed.get(f / 2));
    const int q = f % 2 == 0 ? byte >> 4 : byte & 15;
    return code.get(q) * absmax.get(f / blocksize);
  }
  ops::Weight4bit view(int64_t blocksize) {
    return ops::Weight4bit{packed.view(), absmax.view(), code.view(), blocksize};
  }
};

// Two references for the norms: the exact math, and the one the kernel promises
// (s*B and A rounded once to the product's dtype, everything else exact).
struct Norms {
  std::vector<double> exact, promised;
};
Norms reference_norms(const Quantized& W, const TestTensor& A, const TestTensor& B, double s, double eps,
                      int64_t out, int64_t in, int64_t r, int64_t blocksize) {
  const DType dot = A.dtype() == DType::f16 ? DType::f16 : DType::bf16;
  Norms n;
  for (int64_t i = 0; i < out; ++i) {
    double ss = 0, ss_rounded = 0;
    for (int64_t j = 0; j < in; ++j) {
      double ba = 0, ba_rounded = 0;
      for (int64_t k = 0; k < r; ++k) {
        ba += B.get(i * r + k) * A.get(k * in + j);
        // bf16: s*B and A rounded once to bf16; f16 adapters are exact, s applied after the product.
        ba_rounded += dot == DType::f16 ? s * B.get(i * r + k) * A.get(k * in + j)
                                        : test::round_to(dot, float(B.get(i * r + k)) * float(s)) *
                                              test::round_to(dot, A.get(k * in + j));
      }
      const double w = W.w(i * in + j, blocksize);
      ss += (w + s * ba) * (w + s * ba);
      ss_rounded += (w + ba_rounded) * (w + ba_rounded);
    }
    n.exact.push_back(std::sqrt(ss + eps));
    n.promised.push_back(std::sqrt(ss_rounded + eps));
  }
  return n;
}

void check_4bit(const Case4& c, Device dev, uint64_t seed) {
  CAPTURE(c.out, c.in, c.r, c.blocksize, dtype_name(c.ab), dtype_name(c.m), c.config.split_k, c.config.block_m,
          c.config.block_k, c.config.num_warps, c.config.meta.count("WARPS_N"), seed, dev.str());
  std::mt19937_64 rng(seed);
  Quantized W(c.out, c.in, c.blocksize, dev, rng);
  TestTensor A(c.ab, {c.r, c.in}, dev), B(c.ab, {c.out, c.r}, dev), m(c.m, {c.out}, dev);
  TestTensor norm(DType::f32, {c.out}, dev), scale(DType::f32, {c.out}, dev);
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  m.randomize(rng, 0.5, 1.5);
  norm.poison();
  scale.poison();
  const double s = 1.75, eps = 1e-6;
  ops::dora_norm_4bit(W.view(c.blocksize), A.view(), B.view(), m.view(), s, norm.view(), scale.view(), eps, nullptr,
                      c.config);
  test::sync(dev);
  norm.download();
  scale.download();
  const Norms ref = reference_norms(W, A, B, s, eps, c.out, c.in, c.r, c.blocksize);
  std::vector<double> got_n, got_s, exact_s;
  for (int64_t i = 0; i < c.out; ++i) {
    got_n.push_back(norm.get(i));
    got_s.push_back(scale.get(i));
    exact_s.push_back(m.get(i) / ref.exact[size_t(i)]);
  }
  const std::vector<double>& exact_n = ref.exact;
  const std::vector<double>& promised_n = ref.promised;
  CHECK(test::max_relative_error(got_n, promised_n) <= 1e-5);
  CHECK(test::max_relative_error(got_n, exact_n) <= 1e-2);
  CHECK(test::max_relative_error(got_s, exact_s) <= 1e-2);
}

void run_4bit_cases(Device dev) {
  auto cfg = [](int64_t bm, int64_t bk, int64_t split) {
    ops::Config c;
    c.block_m = bm;
    c.block_k = bk;
    c.split_k = split;
    return c;
  };
  auto cast_a = [](ops::Config c) {
    c.meta["CAST_A"] = 1;
    return c;
  };
  auto warps_n = [](ops::Config c, int64_t warps, int64_t wn) {
    c.num_warps = warps;
    c.meta["WARPS_N"] = wn;
    return c;
  };
  auto cols_first = [](ops::Config c) {
    c.meta["COLS_FIRST"] = 1;
    return c;
  };
  const std::vector<Case4> cases = {
      {77, 130, 5, 64, DType::f32, DType::f32, {}},             // partial blocks, rows and steps
      {64, 256, 16, 64, DType::bf16, DType::bf16, {}},          // whole tiles
      {33, 322, 16, 128, DType::f16, DType::f32, {}},           // f16 product
      {50, 1000, 33, 64, DType::f32, DType::bf16, cfg(16, 64, 3)},  // rank above 32, three splits
      {9, 94, 1, 32, DType::bf16, DType::f32, cfg(0, 2, 0)},    // one byte per step
      {100, 62, 8, 4096, DType::f32, DType::f32, cfg(32, 32, 1)},  // one scale for everything
      {96, 512, 16, 128, DType::bf16, DType::f32, cfg(32, 64, 2)},  // one scale per row and step, split
      {77, 130, 5, 64, DType::f32, DType::f32, cast_a(cfg(0, 0, 1))},   // f32 A rounded once, by its own launch
      {96, 512, 16, 64, DType::f32, DType::bf16, cast_a(cfg(32, 64, 3))},  // the same beside a split's sums
      {200, 322, 33, 128, DType::bf16, DType::f32, warps_n(cfg(128, 64, 2), 8, 2)},  // warps sharing columns
      {77, 130, 5, 64, DType::f16, DType::f32, warps_n(cfg(64, 0, 0), 8, 4)},
      {50, 1000, 33, 64, DType::f32, DType::bf16, cols_first(cfg(16, 64, 3))},  // slices on grid axis 0
      {96, 512, 16, 128, DType::bf16, DType::f32, cols_first(cfg(32, 64, 2))},
  };
  uint64_t seed = 9100;
  for (const Case4& c : cases) check_4bit(c, dev, seed++);
}

template <class F>
void expect_invalid(F&& fn, const std::string& needle) {
  try {
    fn();
    FAIL("no error for: " << needle);
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("dora_norm_4bit matches float64 references on the CPU", "[cpu][ops][dora][4bit]") {
  KERF_REQUIRE_CPU_BACKEND();
  run_4bit_cases(Device::cpu());
}

TEST_CASE("dora_norm_4bit matches float64 references on the GPU", "[gpu][ops][dora][4bit]") {
  KERF_REQUIRE_GPU();
  run_4bit_cases(Device::cuda(0));
}

// Untuned (KERF_AUTOTUNE=0, or a first call in a capture): the op's own tiles, narrowed at
// ranks >= 128 to fit the shared memory, with every adapter dtype.
TEST_CASE("dora_norm_4bit with its untuned tiles at ranks 128 and 256 matches float64 references on the GPU",
          "[gpu][ops][dora][4bit][large_rank]") {
  KERF_REQUIRE_GPU();
  test::ScopedEnv env({{"KERF_AUTOTUNE", "0"}});
  const std::vector<Case4> cases = {
      {77, 130, 128, 64, DType::f32, DType::f32, {}},
      {64, 256, 256, 64, DType::bf16, DType::bf16, {}},
      {33, 322, 256, 128, DType::f16, DType::f32, {}},
      {96, 512, 256, 128, DType::f32, DType::f32, {}},
      // Small tiles on two stages, as an untuned call runs them on GPUs of 99 KiB.
      {64, 256, 256, 64, DType::f32, DType::f32, ops::Config{16, 32, 0, 4, 2}},
  };
  uint64_t seed = 4900;
  for (const Case4& c : cases) check_4bit(c, Device::cuda(0), seed++);
}

namespace {

// A call repeating the last one's shapes, strides, dtypes and alignment takes the
// op's short path (the plan and kernel kept, only the memory checks run again):
// it must compute from the codes, scales and adapters it is given now, and still
// refuse outputs that overlap an input or each other.
void check_4bit_repeated(Device dev) {
  CAPTURE(dev.str());
  std::mt19937_64 rng(4242);
  const int64_t out = 21, in = 46, r = 3, bs = 64;  // partial scale blocks, no multiple of a tile
  Quantized W(out, in, bs, dev, rng);
  TestTensor A(DType::f32, {r, in}, dev), B(DType::f32, {out, r}, dev);
  TestTensor pool(DType::f32, {3 * 64}, dev);  // m, norm, scale, 64 floats apart
  pool.randomize(rng, 0.5, 1.5);
  const auto slot = [&](int64_t k) {
    return TensorView::contiguous(static_cast<float*>(pool.data()) + k * 64, DType::f32, {out}, dev);
  };
  const TensorView m = slot(0), norm = slot(1), scale = slot(2);
  const double s = 0.5, eps = 0.0;
  for (int call = 0; call < 6;
       ++call) {  // the last as the first: the checks below take the short path
    CAPTURE(call);
    if (call == 2) clear_kernel_cache();  // the kept kernel lapses: resolved again, then reused
    for (int64_t i = 0; i < W.packed.numel(); ++i) W.packed.set(i, double(rng() & 255));
    W.packed.upload();
    W.absmax.randomize(rng, 0.5, 2.0);
    A.randomize(rng, -0.5, 0.5);
    B.randomize(rng, -0.5, 0.5);
    ops::Weight4bit wv = W.view(bs);
    if (call == 3) {  // absmax and code as bitsandbytes may keep them, [n, 1]: read by count, the same
      wv.absmax = TensorView::contiguous(wv.absmax.data, DType::f32, {wv.absmax.numel(), 1}, dev);
      wv.code = TensorView::contiguous(wv.code.data, DType::f32, {16, 1}, dev);
    }
    if (call == 4) {  // any contiguous shapes, of the highest ranks
      wv.absmax = TensorView::contiguous(wv.absmax.data, DType::f32,
                                         {1, 1, 1, 1, 1, 1, 1, wv.absmax.numel()}, dev);
      wv.code = TensorView::contiguous(wv.code.data, DType::f32, {2, 1, 2, 1, 2, 1, 2, 1}, dev);
    }
    ops::dora_norm_4bit(wv, A.view(), B.view(), m, s, norm, scale, eps, nullptr);
    test::sync(dev);
    pool.download();
    const Norms ref = reference_norms(W, A, B, s, eps, out, in, r, bs);
    std::vector<double> got_n, got_s, want_s;
    for (int64_t i = 0; i < out; ++i) {
      got_n.push_back(pool.get(64 + i));
      got_s.push_back(pool.get(128 + i));
      want_s.push_back(pool.get(i) / ref.promised[size_t(i)]);
    }
    CHECK(test::max_relative_error(got_n, ref.promised) <= 1e-5);
    CHECK(test::max_relative_error(got_s, want_s) <= 1e-5);
  }
  CHECK_INVALID(ops::dora_norm_4bit(W.view(bs), A.view(), B.view(), m, s, m, scale, eps, nullptr),
                "dora_norm_4bit: output norm overlaps m in memory");
  CHECK_INVALID(ops::dora_norm_4bit(W.view(bs), A.view(), B.view(), m, s, norm, norm, eps, nullptr),
                "dora_norm_4bit: output scale overlaps norm in memory");
  // The fingerprint keeps only an address's alignment: one whose elements would run past the
  // end of the address space is refused on the short path too.
  const uintptr_t low4 = reinterpret_cast<uintptr_t>(norm.data) & 15;
  const TensorView high = TensorView::contiguous(reinterpret_cast<void*>(uintptr_t(0) - 64 + low4),
                                                 DType::f32, {out}, dev);
  CHECK_INVALID(
      ops::dora_norm_4bit(W.view(bs), A.view(), B.view(), m, s, high, scale, eps, nullptr),
      "dora_norm_4bit: norm (");
  CHECK_INVALID(ops::dora_norm_4bit(W.view(bs), A.view(), B.view(), m, s, norm, scale, -1.0, nullptr),
                "dora_norm_4bit: eps must be >= 0");
  CHECK_INVALID(ops::dora_norm_4bit(W.view(bs), A.view(), B.view(), m, s, norm, scale, std::nan(""), nullptr),
                "dora_norm_4bit: eps must be >= 0");
  CHECK_INVALID(ops::dora_norm_4bit(W.view(32), A.view(), B.view(), m, s, norm, scale, eps, nullptr),
                "absmax must hold cdiv(out*in, blocksize)");
}

}  // namespace

TEST_CASE("a repeated dora_norm_4bit call computes from its new data and rechecks its memory on the CPU",
          "[cpu][ops][dora][4bit]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_4bit_repeated(Device::cpu());
}

TEST_CASE("a repeated dora_norm_4bit call computes from its new data and rechecks its memory on the GPU",
          "[gpu][ops][dora][4bit]") {
  KERF_REQUIRE_GPU();
  check_4bit_repeated(Device::cuda(0));
}

TEST_CASE("dora_norm_4bit refuses arrays that do not fit W, with messages saying which", "[ops][dora][4bit][errors]") {
  const Device dev = Device::cpu();
  std::mt19937_64 rng(9200);
  const int64_t out = 8, in = 64, r = 4;
  Quantized W(out, in, 64, dev, rng);
  TestTensor A(DType::f32, {r, in}, dev), B(DType::f32, {out, r}, dev), m(DType::f32, {out}, dev);
  TestTensor norm(DType::f32, {out}, dev), scale(DType::f32, {out}, dev);
  TestTensor odd_A(DType::f32, {r, in - 1}, dev), short_packed(DType::u8, {out * in / 2 - 1}, dev);
  TestTensor absmax_128(DType::f32, {out * in / 128}, dev), code15(DType::f32, {15}, dev);
  TestTensor code_bf16(DType::bf16, {16}, dev), packed_f32(DType::f32, {out * in / 8}, dev);
  auto call = [&](ops::Weight4bit w, const TensorView& a) {
    ops::dora_norm_4bit(w, a, B.view(), m.view(), 1.0, norm.view(), scale.view());
  };
  const ops::Weight4bit good = W.view(64);
  auto with = [&](auto edit) {
    ops::Weight4bit w = good;
    edit(w);
    return w;
  };
  expect_invalid([&] { call(good, odd_A.view()); }, "in (A's columns) must be even");
  expect_invalid([&] { call(with([&](auto& w) { w.packed = short_packed.view(); }), A.view()); },
                 "packed must hold out*in/2 = 256 bytes");
  expect_invalid([&] { call(with([&](auto& w) { w.absmax = absmax_128.view(); }), A.view()); },
                 "absmax must hold cdiv(out*in, blocksize) = 8 scales for blocks of 64, got 4 (is blocksize right?)");
  expect_invalid([&] { call(with([&](auto& w) { w.blocksize = 48; }), A.view()); },
                 "blocksize must be a power of two >= 2, got 48");
  expect_invalid([&] { call(with([&](auto& w) { w.code = code15.view(); }), A.view()); },
                 "code must hold the 16 values");
  expect_invalid([&] { call(with([&](auto& w) { w.code = code_bf16.view(); }), A.view()); }, "code");
  expect_invalid([&] { call(with([&](auto& w) { w.packed = packed_f32.view(); }), A.view()); }, "packed");
  expect_invalid(
      [&] {
        call(with([&](auto& w) { w.packed = W.packed.view({out * in / 4, 1}, {2, 1}); }), A.view());
      },
      "packed must be contiguous");
  expect_invalid(
      [&] {
        ops::dora_norm_4bit(good, A.view(), B.view(), m.view(), 1.0, norm.view(), norm.view());
      },
      "overlaps");
  ops::Config one;
  one.block_k = 1;
  expect_invalid(
      [&] { ops::dora_norm_4bit(good, A.view(), B.view(), m.view(), 1.0, norm.view(), scale.view(), 0.0, nullptr, one); },
      "block_k must be at least 2");
  // Nothing to do for out = 0.
  TestTensor B0(DType::f32, {0, r}, dev), m0(DType::f32, {0}, dev), n0(DType::f32, {0}, dev), s0(DType::f32, {0}, dev);
  TestTensor p0(DType::u8, {0}, dev), a0(DType::f32, {0}, dev);
  CHECK_NOTHROW(ops::dora_norm_4bit(ops::Weight4bit{p0.view(), a0.view(), W.code.view(), 64}, A.view(), B0.view(),
                                    m0.view(), 1.0, n0.view(), s0.view()));
}

TEST_CASE("the 4-bit DoRA tuner tries only steps inside one scale block when there are such", "[ops][dora][4bit][autotune]") {
  bool found = false;
  for (const autotune::TunableOp& op : autotune::tunable_ops()) {
    if (op.name != "dora_norm_4bit") continue;
    found = true;
    const std::vector<autotune::Config> cands = op.gpu_candidates();
    REQUIRE(!cands.empty());
    for (const autotune::Config& c : cands) CHECK(c.at("BLOCK_K") == 64);  // NF4 blocks of 64
  }
  CHECK(found);
}

TEST_CASE("a 4-bit weight whose in is not a multiple of the scale block is tuned apart", "[cpu][ops][dora][4bit][autotune]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "info"}});
  autotune::forget_choices();
  test::LogCapture logs;
  std::mt19937_64 rng(99);
  const Device dev = Device::cpu();
  const int64_t out = 21, r = 3, bs = 64;
  for (const int64_t in : {int64_t(128), int64_t(96)}) {  // one bucket of sizes, other candidates on a GPU
    Quantized W(out, in, bs, dev, rng);
    TestTensor A(DType::f32, {r, in}, dev), B(DType::f32, {out, r}, dev), m(DType::f32, {out}, dev),
        norm(DType::f32, {out}, dev), scale(DType::f32, {out}, dev);
    A.randomize(rng);
    B.randomize(rng);
    m.randomize(rng);
    ops::dora_norm_4bit(W.view(bs), A.view(), B.view(), m.view(), 0.5, norm.view(), scale.view());
  }
  CHECK(logs.count("dora_norm_4bit [32x128x16] f32,f32,f32") >= 1);
  CHECK(logs.count("dora_norm_4bit [32x128x16x-32] f32,f32,f32") >= 1);  // in = 96: its own choice
  CHECK(logs.count("chose") == 2);
}
