#include "kerf/jit/ir.h"

#include <sstream>

namespace kerf::ir {

int64_t Type::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_string(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ",";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

std::string to_string(const Type& t) {
  std::string out = dtype_name(t.dtype);
  if (!t.is_scalar()) out += shape_string(t.shape);
  return out;
}

const char* grid_barrier_name(const Operation& op) {
  return op.attrs.axis == kGridArrive ? "grid_arrive" : op.attrs.axis == kGridAwait ? "grid_await" : "grid_sync";
}

const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::Param: return "param";
    case OpKind::Constant: return "const";
    case OpKind::ProgramId: return "program_id";
    case OpKind::NumPrograms: return "num_programs";
    case OpKind::Arange: return "arange";
    case OpKind::TensorDim: return "dim";
    case OpKind::TensorStride: return "stride";
    case OpKind::Splat: return "splat";
    case OpKind::ExpandDims: return "expand_dims";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::Transpose: return "trans";
    case OpKind::Interleave: return "interleave";
    case OpKind::Neg: return "neg";
    case OpKind::Not: return "not";
    case OpKind::Abs: return "abs";
    case OpKind::Sqrt: return "sqrt";
    case OpKind::Rsqrt: return "rsqrt";
    case OpKind::Exp: return "exp";
    case OpKind::Log: return "log";
    case OpKind::Add: return "add";
    case OpKind::Sub: return "sub";
    case OpKind::Mul: return "mul";
    case OpKind::Div: return "div";
    case OpKind::Rem: return "rem";
    case OpKind::Min: return "min";
    case OpKind::Max: return "max";
    case OpKind::And: return "and";
    case OpKind::Or: return "or";
    case OpKind::Xor: return "xor";
    case OpKind::Shl: return "shl";
    case OpKind::Shr: return "shr";
    case OpKind::Lt: return "lt";
    case OpKind::Le: return "le";
    case OpKind::Gt: return "gt";
    case OpKind::Ge: return "ge";
    case OpKind::Eq: return "eq";
    case OpKind::Ne: return "ne";
    case OpKind::Select: return "select";
    case OpKind::Gather: return "gather";
    case OpKind::Cast: return "cast";
    case OpKind::ReduceSum: return "reduce_sum";
    case OpKind::ReduceMax: return "reduce_max";
    case OpKind::ReduceMin: return "reduce_min";
    case OpKind::Dot: return "dot";
    case OpKind::Load: return "load";
    case OpKind::Store: return "store";
    case OpKind::AtomicAdd: return "atomic_add";
    case OpKind::L2EvictNormal: return "l2_evict_normal";
    case OpKind::GridWait: return "wait_prior_grid";
    case OpKind::GridRelease: return "release_dependents";
    case OpKind::GridSync: return "grid_sync";
    case OpKind::For: return "for";
    case OpKind::Yield: return "yield";
  }
  return "?";
}

bool is_elementwise_unary(OpKind k) {
  switch (k) {
    case OpKind::Neg:
    case OpKind::Not:
    case OpKind::Abs:
    case OpKind::Sqrt:
    case OpKind::Rsqrt:
    case OpKind::Exp:
    case OpKind::Log: return true;
    default: return false;
  }
}

bool is_comparison(OpKind k) {
  switch (k) {
    case OpKind::Lt:
    case OpKind::Le:
    case OpKind::Gt:
    case OpKind::Ge:
    case OpKind::Eq:
    case OpKind::Ne: return true;
    default: return false;
  }
}

bool is_elementwise_binary(OpKind k) {
  switch (k) {
    case OpKind::Add:
    case OpKind::Sub:
    case OpKind::Mul:
    case OpKind::Div:
    case OpKind::Rem:
    case OpKind::Min:
    case OpKind::Max:
    case OpKind::And:
    case OpKind::Or:
    case OpKind::Xor:
    case OpKind::Shl:
    case OpKind::Shr: return true;
    default: return is_comparison(k);
  }
}

bool is_reduction(OpKind k) {
  return k == OpKind::ReduceSum || k == OpKind::ReduceMax || k == OpKind::ReduceMin;
}

int64_t Function::meta_value(const std::string& n, int64_t fallback) const {
  for (const auto& m : meta)
    if (m.name == n) return m.value;
  return fallback;
}

namespace {

void count_block(const Block& b, std::vector<int>& uses) {
  for (const auto& op : b.ops) {
    for (ValueId v : op.operands) uses[size_t(v)]++;
    if (op.body) count_block(*op.body, uses);
  }
}

}  // namespace

std::vector<int> count_uses(const Function& f) {
  std::vector<int> uses(f.types.size(), 0);
  count_block(f.body, uses);
  return uses;
}

bool contains(const Block& b, OpKind k) {
  for (const Operation& op : b.ops)
    if (op.kind == k || (op.body && contains(*op.body, k))) return true;
  return false;
}

}  // namespace kerf::ir
