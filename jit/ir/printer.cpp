// Canonical text form of a Function. The hash of this text is the kernel's
// identity, so everything that changes generated code must appear in it and
// nothing process-dependent (addresses, timings) may.
#include <cinttypes>
#include <cstdio>
#include <string>

#include "kerf/jit/ir.h"

namespace kerf::ir {
namespace {

std::string v(ValueId id) { return "%" + std::to_string(id); }

std::string format_double(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  std::string s = buf;
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // keep floats visibly floats
  return s;
}

std::string bits_list(uint32_t bits, int rank) {
  std::string out = "[";
  bool first = true;
  for (int d = 0; d < rank; ++d) {
    if (!(bits & (1u << d))) continue;
    if (!first) out += ",";
    out += std::to_string(d);
    first = false;
  }
  return out + "]";
}

class Printer {
 public:
  explicit Printer(const Function& f) : f_(f) {}

  std::string run() {
    out_ += "kernel @" + f_.name + "(";
    for (size_t i = 0; i < f_.params.size(); ++i) {
      const Param& p = f_.params[i];
      if (i) out_ += ", ";
      out_ += "@" + p.name + ": ";
      if (p.kind == ParamKind::Scalar) {
        out_ += dtype_name(p.dtype);
        continue;
      }
      out_ += "tensor<" + std::string(dtype_name(p.dtype)) + "," + std::to_string(p.rank) + ">";
      std::string facts;
      auto add = [&](const std::string& s) { facts += (facts.empty() ? "" : ",") + s; };
      if (p.facts.contiguous_last) add("contig");
      if (p.facts.aligned16) add("align16");
      if (p.facts.dims_div16) add("div16=" + bits_list(p.facts.dims_div16, p.rank));
      if (p.facts.strides_div16) add("sdiv16=" + bits_list(p.facts.strides_div16, p.rank));
      // div8 only where div16 does not already say more.
      if (const uint32_t d8 = p.facts.dims_div8 & ~p.facts.dims_div16) add("div8=" + bits_list(d8, p.rank));
      if (const uint32_t s8 = p.facts.strides_div8 & ~p.facts.strides_div16)
        add("sdiv8=" + bits_list(s8, p.rank));
      if (!facts.empty()) out_ += "{" + facts + "}";
    }
    out_ += ") meta {";
    for (size_t i = 0; i < f_.meta.size(); ++i) {
      if (i) out_ += ", ";
      out_ += f_.meta[i].name + "=" + std::to_string(f_.meta[i].value);
    }
    out_ += "} {\n";
    block(f_.body, 1);
    out_ += "}\n";
    return out_;
  }

 private:
  void indent(int depth) { out_.append(size_t(depth) * 2, ' '); }

  std::string tensor_name(const Attrs& a) const {
    return "@" + f_.params.at(size_t(a.param)).name;
  }

  void block(const Block& b, int depth) {
    for (const Operation& op : b.ops) operation(op, depth);
  }

  std::string operand_list(const Operation& op, size_t from, size_t to) const {
    std::string s;
    for (size_t i = from; i < to; ++i) {
      if (i > from) s += ", ";
      s += v(op.operands[i]);
    }
    return s;
  }

  void operation(const Operation& op, int depth) {
    indent(depth);
    if (!op.results.empty()) {
      for (size_t i = 0; i < op.results.size(); ++i) out_ += (i ? ", " : "") + v(op.results[i]);
      out_ += " = ";
    }
    out_ += op_name(op.kind);
    const Attrs& a = op.attrs;
    switch (op.kind) {
      case OpKind::Param: out_ += " @" + f_.params.at(size_t(a.param)).name; break;
      case OpKind::Constant: {
        const DType t = f_.type(op.results[0]).dtype;
        out_ += " " + (is_float(t) ? format_double(a.fvalue) : std::to_string(a.ivalue));
        break;
      }
      case OpKind::ProgramId:
      case OpKind::NumPrograms: out_ += " " + std::to_string(a.axis); break;
      case OpKind::Arange:
        out_ += " " + std::to_string(a.start) + ", " + std::to_string(a.end);
        break;
      case OpKind::TensorDim:
      case OpKind::TensorStride: out_ += " " + tensor_name(a) + ", " + std::to_string(a.axis); break;
      case OpKind::ExpandDims:
      case OpKind::ReduceSum:
      case OpKind::ReduceMax:
      case OpKind::ReduceMin:
        out_ += " " + v(op.operands[0]) + ", axis=" + std::to_string(a.axis);
        break;
      case OpKind::Dot:
        out_ += " " + operand_list(op, 0, op.operands.size());
        if (a.axis) out_ += ", warps_n=" + std::to_string(a.axis);
        if (a.tf32) out_ += ", tf32";
        break;
      case OpKind::Load:
      case OpKind::Store:
      case OpKind::AtomicAdd: {
        const size_t rank = size_t(f_.params.at(size_t(a.param)).rank);
        out_ += " " + tensor_name(a) + "[" + operand_list(op, 0, rank) + "]";
        size_t i = rank;
        if (op.kind != OpKind::Load) out_ += ", " + v(op.operands[i++]);
        if (a.has_mask) out_ += " mask " + v(op.operands[i++]);
        if (a.has_other) out_ += " other " + v(op.operands[i++]);
        if (a.acq_rel) out_ += " acq_rel";
        if (a.cluster_sum) out_ += " cluster_sum";
        if (a.cluster_share) out_ += " cluster_share";
        if (a.evict == 1) out_ += " evict_first";
        if (a.evict == 2) out_ += " evict_last";
        break;
      }
      case OpKind::GridSync:
        out_ += " " + tensor_name(a);
        if (a.axis == kGridArrive) out_ += " arrive";
        if (a.axis == kGridAwait) out_ += " await";
        break;
      case OpKind::L2EvictNormal: {
        const size_t rank = size_t(f_.params.at(size_t(a.param)).rank);
        out_ += " " + tensor_name(a) + "[" + operand_list(op, 0, rank) + "]";
        if (a.has_mask) out_ += " mask " + v(op.operands[rank]);
        break;
      }
      case OpKind::For: {
        out_ += " " + v(op.operands[0]) + " to " + v(op.operands[1]) + " step " +
                v(op.operands[2]) + " iter(";
        const Block& body = *op.body;
        for (size_t i = 3; i < op.operands.size(); ++i) {
          if (i > 3) out_ += ", ";
          out_ += v(body.args[i - 2]) + " = " + v(op.operands[i]);
        }
        out_ += ") : (";
        for (size_t i = 0; i < op.results.size(); ++i)
          out_ += (i ? ", " : "") + to_string(f_.type(op.results[i]));
        out_ += ") {\n";
        indent(depth + 1);
        out_ += "^body(" + v(body.args[0]) + "):\n";
        block(body, depth + 1);
        indent(depth);
        out_ += "}\n";
        return;
      }
      default:
        if (!op.operands.empty()) out_ += " " + operand_list(op, 0, op.operands.size());
        break;
    }
    if (op.results.size() == 1) out_ += " : " + to_string(f_.type(op.results[0]));
    out_ += "\n";
  }

  const Function& f_;
  std::string out_;
};

}  // namespace

std::string print(const Function& f) { return Printer(f).run(); }

}  // namespace kerf::ir
