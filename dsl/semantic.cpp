// The DSL's type and shape rules: what a kernel author's call means, checked
// before any IR is recorded (promotion, broadcasting, dot shapes, store dtypes).
#include <cmath>
#include <cstdio>

#include "builder_impl.h"

namespace kerf::dsl {

using ir::OpKind;
using ir::Shape;
using ir::Type;

namespace {

bool is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

Builder::Impl& impl_of(const Value& v, const char* op) {
  Builder::Impl& s = v.valid() ? v.builder().impl() : current_builder(op).impl();
  s.check_usable(v, op);
  return s;
}

Value make(Builder::Impl& s, ir::Operation op, const Type& t) {
  return Value(s.self, s.emit(std::move(op), &t));
}

Value unary_op(OpKind k, const Value& v, const char* name) {
  Builder::Impl& s = impl_of(v, name);
  ir::Operation op(k);
  op.operands = {v.id()};
  return make(s, std::move(op), v.type());
}

// The dtype two operands meet at (u8 meets anything as i32, even another u8).
DType promote(DType a, DType b) {
  if (a == DType::u8) a = DType::i32;
  if (b == DType::u8) b = DType::i32;
  if (a == b) return a;
  if (is_float(a) && is_float(b)) {
    if (a == DType::f64 || b == DType::f64) return DType::f64;
    return DType::f32;  // f32 with anything smaller, and f16 with bf16
  }
  if (is_float(a)) return a;
  if (is_float(b)) return b;
  if (a == DType::i64 || b == DType::i64) return DType::i64;
  return DType::i32;
}

std::string shape_str(const Shape& s) { return ir::shape_string(s); }

// numpy broadcasting of two shapes (right-aligned).
bool broadcast_shapes(const Shape& a, const Shape& b, Shape& out) {
  const size_t r = std::max(a.size(), b.size());
  out.assign(r, 1);
  for (size_t i = 0; i < r; ++i) {
    const int64_t x = i < r - a.size() ? 1 : a[i - (r - a.size())];
    const int64_t y = i < r - b.size() ? 1 : b[i - (r - b.size())];
    if (x != y && x != 1 && y != 1) return false;
    out[i] = std::max(x, y);
  }
  return true;
}

Value splat(Builder::Impl& s, const Value& v, const Shape& shape) {
  ir::Operation op(OpKind::Splat);
  op.operands = {v.id()};
  return make(s, std::move(op), Type{v.dtype(), shape});
}

// Expands and broadcasts `v` to `shape` (which must be reachable).
Value to_shape(Builder::Impl& s, Value v, const Shape& shape, const char* opname) {
  if (v.shape() == shape) return v;
  if (v.is_scalar()) return splat(s, v, shape);
  if (v.shape().size() > shape.size())
    s.fail(opname, "cannot broadcast " + shape_str(v.shape()) + " to " + shape_str(shape));
  while (v.shape().size() < shape.size()) v = expand_dims(v, 0);
  for (size_t i = 0; i < shape.size(); ++i)
    if (v.shape()[i] != shape[i] && v.shape()[i] != 1)
      s.fail(opname, "cannot broadcast " + shape_str(v.shape()) + " to " + shape_str(shape));
  ir::Operation op(OpKind::Broadcast);
  op.operands = {v.id()};
  return make(s, std::move(op), Type{v.dtype(), shape});
}

Value constant_in(Builder::Impl& s, double value, DType t) {
  ir::Operation op(OpKind::Constant);
  if (is_float(t)) {
    op.attrs.fvalue = value;
  } else if (t == DType::i1) {
    op.attrs.ivalue = value != 0.0;
  } else {
    if (value != std::floor(value))
      s.fail("const", "value " + std::to_string(value) + " is not an integer but the dtype is " +
                          dtype_name(t));
    // It must fit the dtype: a wrapped constant is a silent wrong answer (and an f64 past
    // the i64 range has no integer value at all).
    const double lo = t == DType::u8 ? 0.0 : t == DType::i32 ? double(INT32_MIN) : -9223372036854775808.0;
    const double hi = t == DType::u8 ? 256.0 : t == DType::i32 ? double(INT32_MAX) + 1.0 : 9223372036854775808.0;
    if (!(value >= lo && value < hi)) {
      char text[40];
      std::snprintf(text, sizeof text, "%.17g", value);
      s.fail("const", std::string("the value ") + text + " does not fit " + dtype_name(t));
    }
    op.attrs.ivalue = int64_t(value);
  }
  return make(s, std::move(op), Type{t, {}});
}

const char* binop_name(BinOp op) {
  switch (op) {
    case BinOp::add: return "add";
    case BinOp::sub: return "sub";
    case BinOp::mul: return "mul";
    case BinOp::div: return "div";
    case BinOp::rem: return "rem";
    case BinOp::min: return "minimum";
    case BinOp::max: return "maximum";
    case BinOp::band: return "and";
    case BinOp::bor: return "or";
    case BinOp::bxor: return "xor";
    case BinOp::shl: return "shl";
    case BinOp::shr: return "shr";
    case BinOp::lt: return "lt";
    case BinOp::le: return "le";
    case BinOp::gt: return "gt";
    case BinOp::ge: return "ge";
    case BinOp::eq: return "eq";
    case BinOp::ne: return "ne";
  }
  return "?";
}

OpKind binop_kind(BinOp op) {
  switch (op) {
    case BinOp::add: return OpKind::Add;
    case BinOp::sub: return OpKind::Sub;
    case BinOp::mul: return OpKind::Mul;
    case BinOp::div: return OpKind::Div;
    case BinOp::rem: return OpKind::Rem;
    case BinOp::min: return OpKind::Min;
    case BinOp::max: return OpKind::Max;
    case BinOp::band: return OpKind::And;
    case BinOp::bor: return OpKind::Or;
    case BinOp::bxor: return OpKind::Xor;
    case BinOp::shl: return OpKind::Shl;
    case BinOp::shr: return OpKind::Shr;
    case BinOp::lt: return OpKind::Lt;
    case BinOp::le: return OpKind::Le;
    case BinOp::gt: return OpKind::Gt;
    case BinOp::ge: return OpKind::Ge;
    case BinOp::eq: return OpKind::Eq;
    case BinOp::ne: return OpKind::Ne;
  }
  return OpKind::Add;
}

bool is_bitwise(BinOp op) {
  return op == BinOp::band || op == BinOp::bor || op == BinOp::bxor || op == BinOp::shl ||
         op == BinOp::shr;
}

Value binary_same_builder(Builder::Impl& s, BinOp bop, Value a, Value b) {
  const char* name = binop_name(bop);
  const DType t = promote(a.dtype(), b.dtype());
  // Two i1 tiles meet as i1: logic (&, |, ^) and comparisons only; arithmetic on truth
  // values has no one meaning (true + true), so it is asked for through a cast.
  const bool arithmetic = bop == BinOp::add || bop == BinOp::sub || bop == BinOp::mul || bop == BinOp::div ||
                          bop == BinOp::rem || bop == BinOp::shl || bop == BinOp::shr;
  if (t == DType::i1 && arithmetic)
    s.fail(name, "does not apply to two i1 tiles; cast them to i32 first (.to(DType::i32))");
  if (is_bitwise(bop) && !is_int(t))
    s.fail(name, std::string("applies to integer tiles, got ") + ir::to_string(a.type()) +
                     " and " + ir::to_string(b.type()));
  Shape shape;
  if (!broadcast_shapes(a.shape(), b.shape(), shape))
    s.fail(name, "shapes " + shape_str(a.shape()) + " and " + shape_str(b.shape()) +
                     " do not broadcast");
  a = to_shape(s, cast(a, t), shape, name);
  b = to_shape(s, cast(b, t), shape, name);
  ir::Operation op(binop_kind(bop));
  op.operands = {a.id(), b.id()};
  const DType rt = ir::is_comparison(binop_kind(bop)) ? DType::i1 : t;
  return make(s, std::move(op), Type{rt, shape});
}

// The dtype a literal takes next to a tile of dtype `other` (literals are "weak").
DType literal_dtype(DType other, double value, bool is_integral) {
  if (!is_integral || value != std::floor(value)) return is_float(other) ? other : DType::f32;
  if (other == DType::i1 || other == DType::u8) return DType::i32;
  return other;
}

int normalize_axis(Builder::Impl& s, const char* op, int axis, int rank) {
  const int a = axis < 0 ? axis + rank : axis;
  if (a < 0 || a >= rank)
    s.fail(op, "axis " + std::to_string(axis) + " is out of range for a rank-" +
                   std::to_string(rank) + " tile");
  return a;
}

Value reduce(OpKind k, const char* name, const Value& v, int axis) {
  Builder::Impl& s = impl_of(v, name);
  if (v.is_scalar()) s.fail(name, "cannot reduce a scalar");
  if (v.dtype() == DType::i1 || v.dtype() == DType::u8)
    s.fail(name, std::string("cannot reduce an ") + dtype_name(v.dtype()) + " tile; cast it to i32 first");
  const int a = normalize_axis(s, name, axis, int(v.shape().size()));
  Shape out = v.shape();
  out.erase(out.begin() + a);
  ir::Operation op(k);
  op.operands = {v.id()};
  op.attrs.axis = a;
  return make(s, std::move(op), Type{v.dtype(), out});
}

Value index_value(Builder::Impl& s, const Value& v, const char* op, size_t i) {
  s.check_usable(v, op);
  if (v.dtype() != DType::i32 && v.dtype() != DType::i64)
    s.fail(op, "index " + std::to_string(i) + " must be an i32 or i64 tile, got " +
                   ir::to_string(v.type()));
  return v;
}

// Broadcasts indices, mask and (for stores) the value to one access shape.
struct Access {
  std::vector<Value> idx;
  Value mask;
  Shape shape;
};

Access make_access(Builder::Impl& s, const char* opname, const Tensor& t,
                   const std::vector<Value>& idx, const Value& mask, const Value* value) {
  if (&t.builder().impl() != &s) s.fail(opname, "the tensor belongs to another kernel's trace");
  if (int(idx.size()) != t.rank())
    s.fail(opname, "tensor '" + s.fn.params[size_t(t.param())].name + "' has rank " +
                       std::to_string(t.rank()) + " but " + std::to_string(idx.size()) +
                       " indices were given");
  Shape shape;
  auto meet = [&](const Value& v, const std::string& what) {
    Shape out;
    if (!broadcast_shapes(shape, v.shape(), out))
      s.fail(opname, what + " of shape " + shape_str(v.shape()) +
                         " does not broadcast with the access shape " + shape_str(shape));
    shape = out;
  };
  for (size_t i = 0; i < idx.size(); ++i)
    meet(index_value(s, idx[i], opname, i), "index " + std::to_string(i));
  if (mask.valid()) {
    s.check_usable(mask, opname);
    if (mask.dtype() != DType::i1)
      s.fail(opname, "mask must be an i1 tile (a comparison), got " + ir::to_string(mask.type()));
    meet(mask, "mask");
  }
  if (value) meet(*value, "value");
  Access a;
  a.shape = shape;
  for (const Value& v : idx) a.idx.push_back(to_shape(s, v, shape, opname));
  if (mask.valid()) a.mask = to_shape(s, mask, shape, opname);
  return a;
}

Value store_like(OpKind k, const char* opname, const Tensor& t, const std::vector<Value>& idx,
                 const Value& value, const Value& mask, bool acq_rel, Evict evict = Evict::normal,
                 bool cluster_sum = false) {
  Builder::Impl& s = t.builder().impl();
  s.check_usable(value, opname);
  const std::string& tname = s.fn.params[size_t(t.param())].name;
  if (value.dtype() != t.dtype())
    s.fail(opname, "tensor '" + tname + "' holds " + dtype_name(t.dtype()) + " but the value is " +
                       ir::to_string(value.type()) + "; cast it first with .to(DType::" +
                       dtype_name(t.dtype()) + ")");
  if (k == OpKind::AtomicAdd && (t.dtype() == DType::i1 || t.dtype() == DType::u8))
    s.fail(opname, std::string("atomic_add does not apply to ") + dtype_name(t.dtype()) + " tensors");
  if (cluster_sum && t.dtype() != DType::f32)
    s.fail(opname, "tensor '" + tname + "' holds " + dtype_name(t.dtype()) +
                       "; cluster_atomic_add adds into f32 tensors (accumulate there, then convert)");
  Access a = make_access(s, opname, t, idx, mask, &value);
  if (cluster_sum && a.shape.empty())
    s.fail(opname, "the indices are scalars; cluster_atomic_add adds tiles (use atomic_add for one element)");
  Value v = to_shape(s, value, a.shape, opname);
  ir::Operation op(k);
  op.attrs.param = t.param();
  op.attrs.acq_rel = acq_rel;
  op.attrs.cluster_sum = cluster_sum;
  op.attrs.evict = uint8_t(evict);
  for (const Value& i : a.idx) op.operands.push_back(i.id());
  op.operands.push_back(v.id());
  if (a.mask.valid()) {
    op.operands.push_back(a.mask.id());
    op.attrs.has_mask = true;
  }
  if (k == OpKind::Store || cluster_sum) {
    s.emit(std::move(op), nullptr);
    return Value();
  }
  const Type rt{t.dtype(), a.shape};
  return make(s, std::move(op), rt);
}

Value scalar_int(Builder::Impl& s, const Value& v, const char* opname, const char* what) {
  s.check_usable(v, opname);
  if (!v.is_scalar() || !is_int(v.dtype()) || v.dtype() == DType::i1)
    s.fail(opname, std::string(what) + " must be an integer scalar, got " + ir::to_string(v.type()));
  return v;
}

}  // namespace

// ---------------------------------------------------------------- Value

Value::Value(Builder* b, ir::ValueId id) : b_(b), trace_(b ? b->trace_serial() : 0), id_(id) {}

// A Value or Tensor is used only in the trace that made it, while that trace runs on this
// thread: one kept from an ended trace points at a Builder that is gone (or at another
// trace's, at the same address), so its pointer is compared, never followed, until then.
static Builder& live_builder(Builder* b, uint64_t trace, const char* what) {
  if (!b) throw DefinitionError(std::string("an empty ") + what + " (default-constructed) was used");
  Builder* now = tracing_builder();
  if (!now || now != b || now->trace_serial() != trace) {
    std::string msg = std::string("a ") + what + " from another kernel's trace (or from a trace that has ended) was used";
    if (now) msg = "kernel '" + now->kernel_name() + "': " + msg;
    throw DefinitionError(msg + "; make each " + what + " inside the body that uses it");
  }
  return *b;
}

Builder& Value::builder() const { return live_builder(b_, trace_, "Value"); }
const Type& Value::type() const { return builder().impl().type(id_); }

Value Value::operator[](std::initializer_list<Axis> axes) const {
  Builder::Impl& s = impl_of(*this, "index");
  int kept = 0;
  for (Axis a : axes) kept += a == Axis::all;
  if (kept != int(shape().size()))
    s.fail("index", "x[{...}] must name each of the " + std::to_string(shape().size()) +
                        " dimensions with _ (and add dimensions with newaxis)");
  Value v = *this;
  int pos = 0;
  for (Axis a : axes) {
    if (a == Axis::newaxis) v = expand_dims(v, pos);
    ++pos;
  }
  return v;
}

Value Value::col() const { return expand_dims(*this, 1); }
Value Value::row() const { return expand_dims(*this, 0); }
Value Value::to(DType t) const { return cast(*this, t); }

Tensor::Tensor(Builder* b, int param, int rank, DType dtype)
    : b_(b), trace_(b ? b->trace_serial() : 0), param_(param), rank_(rank), dtype_(dtype) {}

Builder& Tensor::builder() const { return live_builder(b_, trace_, "Tensor"); }

// A size or stride of a tensor argument: one value per (tensor, dimension),
// defined in the function's top block so that every loop body can use it.
static Value tensor_property(Builder& b, OpKind kind, int param, int rank, int d,
                             std::map<std::pair<int, int>, ir::ValueId>& cache) {
  Builder::Impl& s = b.impl();
  const char* name = kind == OpKind::TensorDim ? "dim" : "stride";
  if (d < 0 || d >= rank) s.fail(name, "dimension " + std::to_string(d) + " is out of range");
  const auto key = std::make_pair(param, d);
  if (auto it = cache.find(key); it != cache.end()) return Value(&b, it->second);
  ir::Operation op(kind);
  op.attrs.param = param;
  op.attrs.axis = d;
  std::vector<ir::Block*> saved = s.blocks;
  s.blocks.resize(1);
  const Type t{kind == OpKind::TensorDim ? DType::i32 : DType::i64, {}};
  Value v = make(s, std::move(op), t);
  s.blocks = saved;
  cache[key] = v.id();
  return v;
}

Value Tensor::dim(int d) const {
  return tensor_property(builder(), OpKind::TensorDim, param_, rank_, d, builder().impl().dims);
}

Value Tensor::stride(int d) const {
  return tensor_property(builder(), OpKind::TensorStride, param_, rank_, d, builder().impl().strides);
}

// ---------------------------------------------------------------- free functions

Value program_id(int axis) {
  Builder::Impl& s = current_builder("program_id").impl();
  if (axis < 0 || axis > 2) s.fail("program_id", "axis must be 0, 1 or 2");
  ir::Operation op(OpKind::ProgramId);
  op.attrs.axis = axis;
  return make(s, std::move(op), Type{DType::i32, {}});
}

Value num_programs(int axis) {
  Builder::Impl& s = current_builder("num_programs").impl();
  if (axis < 0 || axis > 2) s.fail("num_programs", "axis must be 0, 1 or 2");
  ir::Operation op(OpKind::NumPrograms);
  op.attrs.axis = axis;
  return make(s, std::move(op), Type{DType::i32, {}});
}

Value arange(int64_t start, int64_t end) {
  Builder::Impl& s = current_builder("arange").impl();
  const int64_t n = end - start;
  if (!is_pow2(n))
    s.fail("arange", "arange(" + std::to_string(start) + ", " + std::to_string(end) +
                         ") has length " + std::to_string(n) +
                         "; tile lengths must be powers of two (pad the tile and mask the tail)");
  if (n > (int64_t(1) << 20)) s.fail("arange", "tile length " + std::to_string(n) + " is too large");
  if (start < INT32_MIN || end - 1 > INT32_MAX)
    s.fail("arange", "arange(" + std::to_string(start) + ", " + std::to_string(end) +
                         ") holds values outside i32 (arange is an i32 tile; add an i64 offset instead)");
  ir::Operation op(OpKind::Arange);
  op.attrs.start = start;
  op.attrs.end = end;
  return make(s, std::move(op), Type{DType::i32, {n}});
}

Value constant(double value, DType dtype) {
  return constant_in(current_builder("const").impl(), value, dtype);
}

Value full(const Shape& shape, double value, DType dtype) {
  Builder::Impl& s = current_builder("full").impl();
  for (int64_t d : shape)
    if (!is_pow2(d))
      s.fail("full", "shape " + shape_str(shape) + " has a dimension that is not a power of two");
  Value c = constant_in(s, value, dtype);
  return shape.empty() ? c : splat(s, c, shape);
}

Value literal(int64_t v) {
  Builder::Impl& s = current_builder("literal").impl();
  const bool fits32 = v >= INT32_MIN && v <= INT32_MAX;
  return constant_in(s, double(v), fits32 ? DType::i32 : DType::i64);
}

Value literal(double v) { return constant_in(current_builder("literal").impl(), v, DType::f32); }

Value cast(const Value& v, DType t) {
  Builder::Impl& s = impl_of(v, "cast");
  if (v.dtype() == t) return v;
  ir::Operation op(OpKind::Cast);
  op.operands = {v.id()};
  return make(s, std::move(op), Type{t, v.shape()});
}

Value binary(BinOp bop, const Value& a, const Value& b) {
  Builder::Impl& s = impl_of(a, binop_name(bop));
  s.check_usable(b, binop_name(bop));
  return binary_same_builder(s, bop, a, b);
}

// An integer literal beside an i32 tile must fit i32: it would wrap silently.
void expect_literal_fits(Builder::Impl& s, BinOp bop, DType t, double value) {
  if (t == DType::i32 && (value < double(INT32_MIN) || value > double(INT32_MAX)))
    s.fail(binop_name(bop), "the integer literal " + std::to_string(int64_t(value)) +
                                " does not fit the i32 tile beside it; cast the tile to i64 first "
                                "(.to(DType::i64))");
}

Value binary(BinOp bop, const Value& a, double b, bool b_is_int) {
  Builder::Impl& s = impl_of(a, binop_name(bop));
  const DType t = literal_dtype(a.dtype(), b, b_is_int);
  expect_literal_fits(s, bop, t, b);
  return binary_same_builder(s, bop, a, constant_in(s, b, t));
}

Value binary(BinOp bop, double a, bool a_is_int, const Value& b) {
  Builder::Impl& s = impl_of(b, binop_name(bop));
  const DType t = literal_dtype(b.dtype(), a, a_is_int);
  expect_literal_fits(s, bop, t, a);
  return binary_same_builder(s, bop, constant_in(s, a, t), b);
}

Value operator-(const Value& v) {
  if (v.dtype() == DType::i1 || v.dtype() == DType::u8)
    impl_of(v, "neg").fail("neg", std::string("cannot negate an ") + dtype_name(v.dtype()) +
                                      " tile; cast it to i32 first");
  return unary_op(OpKind::Neg, v, "neg");
}

Value operator!(const Value& v) {
  Builder::Impl& s = impl_of(v, "not");
  if (v.dtype() != DType::i1) s.fail("not", "logical not applies to i1 tiles; use ~ for integers");
  return unary_op(OpKind::Not, v, "not");
}

Value operator~(const Value& v) {
  Builder::Impl& s = impl_of(v, "not");
  if (!is_int(v.dtype()))
    s.fail("not", "bitwise not applies to integer tiles" +
                      std::string(v.dtype() == DType::u8 ? "; cast the u8 tile to i32 first" : ""));
  return unary_op(OpKind::Not, v, "not");
}

namespace {
Value float_unary(OpKind k, const Value& v, const char* name) {
  Builder::Impl& s = impl_of(v, name);
  if (!is_float(v.dtype()))
    s.fail(name, std::string("applies to float tiles, got ") + ir::to_string(v.type()) +
                     "; cast first");
  return unary_op(k, v, name);
}
}  // namespace

Value sqrt(const Value& v) { return float_unary(OpKind::Sqrt, v, "sqrt"); }
Value rsqrt(const Value& v) { return float_unary(OpKind::Rsqrt, v, "rsqrt"); }
Value exp(const Value& v) { return float_unary(OpKind::Exp, v, "exp"); }
Value log(const Value& v) { return float_unary(OpKind::Log, v, "log"); }
Value abs(const Value& v) {
  if (v.dtype() == DType::i1 || v.dtype() == DType::u8)
    impl_of(v, "abs").fail("abs", std::string("does not apply to ") + dtype_name(v.dtype()) + " tiles");
  return unary_op(OpKind::Abs, v, "abs");
}
Value maximum(const Value& a, const Value& b) { return binary(BinOp::max, a, b); }
Value minimum(const Value& a, const Value& b) { return binary(BinOp::min, a, b); }

Value cdiv(const Value& a, const Value& b) {
  Builder::Impl& s = impl_of(a, "cdiv");
  if (!is_int(a.dtype()) || !is_int(b.dtype())) s.fail("cdiv", "applies to integers");
  return (a + b - 1) / b;
}

Value where(const Value& cond, const Value& a, const Value& b) {
  Builder::Impl& s = impl_of(cond, "where");
  s.check_usable(a, "where");
  s.check_usable(b, "where");
  if (cond.dtype() != DType::i1)
    s.fail("where", "condition must be an i1 tile, got " + ir::to_string(cond.type()));
  const DType t = promote(a.dtype(), b.dtype());
  Shape shape;
  if (!broadcast_shapes(cond.shape(), a.shape(), shape) ||
      !broadcast_shapes(Shape(shape), b.shape(), shape))
    s.fail("where", "shapes " + shape_str(cond.shape()) + ", " + shape_str(a.shape()) + " and " +
                        shape_str(b.shape()) + " do not broadcast");
  Value c = to_shape(s, cond, shape, "where");
  Value x = to_shape(s, cast(a, t), shape, "where");
  Value y = to_shape(s, cast(b, t), shape, "where");
  ir::Operation op(OpKind::Select);
  op.operands = {c.id(), x.id(), y.id()};
  return make(s, std::move(op), Type{t, shape});
}

// A literal beside a tile in where() takes the tile's dtype as it would in arithmetic: an
// integer literal beside an i32 tile stays i32 (it made the result f32, losing precision).
Value where(const Value& cond, const Value& a, double b, bool b_is_int) {
  Builder::Impl& s = impl_of(a, "where");
  const DType t = literal_dtype(a.dtype(), b, b_is_int);
  return where(cond, a, constant_in(s, b, t));
}

Value where(const Value& cond, double a, bool a_is_int, const Value& b) {
  Builder::Impl& s = impl_of(b, "where");
  const DType t = literal_dtype(b.dtype(), a, a_is_int);
  return where(cond, constant_in(s, a, t), b);
}

Value expand_dims(const Value& v, int axis) {
  Builder::Impl& s = impl_of(v, "expand_dims");
  const int rank = int(v.shape().size());
  const int a = axis < 0 ? axis + rank + 1 : axis;
  if (a < 0 || a > rank)
    s.fail("expand_dims", "axis " + std::to_string(axis) + " is out of range for rank " +
                              std::to_string(rank));
  Shape out = v.shape();
  out.insert(out.begin() + a, 1);
  ir::Operation op(OpKind::ExpandDims);
  op.operands = {v.id()};
  op.attrs.axis = a;
  return make(s, std::move(op), Type{v.dtype(), out});
}

Value broadcast_to(const Value& v, const Shape& shape) {
  Builder::Impl& s = impl_of(v, "broadcast");
  for (int64_t d : shape)
    if (!is_pow2(d))
      s.fail("broadcast", "shape " + shape_str(shape) + " has a dimension that is not a power of two");
  return to_shape(s, v, shape, "broadcast");
}

Value trans(const Value& v) {
  Builder::Impl& s = impl_of(v, "trans");
  if (v.shape().size() != 2) s.fail("trans", "transposes rank-2 tiles, got " + ir::to_string(v.type()));
  ir::Operation op(OpKind::Transpose);
  op.operands = {v.id()};
  return make(s, std::move(op), Type{v.dtype(), {v.shape()[1], v.shape()[0]}});
}

Value interleave(const Value& a, const Value& b) {
  Builder::Impl& s = impl_of(a, "interleave");
  s.check_usable(b, "interleave");
  Shape shape;
  if (!broadcast_shapes(a.shape(), b.shape(), shape))
    s.fail("interleave", "shapes " + shape_str(a.shape()) + " and " + shape_str(b.shape()) + " do not broadcast");
  if (shape.empty()) s.fail("interleave", "takes tiles, got two scalars");
  const DType t = promote(a.dtype(), b.dtype());
  Value x = to_shape(s, cast(a, t), shape, "interleave");
  Value y = to_shape(s, cast(b, t), shape, "interleave");
  ir::Operation op(OpKind::Interleave);
  op.operands = {x.id(), y.id()};
  Shape out = shape;
  out.back() *= 2;
  return make(s, std::move(op), Type{t, out});
}

Value gather(const Value& src, const Value& index) {
  Builder::Impl& s = impl_of(src, "gather");
  s.check_usable(index, "gather");
  if (src.shape().size() != 1)
    s.fail("gather", "looks up in a rank-1 tile, got " + ir::to_string(src.type()));
  if (src.shape()[0] > 32)
    s.fail("gather", "looks up in at most 32 elements, got " + ir::to_string(src.type()) +
                         " (load larger tables with load() and computed indices)");
  if (index.shape().empty())
    s.fail("gather", "the index must be a tile, got the scalar " + ir::to_string(index.type()));
  const DType it = index.dtype();
  if (it != DType::i32 && it != DType::i64 && it != DType::u8)
    s.fail("gather", "the index must be an integer tile (i32, i64 or u8), got " + ir::to_string(index.type()));
  ir::Operation op(OpKind::Gather);
  op.operands = {src.id(), index.id()};
  return make(s, std::move(op), Type{src.dtype(), index.shape()});
}

Value sum(const Value& v, int axis) { return reduce(OpKind::ReduceSum, "sum", v, axis); }
Value max(const Value& v, int axis) { return reduce(OpKind::ReduceMax, "max", v, axis); }
Value min(const Value& v, int axis) { return reduce(OpKind::ReduceMin, "min", v, axis); }

Value dot(const Value& a, const Value& b, const Value& acc) { return dot(a, b, acc, 0); }

Value dot(const Value& a, const Value& b, const Value& acc, int64_t warps_n) {
  return dot(a, b, acc, warps_n, DotPrecision::ieee);
}

Value dot(const Value& a, const Value& b, const Value& acc, int64_t warps_n, DotPrecision precision) {
  Builder::Impl& s = impl_of(a, "dot");
  if (precision != DotPrecision::ieee && precision != DotPrecision::tf32)
    s.fail("dot", "precision must be DotPrecision::ieee or DotPrecision::tf32");
  if (warps_n < 0 || warps_n > 32 || (warps_n & (warps_n - 1)) != 0)
    s.fail("dot", "warps_n must be 0 (kerf chooses) or a power of two up to 32, got " +
                      std::to_string(warps_n));
  s.check_usable(b, "dot");
  if (a.shape().size() != 2 || b.shape().size() != 2)
    s.fail("dot", "takes two rank-2 tiles, got " + ir::to_string(a.type()) + " and " +
                      ir::to_string(b.type()));
  if (a.shape()[1] != b.shape()[0])
    s.fail("dot", "inner dimensions differ: " + ir::to_string(a.type()) + " @ " +
                      ir::to_string(b.type()) + " (K=" + std::to_string(a.shape()[1]) + " vs " +
                      std::to_string(b.shape()[0]) + ")");
  if (!is_float(a.dtype()) || !is_float(b.dtype()))
    s.fail("dot", "operands must be float tiles, got " + ir::to_string(a.type()) + " and " +
                      ir::to_string(b.type()));
  if (a.dtype() != b.dtype())
    s.fail("dot", std::string("operands must share a dtype, got ") + dtype_name(a.dtype()) +
                      " and " + dtype_name(b.dtype()) + "; cast one of them");
  if (precision == DotPrecision::tf32 && a.dtype() != DType::f32)
    s.fail("dot", std::string("tf32 precision takes f32 operands, got ") + dtype_name(a.dtype()) +
                      " (bf16/f16 operands are on the tensor cores already)");
  const Type out{DType::f32, {a.shape()[0], b.shape()[1]}};
  ir::Operation op(OpKind::Dot);
  op.operands = {a.id(), b.id()};
  op.attrs.axis = warps_n;
  op.attrs.tf32 = precision == DotPrecision::tf32;
  if (acc.valid()) {
    s.check_usable(acc, "dot");
    if (acc.type() != out)
      s.fail("dot", "accumulator must be " + ir::to_string(out) + ", got " +
                        ir::to_string(acc.type()));
    op.operands.push_back(acc.id());
  }
  return make(s, std::move(op), out);
}

Value dot(const Value& a, const Value& b) { return dot(a, b, Value(), 0); }

Value load(const Tensor& t, const std::vector<Value>& idx, const Value& mask, const Value& other) {
  return load(t, idx, mask, other, Evict::normal);
}

namespace {
Value load_op(const char* opname, const Tensor& t, const std::vector<Value>& idx, const Value& mask,
              const Value& other, Evict evict, bool cluster_share) {
  Builder::Impl& s = t.builder().impl();
  Access a = make_access(s, opname, t, idx, mask, nullptr);
  if (cluster_share && a.shape.empty())
    s.fail(opname, "the indices are scalars; cluster_load reads tiles (use load for one element)");
  ir::Operation op(OpKind::Load);
  op.attrs.param = t.param();
  op.attrs.evict = uint8_t(evict);
  op.attrs.cluster_share = cluster_share;
  for (const Value& i : a.idx) op.operands.push_back(i.id());
  if (a.mask.valid()) {
    op.operands.push_back(a.mask.id());
    op.attrs.has_mask = true;
  }
  if (other.valid()) {
    s.check_usable(other, opname);
    if (!a.mask.valid()) s.fail(opname, "'other' needs a mask");
    Value o = to_shape(s, cast(other, t.dtype()), a.shape, opname);
    op.operands.push_back(o.id());
    op.attrs.has_other = true;
  }
  return make(s, std::move(op), Type{t.dtype(), a.shape});
}
}  // namespace

Value load(const Tensor& t, const std::vector<Value>& idx, const Value& mask, const Value& other, Evict evict) {
  return load_op("load", t, idx, mask, other, evict, false);
}

Value cluster_load(const Tensor& t, const std::vector<Value>& idx, const Value& last, const Value& mask) {
  Builder::Impl& s = t.builder().impl();
  scalar_int(s, last, "cluster_load", "the last index (the cluster's base plus the program's rank)");
  std::vector<Value> all = idx;
  all.push_back(last);
  t.builder().meta("cluster_size", 1);  // part of the specialization: the codegen reads it
  return load_op("cluster_load", t, all, mask, Value(), Evict::normal, true);
}

Value load(const Tensor& t, const std::vector<Value>& idx, const Value& mask, double other) {
  Builder::Impl& s = t.builder().impl();
  if (other == 0.0 && !std::signbit(other)) return load(t, idx, mask, Value());  // -0.0 is kept
  return load(t, idx, mask, constant_in(s, other, t.dtype()));
}

void store(const Tensor& t, const std::vector<Value>& idx, const Value& value, const Value& mask) {
  store_like(OpKind::Store, "store", t, idx, value, mask, false);
}

Value load(const Tensor& t, const std::vector<Value>& idx, const Value& mask, Evict evict) {
  return load(t, idx, mask, Value(), evict);
}

void store(const Tensor& t, const std::vector<Value>& idx, const Value& value, const Value& mask, Evict evict) {
  store_like(OpKind::Store, "store", t, idx, value, mask, false, evict);
}

Value atomic_add(const Tensor& t, const std::vector<Value>& idx, const Value& value, const Value& mask,
                 MemoryOrder order) {
  return store_like(OpKind::AtomicAdd, "atomic_add", t, idx, value, mask, order == MemoryOrder::acq_rel);
}

void cluster_atomic_add(const Tensor& t, const std::vector<Value>& idx, const Value& value, const Value& mask) {
  t.builder().meta("cluster_size", 1);  // part of the specialization: the codegen reads it
  store_like(OpKind::AtomicAdd, "cluster_atomic_add", t, idx, value, mask, false, Evict::normal, true);
}

void l2_evict_normal(const Tensor& t, const std::vector<Value>& idx, const Value& mask) {
  Builder::Impl& s = t.builder().impl();
  const Access a = make_access(s, "l2_evict_normal", t, idx, mask, nullptr);
  if (a.shape.empty()) s.fail("l2_evict_normal", "the indices are scalars; give tiles of indices");
  ir::Operation op(OpKind::L2EvictNormal);
  op.attrs.param = t.param();
  for (const Value& i : a.idx) op.operands.push_back(i.id());
  if (a.mask.valid()) {
    op.operands.push_back(a.mask.id());
    op.attrs.has_mask = true;
  }
  s.emit(std::move(op), nullptr);
}

void wait_prior_grid() {
  current_builder("wait_prior_grid").impl().emit(ir::Operation(OpKind::GridWait), nullptr);
}

namespace {

// part: ir::kGridSyncWhole, kGridArrive or kGridAwait (ir.h, OpKind::GridSync).
void emit_grid_barrier(const Tensor& counter, int64_t part) {
  Builder::Impl& s = counter.builder().impl();
  ir::Operation op(OpKind::GridSync);
  op.attrs.param = counter.param();
  op.attrs.axis = part;
  if (counter.dtype() != DType::i32)
    s.fail(ir::grid_barrier_name(op), "the counter must be an i32 tensor, got " + std::string(dtype_name(counter.dtype())));
  s.emit(std::move(op), nullptr);
}

}  // namespace

void grid_sync(const Tensor& counter) { emit_grid_barrier(counter, ir::kGridSyncWhole); }
void grid_arrive(const Tensor& counter) { emit_grid_barrier(counter, ir::kGridArrive); }
void grid_await(const Tensor& counter) { emit_grid_barrier(counter, ir::kGridAwait); }

void release_dependents() {
  current_builder("release_dependents").impl().emit(ir::Operation(OpKind::GridRelease), nullptr);
}

Value IntArg::value() const {
  if (!is_constant_) return value_;
  return literal(constant_);
}

std::vector<Value> for_range(IntArg lo, IntArg hi, IntArg step, const std::vector<Value>& init,
                             const LoopBody& body) {
  Builder::Impl& s = current_builder("for").impl();
  Value l = scalar_int(s, lo.value(), "for", "the lower bound");
  Value h = scalar_int(s, hi.value(), "for", "the upper bound");
  Value st = scalar_int(s, step.value(), "for", "the step");
  // The counter is i64 when a bound or the step is (never narrowed), else i32. Constant
  // bounds are i64 literals only when they do not fit i32.
  const DType iv_t = (l.dtype() == DType::i64 || h.dtype() == DType::i64 || st.dtype() == DType::i64)
                         ? DType::i64
                         : DType::i32;
  l = cast(l, iv_t);
  h = cast(h, iv_t);
  st = cast(st, iv_t);
  for (const Value& v : init) s.check_usable(v, "for");

  ir::Operation op(OpKind::For);
  op.operands = {l.id(), h.id(), st.id()};
  for (const Value& v : init) op.operands.push_back(v.id());
  op.body = std::make_unique<ir::Block>();
  ir::Block* body_block = op.body.get();

  auto new_arg = [&](const Type& t) {
    const ir::ValueId id = s.fn.new_value(t);
    s.defined_in.push_back(body_block);
    body_block->args.push_back(id);
    return Value(s.self, id);
  };
  const Value iv = new_arg(Type{iv_t, {}});
  std::vector<Value> carried;
  for (const Value& v : init) carried.push_back(new_arg(v.type()));

  s.blocks.push_back(body_block);
  std::vector<Value> next;
  try {
    next = body(iv, carried);
  } catch (...) {
    s.blocks.pop_back();
    throw;
  }
  ir::Operation y(OpKind::Yield);
  // Whatever is refused here, the body's block (owned by `op`, gone with it) leaves the
  // builder's stack first: a caller catching the error goes on tracing in the outer block.
  try {
    if (next.size() != init.size())
      s.fail("for", "the body returns " + std::to_string(next.size()) + " values but " +
                        std::to_string(init.size()) + " are carried");
    for (size_t i = 0; i < next.size(); ++i) {
      s.check_usable(next[i], "for");
      if (next[i].type() != init[i].type())
        s.fail("for", "carried value " + std::to_string(i) + " enters the loop as " +
                          ir::to_string(init[i].type()) + " but the body returns " +
                          ir::to_string(next[i].type()));
      y.operands.push_back(next[i].id());
    }
  } catch (...) {
    s.blocks.pop_back();
    throw;
  }
  s.emit(std::move(y), nullptr);
  s.blocks.pop_back();

  std::vector<Value> results;
  for (const Value& v : init) {
    const ir::ValueId id = s.fn.new_value(v.type());
    s.defined_in.push_back(s.blocks.back());
    op.results.push_back(id);
    results.emplace_back(s.self, id);
  }
  s.blocks.back()->ops.push_back(std::move(op));
  return results;
}

Value for_range(IntArg lo, IntArg hi, IntArg step, const Value& init,
                const std::function<Value(const Value&, const Value&)>& body) {
  return for_range(lo, hi, step, std::vector<Value>{init},
                   [&](const Value& iv, const std::vector<Value>& c) {
                     return std::vector<Value>{body(iv, c[0])};
                   })[0];
}

void for_range(IntArg lo, IntArg hi, IntArg step, const std::function<void(const Value&)>& body) {
  for_range(lo, hi, step, std::vector<Value>{},
            [&](const Value& iv, const std::vector<Value>&) {
              body(iv);
              return std::vector<Value>{};
            });
}

}  // namespace kerf::dsl
