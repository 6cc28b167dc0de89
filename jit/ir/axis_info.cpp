#include "axis_info.h"

#include <algorithm>

namespace kerf::ir {
namespace {

int64_t pow2_dividing(int64_t v) {
  if (v == 0) return kMaxDivisibility;
  int64_t d = 1;
  while (d < kMaxDivisibility && (v % (d * 2)) == 0) d *= 2;
  return d;
}

// What divides every element along axis d (divisibility speaks of a run's first
// element; the elements of a contiguous run differ by one).
int64_t element_divisibility(const AxisInfo& a, size_t d) { return a.contiguity[d] > 1 ? 1 : a.divisibility[d]; }

AxisInfo conservative(const Type& t) {
  AxisInfo a;
  const size_t r = t.shape.size();
  a.contiguity.assign(r, 1);
  a.divisibility.assign(r, 1);
  a.constancy.assign(r, 1);
  a.scalar_div = 1;
  return a;
}

AxisInfo uniform(const Type& t, int64_t div) {
  AxisInfo a;
  const size_t r = t.shape.size();
  a.contiguity.assign(r, 1);
  a.divisibility.assign(r, div);
  a.constancy = t.shape;
  a.scalar_div = div;
  return a;
}

class Analysis {
 public:
  explicit Analysis(const Function& f) : f_(f), info_(f.types.size()) {
    for (size_t i = 0; i < f.types.size(); ++i) info_[i] = conservative(f.types[i]);
  }

  std::vector<AxisInfo> run() {
    block(f_.body);
    return std::move(info_);
  }

 private:
  const AxisInfo& in(ValueId v) const { return info_[size_t(v)]; }
  const Type& type(ValueId v) const { return f_.type(v); }

  void block(const Block& b) {
    for (const Operation& op : b.ops) operation(op);
  }

  void operation(const Operation& op) {
    if (op.kind == OpKind::For) {
      // The induction variable starts at lo and moves by step.
      const Block& body = *op.body;
      AxisInfo iv = uniform(type(body.args[0]),
                            std::min(in(op.operands[0]).scalar_div, in(op.operands[2]).scalar_div));
      info_[size_t(body.args[0])] = iv;
      block(body);
      return;
    }
    if (op.results.size() != 1) return;
    const ValueId res = op.results[0];
    const Type& t = type(res);
    const Attrs& a = op.attrs;
    AxisInfo out = conservative(t);
    const size_t r = t.shape.size();
    switch (op.kind) {
      case OpKind::Constant:
        out = uniform(t, is_int(t.dtype) ? pow2_dividing(a.ivalue) : 1);
        break;
      case OpKind::TensorDim: {
        const Param& p = f_.params[size_t(a.param)];
        out = uniform(t, p.facts.dim_divisor(int(a.axis)));
        break;
      }
      case OpKind::TensorStride: {
        const Param& p = f_.params[size_t(a.param)];
        out = uniform(t, p.facts.stride_divisor(int(a.axis)));
        break;
      }
      case OpKind::Param:
      case OpKind::ProgramId:
      case OpKind::NumPrograms: out = uniform(t, 1); break;
      case OpKind::Arange:
        out.contiguity = {a.end - a.start};
        out.divisibility = {pow2_dividing(a.start)};
        out.constancy = {1};
        break;
      case OpKind::Splat: out = uniform(t, in(op.operands[0]).scalar_div); break;
      case OpKind::ExpandDims: {
        const AxisInfo& x = in(op.operands[0]);
        out = x;
        out.contiguity.insert(out.contiguity.begin() + a.axis, 1);
        out.divisibility.insert(out.divisibility.begin() + a.axis, x.element_divisibility());
        out.constancy.insert(out.constancy.begin() + a.axis, 1);
        break;
      }
      case OpKind::Broadcast: {
        const AxisInfo& x = in(op.operands[0]);
        const Shape& xs = type(op.operands[0]).shape;
        out = x;
        for (size_t d = 0; d < r; ++d)
          if (xs[d] == 1 && t.shape[d] != 1) {
            out.contiguity[d] = 1;
            out.divisibility[d] = x.element_divisibility();
            out.constancy[d] = t.shape[d];
          }
        break;
      }
      case OpKind::Transpose: {
        const AxisInfo& x = in(op.operands[0]);
        out.contiguity = {x.contiguity[1], x.contiguity[0]};
        out.divisibility = {x.divisibility[1], x.divisibility[0]};
        out.constancy = {x.constancy[1], x.constancy[0]};
        break;
      }
      case OpKind::Cast:
        if (is_int(t.dtype) && is_int(type(op.operands[0]).dtype) && t.dtype != DType::i1)
          out = in(op.operands[0]);
        break;
      case OpKind::Add:
      case OpKind::Sub:
      case OpKind::Mul: {
        if (!is_int(t.dtype) || t.dtype == DType::i1) break;
        const AxisInfo& x = in(op.operands[0]);
        const AxisInfo& y = in(op.operands[1]);
        if (r == 0) {
          out.scalar_div = op.kind == OpKind::Mul
                               ? std::min(kMaxDivisibility, x.scalar_div * y.scalar_div)
                               : std::min(x.scalar_div, y.scalar_div);
          break;
        }
        for (size_t d = 0; d < r; ++d) {
          out.constancy[d] = std::min(x.constancy[d], y.constancy[d]);
          if (op.kind == OpKind::Mul) {
            out.divisibility[d] = std::min(kMaxDivisibility, element_divisibility(x, d) * element_divisibility(y, d));
            out.contiguity[d] = 1;
          } else {
            out.divisibility[d] = std::min(x.divisibility[d], y.divisibility[d]);
            int64_t c = std::min(x.contiguity[d], y.constancy[d]);
            if (op.kind == OpKind::Add) c = std::max(c, std::min(y.contiguity[d], x.constancy[d]));
            out.contiguity[d] = c;
          }
        }
        break;
      }
      case OpKind::Min:
      case OpKind::Max: {
        // The result is one of the operands, element by element: divisible by whatever
        // divides both (powers of two: the smaller), equal where both are.
        if (!is_int(t.dtype) || t.dtype == DType::i1) break;
        const AxisInfo& x = in(op.operands[0]);
        const AxisInfo& y = in(op.operands[1]);
        if (r == 0) {
          out.scalar_div = std::min(x.scalar_div, y.scalar_div);
          break;
        }
        for (size_t d = 0; d < r; ++d) {
          out.constancy[d] = std::min(x.constancy[d], y.constancy[d]);
          out.divisibility[d] = std::min(element_divisibility(x, d), element_divisibility(y, d));
        }
        break;
      }
      case OpKind::Lt:
      case OpKind::Le:
      case OpKind::Gt:
      case OpKind::Ge:
      case OpKind::Eq:
      case OpKind::Ne: {
        const AxisInfo& x = in(op.operands[0]);
        const AxisInfo& y = in(op.operands[1]);
        for (size_t d = 0; d < r; ++d) {
          int64_t c = std::min(x.constancy[d], y.constancy[d]);
          // A run of k consecutive values starting at a multiple of k, compared with a
          // constant c that is a multiple of k, gives the same answer along the run for
          // `run < c` and `run >= c` (the run lies wholly below c or wholly at or above it),
          // and for their mirrors `c > run` and `c <= run`; not for `run > c` or `run <= c`
          // (a run starting at c itself: c > c is false, c + 1 > c true).
          const int64_t ex = element_divisibility(x, d), ey = element_divisibility(y, d);
          if (op.kind == OpKind::Lt || op.kind == OpKind::Ge)  // run OP c
            c = std::max(c, std::min({x.contiguity[d], y.constancy[d], x.divisibility[d], ey}));
          if (op.kind == OpKind::Gt || op.kind == OpKind::Le)  // c OP run
            c = std::max(c, std::min({y.contiguity[d], x.constancy[d], y.divisibility[d], ex}));
          out.constancy[d] = c;
        }
        break;
      }
      case OpKind::And:
      case OpKind::Or:
      case OpKind::Xor: {
        const AxisInfo& x = in(op.operands[0]);
        const AxisInfo& y = in(op.operands[1]);
        for (size_t d = 0; d < r; ++d) out.constancy[d] = std::min(x.constancy[d], y.constancy[d]);
        break;
      }
      case OpKind::Not: out.constancy = in(op.operands[0]).constancy; break;
      default: break;
    }
    info_[size_t(res)] = std::move(out);
  }

  const Function& f_;
  std::vector<AxisInfo> info_;
};

}  // namespace

int64_t AxisInfo::element_divisibility() const {
  if (contiguity.empty()) return scalar_div;
  int64_t d = kMaxDivisibility;
  for (size_t i = 0; i < contiguity.size(); ++i)
    d = std::min(d, contiguity[i] > 1 ? int64_t(1) : divisibility[i]);
  return d;
}

std::vector<AxisInfo> analyze_axis_info(const Function& f) { return Analysis(f).run(); }

}  // namespace kerf::ir
