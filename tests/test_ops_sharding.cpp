// Sharding layouts on one device: each supported layout is tested by
// splitting the tensors into shards (views of the whole tensors), running the
// op on each shard with the layout, combining (concatenating split outputs,
// summing partial ones, as an all-reduce would) and comparing with the
// unsharded op. Layouts that cannot work together are rejected before any
// launch, with messages naming both specs.
#include <cmath>
#include <functional>
#include <random>

#include "catch.h"
#include "kernels_src/ops_common.h"
#include "cpu_test_util.h"
#include "device_tensor.h"
#include "error_test_util.h"
#include "gpu_test_util.h"
#include "kerf/error.h"
#include "kerf/ops/ops.h"

using namespace kerf;
using kerf::test::TestTensor;

namespace {

using test::rms_scaled_error;

// A 2-D view of rows [r0, r0 + nr) and columns [c0, c0 + nc) of a row-major [rows, cols] tensor.
TensorView block(TestTensor& t, int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
  const int64_t cols = t.shape()[1];
  return t.view_at(r0 * cols + c0, {nr, nc}, {cols, 1});
}
TensorView range1(TestTensor& t, int64_t i0, int64_t n) {
  return t.view_at(i0, {n}, {1});
}
// A sub-range of dimension 0 of any view.
TensorView slice0(const TensorView& v, int64_t i0, int64_t n) {
  TensorView s = v;
  s.data = static_cast<uint8_t*>(v.data) + i0 * v.strides[0] * dtype_size_bytes(v.dtype);
  s.shape[0] = n;
  return s;
}

ops::Layout layout_of(std::vector<ops::MeshAxis> mesh,
                      std::map<std::string, ops::PartitionSpec> specs,
                      std::vector<int64_t> coords = {}) {
  ops::Layout l;
  l.mesh = std::move(mesh);
  l.specs = std::move(specs);
  l.coords = std::move(coords);
  return l;
}

void check_dora_layouts(Device dev) {
  const int64_t out = 60, in = 129, r = 6;  // in = 3 * 43, out = 4 * 15 = 2 * 30
  std::mt19937_64 rng(8100);
  for (DType wt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(wt), dev.str());
    TestTensor W(wt, {out, in}, dev), A(DType::f32, {r, in}, dev), B(DType::f32, {out, r}, dev);
    TestTensor m(DType::f32, {out}, dev), norm(DType::f32, {out}, dev),
        scale(DType::f32, {out}, dev);
    W.randomize(rng);
    A.randomize(rng, -0.5, 0.5);
    B.randomize(rng, -0.5, 0.5);
    m.randomize(rng, 0.5, 1.5);
    const double s = 1.5, eps = 1e-6;
    ops::dora_norm(W.view(), A.view(), B.view(), m.view(), s, norm.view(), scale.view(), eps);
    test::sync(dev);
    const std::vector<double> ref_n = values(norm), ref_s = values(scale);
    const double tol = test::tolerance(wt);

    // W split on in over "tp" (3 shards): partial sums, all-reduced, then the finish.
    {
      const ops::Layout tp = layout_of({{"tp", 3}}, {{"W", {"", "tp"}}, {"A", {"", "tp"}}});
      std::vector<double> total(size_t(out), 0.0);
      for (int64_t c = 0; c < 3; ++c) {
        TestTensor part(DType::f32, {out}, dev);
        part.poison();
        ops::dora_norm_partial(block(W, 0, out, c * 43, 43), block(A, 0, r, c * 43, 43), B.view(),
                               s, part.view(), nullptr, {}, tp);
        test::sync(dev);
        const std::vector<double> p = values(part);
        for (int64_t i = 0; i < out; ++i) total[size_t(i)] += p[size_t(i)];
      }
      TestTensor sumsq(DType::f32, {out}, dev), n2(DType::f32, {out}, dev),
          s2(DType::f32, {out}, dev);
      for (int64_t i = 0; i < out; ++i) sumsq.set(i, total[size_t(i)]);
      sumsq.upload();
      ops::dora_norm_finish(sumsq.view(), m.view(), eps, n2.view(), s2.view());
      test::sync(dev);
      CHECK(test::max_relative_error(values(n2), ref_n) <= tol);
      CHECK(test::max_relative_error(values(s2), ref_s) <= tol);
    }
    // W split on out over "tp" (4 shards): local; the shards write their rows of the whole outputs.
    {
      const ops::Layout tp = layout_of(
          {{"tp", 4}},
          {{"W", {"tp"}}, {"B", {"tp"}}, {"m", {"tp"}}, {"norm", {"tp"}}, {"scale", {"tp"}}});
      TestTensor n2(DType::f32, {out}, dev), s2(DType::f32, {out}, dev);
      n2.poison();
      s2.poison();
      for (int64_t c = 0; c < 4; ++c)
        ops::dora_norm(block(W, c * 15, 15, 0, in), A.view(), block(B, c * 15, 15, 0, r),
                       range1(m, c * 15, 15), s, range1(n2, c * 15, 15), range1(s2, c * 15, 15),
                       eps, nullptr, {}, tp);
      test::sync(dev);
      CHECK(test::max_relative_error(values(n2), ref_n) <= tol);
      CHECK(test::max_relative_error(values(s2), ref_s) <= tol);
    }
    // out over two mesh axes at once (JAX's P(("x", "y"))): 2 x 2 shards of 15 rows, shard
    // x * 2 + y (the mesh lists the axes in the other order: the spec's order counts).
    {
      TestTensor n2(DType::f32, {out}, dev), s2(DType::f32, {out}, dev);
      n2.poison();
      s2.poison();
      for (int64_t x = 0; x < 2; ++x)
        for (int64_t y = 0; y < 2; ++y) {
          const ops::DimSplit xy{"x", "y"};
          const ops::Layout l = layout_of({{"y", 2}, {"x", 2}},
                                          {{"W", {xy}}, {"B", {xy}}, {"m", {xy}}, {"norm", {xy}}, {"scale", {xy}}},
                                          {y, x});
          const int64_t c = l.shard_index(xy);
          CHECK(c == x * 2 + y);
          ops::dora_norm(block(W, c * 15, 15, 0, in), A.view(), block(B, c * 15, 15, 0, r), range1(m, c * 15, 15),
                         s, range1(n2, c * 15, 15), range1(s2, c * 15, 15), eps, nullptr, {}, l);
        }
      test::sync(dev);
      CHECK(test::max_relative_error(values(n2), ref_n) <= tol);
      CHECK(test::max_relative_error(values(s2), ref_s) <= tol);
    }
    // A 2-D mesh: out over "x" (2), in over "y" (3): partials per (x, y), summed over y, finished
    // per x.
    {
      TestTensor n2(DType::f32, {out}, dev), s2(DType::f32, {out}, dev);
      for (int64_t x = 0; x < 2; ++x) {
        std::vector<double> total(30, 0.0);
        for (int64_t y = 0; y < 3; ++y) {
          const ops::Layout l = layout_of(
              {{"x", 2}, {"y", 3}},
              {{"W", {"x", "y"}}, {"A", {"", "y"}}, {"B", {"x"}}, {"sumsq", {"x"}}}, {x, y});
          TestTensor part(DType::f32, {30}, dev);
          ops::dora_norm_partial(block(W, x * 30, 30, y * 43, 43), block(A, 0, r, y * 43, 43),
                                 block(B, x * 30, 30, 0, r), s, part.view(), nullptr, {}, l);
          test::sync(dev);
          const std::vector<double> p = values(part);
          for (int64_t i = 0; i < 30; ++i) total[size_t(i)] += p[size_t(i)];
        }
        TestTensor sumsq(DType::f32, {30}, dev);
        for (int64_t i = 0; i < 30; ++i) sumsq.set(i, total[size_t(i)]);
        sumsq.upload();
        const ops::Layout lx = layout_of(
            {{"x", 2}}, {{"sumsq", {"x"}}, {"m", {"x"}}, {"norm", {"x"}}, {"scale", {"x"}}});
        ops::dora_norm_finish(sumsq.view(), range1(m, x * 30, 30), eps, range1(n2, x * 30, 30),
                              range1(s2, x * 30, 30), nullptr, lx);
      }
      test::sync(dev);
      CHECK(test::max_relative_error(values(n2), ref_n) <= tol);
      CHECK(test::max_relative_error(values(s2), ref_s) <= tol);
    }
  }
}

void check_moe_layouts(Device dev) {
  const int64_t E = 4, N = 40, K = 50, r = 3;
  std::mt19937_64 rng(8200);
  TestTensor W(DType::bf16, {E, N, K}, dev), lA(DType::f32, {r * E, K}, dev),
      lB(DType::f32, {N, r * E}, dev);
  W.randomize(rng);
  lA.randomize(rng, -0.5, 0.5);
  lB.randomize(rng, -0.5, 0.5);
  const ops::MoeLoraViews v = ops::peft_moe_lora_views(W.view(), lA.view(), lB.view());
  const double s = 0.5;
  // Forward, against the unsharded op: experts split over "ep" (2 shards of 2 experts), and
  // over two mesh axes at once (2 x 2 shards of one expert, shard a * 2 + b). PEFT's flat
  // adapters sliced by expert.
  {
    TestTensor ref(DType::bf16, {E, N, K}, dev);
    ops::moe_lora_materialize(W.view(), v.A, v.B, s, ref.view());
    test::sync(dev);
    const std::vector<double> want = values(ref);
    // `n` shards of E / n experts each, shard c run with the layout `layout_at(c)` into one
    // output, checked against the unsharded op.
    const auto check_shards = [&](int64_t n, const std::function<ops::Layout(int64_t)>& layout_at) {
      TestTensor got(DType::bf16, {E, N, K}, dev);
      got.poison();
      for (int64_t c = 0; c < n; ++c) {
        const int64_t e0 = c * (E / n), ne = E / n;
        ops::moe_lora_materialize(slice0(W.view(), e0, ne), slice0(v.A, e0, ne), slice0(v.B, e0, ne), s,
                                  slice0(got.view(), e0, ne), nullptr, {}, layout_at(c));
      }
      test::sync(dev);
      CHECK(test::max_relative_error(values(got), want, 1.0) <= test::tolerance(DType::bf16));
    };
    check_shards(2, [](int64_t) {
      return layout_of({{"ep", 2}}, {{"W", {"ep"}}, {"A", {"ep"}}, {"B", {"ep"}}, {"W_eff", {"ep"}}});
    });
    const ops::DimSplit ab{"a", "b"};
    check_shards(4, [&](int64_t c) {
      // Coordinates a = c / 2, b = c % 2: the layout's shard number must be c.
      const ops::Layout l =
          layout_of({{"a", 2}, {"b", 2}}, {{"W", {ab}}, {"A", {ab}}, {"B", {ab}}, {"W_eff", {ab}}}, {c / 2, c % 2});
      CHECK(l.shard_index(ab) == c);
      return l;
    });
  }
  // Backward, experts split: each shard writes its experts' rows of the PEFT-layout gradients.
  TestTensor dW(DType::bf16, {E, N, K}, dev);
  dW.randomize(rng);
  TestTensor rA(DType::f32, {r * E, K}, dev), rB(DType::f32, {N, r * E}, dev);
  const ops::MoeLoraViews rg = ops::peft_moe_lora_views(W.view(), rA.view(), rB.view());
  ops::moe_lora_materialize_backward(dW.view(), v.A, v.B, s, rg.A, rg.B);
  test::sync(dev);
  const std::vector<double> ref_a = values(rA), ref_b = values(rB);
  {
    TestTensor gA(DType::f32, {r * E, K}, dev), gB(DType::f32, {N, r * E}, dev);
    gA.poison();
    gB.poison();
    const ops::MoeLoraViews g = ops::peft_moe_lora_views(W.view(), gA.view(), gB.view());
    const ops::Layout ep = layout_of(
        {{"ep", 2}},
        {{"dW_eff", {"ep"}}, {"A", {"ep"}}, {"B", {"ep"}}, {"dA", {"ep"}}, {"dB", {"ep"}}});
    for (int64_t c = 0; c < 2; ++c)
      ops::moe_lora_materialize_backward(slice0(dW.view(), c * 2, 2), slice0(v.A, c * 2, 2),
                                         slice0(v.B, c * 2, 2), s, slice0(g.A, c * 2, 2),
                                         slice0(g.B, c * 2, 2), nullptr, {}, ep);
    test::sync(dev);
    CHECK(test::max_relative_error(values(gA), ref_a, 1e-3) <= 1e-5);
    CHECK(test::max_relative_error(values(gB), ref_b, 1e-3) <= 1e-5);
  }
  // Backward, N split over "tp" (2 shards of 20 rows): dB rows are local, dA is a partial sum.
  {
    TestTensor gB(DType::f32, {N, r * E}, dev);
    const ops::MoeLoraViews g = ops::peft_moe_lora_views(W.view(), rA.view(), gB.view());
    const ops::Layout tp =
        layout_of({{"tp", 2}}, {{"dW_eff", {"", "tp"}}, {"B", {"", "tp"}}, {"dB", {"", "tp"}}});
    std::vector<double> dA_sum(size_t(r * E * K), 0.0);
    for (int64_t c = 0; c < 2; ++c) {
      TestTensor part(DType::f32, {E, r, K}, dev);
      part.poison();
      const auto rows = [&](const TensorView& t) {
        TensorView s1 = t;
        s1.data = static_cast<uint8_t*>(t.data) + c * 20 * t.strides[1] * dtype_size_bytes(t.dtype);
        s1.shape[1] = 20;
        return s1;
      };
      ops::moe_lora_materialize_backward(rows(dW.view()), v.A, rows(v.B), s, part.view(), rows(g.B),
                                         nullptr, {}, tp);
      test::sync(dev);
      const std::vector<double> p = values(part);
      for (size_t i = 0; i < p.size(); ++i) dA_sum[i] += p[i];
    }
    CHECK(test::max_relative_error(dA_sum, ref_a, 1e-3) <= 1e-5);
    CHECK(test::max_relative_error(values(gB), ref_b, 1e-3) <= 1e-5);
  }
}

void check_embedding_layouts(Device dev) {
  const int64_t V = 120, D = 48, r = 4, T = 57, n = 3, Vl = V / n;
  std::mt19937_64 rng(8300);
  TestTensor X(DType::i64, {T}, dev), Wt(DType::f32, {V, D}, dev), A(DType::f32, {r, V}, dev),
      B(DType::f32, {D, r}, dev), G(DType::f32, {T, D}, dev);
  std::uniform_int_distribution<int64_t> id(0, V - 1);
  for (int64_t t = 0; t < T; ++t)
    X.set(t, double(t % 6 == 0 ? 7 : id(rng)));  // 7 repeats; 7 is padding below
  X.upload();
  Wt.randomize(rng);
  A.randomize(rng);
  B.randomize(rng);
  G.randomize(rng);
  const double s = 2.0;
  TestTensor out(DType::f32, {T, D}, dev), dA(DType::f32, {r, V}, dev), dB(DType::f32, {D, r}, dev);
  ops::EmbeddingOptions o;
  o.padding_idx = 7;
  o.scale_grad_by_freq = true;
  ops::lora_embedding(X.view(), Wt.view(), A.view(), B.view(), s, out.view());
  ops::lora_embedding_backward(X.view(), A.view(), B.view(), G.view(), s, dA.view(), dB.view(), o);
  test::sync(dev);
  const std::vector<double> ref_out = values(out), ref_a = values(dA), ref_b = values(dB);

  // Vocab split over "vp" (3 shards of 40 ids): forward outputs and grad_B are partial sums.
  // The backward both as one kernel and as gather, product, scatter (Config.meta GATHER),
  // and with the ids grouped (GROUP_BY_ID: each shard's columns of grad_A, strided views
  // of one tensor, written whole); on a GPU also as one cooperative kernel (FUSED), grouped
  // and adding into grad_A directly.
  ops::Config gathered, grouped, fused_grouped, fused_direct;
  gathered.block_m = 16;
  gathered.block_k = 32;
  gathered.meta["GATHER"] = 1;
  grouped.meta["GROUP_BY_ID"] = 1;
  fused_grouped.meta = {{"GROUP_BY_ID", 1}, {"FUSED", 1}};
  fused_direct.meta = {{"GROUP_BY_ID", 0}, {"FUSED", 1}};
  //
  // The forward's activations (after_a, replicated like x): each shard's forward writes
  // those of its own ids and zeros elsewhere, and its backward reads either those
  // (act 1) or every shard's sum (act 2): both give the same sums over shards.
  TestTensor act_all(DType::f32, {T, r}, dev);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < r; ++k) act_all.set(t * r + k, A.get(k * V + int64_t(X.get(t))));
  act_all.upload();
  for (const ops::Config& cfg : {ops::Config{}, gathered, grouped, fused_grouped, fused_direct})
    for (const int act : {0, 1, 2}) {
      CAPTURE(cfg.meta, act);
      std::vector<double> out_sum(size_t(T * D), 0.0), b_sum(size_t(D * r), 0.0), act_sum(size_t(T * r), 0.0);
      TestTensor gA(DType::f32, {r, V}, dev);
      gA.poison();
      for (int64_t c = 0; c < n; ++c) {
        const ops::Layout fwd = layout_of({{"vp", n}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}}, {c});
        const ops::Layout bwd = layout_of({{"vp", n}}, {{"A", {"", "vp"}}, {"grad_A", {"", "vp"}}}, {c});
        TestTensor po(DType::f32, {T, D}, dev), pb(DType::f32, {D, r}, dev), pact(DType::f32, {T, r}, dev);
        po.poison();
        pb.poison();
        pact.poison();
        ops::EmbeddingOptions fo, bo = o;
        if (act) fo.after_a = pact.view();
        if (act) bo.after_a = act == 1 ? pact.view() : act_all.view();
        ops::lora_embedding(X.view(), block(Wt, c * Vl, Vl, 0, D), block(A, 0, r, c * Vl, Vl), B.view(), s,
                            po.view(), fo, nullptr, {}, fwd);
        ops::lora_embedding_backward(X.view(), block(A, 0, r, c * Vl, Vl), B.view(), G.view(), s,
                                     block(gA, 0, r, c * Vl, Vl), pb.view(), bo, nullptr, cfg, bwd);
        test::sync(dev);
        const std::vector<double> a = values(po), b = values(pb);
        for (size_t i = 0; i < a.size(); ++i) out_sum[i] += a[i];
        for (size_t i = 0; i < b.size(); ++i) b_sum[i] += b[i];
        if (act) {
          const std::vector<double> pa = values(pact);
          for (size_t i = 0; i < pa.size(); ++i) act_sum[i] += pa[i];
        }
      }
      CHECK(test::max_relative_error(out_sum, ref_out, 1.0) <= 1e-5);
      CHECK(rms_scaled_error(values(gA), ref_a) <= 1e-5);
      CHECK(rms_scaled_error(b_sum, ref_b) <= 1e-5);
      if (act) CHECK(act_sum == values(act_all));  // exactly: one shard wrote each, the others zeros
    }

  // A vocab-parallel pass over shards of their own layouts and options: each runs forward
  // and backward on its ids [lo, lo + size); the partial outputs and grad_B are summed,
  // grad_A's columns written in place.
  struct VocabShard {
    int64_t lo, size;
    ops::Layout fwd, bwd;
    ops::EmbeddingOptions fo, bo;
  };
  const auto check_vocab_shards = [&](const std::vector<VocabShard>& shards) {
    std::vector<double> out_sum(size_t(T * D), 0.0), b_sum(size_t(D * r), 0.0);
    TestTensor gA(DType::f32, {r, V}, dev);
    gA.poison();
    for (const VocabShard& sh : shards) {
      TestTensor po(DType::f32, {T, D}, dev), pb(DType::f32, {D, r}, dev);
      po.poison();
      pb.poison();
      ops::lora_embedding(X.view(), block(Wt, sh.lo, sh.size, 0, D), block(A, 0, r, sh.lo, sh.size), B.view(), s,
                          po.view(), sh.fo, nullptr, {}, sh.fwd);
      ops::lora_embedding_backward(X.view(), block(A, 0, r, sh.lo, sh.size), B.view(), G.view(), s,
                                   block(gA, 0, r, sh.lo, sh.size), pb.view(), sh.bo, nullptr, {}, sh.bwd);
      test::sync(dev);
      const std::vector<double> a = values(po), b = values(pb);
      for (size_t i = 0; i < a.size(); ++i) out_sum[i] += a[i];
      for (size_t i = 0; i < b.size(); ++i) b_sum[i] += b[i];
    }
    CHECK(test::max_relative_error(out_sum, ref_out, 1.0) <= 1e-5);
    CHECK(rms_scaled_error(values(gA), ref_a) <= 1e-5);
    CHECK(rms_scaled_error(b_sum, ref_b) <= 1e-5);
  };

  // Vocab split over two mesh axes at once (JAX's P(None, ("x", "y"))): 2 x 3 shards of 20
  // ids; shard x * 3 + y holds ids [20 (x * 3 + y), + 20) (the mesh lists y first, and the
  // coordinates follow the mesh's order).
  {
    const int64_t nx = 2, ny = 3, Vs = V / (nx * ny);
    const ops::DimSplit xy{"x", "y"};
    const std::vector<ops::MeshAxis> mesh{{"y", ny}, {"x", nx}};
    std::vector<VocabShard> shards;
    for (int64_t x = 0; x < nx; ++x)
      for (int64_t y = 0; y < ny; ++y)
        shards.push_back({(x * ny + y) * Vs, Vs, layout_of(mesh, {{"weight", {xy}}, {"A", {"", xy}}}, {y, x}),
                          layout_of(mesh, {{"A", {"", xy}}, {"grad_A", {"", xy}}}, {y, x}), {}, o});
    check_vocab_shards(shards);
  }

  // Vocab split unevenly, as torch.chunk(120 ids, 3) would not but np.array_split-like cuts
  // do (50, 50, 20 ids): each shard says where it starts (vocab_start, vocab_size), no coords.
  {
    const int64_t starts[] = {0, 50, 100}, sizes[] = {50, 50, 20};
    std::vector<VocabShard> shards;
    for (int64_t c = 0; c < n; ++c) {
      ops::EmbeddingOptions fo, bo = o;
      fo.vocab_start = bo.vocab_start = starts[c];
      fo.vocab_size = bo.vocab_size = V;
      shards.push_back({starts[c], sizes[c], layout_of({{"vp", n}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}}),
                        layout_of({{"vp", n}}, {{"A", {"", "vp"}}, {"grad_A", {"", "vp"}}}), fo, bo});
    }
    check_vocab_shards(shards);
  }

  // Tokens split over "dp" (3 shards of 19): outputs local; grad_A and grad_B partial. (Counts for
  // scale_grad_by_freq are per call, as PyTorch's are per batch: test it without.)
  {
    ops::EmbeddingOptions plain;
    plain.padding_idx = 7;
    TestTensor dA2(DType::f32, {r, V}, dev), dB2(DType::f32, {D, r}, dev),
        o2(DType::f32, {T, D}, dev);
    ops::lora_embedding_backward(X.view(), A.view(), B.view(), G.view(), s, dA2.view(), dB2.view(),
                                 plain);
    test::sync(dev);
    const std::vector<double> ra = values(dA2), rb = values(dB2);
    std::vector<double> a_sum(size_t(r * V), 0.0), bb_sum(size_t(D * r), 0.0);
    o2.poison();
    const ops::Layout dp_fwd = layout_of({{"dp", 3}}, {{"x", {"dp"}}, {"out", {"dp"}}});
    const ops::Layout dp_bwd = layout_of({{"dp", 3}}, {{"x", {"dp"}}, {"grad_out", {"dp"}}});
    for (int64_t c = 0; c < 3; ++c) {
      TestTensor pa(DType::f32, {r, V}, dev), pb(DType::f32, {D, r}, dev);
      const TensorView xc = range1(X, c * 19, 19);
      ops::lora_embedding(xc, Wt.view(), A.view(), B.view(), s, block(o2, c * 19, 19, 0, D), {},
                          nullptr, {}, dp_fwd);
      // The backward reads this shard's rows of the forward's activations (after_a split
      // as x is).
      ops::EmbeddingOptions with_act = plain;
      with_act.after_a = block(act_all, c * 19, 19, 0, r);
      ops::lora_embedding_backward(xc, A.view(), B.view(), block(G, c * 19, 19, 0, D), s, pa.view(), pb.view(),
                                   c == 1 ? with_act : plain, nullptr, {},
                                   c == 1 ? layout_of({{"dp", 3}}, {{"x", {"dp"}},
                                                                    {"grad_out", {"dp"}},
                                                                    {"after_a", {"dp"}}})
                                          : dp_bwd);
      test::sync(dev);
      const std::vector<double> a = values(pa), b = values(pb);
      for (size_t i = 0; i < a.size(); ++i) a_sum[i] += a[i];
      for (size_t i = 0; i < b.size(); ++i) bb_sum[i] += b[i];
    }
    CHECK(test::max_relative_error(values(o2), ref_out, 1.0) <= 1e-5);
    CHECK(rms_scaled_error(a_sum, ra) <= 1e-5);
    CHECK(rms_scaled_error(bb_sum, rb) <= 1e-5);
  }
  // dim split over "tp" (2 shards of 24): forward local; grad_B rows local, grad_A partial.
  {
    TestTensor o2(DType::f32, {T, D}, dev), gB(DType::f32, {D, r}, dev);
    std::vector<double> a_sum(size_t(r * V), 0.0);
    const ops::Layout tp_fwd =
        layout_of({{"tp", 2}}, {{"weight", {"", "tp"}}, {"B", {"tp"}}, {"out", {"", "tp"}}});
    const ops::Layout tp_bwd =
        layout_of({{"tp", 2}}, {{"B", {"tp"}}, {"grad_out", {"", "tp"}}, {"grad_B", {"tp"}}});
    for (int64_t c = 0; c < 2; ++c) {
      TestTensor pa(DType::f32, {r, V}, dev);
      ops::lora_embedding(X.view(), block(Wt, 0, V, c * 24, 24), A.view(),
                          block(B, c * 24, 24, 0, r), s, block(o2, 0, T, c * 24, 24), {}, nullptr,
                          {}, tp_fwd);
      ops::lora_embedding_backward(X.view(), A.view(), block(B, c * 24, 24, 0, r),
                                   block(G, 0, T, c * 24, 24), s, pa.view(),
                                   block(gB, c * 24, 24, 0, r), o, nullptr, {}, tp_bwd);
      test::sync(dev);
      const std::vector<double> a = values(pa);
      for (size_t i = 0; i < a.size(); ++i) a_sum[i] += a[i];
    }
    CHECK(test::max_relative_error(values(o2), ref_out, 1.0) <= 1e-5);
    CHECK(rms_scaled_error(a_sum, ref_a) <= 1e-5);
    CHECK(rms_scaled_error(values(gB), ref_b) <= 1e-5);
  }
}

}  // namespace

TEST_CASE("Layout::canonical is the same for layouts that mean the same thing", "[ops][sharding]") {
  ops::Layout a =
      layout_of({{"tp", 4}, {"dp", 2}}, {{"W", {"", "tp", ""}}, {"A", {"", "tp"}}, {"m", {}}});
  ops::Layout b = layout_of({{"dp", 8}, {"tp", 4}}, {{"A", {"", "tp"}}, {"W", {"", "tp"}}});
  CHECK(a.canonical() == "mesh(tp=4) A[,tp] W[,tp]");
  CHECK(a.canonical() == b.canonical());
  CHECK(ops::Layout{}.canonical().empty());
  CHECK(layout_of({{"tp", 4}}, {{"W", {"", ""}}}).canonical().empty());  // nothing split: unsharded
  CHECK(layout_of({{"tp", 2}}, {{"W", {"", "tp"}}}).canonical() != a.canonical());
  CHECK(ops::PartitionSpec{"", "tp", ""}.str() == "P(None, 'tp')");
  CHECK(ops::PartitionSpec{}.str() == "P()");
  // check(): what every op refuses before its own rules (canonical() of such a layout
  // would not parse back); a good layout passes.
  CHECK_NOTHROW(a.check());
  for (const auto& [bad, message] : std::vector<std::pair<ops::Layout, std::string>>{
           {layout_of({{"t p", 2}}, {{"W", {"t p"}}}), "layout: mesh axis name 't p' holds one of"},
           {layout_of({{"tp", -2}}, {{"W", {"tp"}}}),
            "layout: mesh axis 'tp' must have size >= 1, got -2"},
           {layout_of({{"tp", 2}, {"tp", 2}}, {}), "layout: mesh axis 'tp' is named twice"},
           {layout_of({}, {{"W", {"zz"}}}),
            "layout: W P('zz') names mesh axis 'zz', which the mesh lacks"},
           {layout_of({{"tp", 2}}, {{"W", {"tp", "tp"}}}),
            "splits two dimensions over mesh axis 'tp'"}}) {
    CAPTURE(message);
    CHECK_THAT(kerf::test::thrown<InvalidArgument>([&] { bad.check(); }), Catch::Contains(message));
  }
}

TEST_CASE("Layout::parse reads what canonical() writes", "[ops][sharding]") {
  const std::vector<ops::Layout> layouts = {
      {},
      layout_of({{"tp", 4}}, {{"W", {"", "tp"}}, {"A", {"", "tp"}}}),
      layout_of({{"tp", 4}, {"dp", 2}, {"one", 1}}, {{"W", {{"dp", "tp"}, ""}}, {"x", {"one", "", {"tp", "one"}}}}),
      layout_of({{"ep", 8}, {"x", 2}}, {{"W", {"ep", "", "x"}}, {"B", {"ep"}}, {"A", {"ep", "", "x"}}})};
  for (const ops::Layout& l : layouts) {
    const std::string text = l.canonical();
    CAPTURE(text);
    const ops::Layout back = ops::Layout::parse(text);
    CHECK(back.canonical() == text);
    CHECK(back.coords.empty());
  }
  CHECK(ops::Layout::parse("mesh(dp=2,tp=4) W[,(dp,tp)]").specs.at("W").axes_of(1) == ops::DimSplit{"dp", "tp"});
  for (const auto& [text, where] : std::vector<std::pair<std::string, std::string>>{
           {"mesh(tp=4)W[,tp]", "expected ' ' at position 10"},
           {"mesh(tp) W[,tp]", "expected '=' at position 7"},
           {"mesh(tp=x) W[,tp]", "expected a size at position 8"},
           {"mesh(tp=99999999999999999999) W[tp]", "expected a size within 64 bits"},
           {"W[,tp]", "expected 'mesh(' at position 0"},
           {"mesh(tp=4) W[,tp", "expected ',' at position 16"},
           {"mesh(tp=4) W[tp] W[tp]", "expected each operand once, not 'W' again"},
           {"mesh(tp=4) W[(tp]", "expected ',' at position 16"}})
    CHECK_THAT(kerf::test::thrown<InvalidArgument>([&] { (void)ops::Layout::parse(text); }),
               Catch::Contains("layout text '" + text + "': " + where));
}

TEST_CASE("a dimension split over several mesh axes, as JAX's P(None, ('dp', 'tp'))", "[ops][sharding]") {
  const std::vector<ops::MeshAxis> mesh{{"tp", 4}, {"dp", 2}, {"one", 1}};
  // Braces: one entry naming two axes, or two entries naming one each.
  CHECK(ops::PartitionSpec{"", {"dp", "tp"}}.str() == "P(None, ('dp', 'tp'))");
  CHECK(ops::PartitionSpec{{"dp", "tp"}}.str() == "P(('dp', 'tp'))");
  CHECK(ops::PartitionSpec{"dp", "tp"}.str() == "P('dp', 'tp')");
  CHECK(ops::DimSplit{}.str() == "None");
  CHECK(ops::DimSplit("").empty());
  const ops::Layout l = layout_of(mesh, {{"W", {"", {"dp", "tp"}}}, {"A", {"", {"dp", "tp"}}}});
  CHECK(l.sharded());
  CHECK(l.canonical() == "mesh(dp=2,tp=4) A[,(dp,tp)] W[,(dp,tp)]");
  // The order of the axes is part of the meaning (dp major vs tp major); an axis of size 1
  // in the list splits nothing, and one axis left prints as that axis alone.
  CHECK(layout_of(mesh, {{"W", {"", {"tp", "dp"}}}}).canonical() == "mesh(dp=2,tp=4) W[,(tp,dp)]");
  CHECK(layout_of(mesh, {{"W", {"", {"one", "tp"}}}}).canonical() ==
        layout_of(mesh, {{"W", {"", "tp"}}}).canonical());
  CHECK_FALSE(layout_of(mesh, {{"W", {"", {"one"}}}}).sharded());
  // Shard counts and this device's shard: coordinates follow the mesh's order, the shard
  // number the spec's (major to minor).
  ops::Layout at = l;
  at.coords = {3, 1, 0};  // tp = 3, dp = 1
  CHECK(at.shard_count({"dp", "tp"}) == 8);
  CHECK(at.shard_index({"dp", "tp"}) == 1 * 4 + 3);
  CHECK(at.shard_index({"tp", "dp"}) == 3 * 2 + 1);
  CHECK(at.shard_index({"one", "tp"}) == 3);
  CHECK(at.shard_index({}) == 0);
  CHECK_THAT(kerf::test::thrown<InvalidArgument>([&] { (void)l.shard_index({"dp", "tp"}); }),
             Catch::Contains("this device's coordinates are needed"));
  CHECK_THAT(kerf::test::thrown<InvalidArgument>([&] { (void)at.shard_count({"dp", "pp"}); }),
             Catch::Contains("the mesh has no axis 'pp'"));
  CHECK_THAT(kerf::test::thrown<InvalidArgument>([&] { (void)layout_of({{"tp", 0}}, {}).shard_count({"tp"}); }),
             Catch::Contains("mesh axis 'tp' must have size >= 1, got 0"));

  // Operands sharing a dimension must list the same axes in the same order (size-1 axes
  // aside); an axis may split one dimension once.
  const Device cpu = Device::cpu();
  TestTensor W(DType::f32, {8, 12}, cpu), A(DType::f32, {2, 12}, cpu), B(DType::f32, {8, 2}, cpu),
      sumsq(DType::f32, {8}, cpu);
  const auto partial = [&](const ops::Layout& lay) {
    return kerf::test::thrown<InvalidArgument>(
        [&] { ops::dora_norm_partial(W.view(), A.view(), B.view(), 1.0, sumsq.view(), nullptr, {}, lay); });
  };
  CHECK_THAT(partial(layout_of(mesh, {{"W", {"", {"dp", "tp"}}}, {"A", {"", {"tp", "dp"}}}})),
             Catch::Contains("A P(None, ('tp', 'dp')) and W P(None, ('dp', 'tp')) split dimension 'in'") &&
                 Catch::Contains("differently (('tp', 'dp') vs ('dp', 'tp'))"));
  CHECK_THAT(partial(layout_of(mesh, {{"W", {"", {"dp", "dp"}}}, {"A", {"", {"dp", "dp"}}}})),
             Catch::Contains("A P(None, ('dp', 'dp')) names mesh axis 'dp' twice for one dimension"));
  CHECK_THAT(partial(layout_of(mesh, {{"W", {"dp", {"dp", "tp"}}}, {"A", {"", {"dp", "tp"}}}})),
             Catch::Contains("W P('dp', ('dp', 'tp')) splits two dimensions over mesh axis 'dp'"));
  CHECK_THAT(partial(layout_of(mesh, {{"W", {"", {"dp", "pp"}}}})),
             Catch::Contains("names mesh axis 'pp', which the mesh lacks"));
  CHECK_THAT(partial(layout_of(mesh, {{"W", {"", {"dp", ""}}}})),
             Catch::Contains("names a mesh axis with an empty name"));
  // Names holding the characters of the layout's text (part of cache keys) are refused: a
  // mesh axis named "(a,b)" would print like the axes a and b together.
  for (const char* name : {"(a,b)", "a,b", "x=2", "w[0]", "a b"})
    CHECK_THAT(partial(layout_of({{name, 2}}, {{"W", {"", name}}, {"A", {"", name}}})),
               Catch::Contains("mesh axis name '" + std::string(name) + "' holds one of ( ) [ ] , = or a blank"));
  // A size-1 axis in one operand's list and not in the other's: alike.
  const ops::detail::ChecksOnly checks_only;
  CHECK_NOTHROW(ops::dora_norm_partial(W.view(), A.view(), B.view(), 1.0, sumsq.view(), nullptr, {},
                                       layout_of(mesh, {{"W", {"", {"one", "tp"}}}, {"A", {"", "tp"}}})));
  // dora_norm's message for in split names both axes.
  TestTensor m(DType::f32, {8}, cpu), norm(DType::f32, {8}, cpu), scale(DType::f32, {8}, cpu);
  CHECK_THAT(kerf::test::thrown<InvalidArgument>([&] {
               ops::dora_norm(W.view(), A.view(), B.view(), m.view(), 1.0, norm.view(), scale.view(), 0.0, nullptr,
                              {}, layout_of(mesh, {{"W", {"", {"dp", "tp"}}}, {"A", {"", {"dp", "tp"}}}}));
             }),
             Catch::Contains("splits in over ('dp', 'tp'): a row's norm needs every column") &&
                 Catch::Contains("sum sumsq over ('dp', 'tp') (all-reduce)"));
  // The vocabulary over two axes: the message for missing coordinates and the even-shard hint
  // name both; with vocab_start, the layout's shard number is checked against it.
  TestTensor X(DType::i64, {2}, cpu), Wt(DType::f32, {10, 4}, cpu), Ae(DType::f32, {2, 10}, cpu),
      Be(DType::f32, {4, 2}, cpu), out(DType::f32, {2, 4}, cpu);
  X.set(0, 1);
  X.set(1, 85);
  const ops::Layout vocab = layout_of(mesh, {{"weight", {{"dp", "tp"}}}, {"A", {"", {"dp", "tp"}}}});
  CHECK_THAT(kerf::test::thrown<InvalidArgument>([&] {
               ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), {}, nullptr, {},
                                   vocab);
             }),
             Catch::StartsWith("lora_embedding: layout: the vocabulary is split over ('dp', 'tp'), so this "
                               "device's coordinates are needed"));
  ops::Layout vocab_at = vocab;
  vocab_at.coords = {3, 1, 0};  // tp = 3, dp = 1: shard 7 of 8, the last
  ops::EmbeddingOptions first;
  first.vocab_start = 0;
  first.vocab_size = 80;
  CHECK_THAT(kerf::test::thrown<InvalidArgument>([&] {
               ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), first, nullptr, {},
                                   vocab_at);
             }),
             Catch::Contains("disagrees with the layout's shard 7 of 8 on ('dp', 'tp') (the last shard ends at "
                             "the vocabulary's size)"));
  // Two logical dims over overlapping axis lists (the tokens over 'dp', the vocabulary over
  // dp and tp): one axis would split both.
  CHECK_THAT(kerf::test::thrown<InvalidArgument>([&] {
               ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), {}, nullptr, {},
                                   layout_of(mesh,
                                             {{"x", {"dp"}},
                                              {"out", {"dp"}},
                                              {"weight", {{"dp", "tp"}}},
                                              {"A", {"", {"dp", "tp"}}}},
                                             {0, 0, 0}));
             }),
             Catch::Contains("split dimensions") && Catch::Contains("over the same mesh axis 'dp'"));
}

TEST_CASE("every DoRA norm layout matches the unsharded op on the CPU", "[cpu][ops][sharding]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_dora_layouts(Device::cpu());
}

TEST_CASE("every DoRA norm layout matches the unsharded op on the GPU", "[gpu][ops][sharding]") {
  KERF_REQUIRE_GPU();
  check_dora_layouts(Device::cuda(0));
}

TEST_CASE("every MoE layout matches the unsharded op on the CPU", "[cpu][ops][sharding]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_moe_layouts(Device::cpu());
}

TEST_CASE("every MoE layout matches the unsharded op on the GPU", "[gpu][ops][sharding]") {
  KERF_REQUIRE_GPU();
  check_moe_layouts(Device::cuda(0));
}

TEST_CASE("every embedding layout matches the unsharded op on the CPU", "[cpu][ops][sharding]") {
  KERF_REQUIRE_CPU_BACKEND();
  check_embedding_layouts(Device::cpu());
}

TEST_CASE("every embedding layout matches the unsharded op on the GPU", "[gpu][ops][sharding]") {
  KERF_REQUIRE_GPU();
  check_embedding_layouts(Device::cuda(0));
}

TEST_CASE("layouts that cannot work together are rejected before any launch, naming both specs",
          "[ops][sharding]") {
  // Host tensors: nothing runs, so no back end is needed; outputs stay poisoned.
  const Device cpu = Device::cpu();
  TestTensor W(DType::f32, {8, 12}, cpu), A(DType::f32, {2, 12}, cpu), B(DType::f32, {8, 2}, cpu);
  TestTensor m(DType::f32, {8}, cpu), norm(DType::f32, {8}, cpu), scale(DType::f32, {8}, cpu);
  norm.poison();
  const auto dora = [&](const ops::Layout& l) {
    return kerf::test::thrown<InvalidArgument>([&] {
      ops::dora_norm(W.view(), A.view(), B.view(), m.view(), 1.0, norm.view(), scale.view(), 0.0,
                     nullptr, {}, l);
    });
  };
  const auto partial = [&](const ops::Layout& l) {
    return kerf::test::thrown<InvalidArgument>([&] {
      ops::dora_norm_partial(W.view(), A.view(), B.view(), 1.0, norm.view(), nullptr, {}, l);
    });
  };
  // A split on in differently from W.
  std::string msg = partial(layout_of({{"tp", 2}}, {{"W", {"", "tp"}}}));
  CHECK_THAT(msg, Catch::Contains("A P()") && Catch::Contains("W P(None, 'tp')") &&
                      Catch::Contains("split dimension 'in' (A's dim 1, W's dim 1) differently"));
  msg = partial(layout_of({{"tp", 2}, {"x", 2}}, {{"W", {"", "tp"}}, {"A", {"", "x"}}}));
  CHECK_THAT(msg, Catch::Contains("A P(None, 'x')") && Catch::Contains("W P(None, 'tp')"));
  // The magnitude split differently from W's out.
  msg = dora(
      layout_of({{"tp", 2}}, {{"W", {"tp"}}, {"B", {"tp"}}, {"norm", {"tp"}}, {"scale", {"tp"}}}));
  CHECK_THAT(msg,
             Catch::Contains("m P()") && Catch::Contains("W P('tp')") && Catch::Contains("'out'"));
  // The rank split.
  msg = partial(layout_of({{"tp", 2}}, {{"A", {"tp"}}, {"B", {"", "tp"}}}));
  CHECK_THAT(msg,
             Catch::Contains("splits dimension 'r' over 'tp'") && Catch::Contains("A P('tp')"));
  // dora_norm with W split on in points at the partial path.
  msg = dora(layout_of({{"tp", 2}}, {{"W", {"", "tp"}}, {"A", {"", "tp"}}}));
  CHECK_THAT(msg, Catch::Contains("dora_norm_partial") && Catch::Contains("dora_norm_finish"));
  // Malformed layouts.
  CHECK_THAT(partial(layout_of({{"tp", 2}}, {{"V", {"tp"}}})),
             Catch::Contains("there is no operand 'V' (the operands are W, A, B, sumsq)"));
  CHECK_THAT(partial(layout_of({{"tp", 2}}, {{"W", {"", "pp"}}, {"A", {"", "pp"}}})),
             Catch::Contains("names mesh axis 'pp', which the mesh lacks"));
  CHECK_THAT(partial(layout_of({{"tp", 2}}, {{"W", {"tp", "tp"}}})),
             Catch::Contains("splits two dimensions over mesh axis 'tp'"));
  CHECK_THAT(partial(layout_of({{"tp", 0}}, {})),
             Catch::Contains("mesh axis 'tp' must have size >= 1, got 0"));
  CHECK_THAT(partial(layout_of({{"tp", 2}, {"tp", 2}}, {})),
             Catch::Contains("mesh axis 'tp' is named twice"));
  CHECK_THAT(partial(layout_of({{"tp", 2}}, {{"sumsq", {"", "tp"}}})),
             Catch::Contains("sumsq has rank 1 but its spec P(None, 'tp') names 2 dimensions"));
  CHECK_THAT(partial(layout_of({{"tp", 2}}, {{"sumsq", {"", "", ""}}})),  // trailing Nones named too
             Catch::Contains("sumsq has rank 1 but its spec P(None, None, None) names 3 dimensions"));
  norm.download();
  for (int64_t i = 0; i < 8; ++i) CHECK(std::isnan(norm.get(i)));  // nothing ran

  // MoE: B split on experts, A not.
  TestTensor Wm(DType::f32, {2, 4, 4}, cpu), Am(DType::f32, {2, 2, 4}, cpu),
      Bm(DType::f32, {2, 4, 2}, cpu);
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::moe_lora_materialize(
        Wm.view(), Am.view(), Bm.view(), 1.0, Wm.view(), nullptr, {},
        layout_of({{"ep", 2}}, {{"W", {"ep"}}, {"B", {"ep"}}, {"W_eff", {"ep"}}}));
  });
  CHECK_THAT(msg,
             Catch::Contains("A P()") && Catch::Contains("W P('ep')") && Catch::Contains("'E'"));
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::moe_lora_materialize_backward(Wm.view(), Am.view(), Bm.view(), 1.0, Am.view(), Bm.view(),
                                       nullptr, {}, layout_of({{"ep", 2}}, {{"dA", {"ep"}}}));
  });
  CHECK_THAT(msg, Catch::Contains("dA P('ep')") && Catch::Contains("dW_eff P()"));

  // Embedding: vocab split needs this device's coordinates; A split differently from the weight.
  TestTensor X(DType::i64, {3}, cpu), Wt(DType::f32, {10, 4}, cpu), Ae(DType::f32, {2, 10}, cpu),
      Be(DType::f32, {4, 2}, cpu), out(DType::f32, {3, 4}, cpu);
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), {}, nullptr, {},
                        layout_of({{"vp", 2}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}}));
  });
  CHECK_THAT(msg, Catch::Contains("this device's coordinates are needed"));
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), {}, nullptr, {},
                        layout_of({{"vp", 2}}, {{"weight", {"vp"}}}, {0}));
  });
  CHECK_THAT(msg, Catch::Contains("A P()") && Catch::Contains("weight P('vp')") &&
                      Catch::Contains("'vocab'"));
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), {}, nullptr, {},
                        layout_of({{"vp", 2}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}}, {2}));
  });
  CHECK_THAT(msg, Catch::Contains("coordinate 2 on mesh axis 'vp' is outside [0, 2)"));
  // A shard of its own size: vocab_start and vocab_size together, with a vocab split, inside it.
  const ops::Layout vp = layout_of({{"vp", 2}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}});
  ops::EmbeddingOptions only_start, no_split, outside;
  only_start.vocab_start = 10;
  msg = kerf::test::thrown<InvalidArgument>(
      [&] { ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), only_start, nullptr, {}, vp); });
  CHECK_THAT(msg, Catch::Contains("lora_embedding: vocab_start and vocab_size go together") &&
                      Catch::Contains("got only vocab_start"));
  no_split.vocab_start = 0;
  no_split.vocab_size = 10;
  msg = kerf::test::thrown<InvalidArgument>(
      [&] { ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), no_split); });
  CHECK_THAT(msg, Catch::Contains("the layout does not split 'vocab'"));
  outside.vocab_start = 15;
  outside.vocab_size = 24;
  TestTensor gAe(DType::f32, {2, 10}, cpu), gBe(DType::f32, {4, 2}, cpu);
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::lora_embedding_backward(X.view(), Ae.view(), Be.view(), out.view(), 1.0, gAe.view(), gBe.view(), outside,
                                 nullptr, {}, layout_of({{"vp", 2}}, {{"A", {"", "vp"}}, {"grad_A", {"", "vp"}}}));
  });
  CHECK_THAT(msg, Catch::Contains("lora_embedding_backward: this shard's ids [15, 15 + 10) do not lie in the "
                                  "vocabulary [0, 24)"));
  // vocab_start with the device's coordinate as well: they must tell the same shard.
  ops::EmbeddingOptions at0;
  at0.vocab_start = 0;
  at0.vocab_size = 20;
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), at0, nullptr, {},
                        layout_of({{"vp", 2}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}}, {1}));
  });
  CHECK_THAT(msg, Catch::Contains("lora_embedding: vocab_start 0 (ids [0, 10) of 20) disagrees with the layout's "
                                  "coordinate 1 of 2 on 'vp' (the last shard ends at the vocabulary's size)"));
  ops::EmbeddingOptions uneven;
  uneven.vocab_start = 5;
  uneven.vocab_size = 23;
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), uneven, nullptr, {},
                        layout_of({{"vp", 2}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}}, {0}));
  });
  CHECK_THAT(msg, Catch::Contains("disagrees with the layout's coordinate 0 of 2 on 'vp' (the first shard starts "
                                  "at 0)"));
  // Shards of any sizes in coordinate order pass with their coordinates: a middle shard
  // as long as an even one would be (cuts 12/10/8 of 30: it was refused as an even shard
  // that must start at 10), and a shard that ends the vocabulary before the last
  // coordinate (torch.chunk's cuts leave trailing devices empty: ids [2, 12) of 12 on
  // the fourth of five devices).
  for (const auto& [start, total, coord, n] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{12, 30, 1, 3}, {2, 12, 3, 5}}) {
    ops::EmbeddingOptions cut;
    cut.vocab_start = start;
    cut.vocab_size = total;
    CAPTURE(start, total, coord, n);
    const ops::detail::ChecksOnly checks_only;  // the checks alone: nothing runs, no back end needed
    CHECK_NOTHROW(ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), cut, nullptr, {},
                                      layout_of({{"vp", n}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}}, {coord})));
  }
  // Coordinates are checked where given, even by an op whose layout does not need them.
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::moe_lora_materialize(Wm.view(), Am.view(), Bm.view(), 1.0, Wm.view(), nullptr, {},
                              layout_of({{"tp", 2}}, {}, {5}));
  });
  CHECK_THAT(msg, Catch::Contains("moe_lora_materialize: layout: coordinate 5 on mesh axis 'tp' is outside [0, 2)"));
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::moe_lora_materialize(Wm.view(), Am.view(), Bm.view(), 1.0, Wm.view(), nullptr, {},
                              layout_of({{"tp", 2}}, {}, {0, 1}));
  });
  CHECK_THAT(msg, Catch::Contains("layout: coords gives 2 coordinates for a mesh of 1 axes"));
  // Tokens and vocab over one axis: a shard's tokens would miss the other shards' ids.
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::lora_embedding(
        X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), {}, nullptr, {},
        layout_of({{"tp", 2}},
                  {{"x", {"tp"}}, {"out", {"tp"}}, {"weight", {"tp"}}, {"A", {"", "tp"}}}, {0}));
  });
  CHECK_THAT(
      msg, Catch::Contains("split dimensions") && Catch::Contains("over the same mesh axis 'tp'"));
  // The vocabulary split without this device's coordinates: the op says which op and why.
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), {}, nullptr, {},
                        layout_of({{"vp", 2}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}}));
  });
  CHECK_THAT(msg, Catch::StartsWith("lora_embedding: layout: the vocabulary is split over 'vp'"));
  // Shards so many that the vocabulary's range overflows.
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), {}, nullptr, {},
                        layout_of({{"vp", int64_t(1) << 62}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}}, {3}));
  });
  CHECK_THAT(msg, Catch::Contains("vocabulary shards of 10 ids overflow 64 bits"));
  // Coordinates with no mesh are checked too (they were ignored).
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::dora_norm(W.view(), A.view(), B.view(), m.view(), 1.0, norm.view(), scale.view(), 0.0, nullptr, {},
                   layout_of({}, {}, {5}));
  });
  CHECK_THAT(msg, Catch::Contains("dora_norm: layout: coords gives 1 coordinates for a mesh of 0 axes"));
  // scale_grad_by_freq with the tokens split: each shard would divide by its own counts.
  TestTensor G(DType::f32, {3, 4}, cpu), gA(DType::f32, {2, 10}, cpu), gB(DType::f32, {4, 2}, cpu);
  ops::EmbeddingOptions freq;
  freq.scale_grad_by_freq = true;
  msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::lora_embedding_backward(X.view(), Ae.view(), Be.view(), G.view(), 1.0, gA.view(), gB.view(), freq,
                                 nullptr, {}, layout_of({{"dp", 2}}, {{"x", {"dp"}}, {"grad_out", {"dp"}}}));
  });
  CHECK_THAT(msg, Catch::Contains("lora_embedding_backward: layout: x P('dp') splits dimension 'x0' over 'dp'") &&
                      Catch::Contains("scale_grad_by_freq divides by each id's count over all tokens"));
}

TEST_CASE("a mesh axis of size 1 splits nothing and needs no coordinate", "[ops][sharding]") {
  ops::Layout one = layout_of({{"vp", 1}, {"tp", 4}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}});
  CHECK_FALSE(one.sharded());
  CHECK(one.canonical().empty());
  // Mesh order does not change the text.
  CHECK(layout_of({{"tp", 2}, {"dp", 2}}, {{"W", {"tp", "dp"}}}).canonical() ==
        layout_of({{"dp", 2}, {"tp", 2}}, {{"W", {"tp", "dp"}}}).canonical());
  CHECK(layout_of({{"tp", 2}, {"dp", 2}}, {{"W", {"tp", "dp"}}}).canonical() == "mesh(dp=2,tp=2) W[tp,dp]");
  // dora_norm refuses W split on in, but not over an axis of size 1.
  const Device cpu = Device::cpu();
  TestTensor W(DType::f32, {8, 12}, cpu), A(DType::f32, {2, 12}, cpu), B(DType::f32, {8, 2}, cpu);
  TestTensor m(DType::f32, {8}, cpu), norm(DType::f32, {8}, cpu), scale(DType::f32, {8}, cpu);
  const ops::Layout in1 = layout_of({{"tp", 1}}, {{"W", {"", "tp"}}, {"A", {"", "tp"}}});
  const std::string msg = kerf::test::thrown<InvalidArgument>([&] {
    ops::dora_norm(W.view(), A.view(), B.view(), m.view(), 1.0, norm.view(), scale.view(), -1.0, nullptr, {}, in1);
  });
  CHECK_THAT(msg, Catch::Contains("eps must be >= 0"));  // past the layout check: the layout was accepted
  // The vocabulary split over an axis of size 1 takes vocab_start and vocab_size that
  // describe the whole vocabulary (it refused them as describing a shard of no split).
  TestTensor X(DType::i64, {3}, cpu), Wt(DType::f32, {10, 4}, cpu), Ae(DType::f32, {2, 10}, cpu),
      Be(DType::f32, {4, 2}, cpu), out(DType::f32, {3, 4}, cpu);
  ops::EmbeddingOptions whole;
  whole.vocab_start = 0;
  whole.vocab_size = 10;
  const ops::detail::ChecksOnly checks_only;  // the checks alone: nothing runs
  CHECK_NOTHROW(ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), whole, nullptr, {},
                                    layout_of({{"vp", 1}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}})));
  whole.vocab_start = 2;
  whole.vocab_size = 12;
  CHECK_THAT(kerf::test::thrown<InvalidArgument>([&] {
               ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), whole, nullptr, {},
                                   layout_of({{"vp", 1}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}}));
             }),
             Catch::Contains("the layout does not split 'vocab'"));
}

TEST_CASE("an id past even vocabulary shards says how the layout sized the vocabulary", "[cpu][ops][sharding]") {
  KERF_REQUIRE_CPU_BACKEND();
  const Device cpu = Device::cpu();
  TestTensor X(DType::i64, {2}, cpu), Wt(DType::f32, {10, 4}, cpu), Ae(DType::f32, {2, 10}, cpu),
      Be(DType::f32, {4, 2}, cpu), out(DType::f32, {2, 4}, cpu);
  const auto message = [&](int64_t id0, int64_t id1, const ops::Layout& layout) {
    X.set(0, double(id0));
    X.set(1, double(id1));
    return kerf::test::thrown<InvalidArgument>([&] {
      ops::lora_embedding(X.view(), Wt.view(), Ae.view(), Be.view(), 1.0, out.view(), {}, nullptr, {}, layout);
    });
  };
  // np.array_split's 11/11/11/10 of 43 ids, the last shard given only its coordinate: its
  // range was reckoned as [30, 40) of 40, and id 42 reported as outside the vocabulary
  // with nothing about the layout.
  CHECK_THAT(message(31, 42, layout_of({{"vp", 4}}, {{"weight", {"vp"}}, {"A", {"", "vp"}}}, {3})),
             Catch::Contains("token id x[1] = 42 is outside the vocabulary [0, 40)") &&
                 Catch::Contains("(the layout splits the vocabulary over 'vp' into 4 even shards of this "
                                 "shard's 10 ids; shards of other sizes need vocab_start and vocab_size)"));
  // The vocabulary over two mesh axes: both named, their shards counted together.
  CHECK_THAT(message(41, 85,
                     layout_of({{"tp", 4}, {"dp", 2}}, {{"weight", {{"dp", "tp"}}}, {"A", {"", {"dp", "tp"}}}},
                               {0, 1})),
             Catch::Contains("token id x[1] = 85 is outside the vocabulary [0, 80)") &&
                 Catch::Contains("(the layout splits the vocabulary over ('dp', 'tp') into 8 even shards of "
                                 "this shard's 10 ids;"));
}
