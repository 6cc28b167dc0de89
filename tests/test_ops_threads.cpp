// Ops called from several threads on one CUDA stream. Calls whose launches share
// the stream's workspace (an fp32 accumulator one launch adds to and a later one
// flushes into bf16 gradients; the embedding backward's gathered tables) hold it
// until their last launch is queued, so another thread's launches on that stream
// cannot come between them. Each thread's results must equal a lone call's.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch.h"
#include "device_tensor.h"
#include "gpu_test_util.h"
#include "kerf/ops/ops.h"
#include "kerf/runtime/cuda.h"

using namespace kerf;
using kerf::test::TestTensor;

namespace {

// Largest |got - want| over the largest |want|: a race adds or loses whole partial sums.
double scaled_error(const std::vector<double>& got, const std::vector<double>& want) {
  double worst = 0, scale = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return worst / scale;
}

}  // namespace

TEST_CASE("threads sharing a stream get a lone call's MoE and embedding gradients on the GPU",
          "[gpu][ops][threads]") {
  KERF_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  cuda::Stream stream(0);
  std::mt19937_64 rng(9100);

  // MoE backward with bf16 gradients and both sums atomic (rows split in two):
  // fp32 accumulators in the workspace, flushed by later launches.
  const int64_t E = 3, N = 96, K = 160, r = 8;
  TestTensor dW(DType::bf16, {E, N, K}, dev), A(DType::bf16, {E, r, K}, dev), B(DType::bf16, {E, N, r}, dev);
  dW.randomize(rng);
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  const ops::Config moe_cfg{64, 32, 2, 4, 2};

  // Embedding backward as gather, product, scatter, with bf16 gradients.
  const int64_t T = 300, V = 500, D = 96, re = 8;
  TestTensor x(DType::i64, {T}, dev), Ae(DType::bf16, {re, V}, dev), Be(DType::bf16, {D, re}, dev),
      g(DType::bf16, {T, D}, dev);
  std::uniform_int_distribution<int64_t> id(0, V - 1);
  for (int64_t t = 0; t < T; ++t) x.set(t, double(t % 9 == 0 ? 11 : id(rng)));
  x.upload();
  Ae.randomize(rng, -0.5, 0.5);
  Be.randomize(rng, -0.5, 0.5);
  g.randomize(rng);
  ops::Config emb_cfg;
  emb_cfg.block_m = 32;
  emb_cfg.block_k = 64;
  emb_cfg.meta["GATHER"] = 1;

  struct Out {
    TestTensor dA, dB, gA, gB;
    explicit Out(const Device& d)
        : dA(DType::bf16, {3, 8, 160}, d), dB(DType::bf16, {3, 96, 8}, d), gA(DType::bf16, {8, 500}, d),
          gB(DType::bf16, {96, 8}, d) {}
  };
  const auto call = [&](Out& o) {
    ops::moe_lora_materialize_backward(dW.view(), A.view(), B.view(), 0.5, o.dA.view(), o.dB.view(),
                                       stream.handle(), moe_cfg);
    ops::lora_embedding_backward(x.view(), Ae.view(), Be.view(), g.view(), 2.0, o.gA.view(), o.gB.view(), {},
                                 stream.handle(), emb_cfg);
  };
  Out lone(dev);
  call(lone);
  stream.synchronize();
  const std::vector<double> want_dA = values(lone.dA), want_dB = values(lone.dB), want_gA = values(lone.gA),
                            want_gB = values(lone.gB);

  const int threads = 4, calls = 6;
  std::vector<std::vector<Out>> outs(threads);
  for (auto& per : outs) {
    per.reserve(calls);
    for (int i = 0; i < calls; ++i) per.emplace_back(dev);
  }
  // A deadlock between the calls would hang the whole run: give up loudly after two minutes.
  const auto done = std::make_shared<std::atomic<bool>>(false);  // outlives this test for the watchdog
  std::thread([done] {
    for (int i = 0; i < 1200 && !done->load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!done->load()) {
      std::fprintf(stderr, "threads sharing a stream: the calls did not finish in 120 s (a deadlock?)\n");
      std::abort();
    }
  }).detach();
  struct Finished {  // set however this test leaves (a failure too), not while it is stuck
    std::shared_ptr<std::atomic<bool>> flag;
    ~Finished() { *flag = true; }
  } finished{done};
  std::vector<std::thread> pool;
  std::vector<std::string> errors(threads);
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      try {
        for (int i = 0; i < calls; ++i) call(outs[size_t(t)][size_t(i)]);
      } catch (const std::exception& e) {
        errors[size_t(t)] = e.what();
      }
    });
  for (std::thread& th : pool) th.join();
  stream.synchronize();
  for (const std::string& e : errors) CHECK(e.empty());
  stream.synchronize();
  for (int t = 0; t < threads; ++t)
    for (int i = 0; i < calls; ++i) {
      CAPTURE(t, i);
      Out& o = outs[size_t(t)][size_t(i)];
      CHECK(scaled_error(values(o.dA), want_dA) <= 1e-2);
      CHECK(scaled_error(values(o.dB), want_dB) <= 1e-2);
      CHECK(scaled_error(values(o.gA), want_gA) <= 1e-2);
      CHECK(scaled_error(values(o.gB), want_gB) <= 1e-2);
    }
}
