// Checks that a Function is well typed and well scoped. The DSL checks user
// mistakes before it builds IR; this verifier guards against bugs in the
// builder and in passes, so its messages speak IR.
#include <set>
#include <string>

#include "kerf/error.h"
#include "kerf/jit/ir.h"

namespace kerf::ir {
namespace {

bool is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

class Verifier {
 public:
  explicit Verifier(const Function& f) : f_(f) {}

  void run() {
    for (size_t i = 0; i < f_.params.size(); ++i) {
      const Param& p = f_.params[i];
      if (p.kind == ParamKind::Tensor && (p.rank < 0 || p.rank > 8))
        fail_plain("parameter @" + p.name + " has unsupported rank " + std::to_string(p.rank));
    }
    for (size_t i = 0; i < f_.types.size(); ++i)
      for (int64_t d : f_.types[i].shape)
        if (!is_pow2(d))
          fail_plain("value %" + std::to_string(i) + " has shape " +
                     shape_string(f_.types[i].shape) +
                     "; tile dimensions must be powers of two");
    std::vector<std::set<ValueId>> scopes(1);
    block(f_.body, scopes, /*in_loop=*/false);
  }

 private:
  [[noreturn]] void fail_plain(const std::string& msg) const {
    throw InternalError("IR verifier, kernel '" + f_.name + "': " + msg);
  }
  [[noreturn]] void fail(const Operation& op, const std::string& msg) const {
    std::string res = op.results.empty() ? "" : " (defining %" + std::to_string(op.results[0]) + ")";
    fail_plain("op '" + std::string(op_name(op.kind)) + "'" + res + ": " + msg);
  }

  const Type& t(ValueId v) const { return f_.type(v); }

  void expect(bool cond, const Operation& op, const std::string& msg) const {
    if (!cond) fail(op, msg);
  }

  bool visible(ValueId v, const std::vector<std::set<ValueId>>& scopes) const {
    for (const auto& s : scopes)
      if (s.count(v)) return true;
    return false;
  }

  void define(ValueId v, std::vector<std::set<ValueId>>& scopes, const Operation* op) {
    if (v < 0 || size_t(v) >= f_.types.size()) {
      if (op) fail(*op, "result id out of range");
      fail_plain("block argument id out of range");
    }
    if (!defined_.insert(v).second) {
      if (op) fail(*op, "value %" + std::to_string(v) + " is defined twice");
      fail_plain("value %" + std::to_string(v) + " is defined twice");
    }
    scopes.back().insert(v);
  }

  int64_t grid_sync_counter_ = -1;  // the tensor parameter every grid_sync counts in
  bool unawaited_arrivals_ = false;  // a grid_arrive since the last wait (grid_await or grid_sync)

  const Param& tensor_param(const Operation& op) const {
    expect(op.attrs.param >= 0 && size_t(op.attrs.param) < f_.params.size(), op,
           "parameter index out of range");
    const Param& p = f_.params[size_t(op.attrs.param)];
    expect(p.kind == ParamKind::Tensor, op, "@" + p.name + " is not a tensor");
    return p;
  }

  // The indices of a memory access (operands 0..rank-1): integer tiles of its shape.
  void expect_indices(const Operation& op, size_t rank, const Shape& shape) const {
    for (size_t i = 0; i < rank; ++i) {
      const Type& it = t(op.operands[i]);
      expect((it.dtype == DType::i32 || it.dtype == DType::i64) && it.shape == shape, op,
             "index " + std::to_string(i) + " must be an integer tile of shape " + shape_string(shape));
    }
  }

  void block(const Block& b, std::vector<std::set<ValueId>>& scopes, bool in_loop) {
    for (size_t i = 0; i < b.ops.size(); ++i) {
      const Operation& op = b.ops[i];
      for (ValueId v : op.operands)
        if (v < 0 || size_t(v) >= f_.types.size() || !visible(v, scopes))
          fail(op, "operand %" + std::to_string(v) + " is not defined before its use");
      if (op.kind == OpKind::Yield) {
        expect(in_loop && i + 1 == b.ops.size(), op, "yield must end a loop body");
      }
      if (op.kind == OpKind::GridSync) {
        expect(!in_loop, op, std::string(grid_barrier_name(op)) + " must be at the kernel's top level, not inside a loop");
        expect(grid_sync_counter_ < 0 || grid_sync_counter_ == op.attrs.param, op,
               "every grid_sync, grid_arrive and grid_await of a kernel must count in the same tensor");
        grid_sync_counter_ = op.attrs.param;
        if (op.attrs.axis == kGridAwait)
          expect(unawaited_arrivals_, op, "grid_await needs a grid_arrive before it that nothing has waited for");
        unawaited_arrivals_ = op.attrs.axis == kGridArrive;
      }
      check(op, scopes);
      for (ValueId r : op.results) define(r, scopes, &op);
    }
    if (in_loop && (b.ops.empty() || b.ops.back().kind != OpKind::Yield))
      fail_plain("a loop body does not end with yield");
  }

  void check(const Operation& op, std::vector<std::set<ValueId>>& scopes) {
    const Attrs& a = op.attrs;
    const size_t n = op.operands.size();
    auto result = [&]() -> const Type& {
      expect(op.results.size() == 1, op, "expects exactly one result");
      return t(op.results[0]);
    };
    auto scalar_result = [&](DType d) {
      const Type& r = result();
      expect(r.is_scalar() && r.dtype == d, op,
             "result must be a " + std::string(dtype_name(d)) + " scalar");
    };
    switch (op.kind) {
      case OpKind::Param: {
        expect(a.param >= 0 && size_t(a.param) < f_.params.size(), op, "bad parameter index");
        const Param& p = f_.params[size_t(a.param)];
        expect(p.kind == ParamKind::Scalar, op, "@" + p.name + " is not a scalar parameter");
        scalar_result(p.dtype);
        break;
      }
      case OpKind::Constant: expect(result().is_scalar(), op, "constants are scalars"); break;
      case OpKind::ProgramId:
      case OpKind::NumPrograms:
        expect(a.axis >= 0 && a.axis < 3, op, "grid axis must be 0, 1 or 2");
        scalar_result(DType::i32);
        break;
      case OpKind::Arange: {
        const Type& r = result();
        expect(r.dtype == DType::i32 && r.shape == Shape{a.end - a.start}, op,
               "arange result must be i32[end-start]");
        break;
      }
      case OpKind::TensorDim:
      case OpKind::TensorStride: {
        const Param& p = tensor_param(op);
        expect(a.axis >= 0 && a.axis < p.rank, op, "dimension out of range");
        scalar_result(op.kind == OpKind::TensorDim ? DType::i32 : DType::i64);
        break;
      }
      case OpKind::Splat:
        expect(n == 1 && t(op.operands[0]).is_scalar(), op, "splat takes one scalar");
        expect(result().dtype == t(op.operands[0]).dtype && !result().is_scalar(), op,
               "splat result must be a tile of the operand's dtype");
        break;
      case OpKind::ExpandDims: {
        expect(n == 1, op, "takes one operand");
        Shape s = t(op.operands[0]).shape;
        expect(a.axis >= 0 && a.axis <= int64_t(s.size()), op, "axis out of range");
        s.insert(s.begin() + a.axis, 1);
        expect(result() == Type{t(op.operands[0]).dtype, s}, op, "result shape is wrong");
        break;
      }
      case OpKind::Broadcast: {
        expect(n == 1, op, "takes one operand");
        const Type& in = t(op.operands[0]);
        const Type& r = result();
        expect(in.dtype == r.dtype && in.rank() == r.rank(), op, "rank or dtype differ");
        for (int d = 0; d < r.rank(); ++d)
          expect(in.shape[size_t(d)] == r.shape[size_t(d)] || in.shape[size_t(d)] == 1, op,
                 "cannot broadcast " + shape_string(in.shape) + " to " + shape_string(r.shape));
        break;
      }
      case OpKind::Transpose: {
        expect(n == 1 && t(op.operands[0]).rank() == 2, op, "transposes rank-2 tiles");
        const Type& in = t(op.operands[0]);
        expect(result() == Type{in.dtype, {in.shape[1], in.shape[0]}}, op, "result shape is wrong");
        break;
      }
      case OpKind::Interleave: {
        expect(n == 2 && t(op.operands[0]) == t(op.operands[1]) && !t(op.operands[0]).is_scalar(), op,
               "takes two tiles of one type");
        Shape s = t(op.operands[0]).shape;
        s.back() *= 2;
        expect(result() == Type{t(op.operands[0]).dtype, s}, op, "result must double the last dimension");
        break;
      }
      case OpKind::Select:
        expect(n == 3, op, "takes cond, a, b");
        expect(t(op.operands[0]).dtype == DType::i1 &&
                   t(op.operands[0]).shape == t(op.operands[1]).shape,
               op, "condition must be i1 of the operands' shape");
        expect(t(op.operands[1]) == t(op.operands[2]) && result() == t(op.operands[1]), op,
               "operands and result must share one type");
        break;
      case OpKind::Cast:
        expect(n == 1 && result().shape == t(op.operands[0]).shape, op, "cast keeps the shape");
        break;
      case OpKind::Gather: {
        expect(n == 2, op, "takes src and idx");
        const Type& src = t(op.operands[0]);
        const Type& idx = t(op.operands[1]);
        expect(src.rank() == 1 && src.shape[0] <= 32, op, "gathers from a rank-1 tile of at most 32 elements");
        expect(!idx.is_scalar() && (idx.dtype == DType::i32 || idx.dtype == DType::i64 || idx.dtype == DType::u8),
               op, "the index must be an integer tile");
        expect(result() == Type{src.dtype, idx.shape}, op, "result must have src's dtype and idx's shape");
        break;
      }
      case OpKind::ReduceSum:
      case OpKind::ReduceMax:
      case OpKind::ReduceMin: {
        expect(n == 1, op, "takes one operand");
        const Type& in = t(op.operands[0]);
        expect(a.axis >= 0 && a.axis < in.rank(), op, "axis out of range");
        expect(in.dtype != DType::u8, op, "u8 is a storage type: reduce it after a cast");
        Shape s = in.shape;
        s.erase(s.begin() + a.axis);
        expect(result() == Type{in.dtype, s}, op, "result type is wrong");
        break;
      }
      case OpKind::Dot: {
        expect(n == 2 || n == 3, op, "takes a, b and an optional accumulator");
        const Type& x = t(op.operands[0]);
        const Type& y = t(op.operands[1]);
        expect(x.rank() == 2 && y.rank() == 2 && x.shape[1] == y.shape[0], op,
               "shapes " + shape_string(x.shape) + " and " + shape_string(y.shape) +
                   " do not multiply");
        expect(is_float(x.dtype) && x.dtype == y.dtype, op, "operands must share a float dtype");
        const Type want{DType::f32, {x.shape[0], y.shape[1]}};
        expect(result() == want, op, "result must be " + to_string(want));
        if (n == 3) expect(t(op.operands[2]) == want, op, "accumulator must be " + to_string(want));
        expect(a.axis >= 0 && a.axis <= 32 && (a.axis & (a.axis - 1)) == 0, op,
               "warps_n must be 0 or a power of two up to 32");
        expect(!a.tf32 || x.dtype == DType::f32, op, "tf32 takes f32 operands");
        break;
      }
      case OpKind::Load:
      case OpKind::Store:
      case OpKind::AtomicAdd: {
        const Param& p = tensor_param(op);
        const size_t rank = size_t(p.rank);
        const bool is_load = op.kind == OpKind::Load;
        const size_t want = rank + (is_load ? 0 : 1) + (a.has_mask ? 1 : 0) +
                            (a.has_other ? 1 : 0);
        expect(n == want, op, "wrong number of operands");
        expect(is_load || !a.has_other, op, "only loads take 'other'");
        Shape shape;
        if (is_load) {
          const Type& r = result();
          expect(r.dtype == p.dtype, op, "loads give the tensor's dtype");
          expect(!a.cluster_share || (!r.shape.empty() && !a.has_other), op,
                 "cluster_share loads a tile, with no 'other'");
          shape = r.shape;
        } else {
          const Type& val = t(op.operands[rank]);
          expect(val.dtype == p.dtype, op, "stored value must have the tensor's dtype");
          shape = val.shape;
          if (op.kind == OpKind::Store)
            expect(op.results.empty() && !a.acq_rel, op, "has no result and no ordering");
          else
            expect(op.results.empty() || (op.results.size() == 1 && t(op.results[0]) == val), op,
                   "the old values have the added value's type");
          if (a.cluster_sum)
            expect(op.kind == OpKind::AtomicAdd && op.results.empty() && !a.acq_rel && p.dtype == DType::f32 &&
                       !val.shape.empty(),
                   op, "cluster_sum adds an f32 tile, relaxed, with no old values");
        }
        expect_indices(op, rank, shape);
        size_t i = rank + (is_load ? 0 : 1);
        if (a.has_mask) {
          const Type& m = t(op.operands[i++]);
          expect(m.dtype == DType::i1 && m.shape == shape, op, "mask must be i1 of the access shape");
        }
        if (a.has_other)
          expect(t(op.operands[i]) == result(), op, "'other' must have the result's type");
        break;
      }
      case OpKind::For: {
        expect(n >= 3, op, "takes lo, hi, step");
        const Type counter = t(op.operands[0]);
        expect(counter == Type{DType::i32, {}} || counter == Type{DType::i64, {}}, op,
               "bounds must be i32 or i64 scalars");
        for (size_t i = 1; i < 3; ++i)
          expect(t(op.operands[i]) == counter, op, "bounds and step must share one type");
        expect(op.body != nullptr, op, "has no body");
        const Block& body = *op.body;
        const size_t carried = n - 3;
        expect(body.args.size() == carried + 1 && op.results.size() == carried, op,
               "carried values, body arguments and results disagree");
        scopes.emplace_back();
        define(body.args[0], scopes, &op);
        expect(t(body.args[0]) == counter, op, "induction variable must have the bounds' type");
        for (size_t i = 0; i < carried; ++i) {
          define(body.args[i + 1], scopes, &op);
          expect(t(op.operands[i + 3]) == t(body.args[i + 1]) &&
                     t(op.results[i]) == t(body.args[i + 1]),
                 op, "carried value " + std::to_string(i) + " changes type");
        }
        block(body, scopes, /*in_loop=*/true);
        const Operation& y = body.ops.back();
        expect(y.operands.size() == carried, op, "yield count differs from carried values");
        for (size_t i = 0; i < carried; ++i)
          expect(t(y.operands[i]) == t(body.args[i + 1]), op,
                 "yielded value " + std::to_string(i) + " has type " +
                     to_string(t(y.operands[i])) + ", carried type is " +
                     to_string(t(body.args[i + 1])));
        scopes.pop_back();
        break;
      }
      case OpKind::Yield: break;
      case OpKind::L2EvictNormal: {
        const Param& p = tensor_param(op);
        const size_t rank = size_t(p.rank);
        expect(n == rank + (a.has_mask ? 1 : 0) && op.results.empty() && !a.has_other, op,
               "takes one index per tensor dimension and an optional mask, and has no result");
        if (n != rank + (a.has_mask ? 1 : 0)) break;
        const Shape& shape = t(op.operands[0]).shape;
        expect_indices(op, rank, shape);
        if (a.has_mask)
          expect(t(op.operands[rank]) == Type{DType::i1, shape}, op, "mask must be i1 of the access shape");
        break;
      }
      case OpKind::GridWait:
      case OpKind::GridRelease:
        expect(n == 0 && op.results.empty(), op, "takes no operands and has no result");
        break;
      case OpKind::GridSync: {
        const Param& p = tensor_param(op);
        expect(n == 0 && op.results.empty(), op, "takes no operands and has no result");
        expect(p.dtype == DType::i32, op, "its counter @" + p.name + " must be an i32 tensor");
        expect(op.attrs.axis == kGridSyncWhole || op.attrs.axis == kGridArrive || op.attrs.axis == kGridAwait, op,
               "its part must be 0 (whole), 1 (arrive) or 2 (await)");
        break;
      }
      default:
        if (is_elementwise_unary(op.kind) || is_elementwise_binary(op.kind))
          expect(n >= 1 && t(op.operands[0]).dtype != DType::u8, op,
                 "u8 is a storage type: arithmetic on it happens after a cast");
        if (is_elementwise_unary(op.kind)) {
          expect(n == 1 && result() == t(op.operands[0]), op, "keeps its operand's type");
          if (op.kind == OpKind::Not)
            expect(is_int(result().dtype), op, "applies to integer or i1 tiles");
          if (op.kind == OpKind::Sqrt || op.kind == OpKind::Rsqrt || op.kind == OpKind::Exp ||
              op.kind == OpKind::Log)
            expect(is_float(result().dtype), op, "applies to float tiles");
        } else if (is_elementwise_binary(op.kind)) {
          expect(n == 2 && t(op.operands[0]) == t(op.operands[1]), op,
                 "operands must share one type, got " + to_string(t(op.operands[0])) + " and " +
                     to_string(t(op.operands[1])));
          const Type& in = t(op.operands[0]);
          if (is_comparison(op.kind))
            expect(result() == Type{DType::i1, in.shape}, op, "comparisons give i1");
          else
            expect(result() == in, op, "result must have the operands' type");
          if (op.kind == OpKind::And || op.kind == OpKind::Or || op.kind == OpKind::Xor ||
              op.kind == OpKind::Shl || op.kind == OpKind::Shr)
            expect(is_int(in.dtype), op, "bitwise ops apply to integers");
        } else {
          fail(op, "unknown op");
        }
    }
  }

  const Function& f_;
  std::set<ValueId> defined_;
};

}  // namespace

void verify(const Function& f) { Verifier(f).run(); }

}  // namespace kerf::ir
