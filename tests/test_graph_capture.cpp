// kerf's ops captured into CUDA graphs: a graph launched on fresh inputs gives
// what an eager call gives on them, launch after launch (workspaces are the
// graph's own and zero at each launch); bad token ids seen by a graph's launch
// are reported by the next check; a first call during a capture neither tunes
// nor leaves its untuned config behind; what cannot work during a capture is
// refused with a message, before the driver would invalidate the capture.
#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "catch.h"
#include "device_tensor.h"
#include "error_test_util.h"
#include "gpu_test_util.h"
#include "kerf/jit/autotune.h"
#include "kerf/ops/ops.h"
#include "kerf/runtime/cuda.h"
#include "test_cache_util.h"

using namespace kerf;
using kerf::test::TestTensor;

namespace {

// max |g - w| over max |w|: the graph's launch and the eager call add across programs
// in different orders (atomics), so single elements near zero differ relatively more.
double scaled_error(const std::vector<double>& g, const std::vector<double>& w) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < w.size(); ++i) {
    diff = std::max(diff, std::abs(g[i] - w[i]));
    scale = std::max(scale, std::abs(w[i]));
  }
  return scale > 0.0 ? diff / scale : diff;
}

// One op captured: `run(outputs, stream)` queues the op on `stream` writing into
// the output set `set` (0: the graph's, 1: the eager call's); `draw` gives every
// input new values. The graph is launched `launches` times, each on new inputs,
// and its outputs compared with an eager call's.
struct CaptureCase {
  std::string name;
  std::function<void(std::mt19937_64&)> draw;
  std::function<void(int set, void* stream)> run;
  std::function<std::vector<TestTensor*>(int set)> outputs;
  double tolerance = 1e-5;
  bool in_place = false;  // the outputs are inputs too: drawn, not poisoned
};

void check_captured(const CaptureCase& c, uint64_t seed, int launches = 2) {
  CAPTURE(c.name, seed);
  const Device dev = Device::cuda(0);
  std::mt19937_64 rng(seed);
  cuda::Stream stream(0);
  c.draw(rng);
  c.run(0, stream.handle());  // the warm-up call: compiles, and makes what a capture cannot
  stream.synchronize();
  cuda::Graph graph = cuda::Graph::capture(stream.handle(), [&] { c.run(0, stream.handle()); });
  for (int launch = 0; launch < launches; ++launch) {
    CAPTURE(launch);
    c.draw(rng);
    if (!c.in_place)
      for (int set : {0, 1})
        for (TestTensor* t : c.outputs(set)) t->poison();
    test::sync(dev);
    graph.launch(stream.handle());
    stream.synchronize();
    c.run(1, nullptr);
    test::sync(dev);
    const std::vector<TestTensor*> got = c.outputs(0), want = c.outputs(1);
    for (size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      const std::vector<double> g = values(*got[i]), w = values(*want[i]);
      bool finite = true;
      for (double x : g) finite = finite && std::isfinite(x);
      CHECK(finite);  // every element written by the graph's launch
      CHECK(scaled_error(g, w) <= c.tolerance);
    }
  }
}

// lora_merge of a bf16 W [out, in] with fp32 adapters at rank r under `cfg`, in place,
// captured (the second W a copy of the first at each draw).
void check_merge_captured(int64_t out, int64_t in, int64_t r, const ops::Config& cfg,
                          uint64_t seed) {
  const Device dev = Device::cuda(0);
  TestTensor A(DType::f32, {r, in}, dev), B(DType::f32, {out, r}, dev);
  std::vector<TestTensor> Ws;
  for (int i = 0; i < 2; ++i) Ws.emplace_back(DType::bf16, std::vector<int64_t>{out, in}, dev);
  check_captured({"lora_merge",
                  [&](std::mt19937_64& rng) {
                    Ws[0].randomize(rng);
                    for (int64_t i = 0; i < Ws[1].numel(); ++i) Ws[1].set(i, Ws[0].get(i));
                    Ws[1].upload();
                    A.randomize(rng, -0.5, 0.5);
                    B.randomize(rng, -0.5, 0.5);
                  },
                  [&](int set, void* stream) {
                    ops::lora_merge(Ws[size_t(set)].view(), A.view(), B.view(), 0.7, stream, cfg);
                  },
                  [&](int set) { return std::vector<TestTensor*>{&Ws[size_t(set)]}; }, 0.0, true},
                 seed);
}

}  // namespace

TEST_CASE("ops captured into a CUDA graph give an eager call's results launch after launch", "[gpu][ops][graph]") {
  KERF_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "0"}});

  SECTION("dora_norm split over programs (a zeroed workspace) with its fp32 A cast to bf16 first (scratch)") {
    const int64_t out = 300, in = 1000, r = 16;
    TestTensor W(DType::bf16, {out, in}, dev), A(DType::f32, {r, in}, dev), B(DType::f32, {out, r}, dev),
        m(DType::f32, {out}, dev);
    std::vector<TestTensor> outs;
    for (int i = 0; i < 4; ++i) outs.emplace_back(DType::f32, std::vector<int64_t>{out}, dev);
    ops::Config cfg;
    cfg.split_k = 4;
    cfg.meta["CAST_A"] = 1;
    check_captured({"dora_norm",
                    [&](std::mt19937_64& rng) {
                      W.randomize(rng);
                      A.randomize(rng, -0.1, 0.1);
                      B.randomize(rng, -0.1, 0.1);
                      m.randomize(rng, 0.5, 1.5);
                    },
                    [&](int set, void* stream) {
                      ops::dora_norm(W.view(), A.view(), B.view(), m.view(), 0.5, outs[size_t(2 * set)].view(),
                                     outs[size_t(2 * set + 1)].view(), 0.0, stream, cfg);
                    },
                    [&](int set) {
                      return std::vector<TestTensor*>{&outs[size_t(2 * set)], &outs[size_t(2 * set + 1)]};
                    }},
                   101);
  }

  SECTION("lora_merge in place") {
    check_merge_captured(130, 200, 8, {}, 102);
  }

  SECTION(
      "lora_merge in its one-tile form after its fp32 A's cast, the merge's launch overlapping the "
      "cast's") {
    ops::Config cfg;
    cfg.block_m = 64;
    cfg.block_k = 128;
    cfg.num_warps = 8;
    cfg.meta = {{"STREAM", 1}, {"ONE_TILE", 1}, {"CAST_A", 1}};
    check_merge_captured(200, 520, 20, cfg, 108);
  }

  SECTION("moe_lora_materialize and its backward into bf16 gradients (an fp32 workspace flushed)") {
    const int64_t E = 3, N = 96, K = 80, r = 8;
    TestTensor W(DType::bf16, {E, N, K}, dev), A(DType::f32, {E, r, K}, dev), B(DType::f32, {E, N, r}, dev),
        dW(DType::bf16, {E, N, K}, dev);
    std::vector<TestTensor> outs;
    for (int i = 0; i < 2; ++i) {
      outs.emplace_back(DType::bf16, std::vector<int64_t>{E, N, K}, dev);
      outs.emplace_back(DType::bf16, std::vector<int64_t>{E, r, K}, dev);
      outs.emplace_back(DType::bf16, std::vector<int64_t>{E, N, r}, dev);
    }
    check_captured({"moe_lora_materialize",
                    [&](std::mt19937_64& rng) {
                      W.randomize(rng);
                      A.randomize(rng, -0.5, 0.5);
                      B.randomize(rng, -0.5, 0.5);
                      dW.randomize(rng);
                    },
                    [&](int set, void* stream) {
                      TestTensor* o = &outs[size_t(3 * set)];
                      ops::moe_lora_materialize(W.view(), A.view(), B.view(), 0.5, o[0].view(), stream);
                      ops::moe_lora_materialize_backward(dW.view(), A.view(), B.view(), 0.5, o[1].view(),
                                                         o[2].view(), stream);
                    },
                    [&](int set) {
                      TestTensor* o = &outs[size_t(3 * set)];
                      return std::vector<TestTensor*>{&o[0], &o[1], &o[2]};
                    },
                    1e-2},
                   103, 3);
  }

  SECTION("moe_lora_materialize and its backward in PEFT's flat layout (strided adapters copied into scratch)") {
    const int64_t E = 3, N = 96, K = 80, r = 8;
    TestTensor W(DType::bf16, {E, N, K}, dev), lA(DType::f32, {r * E, K}, dev), lB(DType::f32, {N, r * E}, dev),
        dW(DType::bf16, {E, N, K}, dev);
    std::vector<TestTensor> outs;
    for (int i = 0; i < 2; ++i) {
      outs.emplace_back(DType::bf16, std::vector<int64_t>{E, N, K}, dev);
      outs.emplace_back(DType::bf16, std::vector<int64_t>{r * E, K}, dev);
      outs.emplace_back(DType::bf16, std::vector<int64_t>{N, r * E}, dev);
    }
    check_captured({"moe_lora_materialize peft",
                    [&](std::mt19937_64& rng) {
                      W.randomize(rng);
                      lA.randomize(rng, -0.5, 0.5);
                      lB.randomize(rng, -0.5, 0.5);
                      dW.randomize(rng);
                    },
                    [&](int set, void* stream) {
                      TestTensor* o = &outs[size_t(3 * set)];
                      const ops::MoeLoraViews v = ops::peft_moe_lora_views(W.view(), lA.view(), lB.view());
                      const ops::MoeLoraViews g = ops::peft_moe_lora_views(W.view(), o[1].view(), o[2].view());
                      ops::moe_lora_materialize(W.view(), v.A, v.B, 0.5, o[0].view(), stream);
                      ops::moe_lora_materialize_backward(dW.view(), v.A, v.B, 0.5, g.A, g.B, stream);
                    },
                    [&](int set) {
                      TestTensor* o = &outs[size_t(3 * set)];
                      return std::vector<TestTensor*>{&o[0], &o[1], &o[2]};
                    },
                    1e-2},
                   105, 3);
  }

  SECTION("lora_embedding and its backward in every form") {
    const int64_t T = 300, V = 1000, D = 200, r = 16;
    TestTensor x(DType::i64, {T}, dev), table(DType::bf16, {V, D}, dev), A(DType::bf16, {r, V}, dev),
        B(DType::bf16, {D, r}, dev), g(DType::bf16, {T, D}, dev);
    std::vector<TestTensor> outs;
    for (int i = 0; i < 2; ++i) {
      outs.emplace_back(DType::bf16, std::vector<int64_t>{T, D}, dev);
      outs.emplace_back(DType::f32, std::vector<int64_t>{r, V}, dev);
      outs.emplace_back(DType::f32, std::vector<int64_t>{D, r}, dev);
    }
    const auto draw = [&](std::mt19937_64& rng) {
      std::uniform_int_distribution<int64_t> id(0, 99);  // repeated ids: sums by id
      for (int64_t t = 0; t < T; ++t) x.set(t, double(id(rng) * 7 % V));
      x.upload();
      table.randomize(rng);
      A.randomize(rng, -0.5, 0.5);
      B.randomize(rng, -0.5, 0.5);
      g.randomize(rng);
    };
    // The default backward, and each other form kerf's configs choose among.
    std::vector<std::pair<std::string, ops::Config>> forms = {{"default", {}}};
    for (const char* form : {"FUSED", "GROUP_BY_ID", "GATHER"}) {
      ops::Config c;
      c.meta[form] = 1;
      if (std::string(form) == "FUSED") c.meta["GROUP_BY_ID"] = 1;
      if (std::string(form) == "GROUP_BY_ID") c.meta["FUSED"] = 0;  // the three launches (untuned: fused)
      forms.emplace_back(form, c);
    }
    for (const auto& [form, cfg] : forms) {
      ops::EmbeddingOptions o;
      o.padding_idx = 7;
      o.scale_grad_by_freq = form == "GROUP_BY_ID";
      check_captured({"lora_embedding " + form, draw,
                      [&, cfg = cfg, o](int set, void* stream) {
                        TestTensor* out = &outs[size_t(3 * set)];
                        ops::lora_embedding(x.view(), table.view(), A.view(), B.view(), 2.0, out[0].view(), o,
                                            stream);
                        ops::lora_embedding_backward(x.view(), A.view(), B.view(), g.view(), 2.0, out[1].view(),
                                                     out[2].view(), o, stream, cfg);
                      },
                      [&](int set) {
                        TestTensor* out = &outs[size_t(3 * set)];
                        return std::vector<TestTensor*>{&out[0], &out[1], &out[2]};
                      },
                      1e-5},
                     104, 3);
    }
  }
}

TEST_CASE("a captured embedding call's bad ids are reported by the next check on the device",
          "[gpu][ops][graph][embedding]") {
  KERF_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "0"}});
  const int64_t T = 64, V = 50, D = 32, r = 4;
  std::mt19937_64 rng(105);
  TestTensor x(DType::i32, {T}, dev), table(DType::f32, {V, D}, dev), A(DType::f32, {r, V}, dev),
      B(DType::f32, {D, r}, dev), out(DType::f32, {T, D}, dev);
  for (int64_t t = 0; t < T; ++t) x.set(t, double(t % V));
  x.upload();
  table.randomize(rng);
  A.randomize(rng);
  B.randomize(rng);
  cuda::Stream stream(0);
  const auto call = [&] {
    ops::lora_embedding(x.view(), table.view(), A.view(), B.view(), 1.0, out.view(), {}, stream.handle());
  };
  call();  // warm-up, ids in range: nothing to report
  cuda::Graph graph = cuda::Graph::capture(stream.handle(), call);  // no wait inside: IdCheck::sync cannot
  graph.launch(stream.handle());
  stream.synchronize();
  ops::check_embedding_ids(dev, stream.handle());  // nothing recorded
  x.set(9, double(V + 3));
  x.upload();
  graph.launch(stream.handle());
  stream.synchronize();
  out.download();
  for (int64_t d = 0; d < D; ++d) CHECK(out.get(9 * D + d) == 0.0);  // masked: zeros, no wild read
  CHECK_THROWS_WITH(ops::check_embedding_ids(dev, stream.handle()),
                    Catch::Contains("lora_embedding (a launch of a captured CUDA graph): token id x[9] = 53 is "
                                    "outside the vocabulary [0, 50)"));
  ops::check_embedding_ids(dev, stream.handle());  // reported once, then cleared
  // An eager call's own check reads the graphs' record too: nothing is lost.
  graph.launch(stream.handle());
  stream.synchronize();
  x.set(9, 1.0);
  x.upload();
  CHECK_THROWS_WITH(ops::lora_embedding(x.view(), table.view(), A.view(), B.view(), 1.0, out.view()),
                    Catch::Contains("(a launch of a captured CUDA graph): token id x[9] = 53"));
  // Checking during a capture would wait for the stream: refused, and the capture survives,
  // also on a stream kerf has seen no call on (whose record a check would otherwise make).
  cuda::Stream fresh(0);
  for (cuda::StreamHandle st : {stream.handle(), fresh.handle()}) {
    cuda::Graph checked = cuda::Graph::capture(st, [&] {
      CHECK_THROWS_WITH(ops::check_embedding_ids(dev, st),
                        Catch::Contains("cannot wait for a CUDA stream while it captures a graph"));
      ops::lora_embedding(x.view(), table.view(), A.view(), B.view(), 1.0, out.view(), {}, st);
    });
    checked.launch(st);
    cuda::stream_synchronize(st);
  }
}

TEST_CASE("an op first called during a capture runs its default config and tunes at its next eager call",
          "[gpu][ops][graph][autotune]") {
  KERF_REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "info"}});
  test::LogCapture logs;
  const int64_t out = 96, in = 160, r = 4;
  std::mt19937_64 rng(106);
  TestTensor W(DType::f32, {out, in}, dev), A(DType::f32, {r, in}, dev), B(DType::f32, {out, r}, dev),
      m(DType::f32, {out}, dev), norm(DType::f32, {out}, dev), scale(DType::f32, {out}, dev),
      norm2(DType::f32, {out}, dev), scale2(DType::f32, {out}, dev);
  W.randomize(rng);
  A.randomize(rng);
  B.randomize(rng);
  m.randomize(rng, 0.5, 1.5);
  cuda::Stream stream(0);
  const auto call = [&](TestTensor& n, TestTensor& sc, void* s) {
    ops::dora_norm(W.view(), A.view(), B.view(), m.view(), 0.25, n.view(), sc.view(), 0.0, s);
  };
  // First call of this shape, during the capture: compiled there, not tuned.
  cuda::Graph graph = cuda::Graph::capture(stream.handle(), [&] { call(norm, scale, stream.handle()); });
  CHECK(logs.count("none may be timed now") == 1);
  CHECK(logs.count("chose") == 0);
  graph.launch(stream.handle());
  stream.synchronize();
  call(norm2, scale2, nullptr);  // outside a capture: now it tunes
  test::sync(dev);
  CHECK(logs.count("autotune dora_norm") >= 2);
  CHECK(logs.count("chose") == 1);
  CHECK(test::max_relative_error(values(norm), values(norm2)) <= 1e-5);
  CHECK(test::max_relative_error(values(scale), values(scale2)) <= 1e-5);
  call(norm2, scale2, nullptr);  // and keeps its choice
  test::sync(dev);
  CHECK(logs.count("chose") == 1);
}

TEST_CASE("cuda::Graph refuses the legacy default stream and ends a capture whose work throws",
          "[gpu][graph]") {
  KERF_REQUIRE_GPU();
  CHECK_THROWS_WITH(cuda::Graph::capture(nullptr, [] {}),
                    Catch::Contains("the legacy default stream cannot capture a graph"));
  cuda::Stream stream(0);
  CHECK_THROWS_WITH(cuda::Graph::capture(stream.handle(), [] { throw InvalidArgument("inside"); }),
                    Catch::Contains("inside"));
  CHECK_FALSE(cuda::stream_capturing(stream.handle()));  // ended
  bool seen = false;
  cuda::Graph g = cuda::Graph::capture(stream.handle(), [&] { seen = cuda::stream_capturing(stream.handle()); });
  CHECK(seen);
  CHECK(g.valid());
  g.launch(stream.handle());  // an empty graph runs
  stream.synchronize();
  cuda::Graph empty;
  CHECK_THROWS_WITH(empty.launch(stream.handle()), Catch::Contains("the graph is empty"));
}

// Run in a child process, whose device has seen no embedding call yet.
TEST_CASE("child: an embedding call captured before any other", "[.graph-child-first-embedding]") {
  const Device dev = Device::cuda(0);
  TestTensor x(DType::i64, {4}, dev), table(DType::f32, {10, 8}, dev), A(DType::f32, {2, 10}, dev),
      B(DType::f32, {8, 2}, dev), out(DType::f32, {4, 8}, dev);
  cuda::Stream stream(0);
  std::string message;
  cuda::Graph g = cuda::Graph::capture(stream.handle(), [&] {
    message = test::thrown<InvalidArgument>([&] {
      ops::lora_embedding(x.view(), table.view(), A.view(), B.view(), 1.0, out.view(), {}, stream.handle());
    });
  });
  std::cout << "MESSAGE=" << message << std::endl;
  std::cout << "CAPTURE=" << (g.valid() ? "ok" : "lost") << std::endl;
}

TEST_CASE("an embedding call captured before the device's first one refuses, and the capture survives",
          "[gpu][ops][graph][embedding]") {
  KERF_REQUIRE_GPU();
  test::Child child(test::self_test("[.graph-child-first-embedding]"), {});
  CHECK(child.wait() == 0);
  INFO(child.output());
  CHECK(child.value("MESSAGE").find("lora_embedding: the first embedding call on cuda:0 is being captured into a "
                                    "CUDA graph; call it once before the capture") != std::string::npos);
  CHECK(child.value("CAPTURE") == "ok");
}
