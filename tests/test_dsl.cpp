// The DSL records the IR it should, and reports definition mistakes by kernel and op.
#include <string>
#include <vector>

#include "catch.h"
#include "kerf/dsl/dsl.h"
#include "kerf/error.h"
#include "kerf/jit/launch.h"
#include "sample_kernels.h"

using namespace kerf;
using namespace kerf::dsl;

namespace {

Kernel vec_add() {
  return Kernel("vec_add", [](Builder& k) {
    auto x = k.tensor("x", 1), y = k.tensor("y", 1), out = k.tensor("out", 1);
    const int64_t B = k.meta("BLOCK");
    auto i = program_id(0) * B + arange(B);
    auto m = i < x.dim(0);
    store(out, {i}, load(x, {i}, m) + load(y, {i}, m), m);
  });
}

std::vector<ArgSpec> three_vectors(DType t = DType::f32) {
  return {ArgSpec::tensor(t, 1), ArgSpec::tensor(t, 1), ArgSpec::tensor(t, 1)};
}

// Expects `fn` to throw a DefinitionError whose message contains every needle.
template <class F>
void expect_definition_error(F&& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    FAIL("no error was raised");
  } catch (const DefinitionError& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) {
      INFO("message: " << msg);
      CHECK(msg.find(n) != std::string::npos);
    }
  }
}

}  // namespace

TEST_CASE("a traced kernel records typed IR with its meta-parameters", "[dsl]") {
  ir::Function f = vec_add().trace(three_vectors(), {{"BLOCK", 128}});
  const std::string text = ir::print(f);
  INFO(text);
  CHECK(text.find("kernel @vec_add(@x: tensor<f32,1>") != std::string::npos);
  CHECK(text.find("BLOCK=128") != std::string::npos);
  CHECK(text.find("num_warps=4") != std::string::npos);
  CHECK(text.find("arange 0, 128 : i32[128]") != std::string::npos);
  CHECK(text.find("load @x[") != std::string::npos);
  CHECK(text.find(" mask ") != std::string::npos);
  CHECK(text.find("store @out[") != std::string::npos);
  CHECK(f.params.size() == 3);
}

TEST_CASE("literals take the dtype of the tile they meet", "[dsl]") {
  Kernel k("lit", [](Builder& b) {
    auto x = b.tensor("x", 1);
    auto i = arange(16);
    auto v = load(x, {i});
    store(x, {i}, v * 2.5 + 1);
  });
  ir::Function f = k.trace({ArgSpec::tensor(DType::bf16, 1)}, {});
  const std::string text = ir::print(f);
  INFO(text);
  CHECK(text.find("const 2.5 : bf16") != std::string::npos);
  CHECK(text.find("const 1.0 : bf16") != std::string::npos);
}

TEST_CASE("an integer literal that does not fit the i32 tile beside it is refused, not wrapped", "[dsl]") {
  const auto body = [](int64_t literal) {
    return Kernel("lit_range", [literal](Builder& b) {
      auto x = b.tensor("x", 1);
      auto i = arange(16);
      store(x, {i}, where(i < literal, load(x, {i}), 0.0));
    });
  };
  expect_definition_error([&] { body(3000000000LL).trace({ArgSpec::tensor(DType::f32, 1)}, {}); },
                          {"kernel 'lit_range'", "the integer literal 3000000000 does not fit the i32 tile",
                           ".to(DType::i64)"});
  CHECK_NOTHROW(body(2147483647LL).trace({ArgSpec::tensor(DType::f32, 1)}, {}));
  // Beside an i64 tile it fits.
  Kernel wide("lit_wide", [](Builder& b) {
    auto x = b.tensor("x", 1);
    auto i = arange(16);
    store(x, {i}, where(i.to(DType::i64) + (int64_t(1) << 33) > (int64_t(1) << 33), load(x, {i}), 0.0));
  });
  CHECK_NOTHROW(wide.trace({ArgSpec::tensor(DType::f32, 1)}, {}));
}

TEST_CASE("mixed float tiles promote to f32 and half tiles are cast explicitly", "[dsl]") {
  Kernel k("promote", [](Builder& b) {
    auto x = b.tensor("x", 1), y = b.tensor("y", 1), out = b.tensor("out", 1);
    auto i = arange(32);
    auto s = load(x, {i}) + load(y, {i});  // bf16 + f16 -> f32
    store(out, {i}, s);
  });
  ir::Function f = k.trace({ArgSpec::tensor(DType::bf16, 1), ArgSpec::tensor(DType::f16, 1),
                            ArgSpec::tensor(DType::f32, 1)},
                           {});
  const std::string text = ir::print(f);
  CHECK(text.find("cast %") != std::string::npos);
  CHECK(text.find("add %") != std::string::npos);
}

TEST_CASE("loops carry typed values and reductions drop an axis", "[dsl]") {
  Kernel k("rowsum", [](Builder& b) {
    auto x = b.tensor("x", 2), out = b.tensor("out", 1);
    const int64_t BM = b.meta("BM"), BN = b.meta("BN");
    auto rows = program_id(0) * BM + arange(BM);
    auto acc = for_range(0, x.dim(1), BN, zeros({BM, BN}), [&](const Value& c0, const Value& a) {
      auto cols = c0 + arange(BN);
      auto m = (rows.col() < x.dim(0)) & (cols.row() < x.dim(1));
      return a + load(x, {rows.col(), cols.row()}, m);
    });
    store(out, {rows}, sum(acc, 1), rows < x.dim(0));
  });
  ir::Function f = k.trace({ArgSpec::tensor(DType::f32, 2), ArgSpec::tensor(DType::f32, 1)},
                           {{"BM", 16}, {"BN", 32}});
  const std::string text = ir::print(f);
  INFO(text);
  CHECK(text.find("for %") != std::string::npos);
  CHECK(text.find("yield %") != std::string::npos);
  CHECK(text.find("reduce_sum %") != std::string::npos);
  CHECK(text.find(": f32[16]") != std::string::npos);
}

TEST_CASE("the same kernel hashes the same; any change changes the hash", "[ir][hash]") {
  const auto a = ir::hash(vec_add().trace(three_vectors(), {{"BLOCK", 128}}));
  const auto b = ir::hash(vec_add().trace(three_vectors(), {{"BLOCK", 128}}));
  CHECK(a == b);
  CHECK(a.hex().size() == 32);
  // meta-parameter
  CHECK(a != ir::hash(vec_add().trace(three_vectors(), {{"BLOCK", 256}})));
  // warps
  CHECK(a != ir::hash(vec_add().trace(three_vectors(), {{"BLOCK", 128}, {"num_warps", 8}})));
  // dtype
  CHECK(a != ir::hash(vec_add().trace(three_vectors(DType::bf16), {{"BLOCK", 128}})));
  // facts
  auto facts = three_vectors();
  facts[0].facts.contiguous_last = true;
  CHECK(a != ir::hash(vec_add().trace(facts, {{"BLOCK", 128}})));
  // an op
  Kernel sub("vec_add", [](Builder& k) {
    auto x = k.tensor("x", 1), y = k.tensor("y", 1), out = k.tensor("out", 1);
    const int64_t B = k.meta("BLOCK");
    auto i = program_id(0) * B + arange(B);
    auto m = i < x.dim(0);
    store(out, {i}, load(x, {i}, m) - load(y, {i}, m), m);
  });
  CHECK(a != ir::hash(sub.trace(three_vectors(), {{"BLOCK", 128}})));
  // a constant
  Kernel scaled("vec_add", [](Builder& k) {
    auto x = k.tensor("x", 1), y = k.tensor("y", 1), out = k.tensor("out", 1);
    const int64_t B = k.meta("BLOCK");
    auto i = program_id(0) * B + arange(B);
    auto m = i < x.dim(0);
    store(out, {i}, load(x, {i}, m) + load(y, {i}, m) * 1.0, m);
  });
  CHECK(a != ir::hash(scaled.trace(three_vectors(), {{"BLOCK", 128}})));
}

TEST_CASE("the IR hash matches xxHash's XXH3-128 of the text", "[ir][hash]") {
  // Reference value of XXH3_128bits("abc") from xxHash's own documentation of 0.8.
  CHECK(ir::hash_bytes("abc", 3).hex() == "06b05ab6733a618578af5f94892f3950");
}

TEST_CASE("broadcasting incompatible shapes is a definition error", "[dsl][errors]") {
  Kernel k("bad_broadcast", [](Builder&) {
    auto a = arange(16), b = arange(32);
    (void)(a + b);
  });
  expect_definition_error([&] { k.trace({}, {}); },
                          {"bad_broadcast", "'add'", "[16]", "[32]", "do not broadcast"});
}

TEST_CASE("dot of mismatched tiles is a definition error", "[dsl][errors]") {
  Kernel k("bad_dot", [](Builder&) {
    auto a = zeros({16, 32}), b = zeros({16, 64});
    (void)dot(a, b);
  });
  expect_definition_error([&] { k.trace({}, {}); }, {"bad_dot", "'dot'", "K=32 vs 16"});
  Kernel k2("bad_dot_dtype", [](Builder&) {
    auto a = zeros({16, 16}, DType::bf16), b = zeros({16, 16}, DType::f32);
    (void)dot(a, b);
  });
  expect_definition_error([&] { k2.trace({}, {}); }, {"bad_dot_dtype", "share a dtype"});
}

TEST_CASE("storing the wrong dtype is a definition error", "[dsl][errors]") {
  Kernel k("bad_store", [](Builder& b) {
    auto out = b.tensor("out", 1);
    store(out, {arange(16)}, zeros({16}, DType::f32));
  });
  expect_definition_error([&] { k.trace({ArgSpec::tensor(DType::bf16, 1)}, {}); },
                          {"bad_store", "'store'", "bf16", "f32"});
}

TEST_CASE("a meta-parameter left unset is a definition error", "[dsl][errors]") {
  expect_definition_error([&] { vec_add().trace(three_vectors(), {}); },
                          {"vec_add", "BLOCK", "not set"});
  expect_definition_error([&] { vec_add().trace(three_vectors(), {{"BLOCK", 64}, {"BLCK", 2}}); },
                          {"vec_add", "BLCK", "does not use"});
}

TEST_CASE("tile lengths must be powers of two", "[dsl][errors]") {
  Kernel k("odd", [](Builder&) { (void)arange(0, 100); });
  expect_definition_error([&] { k.trace({}, {}); }, {"odd", "'arange'", "power"});
}

TEST_CASE("arguments that disagree with the declaration are definition errors", "[dsl][errors]") {
  expect_definition_error(
      [&] { vec_add().trace({ArgSpec::tensor(DType::f32, 2)}, {{"BLOCK", 64}}); },
      {"vec_add", "rank 1", "rank-2"});
  expect_definition_error([&] { vec_add().trace({ArgSpec::tensor(DType::f32, 1)}, {{"BLOCK", 64}}); },
                          {"vec_add", "passes only 1"});
  // Every argument has a name (an empty one was taken, and messages named it '').
  const Kernel unnamed_tensor("unnamed_tensor", [](Builder& k) { (void)k.tensor("", 1); });
  expect_definition_error([&] { unnamed_tensor.trace({ArgSpec::tensor(DType::f32, 1)}, {}); },
                          {"unnamed_tensor", "argument 0 needs a name"});
  const Kernel unnamed_scalar("unnamed_scalar", [](Builder& k) { (void)k.scalar("", DType::f32); });
  expect_definition_error([&] { unnamed_scalar.trace({ArgSpec::scalar()}, {}); },
                          {"unnamed_scalar", "argument 0 needs a name"});
}

TEST_CASE("loop-carried values must keep their type", "[dsl][errors]") {
  Kernel k("bad_loop", [](Builder&) {
    (void)for_range(0, 10, 1, zeros({16}), [&](const Value&, const Value& a) {
      return a.to(DType::bf16);
    });
  });
  expect_definition_error([&] { k.trace({}, {}); }, {"bad_loop", "'for'", "f32[16]", "bf16[16]"});
}

// A refused loop leaves the builder in the block around it: a body that catches the error
// goes on tracing there (the loop's block, gone with the loop, was left current before).
TEST_CASE("a loop refused for what its body returns leaves tracing in the block around it",
          "[dsl][errors]") {
  for (const int how : {0, 1, 2}) {
    CAPTURE(how);
    Kernel k("caught_loop", [how](Builder& b) {
      auto out = b.tensor("out", 1);
      try {
        if (how == 0)  // an empty Value
          (void)for_range(0, 4, 1, zeros({16}), [](const Value&, const Value&) { return Value(); });
        else if (how == 1)  // another type
          (void)for_range(0, 4, 1, zeros({16}),
                          [](const Value&, const Value& a) { return a.to(DType::f16); });
        else  // two values for one
          (void)for_range(0, 4, 1, std::vector<Value>{zeros({16})},
                          [](const Value&, const std::vector<Value>& a) {
                            return std::vector<Value>{a[0], a[0]};
                          });
        FAIL("the loop was accepted");
      } catch (const DefinitionError& e) {
        CHECK(std::string(e.what()).find("'for'") != std::string::npos);
      }
      store(out, {arange(16)}, zeros({16}) + 3.0);
    });
    const ir::Function f = k.trace({ArgSpec::tensor(DType::f32, 1)}, {});
    // The store is in the kernel's own block, after no loop.
    REQUIRE_FALSE(f.body.ops.empty());
    CHECK(f.body.ops.back().kind == ir::OpKind::Store);
    for (const ir::Operation& op : f.body.ops) CHECK(op.kind != ir::OpKind::For);
  }
}

// Tiles index their elements in 32 bits: a tile of more elements, or one whose count would
// wrap 64 bits, is refused where it is made (its stack size wrapped to nothing on the CPU).
TEST_CASE("a tile of more than 2^31 - 1 elements is a definition error", "[dsl][errors]") {
  for (const ir::Shape& shape :
       {ir::Shape{int64_t(1) << 31}, ir::Shape{int64_t(1) << 62},
        ir::Shape{int64_t(1) << 40, int64_t(1) << 40}, ir::Shape{65536, 65536}}) {
    CAPTURE(shape);
    Kernel k("huge_tile", [shape](Builder& b) {
      auto out = b.tensor("out", 1);
      auto acc =
          for_range(0, 1, 1, zeros(shape), [](const Value&, const Value& c) { return c + 1.0; });
      store(out, {arange(16)}, zeros({16}) + sum(acc, 0).to(DType::f32));
    });
    expect_definition_error([&] { k.trace({ArgSpec::tensor(DType::f32, 1)}, {}); },
                            {"huge_tile", "has more than 2^31 - 1 elements"});
  }
  Kernel fits("big_tile", [](Builder& b) {  // 2^30 elements: traced (the back ends judge its size)
    auto out = b.tensor("out", 1);
    store(out, {arange(16)}, zeros({16}) + sum(zeros({int64_t(1) << 30}), 0));
  });
  CHECK_NOTHROW(fits.trace({ArgSpec::tensor(DType::f32, 1)}, {}));
}

// literal() takes any integer type (literal(0) was ambiguous between int64_t and double).
TEST_CASE("literal takes any integer type as an integer and floats as f32", "[dsl]") {
  Kernel k("literals", [](Builder& b) {
    auto out = b.tensor("out", 1);
    const Value a = literal(0), c = literal(7u), d = literal(int64_t(1) << 40), e = literal(2.5f);
    CHECK(a.dtype() == DType::i32);
    CHECK(c.dtype() == DType::i32);
    CHECK(d.dtype() == DType::i64);
    CHECK(e.dtype() == DType::f32);
    store(out, {arange(16)}, zeros({16}, DType::i32) + a + c);
  });
  CHECK_NOTHROW(k.trace({ArgSpec::tensor(DType::i32, 1)}, {}));
}

TEST_CASE("a value escaping its loop body is a definition error", "[dsl][errors]") {
  Kernel k("escape", [](Builder& b) {
    auto out = b.tensor("out", 1);
    Value leaked;
    for_range(0, 4, 1, [&](const Value& iv) { leaked = iv + arange(16); });
    store(out, {arange(16)}, leaked);
  });
  expect_definition_error([&] { k.trace({ArgSpec::tensor(DType::i32, 1)}, {}); },
                          {"escape", "loop body"});
}

TEST_CASE("ops used outside a trace are reported, not crashed on", "[dsl][errors]") {
  CHECK_THROWS_AS(arange(16), DefinitionError);
}

TEST_CASE("a Value or Tensor kept from one trace is refused in another and after it", "[dsl][errors]") {
  Value kept;
  Tensor kept_tensor;
  Kernel first("first", [&](Builder& b) {
    kept_tensor = b.tensor("x", 1);
    kept = arange(16);
    store(kept_tensor, {kept}, kept.to(kept_tensor.dtype()));
  });
  // The second kernel's Builder may live at the first's address: the trace, not the address, decides.
  Kernel second("second", [&](Builder& b) {
    auto out = b.tensor("out", 1);
    store(out, {arange(16)}, kept.to(DType::f32));
  });
  Kernel third("third", [&](Builder& b) {
    auto out = b.tensor("out", 1);
    store(kept_tensor, {arange(16)}, load(out, {arange(16)}));
  });
  for (int round = 0; round < 2; ++round) {
    (void)first.trace({ArgSpec::tensor(DType::f32, 1)}, {});
    expect_definition_error([&] { second.trace({ArgSpec::tensor(DType::f32, 1)}, {}); },
                            {"second", "Value from another kernel's trace (or from a trace that has ended)"});
    expect_definition_error([&] { third.trace({ArgSpec::tensor(DType::f32, 1)}, {}); },
                            {"third", "Tensor from another kernel's trace"});
    // Outside any trace: reported, never read.
    expect_definition_error([&] { (void)(kept + 1); }, {"Value from another kernel's trace"});
    expect_definition_error([&] { (void)kept.shape(); }, {"trace that has ended"});
    expect_definition_error([&] { (void)kept_tensor.dim(0); }, {"Tensor from another"});
  }
}

TEST_CASE("a kernel body that traces or launches kernels is refused, not hung", "[dsl][errors]") {
  Kernel inner("inner", [](Builder& b) { store(b.tensor("out", 1), {arange(16)}, zeros({16})); });
  Kernel outer("outer", [&](Builder&) { (void)inner.trace({ArgSpec::tensor(DType::f32, 1)}, {}); });
  expect_definition_error([&] { outer.trace({}, {}); }, {"'inner' was traced", "body of kernel 'outer'"});
  // A body launching its own kernel waited for its own build before.
  std::vector<float> data(16, 1.0f);
  static Kernel* self = nullptr;
  Kernel again("again", [&](Builder& b) {
    auto out = b.tensor("out", 1);
    store(out, {arange(16)}, zeros({16}));
    kerf::launch(*self, {kerf::TensorView::contiguous(data.data(), DType::f32, {16})}, Grid{}, MetaMap{});
  });
  self = &again;
  try {
    kerf::launch(again, {kerf::TensorView::contiguous(data.data(), DType::f32, {16})}, Grid{}, MetaMap{});
    FAIL("no error");
  } catch (const DefinitionError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("kernel 'again' was launched inside the body of kernel 'again'") !=
          std::string::npos);
  } catch (const NotAvailable&) {
    // Without a CPU back end the launch stops before tracing: nothing to check.
  }
  self = nullptr;
}

TEST_CASE("a meta-parameter given two different defaults in one body is refused", "[dsl][errors]") {
  Kernel k("two_defaults", [](Builder& b) {
    (void)b.meta("B", 8);
    (void)b.meta("B", 8);  // the same default twice is fine
    (void)b.meta("B", 16);
  });
  expect_definition_error([&] { k.trace({}, {}); }, {"two_defaults", "'B' has two defaults, 8 and 16"});
  CHECK_NOTHROW(k.trace({}, {{"B", 32}}));  // set by the call: no default is used
}

TEST_CASE("a body's own exceptions come back as definition errors naming the kernel", "[dsl][errors]") {
  Kernel k("throws", [](Builder&) { (void)std::vector<int>().at(3); });
  expect_definition_error([&] { k.trace({}, {}); }, {"kernel 'throws': its body threw"});
  Kernel odd("odd_throw", [](Builder&) { throw 42; });
  expect_definition_error([&] { odd.trace({}, {}); }, {"odd_throw", "not a std::exception"});
  // kerf's own errors pass unchanged.
  Kernel own("own", [](Builder&) { throw InvalidArgument("mine"); });
  CHECK_THROWS_WITH(own.trace({}, {}), "mine");
}

TEST_CASE("constants must fit their dtype, and arange must fit i32", "[dsl][errors]") {
  Kernel big("big_full", [](Builder&) { (void)full({4}, 3e9, DType::i32); });
  expect_definition_error([&] { big.trace({}, {}); }, {"big_full", "'const'", "3000000000 does not fit i32"});
  Kernel huge("huge_const", [](Builder&) { (void)constant(1e20, DType::i64); });
  expect_definition_error([&] { huge.trace({}, {}); }, {"huge_const", "does not fit i64"});
  Kernel byte("byte_full", [](Builder&) { (void)full({4}, 300, DType::u8); });
  expect_definition_error([&] { byte.trace({}, {}); }, {"byte_full", "300 does not fit u8"});
  Kernel wide("wide_arange", [](Builder&) { (void)arange(2147483646, 2147483650); });
  expect_definition_error([&] { wide.trace({}, {}); }, {"wide_arange", "'arange'", "outside i32"});
  Kernel fine("fine", [](Builder&) {
    (void)full({4}, -2147483648.0, DType::i32);
    (void)full({4}, 255, DType::u8);
    (void)arange(2147483647 - 15, 2147483647 + 1LL);
  });
  CHECK_NOTHROW(fine.trace({}, {}));
}

TEST_CASE("arithmetic on two i1 tiles asks for a cast; logic and comparisons do not", "[dsl][errors]") {
  Kernel add("bool_add", [](Builder&) { (void)((arange(4) > 1) + (arange(4) > 2)); });
  expect_definition_error([&] { add.trace({}, {}); }, {"bool_add", "'add'", "two i1 tiles; cast them to i32"});
  Kernel shl("bool_shl", [](Builder&) { (void)((arange(4) > 1) << (arange(4) > 2)); });
  expect_definition_error([&] { shl.trace({}, {}); }, {"bool_shl", "'shl'"});
  Kernel logic("bool_logic", [](Builder&) {
    const Value a = arange(4) > 1, b = arange(4) > 2;
    (void)(a & b);
    (void)(a | b);
    (void)(a ^ b);
    (void)(a == b);
    (void)(a.to(DType::i32) + b.to(DType::i32));
  });
  CHECK_NOTHROW(logic.trace({}, {}));
}

TEST_CASE("a literal in where() takes the dtype of the tile beside it", "[dsl]") {
  DType got_int = DType::f64, got_float = DType::f64, got_left = DType::f64;
  Kernel k("where_literal", [&](Builder&) {
    const Value v = arange(4) * 16777217;  // i32 values f32 cannot hold
    got_int = where(v > 0, v, 0).dtype();
    got_float = where(v > 0, v, 0.5).dtype();
    got_left = where(v > 0, -1, v).dtype();
  });
  (void)k.trace({}, {});
  CHECK(got_int == DType::i32);  // was f32: 16777217 came back as 16777216
  CHECK(got_float == DType::f32);
  CHECK(got_left == DType::i32);
}

TEST_CASE("arange of a length that is not a power of two names arange", "[dsl][errors]") {
  Kernel k("ten", [](Builder&) { (void)arange(10); });
  expect_definition_error([&] { k.trace({}, {}); }, {"ten", "'arange'", "arange(0, 10)"});
}

TEST_CASE("the verifier rejects ill-typed IR", "[ir][verifier]") {
  ir::Function f = vec_add().trace(three_vectors(), {{"BLOCK", 64}});
  ir::verify(f);  // well typed
  // Corrupt the type of the add's result.
  for (auto& op : f.body.ops)
    if (op.kind == ir::OpKind::Add) f.types[size_t(op.results[0])].dtype = DType::i32;
  CHECK_THROWS_AS(ir::verify(f), InternalError);

  ir::Function g = vec_add().trace(three_vectors(), {{"BLOCK", 64}});
  // Use a value before it is defined: swap the first two ops.
  std::swap(g.body.ops[0], g.body.ops.back());
  CHECK_THROWS_AS(ir::verify(g), InternalError);
}

TEST_CASE("grid_sync is a barrier at the kernel's top level on one i32 counter", "[dsl][ir]") {
  const std::vector<ArgSpec> args = {ArgSpec::tensor(DType::f32, 1), ArgSpec::tensor(DType::i32, 1),
                                     ArgSpec::tensor(DType::i32, 1)};
  Kernel k("two_phases", [](Builder& b) {
    auto x = b.tensor("x", 1), sync = b.tensor("sync", 1);
    b.tensor("other", 1);
    auto i = program_id(0) * 16 + arange(16);
    atomic_add(x, {i}, full({16}, 1.0, DType::f32), i < x.dim(0));
    grid_sync(sync);
    store(x, {i}, zeros({16}), i < x.dim(0));
    grid_sync(sync);
  });
  ir::Function f = k.trace(args, {});
  ir::verify(f);
  const std::string text = ir::print(f);
  INFO(text);
  const size_t add = text.find("atomic_add @x"), sync1 = text.find("grid_sync @sync"),
               store = text.find("store @x"), sync2 = text.find("grid_sync @sync", sync1 + 1);
  REQUIRE(sync2 != std::string::npos);
  CHECK(add < sync1);
  CHECK(sync1 < store);  // kept in place and not merged: both barriers stay
  CHECK(store < sync2);
  // Inside a loop, on an f32 counter, or on two counters: refused.
  Kernel in_loop("in_loop", [](Builder& b) {
    auto sync = b.tensor("sync", 1, DType::i32);
    for_range(0, 2, 1, [&](const Value&) { grid_sync(sync); });
  });
  CHECK_THROWS_WITH(in_loop.trace({ArgSpec::tensor(DType::i32, 1)}, {}),
                    Catch::Matchers::Contains("top level"));
  Kernel f32_counter("f32_counter", [](Builder& b) { grid_sync(b.tensor("sync", 1)); });
  CHECK_THROWS_WITH(f32_counter.trace({ArgSpec::tensor(DType::f32, 1)}, {}), Catch::Matchers::Contains("i32"));
  Kernel two("two_counters", [](Builder& b) {
    auto a = b.tensor("a", 1), c = b.tensor("c", 1);
    grid_sync(a);
    grid_sync(c);
  });
  CHECK_THROWS_WITH(two.trace({ArgSpec::tensor(DType::i32, 1), ArgSpec::tensor(DType::i32, 1)}, {}),
                    Catch::Matchers::Contains("same tensor"));
}

TEST_CASE("grid_arrive and grid_await split a grid barrier and a wait needs an arrival before it", "[dsl][ir]") {
  Kernel k("split_phase", [](Builder& b) {
    auto x = b.tensor("x", 1), sync = b.tensor("sync", 1, DType::i32);
    auto i = program_id(0) * 16 + arange(16);
    store(x, {i}, zeros({16}), i < x.dim(0));
    grid_arrive(sync);
    auto v = load(x, {i}, i < x.dim(0));
    grid_await(sync);
    store(x, {i}, v + 1.0, i < x.dim(0));
  });
  const std::vector<ArgSpec> args = {ArgSpec::tensor(DType::f32, 1), ArgSpec::tensor(DType::i32, 1)};
  ir::Function f = k.trace(args, {});
  ir::verify(f);
  const std::string text = ir::print(f);
  INFO(text);
  const size_t arrive = text.find("grid_sync @sync arrive"), await = text.find("grid_sync @sync await");
  REQUIRE(arrive != std::string::npos);
  REQUIRE(await != std::string::npos);
  CHECK(arrive < text.find("load @x"));
  CHECK(text.find("load @x") < await);
  // A wait with no arrival before it that nothing has waited for: refused.
  Kernel lone("lone_await", [](Builder& b) { grid_await(b.tensor("sync", 1, DType::i32)); });
  CHECK_THROWS_WITH(lone.trace({ArgSpec::tensor(DType::i32, 1)}, {}), Catch::Matchers::Contains("grid_arrive before it"));
  Kernel twice("await_twice", [](Builder& b) {
    auto sync = b.tensor("sync", 1, DType::i32);
    grid_arrive(sync);
    grid_await(sync);
    grid_await(sync);
  });
  CHECK_THROWS_WITH(twice.trace({ArgSpec::tensor(DType::i32, 1)}, {}), Catch::Matchers::Contains("grid_arrive before it"));
  Kernel synced("arrive_then_sync", [](Builder& b) {
    auto sync = b.tensor("sync", 1, DType::i32);
    grid_arrive(sync);
    grid_sync(sync);  // waits for both arrivals
    grid_await(sync);
  });
  CHECK_THROWS_WITH(synced.trace({ArgSpec::tensor(DType::i32, 1)}, {}),
                    Catch::Matchers::Contains("grid_arrive before it"));
  Kernel looped("arrive_in_loop", [](Builder& b) {
    auto sync = b.tensor("sync", 1, DType::i32);
    for_range(0, 2, 1, [&](const Value&) { grid_arrive(sync); });
  });
  CHECK_THROWS_WITH(looped.trace({ArgSpec::tensor(DType::i32, 1)}, {}), Catch::Matchers::Contains("grid_arrive must be at the kernel's top level"));
}

TEST_CASE("grid dependency ops keep their place among a kernel's effects", "[dsl][ir]") {
  Kernel k("overlap", [](Builder& b) {
    auto x = b.tensor("x", 1), out = b.tensor("out", 1);
    release_dependents();
    auto i = program_id(0) * 16 + arange(16);
    auto v = load(x, {i}, i < x.dim(0));
    wait_prior_grid();
    for_range(0, 2, 1, [&](const Value&) {
      wait_prior_grid();
      store(out, {i}, v, i < out.dim(0));
    });
  });
  ir::Function f = k.trace({ArgSpec::tensor(DType::f32, 1), ArgSpec::tensor(DType::f32, 1)}, {});
  ir::verify(f);
  const std::string text = ir::print(f);
  INFO(text);
  const size_t at_release = text.find("release_dependents"), at_load = text.find("load @x"),
               at_wait = text.find("wait_prior_grid"), at_loop = text.find("for "),
               at_inner = text.find("wait_prior_grid", at_wait + 1), at_store = text.find("store @out");
  REQUIRE(at_release != std::string::npos);
  REQUIRE(at_inner != std::string::npos);
  CHECK(at_release < at_load);
  CHECK(at_load < at_wait);
  CHECK(at_wait < at_loop);
  CHECK(at_loop < at_inner);
  CHECK(at_inner < at_store);
  // Not pure: a kernel with them hashes differently from one without.
  Kernel plain("overlap", [](Builder& b) {
    auto x = b.tensor("x", 1), out = b.tensor("out", 1);
    auto i = program_id(0) * 16 + arange(16);
    auto v = load(x, {i}, i < x.dim(0));
    for_range(0, 2, 1, [&](const Value&) { store(out, {i}, v, i < out.dim(0)); });
  });
  CHECK(ir::hash(plain.trace({ArgSpec::tensor(DType::f32, 1), ArgSpec::tensor(DType::f32, 1)}, {})) != ir::hash(f));
  // The verifier holds them to no operands and no results.
  for (auto& op : f.body.ops)
    if (op.kind == ir::OpKind::GridWait) op.operands.push_back(op.operands.empty() ? 0 : op.operands[0]);
  CHECK_THROWS_AS(ir::verify(f), InternalError);
}

TEST_CASE("l2_evict_normal is an effect on a tensor's elements, checked like an access", "[dsl][ir]") {
  const std::vector<ArgSpec> args = {ArgSpec::tensor(DType::f32, 1), ArgSpec::tensor(DType::f32, 1)};
  ir::Function f = test::l2_keep_kernel().trace(args, {{"BLOCK", 64}});
  ir::verify(f);
  const std::string text = ir::print(f);
  INFO(text);
  const size_t at_store = text.find("store @y"), at_hint = text.find("l2_evict_normal @y");
  REQUIRE(at_store != std::string::npos);
  REQUIRE(at_hint != std::string::npos);
  CHECK(at_store < at_hint);
  CHECK(text.find("evict_last") != std::string::npos);
  // Kept though it has no result, and part of the kernel's hash.
  Kernel plain("l2_keep", [](Builder& b) {
    auto x = b.tensor("x", 1), y = b.tensor("y", 1);
    auto i = program_id(0) * 64 + arange(64);
    store(y, {i}, load(x, {i}, i < x.dim(0)) * 2.0 + 1.0, i < x.dim(0), Evict::last);
  });
  CHECK(ir::hash(plain.trace(args, {})) != ir::hash(f));
  // One index per dimension, tiles not scalars.
  expect_definition_error(
      [] {
        Kernel("bad", [](Builder& b) {
          auto y = b.tensor("y", 2);
          l2_evict_normal(y, {arange(16)});
        }).trace({ArgSpec::tensor(DType::f32, 2)}, {});
      },
      {"l2_evict_normal", "rank 2", "1 indices"});
  expect_definition_error(
      [] {
        Kernel("bad", [](Builder& b) {
          auto y = b.tensor("y", 1);
          l2_evict_normal(y, {program_id(0)});
        }).trace({ArgSpec::tensor(DType::f32, 1)}, {});
      },
      {"l2_evict_normal", "scalars"});
  // The verifier holds it to its indices and mask.
  for (auto& op : f.body.ops)
    if (op.kind == ir::OpKind::L2EvictNormal) op.operands.pop_back();
  CHECK_THROWS_AS(ir::verify(f), InternalError);
}

TEST_CASE("the IR text does not depend on the order the kernel's operands were traced", "[ir][canonical]") {
  // The same mask built with its two halves traced in either order (what two
  // C++ compilers may do with `(a < n) & (b < n)`), plus a dead and a duplicate value.
  auto make = [](bool rows_first) {
    return Kernel("masked_copy", [rows_first](Builder& k) {
      auto x = k.tensor("x", 2), out = k.tensor("out", 2);
      auto rows = arange(16), cols = arange(32);
      Value rm, cm;
      if (rows_first) {
        rm = rows.col() < x.dim(0);
        cm = cols.row() < x.dim(1);
      } else {
        cm = cols.row() < x.dim(1);
        rm = rows.col() < x.dim(0);
        (void)(rows * 3);  // traced, never used
      }
      auto m = rm & cm;
      auto twice = (rows.col() < x.dim(0)) & cm;  // the same mask again
      store(out, {rows.col(), cols.row()}, load(x, {rows.col(), cols.row()}, m), twice);
    });
  };
  const std::vector<ArgSpec> args = {ArgSpec::tensor(DType::f32, 2), ArgSpec::tensor(DType::f32, 2)};
  const ir::Function a = make(true).trace(args, {});
  const ir::Function b = make(false).trace(args, {});
  CHECK(ir::print(a) == ir::print(b));
  CHECK(ir::hash(a) == ir::hash(b));
  // The duplicate mask was merged: the load and the store use one value.
  const ir::Operation* load = nullptr;
  const ir::Operation* st = nullptr;
  for (const auto& op : a.body.ops) {
    if (op.kind == ir::OpKind::Load) load = &op;
    if (op.kind == ir::OpKind::Store) st = &op;
  }
  REQUIRE(load);
  REQUIRE(st);
  CHECK(load->operands.back() == st->operands.back());
  CHECK(ir::print(a).find("const 3") == std::string::npos);  // the dead value is gone
}

TEST_CASE("cluster_atomic_add adds f32 tiles, and cluster_size is 1..8 and part of the specialization",
          "[dsl][errors]") {
  const std::vector<ArgSpec> args = {ArgSpec::tensor(DType::f32, 1), ArgSpec::tensor(DType::bf16, 1)};
  const auto kernel = [](const char* name, int what) {
    return Kernel(name, [what](Builder& b) {
      auto x = b.tensor("x", 1), h = b.tensor("h", 1);
      auto i = arange(16);
      if (what == 0) cluster_atomic_add(x, {i}, load(x, {i}), i < x.dim(0));
      if (what == 1) cluster_atomic_add(h, {i}, load(h, {i}));
      if (what == 2) cluster_atomic_add(x, {literal(int64_t(0))}, literal(1.0f));
    });
  };
  const Kernel ok = kernel("cluster_ok", 0);
  const std::string two = ir::print(ok.trace(args, {{"cluster_size", 2}}));
  INFO(two);
  CHECK(two.find("cluster_sum") != std::string::npos);
  CHECK(two.find("cluster_size=2") != std::string::npos);
  // The default size is recorded too, and sizes give different kernels.
  CHECK(ir::print(ok.trace(args, {})).find("cluster_size=1") != std::string::npos);
  CHECK(ir::hash(ok.trace(args, {{"cluster_size", 2}})) != ir::hash(ok.trace(args, {{"cluster_size", 4}})));
  expect_definition_error([&] { ok.trace(args, {{"cluster_size", 9}}); }, {"cluster_ok", "cluster_size must be in 1..8, got 9"});
  expect_definition_error([&] { ok.trace(args, {{"cluster_size", 0}}); }, {"cluster_size must be in 1..8, got 0"});
  expect_definition_error([&] { kernel("cluster_bf16", 1).trace(args, {}); },
                          {"cluster_bf16", "cluster_atomic_add", "'h' holds bf16", "f32 tensors"});
  expect_definition_error([&] { kernel("cluster_scalar", 2).trace(args, {}); },
                          {"cluster_scalar", "cluster_atomic_add adds tiles"});
}

TEST_CASE("cluster_load reads a tile whose last index is a scalar, and records cluster_size", "[dsl][errors]") {
  const std::vector<ArgSpec> args = {ArgSpec::tensor(DType::bf16, 2), ArgSpec::tensor(DType::bf16, 1)};
  const auto kernel = [](const char* name, int what) {
    return Kernel(name, [what](Builder& b) {
      auto x = b.tensor("x", 2), out = b.tensor("out", 1);
      auto i = arange(16);
      auto e = program_id(0);
      if (what == 0) store(out, {i}, cluster_load(x, {i}, e, i < x.dim(0)), i < out.dim(0));
      if (what == 1) store(out, {i}, cluster_load(x, {e}, e));
      if (what == 2) store(out, {i}, cluster_load(x, {i}, i));
      if (what == 3) store(out, {i}, cluster_load(x, {i}, literal(1.0f)));
      if (what == 4) store(out, {i}, cluster_load(x, {i, i}, e));
    });
  };
  const std::string two = ir::print(kernel("cluster_load_ok", 0).trace(args, {{"cluster_size", 2}}));
  INFO(two);
  CHECK(two.find("cluster_share") != std::string::npos);
  CHECK(two.find("cluster_size=2") != std::string::npos);
  CHECK(ir::print(kernel("cluster_load_ok", 0).trace(args, {})).find("cluster_size=1") != std::string::npos);
  expect_definition_error([&] { kernel("cluster_load_scalar", 1).trace(args, {}); },
                          {"cluster_load_scalar", "cluster_load reads tiles"});
  expect_definition_error([&] { kernel("cluster_load_tile", 2).trace(args, {}); },
                          {"cluster_load", "must be an integer scalar"});
  expect_definition_error([&] { kernel("cluster_load_float", 3).trace(args, {}); },
                          {"cluster_load", "must be an integer scalar"});
  expect_definition_error([&] { kernel("cluster_load_rank", 4).trace(args, {}); },
                          {"cluster_load", "has rank 2 but 3 indices"});
}

TEST_CASE("u8 is a storage type: integers meet it as i32, arithmetic on it alone is refused", "[dsl][errors]") {
  const std::vector<ArgSpec> bytes = {ArgSpec::tensor(DType::u8, 1), ArgSpec::tensor(DType::i32, 1),
                                      ArgSpec::tensor(DType::u8, 1)};
  Kernel ok("u8_ok", [](Builder& b) {
    auto x = b.tensor("x", 1), out = b.tensor("out", 1), back = b.tensor("back", 1);
    auto i = arange(16);
    auto q = load(x, {i});
    CHECK(q.dtype() == DType::u8);
    CHECK((q >> 4).dtype() == DType::i32);
    CHECK((q & q).dtype() == DType::i32);
    CHECK((q < 3).dtype() == DType::i1);
    CHECK((q * 2.5).dtype() == DType::f32);
    store(out, {i}, q + 1);
    store(back, {i}, (q + 1).to(DType::u8));
  });
  const std::string text = ir::print(ok.trace(bytes, {}));
  INFO(text);
  CHECK(text.find("cast") != std::string::npos);
  CHECK(text.find("u8[16]") != std::string::npos);

  auto refused = [&](const char* name, void (*body)(const Value&), std::initializer_list<std::string> needles) {
    Kernel k(name, [body](Builder& b) {
      auto x = b.tensor("x", 1);
      b.tensor("out", 1);
      b.tensor("back", 1);
      body(load(x, {arange(16)}));
    });
    expect_definition_error([&] { k.trace(bytes, {}); }, needles);
  };
  refused("u8_neg", [](const Value& q) { (void)-q; }, {"u8_neg", "negate", "u8"});
  refused("u8_sum", [](const Value& q) { (void)sum(q, 0); }, {"u8_sum", "reduce", "u8", "cast it to i32"});
  refused("u8_not", [](const Value& q) { (void)~q; }, {"u8_not", "cast the u8 tile to i32"});
  Kernel atomic("u8_atomic", [](Builder& b) {
    auto x = b.tensor("x", 1);
    b.tensor("out", 1);
    b.tensor("back", 1);
    atomic_add(x, {arange(16)}, zeros({16}, DType::u8));
  });
  expect_definition_error([&] { atomic.trace(bytes, {}); }, {"u8_atomic", "atomic_add does not apply to u8"});
  Kernel scalar("u8_scalar", [](Builder& b) { b.scalar("q", DType::u8); });
  expect_definition_error([&] { scalar.trace({ArgSpec::scalar()}, {}); }, {"u8_scalar", "u8 scalars"});
}
