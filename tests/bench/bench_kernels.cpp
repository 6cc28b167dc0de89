// kerf's GPU benchmark for the flagship kernels.
//
// For each case: median time of many launches (CUDA events around each launch,
// after warm-up), inputs drawn at random and rotated over several sets so that
// L2 does not hold them, the bytes that must move (each input read once, each
// output written once), and those bytes over the bandwidth of a
// device-to-device copy of the same number of bytes (read + written), timed in
// the same run. Results go to stdout as a table and, with --json FILE, as JSON
// for tools/bench_table.py.
#include <dlfcn.h>

#include <algorithm>
#include <map>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kerf/cache/log.h"
#include "kerf/cache/store.h"
#include "kerf/dtype.h"
#include "kerf/error.h"
#include "kerf/ops/ops.h"
#include "kerf/runtime/cuda.h"

using namespace kerf;

namespace {

struct Result {
  std::string op, shape, config;
  double median_us = 0, bytes = 0, gbps = 0, copy_gbps = 0;
};

// Fills a device buffer with uniform random values of `dtype` in [-1, 1) * amp: element i
// from a counter-based hash of (seed, i), drawn on every host core at once (the same
// values whatever the core count; a 738 MB MoE gradient took seconds from one
// sequential generator, which every case of every run paid).
uint64_t mix64(uint64_t x) {  // SplitMix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

void fill_random(cuda::DeviceBuffer& buf, DType dtype, size_t n, uint64_t seed, float amp = 1.0f) {
  const size_t eb = size_t(dtype_size_bytes(dtype));
  std::vector<uint8_t> host(n * eb);
  const uint64_t key = mix64(seed);
  const auto fill = [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      // 24 random bits -> [-1, 1), exact in fp32.
      const float u = float(int64_t(mix64(key ^ i) >> 40) - (int64_t(1) << 23)) * (1.0f / float(1 << 23));
      const float v = u * amp;
      if (dtype == DType::bf16) {
        const uint16_t h = float_to_bf16(v);
        std::memcpy(&host[i * 2], &h, 2);
      } else if (dtype == DType::f16) {
        const uint16_t h = float_to_f16(v);
        std::memcpy(&host[i * 2], &h, 2);
      } else {
        std::memcpy(&host[i * 4], &v, 4);
      }
    }
  };
  const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 64);
  const size_t chunk = (n + threads - 1) / threads;
  if (n < (size_t(1) << 20) || threads == 1) {
    fill(0, n);
  } else {
    std::vector<std::thread> pool;
    for (size_t t = 0; t < threads; ++t) {
      const size_t lo = std::min(n, t * chunk), hi = std::min(n, lo + chunk);
      if (lo < hi) pool.emplace_back(fill, lo, hi);
    }
    for (std::thread& th : pool) th.join();
  }
  buf.copy_from_host(host.data(), host.size());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds of `iters` launches of `run(i)` (i selects the input set).
double time_us(const std::function<void(int)>& run, int iters, cuda::StreamHandle stream) {
  for (int i = 0; i < 5; ++i) run(i);
  cuda::stream_synchronize(stream);
  std::vector<cuda::Event> start(static_cast<size_t>(iters)), stop(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    start[size_t(i)].record(stream);
    run(i);
    stop[size_t(i)].record(stream);
  }
  cuda::stream_synchronize(stream);
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) t.push_back(1000.0 * cuda::Event::elapsed_ms(start[size_t(i)], stop[size_t(i)]));
  return median(t);
}

// GB/s of a device-to-device copy that moves `bytes` (half read, half written).
double copy_gbps(double bytes, cuda::StreamHandle stream) {
  if (!(bytes > 0)) throw InvalidArgument("copy_gbps: nothing to copy");
  const size_t half = size_t(bytes / 2);
  const int sets = int(std::max<double>(2, std::ceil(400e6 / bytes)));
  std::vector<cuda::DeviceBuffer> src, dst;
  for (int i = 0; i < sets; ++i) {
    src.emplace_back(half);
    dst.emplace_back(half);
    src.back().fill_bytes(uint8_t(i + 1));
  }
  const double us = time_us(
      [&](int i) { cuda::memcpy_device_to_device(dst[size_t(i % sets)].data(), src[size_t(i % sets)].data(), half, stream); },
      200, stream);
  return bytes / (us * 1e3);
}

std::string shape_str(std::initializer_list<int64_t> dims) {
  std::string s;
  for (int64_t d : dims) s += (s.empty() ? "" : "x") + std::to_string(d);
  return s;
}

// Input sets of one benchmark case, allocated and filled once.
struct DoraSets {
  int64_t out, in, r;
  DType wt;
  double bytes;
  DType at;  // the adapters' dtype (PEFT keeps fp32 adapters on a bf16 base)
  bool partial = false;  // dora_norm_partial: sumsq (into `norm`) only, no m or scale
  struct Set {
    cuda::DeviceBuffer W, A, B, m, norm, scale;
  };
  std::vector<Set> sets;
};

DoraSets make_dora(int64_t out, int64_t in, int64_t r, DType wt, DType at, bool partial = false) {
  DoraSets d{out, in, r, wt,
             double(out * in) * dtype_size_bytes(wt) + double(r * in + out * r) * dtype_size_bytes(at) +
                 double(out) * 4 * (partial ? 1 : 3),
             at, partial, {}};
  const int n = int(std::max<double>(2, std::ceil(300e6 / d.bytes)));
  d.sets.resize(size_t(n));
  for (int i = 0; i < n; ++i) {
    auto& x = d.sets[size_t(i)];
    x.W = cuda::DeviceBuffer(size_t(out * in) * dtype_size_bytes(wt));
    x.A = cuda::DeviceBuffer(size_t(r * in) * dtype_size_bytes(at));
    x.B = cuda::DeviceBuffer(size_t(out * r) * dtype_size_bytes(at));
    x.m = cuda::DeviceBuffer(size_t(out) * 4);
    x.norm = cuda::DeviceBuffer(size_t(out) * 4);
    x.scale = cuda::DeviceBuffer(size_t(out) * 4);
    fill_random(x.W, wt, size_t(out * in), 11 + i);
    fill_random(x.A, at, size_t(r * in), 23 + i, 0.1f);
    fill_random(x.B, at, size_t(out * r), 37 + i, 0.1f);
    fill_random(x.m, DType::f32, size_t(out), 41 + i);
  }
  return d;
}

std::string config_str(const ops::Config& c) {
  std::string s = "b" + std::to_string(c.block_m) + " bk" + std::to_string(c.block_k) + " split" +
                  std::to_string(c.split_k) + " w" + std::to_string(c.num_warps) + " s" + std::to_string(c.num_stages);
  for (const auto& [name, value] : c.meta) s += " " + name + "=" + std::to_string(value);
  return s;
}

Result bench_dora(DoraSets& d, const ops::Config& cfg, cuda::StreamHandle stream) {
  const Device dev = Device::cuda(0);
  const int64_t out = d.out, in = d.in, r = d.r;
  const DType wt = d.wt;
  auto run = [&](int i) {
    auto& x = d.sets[size_t(i) % d.sets.size()];
    if (d.partial) {
      ops::dora_norm_partial(TensorView::contiguous(x.W.data(), wt, {out, in}, dev),
                             TensorView::contiguous(x.A.data(), d.at, {r, in}, dev),
                             TensorView::contiguous(x.B.data(), d.at, {out, r}, dev), 2.0,
                             TensorView::contiguous(x.norm.data(), DType::f32, {out}, dev), stream, cfg);
      return;
    }
    ops::dora_norm(TensorView::contiguous(x.W.data(), wt, {out, in}, dev),
                   TensorView::contiguous(x.A.data(), d.at, {r, in}, dev),
                   TensorView::contiguous(x.B.data(), d.at, {out, r}, dev),
                   TensorView::contiguous(x.m.data(), DType::f32, {out}, dev), 2.0,
                   TensorView::contiguous(x.norm.data(), DType::f32, {out}, dev),
                   TensorView::contiguous(x.scale.data(), DType::f32, {out}, dev), 0.0, stream, cfg);
  };
  Result res;
  res.op = std::string(d.partial ? "dora_norm_partial" : "dora_norm") + " r=" + std::to_string(r) +
           (wt != DType::bf16 ? std::string(" ") + dtype_name(wt) + " W" : "") +
           (d.at != wt ? std::string(" ") + dtype_name(d.at) + " adapters" : "");
  res.shape = shape_str({out, in});
  res.config = config_str(cfg);
  res.median_us = time_us(run, 100, stream);
  res.bytes = d.bytes;
  res.gbps = d.bytes / (res.median_us * 1e3);
  return res;
}

struct MoeSets {
  int64_t E, N, K, r;
  DType wt;
  double bytes;
  DType at;  // the adapters' dtype
  // 0: plain [E, r, K] / [E, N, r]; 1: PEFT's flat lora_A [r*E, K], lora_B [N, r*E]; 2: PEFT's
  // transposed experts (W[e] is [in=N, out=K]: lora_A [r*E, N], lora_B [K, r*E]).
  int peft = 0;
  struct Set {
    cuda::DeviceBuffer W, A, B, out;
  };
  std::vector<Set> sets;
};

MoeSets make_moe(int64_t E, int64_t N, int64_t K, int64_t r, DType wt, DType at) {
  MoeSets d{E, N, K, r, wt,
            double(2 * E * N * K) * dtype_size_bytes(wt) + double(E * r * K + E * N * r) * dtype_size_bytes(at), at,
            {}};
  const int n = int(std::max<double>(2, std::ceil(300e6 / d.bytes)));
  d.sets.resize(size_t(n));
  for (int i = 0; i < n; ++i) {
    auto& x = d.sets[size_t(i)];
    x.W = cuda::DeviceBuffer(size_t(E * N * K) * dtype_size_bytes(wt));
    x.out = cuda::DeviceBuffer(size_t(E * N * K) * dtype_size_bytes(wt));
    // Room for either layout's adapters (the transposed one swaps their sizes).
    const int64_t most = E * r * std::max(N, K);
    x.A = cuda::DeviceBuffer(size_t(most) * dtype_size_bytes(at));
    x.B = cuda::DeviceBuffer(size_t(most) * dtype_size_bytes(at));
    fill_random(x.W, wt, size_t(E * N * K), 5 + i);
    fill_random(x.A, at, size_t(most), 7 + i, 0.1f);
    fill_random(x.B, at, size_t(most), 9 + i, 0.1f);
  }
  return d;
}

Result bench_moe(MoeSets& d, const ops::Config& cfg, cuda::StreamHandle stream) {
  const Device dev = Device::cuda(0);
  const int64_t E = d.E, N = d.N, K = d.K, r = d.r;
  const DType wt = d.wt;
  auto run = [&](int i) {
    auto& x = d.sets[size_t(i) % d.sets.size()];
    const TensorView W = TensorView::contiguous(x.W.data(), wt, {E, N, K}, dev);
    TensorView A = TensorView::contiguous(x.A.data(), d.at, {E, r, K}, dev);
    TensorView B = TensorView::contiguous(x.B.data(), d.at, {E, N, r}, dev);
    if (d.peft) {
      const bool t = d.peft == 2;
      const ops::MoeLoraViews v =
          ops::peft_moe_lora_views(W, TensorView::contiguous(x.A.data(), d.at, {r * E, t ? N : K}, dev),
                                   TensorView::contiguous(x.B.data(), d.at, {t ? K : N, r * E}, dev), t);
      A = v.A;
      B = v.B;
    }
    ops::moe_lora_materialize(W, A, B, 0.5, TensorView::contiguous(x.out.data(), wt, {E, N, K}, dev), stream, cfg);
  };
  Result res;
  res.op = "moe_materialize r=" + std::to_string(r) +
           (d.at != wt ? std::string(" ") + dtype_name(d.at) + " adapters" : "") +
           (d.peft == 1 ? " peft" : d.peft == 2 ? " peft transposed" : "");
  res.shape = shape_str({E, N, K});
  res.config = config_str(cfg);
  res.median_us = time_us(run, 50, stream);
  res.bytes = d.bytes;
  res.gbps = d.bytes / (res.median_us * 1e3);
  return res;
}

// ---------------------------------------------------------------- LoRA ops (merge, MoE backward, embedding)
// Each case: a set of device buffers per input set; `run(i, cfg)` launches one
// op on set i. bytes: each input read once, each output written once (the
// in-place merge reads and writes W).
struct OpCase {
  std::string op, shape;
  double bytes = 0;
  std::vector<std::vector<cuda::DeviceBuffer>> sets;
  std::function<void(std::vector<cuda::DeviceBuffer>&, const ops::Config&, cuda::StreamHandle)> run;
};

cuda::DeviceBuffer random_buffer(DType t, size_t n, uint64_t seed, float amp = 1.0f) {
  cuda::DeviceBuffer b(n * size_t(dtype_size_bytes(t)));
  fill_random(b, t, n, seed, amp);
  return b;
}

// Input sets until they pass ~300 MB together (L2 does not hold them); at least 2.
int set_count(double bytes) { return int(std::max<double>(2, std::ceil(300e6 / bytes))); }


Result bench_op(OpCase& c, const ops::Config& cfg, cuda::StreamHandle stream, int iters = 50) {
  Result res;
  res.op = c.op;
  res.shape = c.shape;
  res.config = config_str(cfg);
  res.median_us = time_us([&](int i) { c.run(c.sets[size_t(i) % c.sets.size()], cfg, stream); }, iters, stream);
  res.bytes = c.bytes;
  res.gbps = c.bytes / (res.median_us * 1e3);
  return res;
}

// W [out, in] += s * B @ A in place; W of dtype `wt` (bf16 unless named), A and B of `at`.
OpCase make_merge(int64_t out, int64_t in, int64_t r, DType wt = DType::bf16, DType at = DType::bf16) {
  const Device dev = Device::cuda(0);
  OpCase c;
  c.op = "lora_merge r=" + std::to_string(r) + (wt != DType::bf16 ? std::string(" ") + dtype_name(wt) + " W" : "") +
         (at != wt ? std::string(" ") + dtype_name(at) + " adapters" : "");
  c.shape = shape_str({out, in});
  c.bytes = double(2 * out * in) * dtype_size_bytes(wt) + double(r * in + out * r) * dtype_size_bytes(at);
  for (int i = 0; i < set_count(c.bytes); ++i) {
    std::vector<cuda::DeviceBuffer> b;
    b.push_back(random_buffer(wt, size_t(out * in), 101 + i));
    b.push_back(random_buffer(at, size_t(r * in), 103 + i, 0.1f));
    b.push_back(random_buffer(at, size_t(out * r), 107 + i, 0.1f));
    c.sets.push_back(std::move(b));
  }
  c.run = [=](std::vector<cuda::DeviceBuffer>& b, const ops::Config& cfg, cuda::StreamHandle stream) {
    ops::lora_merge(TensorView::contiguous(b[0].data(), wt, {out, in}, dev),
                    TensorView::contiguous(b[1].data(), at, {r, in}, dev),
                    TensorView::contiguous(b[2].data(), at, {out, r}, dev), 1e-3, stream, cfg);
  };
  return c;
}

// The DoRA norm of an NF4 weight [out, in] (blocks of 64), bf16 adapters and m.
OpCase make_dora_4bit(int64_t out, int64_t in, int64_t r) {
  const Device dev = Device::cuda(0);
  OpCase c;
  c.op = "dora_norm_4bit r=" + std::to_string(r);
  c.shape = shape_str({out, in});
  const int64_t blocks = (out * in + 63) / 64;
  c.bytes = double(out * in / 2 + blocks * 4 + (r * in + out * r + out) * 2 + out * 8);
  for (int i = 0; i < set_count(c.bytes); ++i) {
    std::vector<cuda::DeviceBuffer> b;
    std::mt19937_64 rng(301 + i);
    std::vector<uint8_t> bytes(size_t(out * in / 2));
    for (uint8_t& x : bytes) x = uint8_t(rng());
    b.emplace_back(bytes.size());
    b.back().copy_from_host(bytes.data(), bytes.size());
    b.push_back(random_buffer(DType::f32, size_t(blocks), 303 + i));
    b.push_back(random_buffer(DType::bf16, size_t(r * in), 307 + i, 0.1f));
    b.push_back(random_buffer(DType::bf16, size_t(out * r), 311 + i, 0.1f));
    b.push_back(random_buffer(DType::bf16, size_t(out), 313 + i));
    b.emplace_back(size_t(out) * 4);
    b.emplace_back(size_t(out) * 4);
    c.sets.push_back(std::move(b));
  }
  c.run = [=](std::vector<cuda::DeviceBuffer>& b, const ops::Config& cfg, cuda::StreamHandle stream) {
    const ops::Weight4bit w{TensorView::contiguous(b[0].data(), DType::u8, {out * in / 2}, dev),
                            TensorView::contiguous(b[1].data(), DType::f32, {blocks}, dev), ops::nf4_code_tensor(dev),
                            64};
    ops::dora_norm_4bit(w, TensorView::contiguous(b[2].data(), DType::bf16, {r, in}, dev),
                        TensorView::contiguous(b[3].data(), DType::bf16, {out, r}, dev),
                        TensorView::contiguous(b[4].data(), DType::bf16, {out}, dev), 2.0,
                        TensorView::contiguous(b[5].data(), DType::f32, {out}, dev),
                        TensorView::contiguous(b[6].data(), DType::f32, {out}, dev), 0.0, stream, cfg);
  };
  return c;
}

// dA = s B^T dW, dB = s dW A^T per expert; bf16 dW, adapters in `adapters` (bf16 unless
// named), gradients in `grads`. With `peft`, adapters and gradients are PEFT's flat expert
// parameters (lora_A [r*E, K], lora_B [N, r*E], seen through peft_moe_lora_views: B[e]'s
// rank columns E apart); PEFT keeps them in fp32.
OpCase make_moe_backward(int64_t E, int64_t N, int64_t K, int64_t r, DType grads, bool peft = false,
                         DType adapters = DType::bf16) {
  const Device dev = Device::cuda(0);
  OpCase c;
  c.op = std::string("moe_backward r=") + std::to_string(r) + " " + dtype_name(grads) + " grads" +
         (adapters != DType::bf16 ? std::string(" ") + dtype_name(adapters) + " adapters" : "") + (peft ? " peft" : "");
  c.shape = shape_str({E, N, K});
  c.bytes = double(E * N * K) * 2 + double(E * r * K + E * N * r) * dtype_size_bytes(adapters) +
            double(E * r * K + E * N * r) * dtype_size_bytes(grads);
  for (int i = 0; i < set_count(c.bytes); ++i) {
    std::vector<cuda::DeviceBuffer> b;
    b.push_back(random_buffer(DType::bf16, size_t(E * N * K), 201 + i));
    b.push_back(random_buffer(adapters, size_t(E * r * K), 203 + i, 0.1f));
    b.push_back(random_buffer(adapters, size_t(E * N * r), 207 + i, 0.1f));
    b.emplace_back(size_t(E * r * K) * dtype_size_bytes(grads));
    b.emplace_back(size_t(E * N * r) * dtype_size_bytes(grads));
    c.sets.push_back(std::move(b));
  }
  c.run = [=](std::vector<cuda::DeviceBuffer>& b, const ops::Config& cfg, cuda::StreamHandle stream) {
    const TensorView dW = TensorView::contiguous(b[0].data(), DType::bf16, {E, N, K}, dev);
    if (peft) {
      const ops::MoeLoraViews v =
          ops::peft_moe_lora_views(dW, TensorView::contiguous(b[1].data(), adapters, {r * E, K}, dev),
                                   TensorView::contiguous(b[2].data(), adapters, {N, r * E}, dev));
      const ops::MoeLoraViews g =
          ops::peft_moe_lora_views(dW, TensorView::contiguous(b[3].data(), grads, {r * E, K}, dev),
                                   TensorView::contiguous(b[4].data(), grads, {N, r * E}, dev));
      ops::moe_lora_materialize_backward(dW, v.A, v.B, 0.5, g.A, g.B, stream, cfg);
      return;
    }
    ops::moe_lora_materialize_backward(dW, TensorView::contiguous(b[1].data(), adapters, {E, r, K}, dev),
                                       TensorView::contiguous(b[2].data(), adapters, {E, N, r}, dev), 0.5,
                                       TensorView::contiguous(b[3].data(), grads, {E, r, K}, dev),
                                       TensorView::contiguous(b[4].data(), grads, {E, N, r}, dev), stream, cfg);
  };
  return c;
}

// Random ids in [0, V) as i64.
cuda::DeviceBuffer random_ids(int64_t T, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> d(0, V - 1);
  std::vector<int64_t> host(static_cast<size_t>(T));
  for (auto& v : host) v = d(rng);
  cuda::DeviceBuffer b(size_t(T) * 8);
  b.copy_from_host(host.data(), host.size() * 8);
  return b;
}

// out[t] = E[x[t]] + s A[:, x[t]] @ B^T, bf16 table and adapters; one table, ids rotated.
// Backward: gradients of A and B in `grads` (f32, or bf16 as the adapters); with
// `by_freq`, scale_grad_by_freq; with `after_a`, the forward's activations given
// (EmbeddingOptions::after_a, [T, r] bf16, read in place of the gather of A's columns).
OpCase make_embedding(int64_t T, int64_t V, int64_t D, int64_t r, bool backward, DType grads = DType::f32,
                      bool by_freq = false, bool after_a = false) {
  const Device dev = Device::cuda(0);
  OpCase c;
  c.op = std::string(backward ? "embedding_backward" : "embedding") + " r=" + std::to_string(r);
  if (backward && grads != DType::f32) c.op += std::string(" ") + dtype_name(grads) + " grads";
  if (backward && by_freq) c.op += " by_freq";
  if (after_a) c.op += " after_a";
  c.shape = shape_str({T, V, D});
  const double gb = double(dtype_size_bytes(grads));
  // forward: ids, gathered rows and LoRA columns, B, out; backward: ids, g, gathered A, B, dA and dB.
  // (forward with after_a: the activations written as well, T * r more.)
  c.bytes = backward ? double(T) * 8 + double(T * D + T * r + D * r) * 2 + double(r * V + D * r) * gb
                     : double(T) * 8 + double(T * D + T * r + D * r + T * D + (after_a ? T * r : 0)) * 2;
  // The table only for the forward (1 GB of random bf16 at 128256x4096, made on the host).
  auto table = backward ? nullptr : std::make_shared<cuda::DeviceBuffer>(random_buffer(DType::bf16, size_t(V * D), 301));
  auto A = std::make_shared<cuda::DeviceBuffer>(random_buffer(DType::bf16, size_t(r * V), 303, 0.1f));
  auto B = std::make_shared<cuda::DeviceBuffer>(random_buffer(DType::bf16, size_t(D * r), 307, 0.1f));
  for (int i = 0; i < set_count(double(T * D) * 4); ++i) {
    std::vector<cuda::DeviceBuffer> b;
    b.push_back(random_ids(T, V, 311 + i));
    b.emplace_back(size_t(T * D) * 2);  // out, or g
    if (backward) {
      fill_random(b.back(), DType::bf16, size_t(T * D), 313 + i);
      // Gradients rotate with the inputs: a call never finds the last call's dA and dB in L2.
      b.emplace_back(size_t(r * V) * size_t(gb));
      b.emplace_back(size_t(D * r) * size_t(gb));
      if (after_a) {  // the values do not change the time; random, as every input
        b.emplace_back(size_t(T * r) * 2);
        fill_random(b.back(), DType::bf16, size_t(T * r), 317 + i, 0.1f);
      }
    } else if (after_a) {
      b.emplace_back(size_t(T * r) * 2);  // written by the forward
    }
    c.sets.push_back(std::move(b));
  }
  c.run = [=](std::vector<cuda::DeviceBuffer>& b, const ops::Config& cfg, cuda::StreamHandle stream) {
    ops::EmbeddingOptions o;
    o.id_check = ops::IdCheck::deferred;  // no host wait per call (the ids are valid)
    o.scale_grad_by_freq = by_freq;
    if (after_a)
      o.after_a = TensorView::contiguous(b[backward ? 4 : 2].data(), DType::bf16, {T, r}, dev);
    const TensorView x = TensorView::contiguous(b[0].data(), DType::i64, {T}, dev);
    const TensorView a = TensorView::contiguous(A->data(), DType::bf16, {r, V}, dev);
    const TensorView bb = TensorView::contiguous(B->data(), DType::bf16, {D, r}, dev);
    const TensorView y = TensorView::contiguous(b[1].data(), DType::bf16, {T, D}, dev);
    if (backward)
      ops::lora_embedding_backward(x, a, bb, y, 2.0, TensorView::contiguous(b[2].data(), grads, {r, V}, dev),
                                   TensorView::contiguous(b[3].data(), grads, {D, r}, dev), o, stream, cfg);
    else
      ops::lora_embedding(x, TensorView::contiguous(table->data(), DType::bf16, {V, D}, dev), a, bb, 2.0, y, o,
                          stream, cfg);
  };
  return c;
}

// The best of a few configurations (the autotuned call is timed after it, in
// tuned_vs_default, and becomes the figure when faster).
std::vector<Result> g_sweep;  // every configuration tried, for the JSON report
bool g_verbose = false;       // --verbose: a line per configuration tried

// The op with its own defaults (autotuner off) and autotuned (on), each timed, and the
// configs the tuner chose for the call's launches (its KERF_LOG=info lines).
struct TunedVsDefault {
  std::string op, shape;
  double default_us = 0, tuned_us = 0;
  std::string chosen;
};
std::vector<TunedVsDefault> g_tuning;

// Runs `run` with the autotuner's info lines caught: the config of each "chose CONFIG" or
// "CONFIG (stored choice)" line, joined by "; ". Other messages go to stderr as kerf writes
// them at the level KERF_LOG asks for (raised to info meanwhile where it is lower).
std::string tuner_choices(const std::function<void()>& run) {
  const log::Level shown = log::level();
  std::string chosen;  // declared before the guard: the sink writes here until the guard removes it
  // Puts the sink and KERF_LOG back however `run` ends.
  struct Restore {
    bool had = false;
    std::string value;
    ~Restore() {
      log::set_sink({});
      if (had)
        setenv("KERF_LOG", value.c_str(), 1);
      else
        unsetenv("KERF_LOG");
      log::reload();
    }
  } restore;
  if (const char* was = std::getenv("KERF_LOG")) {
    restore.had = true;
    restore.value = was;
  }
  if (int(shown) < int(log::Level::info)) {
    setenv("KERF_LOG", "info", 1);
    log::reload();
  }
  log::set_sink([&](log::Level l, const std::string& m) {
    std::string config;  // config texts hold no blanks
    if (l == log::Level::info && m.rfind("autotune ", 0) == 0) {
      if (const size_t at = m.find(": chose "); at != std::string::npos) {
        config = m.substr(at + 8, m.find(' ', at + 8) - at - 8);
      } else if (const size_t end = m.rfind(" (stored choice)"); end != std::string::npos) {
        const size_t start = m.rfind(' ', end - 1) + 1;
        config = m.substr(start, end - start);
      }
    }
    if (!config.empty())
      chosen += (chosen.empty() ? "" : "; ") + config;
    else if (l != log::Level::off && int(l) <= int(shown))
      std::fprintf(stderr, "kerf %s: %s\n", l == log::Level::warn ? "warning" : l == log::Level::info ? "info" : "debug",
                   m.c_str());
  });
  run();
  return chosen;
}

// Also makes the autotuned call the case's figure when it beats every swept
// config (it is what a caller without a Config gets); its label is "autotuned".
template <class F>
void tuned_vs_default(Result& best, F run_with_config) {
  TunedVsDefault t{best.op, best.shape, 0, 0};
  setenv("KERF_AUTOTUNE", "0", 1);
  cache::reload_settings();
  t.default_us = run_with_config(ops::Config{}).median_us;
  setenv("KERF_AUTOTUNE", "1", 1);
  cache::reload_settings();
  Result tuned;
  t.chosen = tuner_choices([&] { tuned = run_with_config(ops::Config{}); });  // the warm-up call tunes
  t.tuned_us = tuned.median_us;
  if (t.op.empty()) {  // nothing swept (--tuned-only): the case's names come from its runs
    t.op = tuned.op;
    t.shape = tuned.shape;
  }
  unsetenv("KERF_AUTOTUNE");
  cache::reload_settings();
  if (best.median_us == 0 || tuned.median_us < best.median_us) {
    tuned.config = "autotuned";
    best = tuned;
  }
  std::printf("  %-22s %-12s default %8.1f us, autotuned %8.1f us (%+.1f%%) [%s]\n", t.op.c_str(), t.shape.c_str(),
              t.default_us, t.tuned_us, 100.0 * (t.tuned_us / t.default_us - 1.0),
              t.chosen.empty() ? "no choice reported" : t.chosen.c_str());
  g_tuning.push_back(t);
}

// The comma-separated items of a command-line value (an empty one between two
// commas included, a trailing comma adding none).
std::vector<std::string> comma_items(const std::string& list) {
  std::vector<std::string> items;
  for (size_t at = 0; at < list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    items.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return items;
}

// NAME=VALUE[,NAME=VALUE...] (Config.meta entries) added to `into`; false at an item
// without '='.
bool parse_meta_items(const std::string& list, std::map<std::string, int64_t>& into) {
  for (const std::string& item : comma_items(list)) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos) return false;
    into[item.substr(0, eq)] = std::atoll(item.c_str() + eq + 1);
  }
  return true;
}

template <class F>
Result best_of(const std::vector<ops::Config>& configs, F run_one) {
  Result best;
  for (const ops::Config& c : configs) {
    try {
      Result r = run_one(c);
      if (g_verbose)
        std::printf("    %-30s %-18s %9.1f us  [%s]\n", r.op.c_str(), r.shape.c_str(), r.median_us, r.config.c_str());
      g_sweep.push_back(r);
      if (best.median_us == 0 || r.median_us < best.median_us) best = r;
    } catch (const kerf::Error& e) {
      std::fprintf(stderr, "  config skipped: %s\n", e.what());
    }
  }
  return best;
}

}  // namespace

// --l2-persist-mb N: sets the current context's L2 set-aside for persisting accesses
// (CU_LIMIT_PERSISTING_L2_CACHE_SIZE, where evict-last lines are kept) before the
// cases run, and prints it before and after. The driver is the one kerf loaded.
static bool set_l2_persisting(long long mib) {
  using SetLimit = int (*)(int, size_t);
  using GetLimit = int (*)(size_t*, int);
  constexpr int kPersistingL2 = 0x06;  // CU_LIMIT_PERSISTING_L2_CACHE_SIZE
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  const auto set = lib ? reinterpret_cast<SetLimit>(dlsym(lib, "cuCtxSetLimit")) : nullptr;
  const auto get = lib ? reinterpret_cast<GetLimit>(dlsym(lib, "cuCtxGetLimit")) : nullptr;
  if (!set || !get) {
    std::fprintf(stderr, "--l2-persist-mb: the CUDA driver's cuCtxSetLimit is not available\n");
    return false;
  }
  size_t before = 0, after = 0;
  get(&before, kPersistingL2);
  const int rc = set(kPersistingL2, size_t(mib) << 20);
  get(&after, kPersistingL2);
  std::printf("L2 set-aside for persisting accesses: %zu -> %zu bytes\n", before, after);
  if (rc != 0) std::fprintf(stderr, "--l2-persist-mb: cuCtxSetLimit failed (CUresult %d)\n", rc);
  return rc == 0;
}

int main(int argc, char** argv) {
  std::string json_path, only, op_filter, with_meta;
  std::optional<ops::Config> forced;
  std::map<std::string, int64_t> meta;
  std::vector<std::map<std::string, int64_t>> variants;  // --variants: meta added to --config's, in turns
  int rounds = 3;
  bool quick = false, tuned_only = false;
  long long l2_persist_mib = -1;  // --l2-persist-mb: left as the driver set it when negative
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--verbose")) g_verbose = true;
    // --only OUT,IN,R,BM,BK,SPLIT,WARPS,STAGES: one DoRA case and config, timed
    // repeatedly (for profilers).
    if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    // --op NAME[,NAME...]: only the cases whose op name contains one of them (e.g. "moe_backward").
    if (!std::strcmp(argv[i], "--op") && i + 1 < argc) op_filter = argv[++i];
    // --config BM,BK,SPLIT,WARPS,STAGES: every case runs that one config only, with
    // no tuned-vs-default comparison (for profilers; 0 fields: the op's default).
    if (!std::strcmp(argv[i], "--config") && i + 1 < argc) {
      long long c[5] = {0};
      if (std::sscanf(argv[++i], "%lld,%lld,%lld,%lld,%lld", &c[0], &c[1], &c[2], &c[3], &c[4]) != 5) {
        std::fprintf(stderr, "--config wants BM,BK,SPLIT,WARPS,STAGES\n");
        return 2;
      }
      forced = ops::Config{c[0], c[1], c[2], c[3], c[4]};
    }
    // --with-meta NAME: only the swept configs that set meta NAME (e.g. WGMMA), beside
    // the op's default and autotuned calls.
    if (!std::strcmp(argv[i], "--with-meta") && i + 1 < argc) with_meta = argv[++i];
    // --tuned-only: no sweep; each case's figure is the autotuner's choice (what a
    // call without a Config gets), timed beside the op's default config.
    if (!std::strcmp(argv[i], "--tuned-only")) tuned_only = true;
    // --l2-persist-mb N: the L2 set-aside for persisting (evict-last) lines, in MiB, for this run.
    if (!std::strcmp(argv[i], "--l2-persist-mb") && i + 1 < argc) l2_persist_mib = std::atoll(argv[++i]);
    // --variants "M1;M2;...": with --config, each case runs once per variant in turns,
    // --rounds times (default 3), each Mi (NAME=V[,NAME=V...], or empty) added to --meta;
    // a row per variant with its median round, after every round's time (an A/B in one
    // process: the same inputs, machine state and copy measurement for every variant).
    if (!std::strcmp(argv[i], "--variants") && i + 1 < argc) {
      const std::string list = argv[++i];
      for (size_t at = 0; at <= list.size();) {
        const size_t semi = std::min(list.find(';', at), list.size());
        std::map<std::string, int64_t> v;
        if (!parse_meta_items(list.substr(at, semi - at), v)) {
          std::fprintf(stderr, "--variants wants NAME=VALUE[,NAME=VALUE...] items separated by ';'\n");
          return 2;
        }
        variants.push_back(std::move(v));
        at = semi + 1;
      }
    }
    if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = std::max(1, std::atoi(argv[++i]));
    // --meta NAME=V[,NAME=V...]: Config.meta for --only and --config (e.g. WARPS_N=2).
    if (!std::strcmp(argv[i], "--meta") && i + 1 < argc && !parse_meta_items(argv[++i], meta)) {
      std::fprintf(stderr, "--meta wants NAME=VALUE[,NAME=VALUE...]\n");
      return 2;
    }
  }
  if (forced) forced->meta = meta;
  if (!variants.empty() && !forced) {
    std::fprintf(stderr, "--variants needs --config\n");
    return 2;
  }
  std::vector<std::string> filters;  // --op A,B: the cases whose name contains A or B
  for (const std::string& f : comma_items(op_filter))
    if (!f.empty()) filters.push_back(f);
  const auto wanted = [&](const std::string& op) {
    if (filters.empty()) return true;
    for (const std::string& f : filters)
      if (op.find(f) != std::string::npos) return true;
    return false;
  };
  // Whether some case of this family may be wanted: a filter naming it ("moe_backward r=64" for
  // "moe_backward"), or one naming no family at all ("peft", "bf16 grads"), which each case's
  // own name then answers.
  const auto family = [&](const std::string& prefix) {
    if (wanted(prefix)) return true;
    static const char* const families[] = {"dora_norm", "lora_merge", "moe_materialize", "moe_backward", "embedding"};
    for (const std::string& f : filters) {
      if (f.find(prefix) != std::string::npos) return true;
      if (std::none_of(std::begin(families), std::end(families),
                       [&](const char* name) { return f.find(name) != std::string::npos; }))
        return true;
    }
    return false;
  };
  if (!only.empty()) {
    long long v[8] = {0};
    if (std::sscanf(only.c_str(), "%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                    &v[6], &v[7]) != 8) {
      std::fprintf(stderr, "--only wants OUT,IN,R,BM,BK,SPLIT,WARPS,STAGES\n");
      return 2;
    }
    cuda::set_current_device(0);
    if (l2_persist_mib >= 0 && !set_l2_persisting(l2_persist_mib)) return 1;
    cuda::Stream stream(0);
    DoraSets sets = make_dora(v[0], v[1], v[2], DType::bf16, DType::bf16);
    const Result r = bench_dora(sets, ops::Config{v[3], v[4], v[5], v[6], v[7], meta}, stream.handle());
    std::printf("%s %s %.1f us %.0f GB/s [%s]\n", r.op.c_str(), r.shape.c_str(), r.median_us, r.gbps, r.config.c_str());
    return 0;
  }
  try {
    cuda::require_device(0);
    const cuda::DeviceInfo info = cuda::device_info(0);
    std::printf("device: %s (%s, %d SMs)\n", info.name.c_str(),
                cuda::arch_name(info.cc_major, info.cc_minor).c_str(), info.sm_count);
    cuda::set_current_device(0);
    if (l2_persist_mib >= 0 && !set_l2_persisting(l2_persist_mib)) return 1;
    cuda::Stream stream(0);
    std::vector<Result> results;
    // Rewritten after every case, so that a run stopped part way keeps what it measured.
    const auto write_json = [&] {
      if (json_path.empty()) return;
      std::ofstream js(json_path);
      js << "{\"device\": \"" << info.name << "\", \"results\": [\n";
      for (size_t i = 0; i < results.size(); ++i) {
        const Result& r = results[i];
        js << "  {\"impl\": \"kerf\", \"op\": \"" << r.op << "\", \"shape\": \"" << r.shape << "\", \"config\": \""
           << r.config << "\", \"median_us\": " << r.median_us << ", \"bytes\": " << r.bytes
           << ", \"gbps\": " << r.gbps << ", \"copy_gbps\": " << r.copy_gbps << "}"
           << (i + 1 < results.size() ? "," : "") << "\n";
      }
      js << "], \"tuning\": [\n";
      for (size_t i = 0; i < g_tuning.size(); ++i) {
        const TunedVsDefault& t = g_tuning[i];
        js << "  {\"op\": \"" << t.op << "\", \"shape\": \"" << t.shape << "\", \"default_us\": " << t.default_us
           << ", \"tuned_us\": " << t.tuned_us << ", \"chosen\": \"" << t.chosen << "\"}"
           << (i + 1 < g_tuning.size() ? "," : "") << "\n";
      }
      js << "], \"sweep\": [\n";
      for (size_t i = 0; i < g_sweep.size(); ++i) {
        const Result& r = g_sweep[i];
        js << "  {\"op\": \"" << r.op << "\", \"shape\": \"" << r.shape << "\", \"config\": \"" << r.config
           << "\", \"median_us\": " << r.median_us << "}" << (i + 1 < g_sweep.size() ? "," : "") << "\n";
      }
      js << "]}\n";
    };
    // One row: the copy bandwidth of the same bytes measured now, the line, the JSON.
    const auto report = [&](Result res) {
      res.copy_gbps = copy_gbps(res.bytes, stream.handle());
      std::printf("%-34s %-18s %9.1f us %8.0f GB/s  copy %6.0f GB/s  %5.1f%%  [%s]\n", res.op.c_str(),
                  res.shape.c_str(), res.median_us, res.gbps, res.copy_gbps, 100 * res.gbps / res.copy_gbps,
                  res.config.c_str());
      std::fflush(stdout);
      results.push_back(res);
      write_json();
    };
    // One case: the best of `cfgs` (or the forced config), the tuned-vs-default line, the row.
    const auto measure = [&](const std::function<Result(const ops::Config&)>& run,
                             const std::vector<ops::Config>& cfgs) {
      if (forced && !variants.empty()) {  // --variants: in turns, a row per variant
        std::vector<std::vector<Result>> got(variants.size());
        for (int round = 0; round < rounds; ++round)
          for (size_t v = 0; v < variants.size(); ++v) {
            ops::Config c = *forced;
            for (const auto& [name, value] : variants[v]) c.meta[name] = value;
            try {
              got[v].push_back(run(c));
            } catch (const kerf::Error& e) {
              std::fprintf(stderr, "  variant skipped: %s\n", e.what());
            }
          }
        for (std::vector<Result>& rs : got) {
          if (rs.empty()) continue;
          std::printf("  rounds [%s]:", rs.front().config.c_str());
          for (const Result& r : rs) std::printf(" %.1f", r.median_us);
          std::printf(" us\n");
          std::sort(rs.begin(), rs.end(), [](const Result& a, const Result& b) { return a.median_us < b.median_us; });
          report(rs[rs.size() / 2]);
        }
        return;
      }
      std::vector<ops::Config> tried = forced ? std::vector<ops::Config>{*forced} : cfgs;
      if (!forced && !with_meta.empty())
        std::erase_if(tried, [&](const ops::Config& c) { return !c.meta.count(with_meta); });
      if (!forced && tuned_only) tried.clear();
      Result res = best_of(tried, run);
      if (!forced) tuned_vs_default(res, run);
      if (res.median_us == 0) {  // every config was refused (the reasons are printed above)
        std::printf("  no configuration of this case ran\n");
        return;
      }
      report(res);
    };

    std::vector<ops::Config> dora_cfgs;
    for (int64_t bm : {64, 128})
      for (int64_t bk : {64, 128})
        for (int64_t warps : {4, 8})
          for (int64_t stages : {2, 3}) dora_cfgs.push_back(ops::Config{bm, bk, 0, warps, stages});
    for (int64_t stages : {2, 3}) dora_cfgs.push_back(ops::Config{256, 64, 0, 8, stages});
    for (int64_t bm : {128, 256}) dora_cfgs.push_back(ops::Config{bm, 64, 0, 16, 3});
    // Without split-K, smaller row blocks fill the device.
    for (int64_t bm : {16, 32, 64})
      for (int64_t warps : {4, 8}) dora_cfgs.push_back(ops::Config{bm, 64, 1, warps, 3});
    // L2 hints (W evicted first; 2: A kept) on two of the usual winners.
    for (int64_t evict : {1, 2})
      for (int64_t bm : {64, 128}) dora_cfgs.push_back(ops::Config{bm, 64, 0, 8, 3, {{"EVICT", evict}}});
    // Warpgroup dots (WGMMA, sm_90a only: elsewhere these would repeat the mma.sync
    // tiles): each warpgroup owns 64 rows per instruction, so the tiles pair rows
    // with warps differently, and deeper rings pay off when B is read once per warpgroup.
    const bool hopper = cuda::arch_name(info.cc_major, info.cc_minor) == "sm_90a";
    const auto wgmma_tiles = [&](const std::vector<std::array<int64_t, 2>>& rows_warps,
                                 const std::vector<int64_t>& steps, const std::vector<int64_t>& stages) {
      std::vector<ops::Config> c;
      if (!hopper || quick) return c;
      for (const auto& [bm, warps] : rows_warps)
        for (int64_t bk : steps)
          for (int64_t st : stages) c.push_back(ops::Config{bm, bk, 0, warps, st, {{"WGMMA", 1}}});
      return c;
    };
    for (ops::Config& c : wgmma_tiles({{64, 4}, {128, 4}, {128, 8}, {256, 8}}, {64, 128}, {2, 3, 4}))
      dora_cfgs.push_back(std::move(c));
    if (quick) dora_cfgs = {ops::Config{64, 64, 0, 8, 3}, ops::Config{128, 64, 0, 8, 3}, ops::Config{64, 128, 0, 4, 3}};
    const std::vector<std::pair<int64_t, int64_t>> dora_shapes = {
        {4096, 4096}, {8192, 8192}, {14336, 4096}, {4096, 14336}};
    // Warps sharing the dot's columns (WARPS_N) on the tall tiles, each with the
    // default split and the columns split for one and two full waves of one
    // program per SM (the tuner's wave candidates).
    const auto dora_warps_n_cfgs = [&](int64_t out, int64_t in) {
      std::vector<ops::Config> c;
      if (quick) return c;
      for (int64_t bm : {128, 256})
        for (int64_t waves : {0, 1, 2}) {
          const int64_t blocks = (out + bm - 1) / bm, steps = (in + 63) / 64;
          const int64_t split = waves ? std::clamp<int64_t>(waves * info.sm_count / blocks, 1, steps) : 0;
          for (int64_t wn : {0, 2}) {  // 4 was slower still (8192x8192 r=64: 65.1 us against 60.9)
            if (wn == 0 && waves == 0) continue;  // in dora_cfgs
            ops::Config cfg{bm, 64, split, 8, 3};
            if (wn) cfg.meta["WARPS_N"] = wn;
            c.push_back(cfg);
          }
          // The same splits of the warpgroup tiles.
          if (waves)
            for (ops::Config cfg : wgmma_tiles({{bm, 8}}, {64, 128}, {3})) {
              cfg.split_k = split;
              c.push_back(std::move(cfg));
            }
        }
      return c;
    };
    for (int64_t r : {16, 32, 64}) {
      for (auto [o, i] : dora_shapes) {
        if (!wanted("dora_norm r=" + std::to_string(r))) break;
        DoraSets sets = make_dora(o, i, r, DType::bf16, DType::bf16);
        std::vector<ops::Config> cfgs = dora_cfgs;
        for (ops::Config& c : dora_warps_n_cfgs(o, i)) cfgs.push_back(std::move(c));
        measure([&](const ops::Config& c) { return bench_dora(sets, c, stream.handle()); }, cfgs);
      }
    }
    // A row-parallel layer's shard (W split on in over two devices): 8192x8192 and
    // 4096x14336 halved, as dora_norm_partial sees them.
    for (int64_t r : {16, 64})
      for (auto [o, i] : std::vector<std::pair<int64_t, int64_t>>{{8192, 4096}, {4096, 7168}}) {
        if (!wanted("dora_norm_partial r=" + std::to_string(r))) break;
        DoraSets sets = make_dora(o, i, r, DType::bf16, DType::bf16, true);
        measure([&](const ops::Config& c) { return bench_dora(sets, c, stream.handle()); }, dora_cfgs);
      }
    // PEFT's usual case: fp32 adapters on a bf16 base (the adapters converted per
    // step, or once per call with CAST_A).
    std::vector<ops::Config> dora_f32a_cfgs = dora_cfgs;
    if (!quick)
      for (int64_t bm : {64, 128}) dora_f32a_cfgs.push_back(ops::Config{bm, 64, 0, 8, 3, {{"CAST_A", 1}}});
    for (auto [o, i] : std::vector<std::pair<int64_t, int64_t>>{{4096, 4096}, {8192, 8192}}) {
      if (!wanted("dora_norm r=16 f32 adapters")) break;
      DoraSets sets = make_dora(o, i, 16, DType::bf16, DType::f32);
      measure([&](const ops::Config& c) { return bench_dora(sets, c, stream.handle()); }, dora_f32a_cfgs);
    }
    // An f16 base: f16 adapters (the product in f16), fp32 adapters (the product in fp32,
    // which f16 cannot hold) — the autotuner's choice and the default only.
    for (int64_t r : {16, 64})
      for (DType at : {DType::f16, DType::f32}) {
        const std::string name = "dora_norm r=" + std::to_string(r) + " f16 W" + (at == DType::f32 ? " f32 adapters" : "");
        if (!wanted(name)) continue;
        DoraSets sets = make_dora(8192, 8192, r, DType::f16, at);
        measure([&](const ops::Config& c) { return bench_dora(sets, c, stream.handle()); }, {ops::Config{}});
      }
    std::vector<ops::Config> moe_cfgs;
    for (int64_t bn : {32, 64, 128})
      for (int64_t bk : {64, 128})
        for (int64_t warps : {4, 8})
          for (int64_t stages : {2, 3}) moe_cfgs.push_back(ops::Config{bn, bk, 0, warps, stages});
    // Taller row blocks read each expert's A fewer times (it matters at r=64).
    for (int64_t stages : {2, 3}) moe_cfgs.push_back(ops::Config{256, 64, 0, 8, stages});
    for (int64_t evict : {1, 2})
      for (int64_t bn : {64, 128}) moe_cfgs.push_back(ops::Config{bn, 128, 0, 8, 3, {{"EVICT", evict}}});
    for (int64_t wn : {2, 4})
      for (int64_t bn : {128, 256}) moe_cfgs.push_back(ops::Config{bn, 64, 0, 8, 3, {{"WARPS_N", wn}}});
    for (ops::Config& c : wgmma_tiles({{64, 4}, {128, 4}, {128, 8}, {256, 8}}, {64, 128}, {2, 3, 4}))
      moe_cfgs.push_back(std::move(c));
    // One tile per program through the accumulator's registers (STREAM), and in its one-tile
    // form (64x64: the own tile up to rank 16; 32x128 up to 32).
    for (auto [bn, bk] : std::vector<std::pair<int64_t, int64_t>>{{32, 128}, {32, 256}, {64, 128}})
      moe_cfgs.push_back(ops::Config{bn, bk, 0, 4, 1, {{"STREAM", 1}}});
    for (auto [bn, bk] : std::vector<std::pair<int64_t, int64_t>>{{32, 64}, {64, 64}, {32, 128}, {32, 256}})
      moe_cfgs.push_back(ops::Config{bn, bk, 0, 4, 1, {{"STREAM", 1}, {"ONE_TILE", 1}}});
    if (quick) moe_cfgs = {ops::Config{64, 64, 0, 8, 3}, ops::Config{32, 128, 0, 4, 3}, ops::Config{64, 128, 0, 4, 2}};
    struct MoeCase {
      int64_t E, N, K, r;
    };
    // One expert whose rows are a multiple of 8 but not of 16 elements: 16-byte vectors there too.
    // One expert of 8192x8192 at r=64: lora_merge's math and shape written out of place.
    // Eight large experts (Mixtral 8x7B's gate and up [8, 14336, 4096], down [8, 4096, 14336]):
    // 1792 and 512 row blocks of 64, either side of where the own tile starts walking the rows.
    // Rank 32, many experts and one large one; one 8192x8192 expert at r=16 (rows of whole sectors).
    for (const MoeCase& c : {MoeCase{128, 1536, 2048, 16}, MoeCase{128, 2048, 768, 16}, MoeCase{64, 2816, 2048, 64},
                             MoeCase{1, 8192, 8200, 16}, MoeCase{1, 8192, 8192, 64}, MoeCase{8, 14336, 4096, 16},
                             MoeCase{8, 4096, 14336, 16}, MoeCase{128, 1536, 2048, 32}, MoeCase{1, 8192, 8200, 32},
                             MoeCase{1, 8192, 8192, 16}}) {
      if (!wanted("moe_materialize r=" + std::to_string(c.r))) continue;
      MoeSets sets = make_moe(c.E, c.N, c.K, c.r, DType::bf16, DType::bf16);
      measure([&](const ops::Config& cfg) { return bench_moe(sets, cfg, stream.handle()); }, moe_cfgs);
    }
    // PEFT's layouts (its flat expert parameters, and those of transposed experts), r=64.
    for (const int peft : {1, 2}) {
      if (!wanted(peft == 1 ? "moe_materialize r=64 peft" : "moe_materialize r=64 peft transposed")) continue;
      MoeSets sets = make_moe(64, 2816, 2048, 64, DType::bf16, DType::bf16);
      sets.peft = peft;
      measure([&](const ops::Config& cfg) { return bench_moe(sets, cfg, stream.handle()); }, moe_cfgs);
    }
    // fp32 adapters on a bf16 base, converted per step or cast once (CAST_A).
    for (int64_t r : {16, 32}) {
      if (!wanted("moe_materialize r=" + std::to_string(r) + " f32 adapters")) continue;
      MoeSets sets = make_moe(128, 1536, 2048, r, DType::bf16, DType::f32);
      std::vector<ops::Config> cfgs = moe_cfgs;
      if (!quick)
        for (int64_t bn : {64, 128}) cfgs.push_back(ops::Config{bn, 128, 0, 8, 3, {{"CAST_A", 1}}});
      measure([&](const ops::Config& cfg) { return bench_moe(sets, cfg, stream.handle()); }, cfgs);
    }
    // The LoRA ops: each with kerf's own choice (Config{}: the autotuner on a GPU) and a few fixed configs.
    const auto run_case = [&](OpCase c, const std::vector<ops::Config>& cfgs) {
      if (!wanted(c.op)) return;
      measure([&](const ops::Config& cfg) { return bench_op(c, cfg, stream.handle()); }, cfgs);
    };
    std::vector<ops::Config> merge_cfgs = {ops::Config{}};
    if (!quick)
      for (int64_t bm : {32, 64, 128})
        for (int64_t bk : {64, 128})
          for (int64_t warps : {4, 8}) merge_cfgs.push_back(ops::Config{bm, bk, 0, warps, 3});
    if (!quick)
      for (int64_t evict : {1, 2})
        for (int64_t bm : {32, 64}) merge_cfgs.push_back(ops::Config{bm, 128, 0, 8, 3, {{"EVICT", evict}}});
    if (!quick)
      for (int64_t wn : {2, 4})
        for (int64_t bm : {64, 128}) merge_cfgs.push_back(ops::Config{bm, 128, 0, 8, 3, {{"WARPS_N", wn}}});
    // One tile per program, W moved through the product's accumulator registers (STREAM).
    if (!quick)
      for (auto [bm, bk] : std::vector<std::pair<int64_t, int64_t>>{{32, 128}, {32, 256}, {64, 128}}) {
        merge_cfgs.push_back(ops::Config{bm, bk, 0, 4, 1, {{"STREAM", 1}}});
        // Its one-tile form: W's tile asked for before the adapters'.
        merge_cfgs.push_back(ops::Config{bm, bk, 0, 4, 1, {{"STREAM", 1}, {"ONE_TILE", 1}}});
      }
    for (auto [o, i] : std::vector<std::pair<int64_t, int64_t>>{{4096, 4096}, {8192, 8192}, {14336, 4096}})
      if (family("lora_merge")) run_case(make_merge(o, i, 16), merge_cfgs);
    for (DType at : {DType::f16, DType::f32})
      if (family("lora_merge")) run_case(make_merge(8192, 8192, 16, DType::f16, at), {ops::Config{}});
    // PEFT's usual adapters on a bf16 base: fp32.
    if (family("lora_merge")) run_case(make_merge(8192, 8192, 16, DType::bf16, DType::f32), {ops::Config{}});
    // Ranks 32 and 64 (their own tiles on sm_90a: one 32x64 tile a program at 32, the MoE
    // forward's ring tile at 64), and at each f16 W and bf16 W with f16 or fp32 adapters.
    for (int64_t r : {32, 64})
      for (auto [o, i] : std::vector<std::pair<int64_t, int64_t>>{{4096, 4096}, {8192, 8192}, {14336, 4096}})
        if (family("lora_merge")) run_case(make_merge(o, i, r), {ops::Config{}});
    for (int64_t r : {32, 64}) {
      if (family("lora_merge")) run_case(make_merge(8192, 8192, r, DType::f16), {ops::Config{}});
      for (DType at : {DType::f16, DType::f32})
        if (family("lora_merge")) run_case(make_merge(8192, 8192, r, DType::bf16, at), {ops::Config{}});
    }
    std::vector<ops::Config> dora4_cfgs = {ops::Config{}};
    if (!quick)
      for (int64_t bm : {32, 64, 128})
        for (int64_t bk : {64, 128})
          for (int64_t warps : {4, 8}) dora4_cfgs.push_back(ops::Config{bm, bk, 0, warps, 3});
    for (auto [o, i] : std::vector<std::pair<int64_t, int64_t>>{{4096, 4096}, {8192, 8192}, {14336, 4096}})
      if (family("dora_norm_4bit")) run_case(make_dora_4bit(o, i, 16), dora4_cfgs);
    std::vector<ops::Config> moe_bwd_cfgs = {ops::Config{}};
    if (!quick)
      for (int64_t bn : {64, 128, 256})
        for (int64_t bk : {32, 64})
          for (int64_t warps : {4, 8}) moe_bwd_cfgs.push_back(ops::Config{bn, bk, 0, warps, 3});
    if (!quick)  // the column-owning kernel, and both kernels with rotated steps
      for (int64_t rotate : {0, 1}) {
        for (const auto& [bn, bk, warps, stages] : {std::array<int64_t, 4>{32, 256, 8, 3}, {16, 512, 16, 3},
                                                     {32, 512, 16, 2}, {64, 256, 8, 2}})
          moe_bwd_cfgs.push_back(ops::Config{bn, bk, 0, warps, stages, {{"BY_COLUMNS", 1}, {"ROTATE", rotate}}});
        if (rotate)
          for (int64_t bn : {128, 256}) moe_bwd_cfgs.push_back(ops::Config{bn, 64, 0, 8, 3, {{"ROTATE", 1}}});
      }
    for (ops::Config c : wgmma_tiles({{256, 8}}, {64}, {2, 3})) {  // 128 rows ran 30% slower
      c.meta["ROTATE"] = 1;
      moe_bwd_cfgs.push_back(std::move(c));
    }
    for (const MoeCase& c : {MoeCase{128, 1536, 2048, 16}, MoeCase{128, 2048, 768, 16}, MoeCase{64, 2816, 2048, 64}})
      for (DType grads : {DType::f32, DType::bf16})
        if (family("moe_backward")) run_case(make_moe_backward(c.E, c.N, c.K, c.r, grads), moe_bwd_cfgs);
    // PEFT's own layout (the adapters as PEFT >= 0.19 stores expert parameters), r=64: bf16
    // adapters and gradients, and PEFT's usual fp32 ones (beside the plain layout's).
    if (family("moe_backward")) {
      run_case(make_moe_backward(64, 2816, 2048, 64, DType::bf16, true), moe_bwd_cfgs);
      run_case(make_moe_backward(64, 2816, 2048, 64, DType::f32, false, DType::f32), moe_bwd_cfgs);
      run_case(make_moe_backward(64, 2816, 2048, 64, DType::f32, true, DType::f32), moe_bwd_cfgs);
    }
    std::vector<ops::Config> emb_cfgs = {ops::Config{}}, emb_bwd_cfgs = {ops::Config{}};
    if (!quick) {
      for (int64_t bt : {16, 32, 64, 128})
        for (int64_t bd : {64, 128, 256})
          if (bt * bd <= 16384) emb_cfgs.push_back(ops::Config{bt, bd, 0, 4, 3});  // else too big for 3 stages
      for (int64_t bt : {64, 128, 256})
        for (int64_t bd : {32, 64, 128})
          for (int64_t warps : {4, 8}) {
            if (bt * bd > 16384) continue;  // three stages of such tiles do not fit in shared memory
            emb_bwd_cfgs.push_back(ops::Config{bt, bd, 0, warps, 3});
            emb_bwd_cfgs.push_back(ops::Config{bt, bd, 0, warps, 3, {{"ROTATE", 1}}});
          }
      // D shared by a given number of programs (the default is one full wave of them).
      for (const auto& [bt, bd, split, warps] : {std::array<int64_t, 4>{32, 64, 1, 4}, {64, 64, 1, 8},
                                                  {64, 64, 2, 8}, {32, 128, 1, 8}, {64, 128, 1, 8}})
        emb_bwd_cfgs.push_back(ops::Config{bt, bd, split, warps, 3});
      for (int64_t bt : {128, 256})
        for (int64_t split : {2, 4}) {
          emb_bwd_cfgs.push_back(ops::Config{bt, 64, split, 8, 3});
          emb_bwd_cfgs.push_back(ops::Config{bt, 64, split, 8, 3, {{"ROTATE", 1}}});
        }
      // Gather, the MoE backward's column-owning pass over grad_out, scatter (its best so far).
      emb_bwd_cfgs.push_back(ops::Config{32, 256, 0, 8, 2, {{"GATHER", 1}}});
    }
    if (family("embedding r=")) {
      run_case(make_embedding(8192, 128256, 4096, 16, false), emb_cfgs);
      // Writing the activations for the backward as well.
      run_case(make_embedding(8192, 128256, 4096, 16, false, DType::f32, false, true), emb_cfgs);
    }
    if (family("embedding_backward")) {
      run_case(make_embedding(8192, 128256, 4096, 16, true), emb_bwd_cfgs);
      run_case(make_embedding(8192, 128256, 4096, 16, true, DType::bf16), emb_bwd_cfgs);
      run_case(make_embedding(8192, 128256, 4096, 16, true, DType::f32, true), emb_bwd_cfgs);
      // The forward's activations given: no gather of A's columns by id.
      run_case(make_embedding(8192, 128256, 4096, 16, true, DType::bf16, false, true), emb_bwd_cfgs);
      run_case(make_embedding(8192, 128256, 4096, 16, true, DType::f32, true, true), emb_bwd_cfgs);
    }

    write_json();
  } catch (const kerf::Error& e) {
    std::fprintf(stderr, "kerf_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
