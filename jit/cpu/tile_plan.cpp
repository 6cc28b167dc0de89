// Decides which tile values live in stack arrays (see tile_plan.h).
//
// Two passes over each block:
//  1. forward: values that must or should be arrays (dot, reductions, loop
//     state, reused loads, expensive reused or loop-invariant expressions);
//  2. backward: where each remaining inline value is finally evaluated (the
//     place of the array or store that consumes it). An inline load whose
//     evaluation would move past a store, an atomic or a loop that writes
//     memory, or that feeds a store into its own tensor, is made an array so
//     that it reads memory where the program says it does.
#include "jit/cpu/tile_plan.h"

#include <cstddef>
#include <vector>

namespace kerf::jit::cpu {
namespace {

using ir::Block;
using ir::Operation;
using ir::OpKind;
using ir::ValueId;

// Where a value is used: the op of the defining block that contains the use.
struct Use {
  int pos = 0;                      // position of that op in the defining block
  const Operation* user = nullptr;  // the op that names the value
  bool nested = false;              // the use is inside a loop body of that op
};

// Cost, in rough instruction counts, of recomputing one element inline.
constexpr int kMaterializeCost = 8;

bool writes_memory(const Operation& op) {
  if (op.kind == OpKind::Store || op.kind == OpKind::AtomicAdd) return true;
  if (op.body)
    for (const Operation& inner : op.body->ops)
      if (writes_memory(inner)) return true;
  return false;
}

class Planner {
 public:
  explicit Planner(const ir::Function& f) : f_(f) {
    const size_t n = f.types.size();
    plan_.materialized.assign(n, false);
    plan_.def.assign(n, nullptr);
    plan_.is_block_arg.assign(n, false);
    plan_.uses.assign(n, 0);
    def_block_.assign(n, nullptr);
    use_.assign(n, Use{});
    cost_.assign(n, 0);
    has_load_.assign(n, false);
    eval_pos_.assign(n, -1);
    root_param_.assign(n, -1);
  }

  TilePlan run() {
    record_definitions(f_.body);
    std::vector<std::pair<const Block*, int>> ancestors;
    record_uses(f_.body, ancestors);
    decide_forward(f_.body);
    decide_backward(f_.body);
    return std::move(plan_);
  }

 private:
  bool is_tile(ValueId v) const { return !f_.type(v).is_scalar(); }
  bool inline_tile(ValueId v) const { return is_tile(v) && !plan_.materialized[size_t(v)]; }

  void record_definitions(const Block& b) {
    for (ValueId a : b.args) {
      def_block_[size_t(a)] = &b;
      plan_.is_block_arg[size_t(a)] = true;
    }
    for (size_t i = 0; i < b.ops.size(); ++i) {
      const Operation& op = b.ops[i];
      for (ValueId r : op.results) {
        def_block_[size_t(r)] = &b;
        plan_.def[size_t(r)] = &op;
      }
      if (op.body) record_definitions(*op.body);
    }
  }

  void record_uses(const Block& b, std::vector<std::pair<const Block*, int>>& ancestors) {
    for (size_t i = 0; i < b.ops.size(); ++i) {
      const Operation& op = b.ops[i];
      ancestors.emplace_back(&b, int(i));
      for (ValueId v : op.operands) {
        plan_.uses[size_t(v)]++;
        const Block* home = def_block_[size_t(v)];
        for (const auto& [blk, pos] : ancestors)
          if (blk == home) use_[size_t(v)] = Use{pos, &op, blk != &b};
      }
      if (op.body) record_uses(*op.body, ancestors);
      ancestors.pop_back();
    }
  }

  static int own_cost(const Operation& op, DType result) {
    const int rounding = is_half(result) ? 3 : 0;
    switch (op.kind) {
      case OpKind::Arange:
      case OpKind::Splat:
      case OpKind::Broadcast:
      case OpKind::ExpandDims:
      case OpKind::Transpose:
        return 0;
      case OpKind::Add:
      case OpKind::Sub:
      case OpKind::Mul:
      case OpKind::Cast:
        return 1 + rounding;
      case OpKind::Div:
      case OpKind::Rem:
      case OpKind::Sqrt:
      case OpKind::Rsqrt:
        return 8 + rounding;
      case OpKind::Exp:
      case OpKind::Log:
        return 16 + rounding;
      case OpKind::Load:
        return 4;
      default:
        return 1;
    }
  }

  void decide_forward(const Block& b) {
    for (ValueId a : b.args)
      if (is_tile(a)) plan_.materialized[size_t(a)] = true;  // loop state
    for (const Operation& op : b.ops) {
      if (op.body) decide_forward(*op.body);
      for (ValueId r : op.results) {
        if (!is_tile(r)) continue;
        const size_t ri = size_t(r);
        const Use& u = use_[ri];
        const bool reused = plan_.uses[ri] > 1 || u.nested;
        switch (op.kind) {
          case OpKind::For:
          case OpKind::AtomicAdd:  // the old values come from memory as the op runs
          case OpKind::Dot:
          case OpKind::ReduceSum:
          case OpKind::ReduceMax:
          case OpKind::ReduceMin:
            plan_.materialized[ri] = true;
            break;
          case OpKind::Load:
            plan_.materialized[ri] = reused;
            cost_[ri] = own_cost(op, f_.type(r).dtype);
            has_load_[ri] = true;
            break;
          default: {
            int cost = own_cost(op, f_.type(r).dtype);
            bool has_load = false;
            for (ValueId v : op.operands) {
              if (!inline_tile(v)) continue;
              cost += cost_[size_t(v)];
              has_load = has_load || has_load_[size_t(v)];
            }
            cost_[ri] = cost;
            has_load_[ri] = has_load;
            plan_.materialized[ri] = reused && (has_load || cost >= kMaterializeCost);
          }
        }
      }
    }
  }

  void decide_backward(const Block& b) {
    // writes_before[i]: number of memory-writing ops at positions < i.
    std::vector<int> writes_before(b.ops.size() + 1, 0);
    for (size_t i = 0; i < b.ops.size(); ++i)
      writes_before[i + 1] = writes_before[i] + (writes_memory(b.ops[i]) ? 1 : 0);
    auto writes_between = [&](int from, int to) {  // strictly between the two positions
      if (to <= from + 1) return false;
      return writes_before[size_t(to)] - writes_before[size_t(from + 1)] > 0;
    };

    for (size_t i = b.ops.size(); i-- > 0;) {
      const Operation& op = b.ops[i];
      if (op.body) decide_backward(*op.body);
      for (ValueId r : op.results) {
        const size_t ri = size_t(r);
        if (!inline_tile(r) || plan_.uses[ri] != 1) continue;
        const Use& u = use_[ri];
        const bool chains =
            !u.nested && !u.user->results.empty() && inline_tile(u.user->results[0]);
        if (chains) {
          eval_pos_[ri] = eval_pos_[size_t(u.user->results[0])];
          root_param_[ri] = root_param_[size_t(u.user->results[0])];
        } else {
          eval_pos_[ri] = u.pos;
          const bool writes = u.user->kind == OpKind::Store || u.user->kind == OpKind::AtomicAdd;
          root_param_[ri] = writes ? int(u.user->attrs.param) : -1;
        }
        if (op.kind == OpKind::Load &&
            (root_param_[ri] == int(op.attrs.param) || writes_between(int(i), eval_pos_[ri]))) {
          plan_.materialized[ri] = true;
          eval_pos_[ri] = int(i);
          root_param_[ri] = -1;
        }
      }
    }
  }

  const ir::Function& f_;
  TilePlan plan_;
  std::vector<const Block*> def_block_;
  std::vector<Use> use_;  // meaningful for values with exactly one use
  std::vector<int> cost_;
  std::vector<bool> has_load_;
  std::vector<int> eval_pos_;
  std::vector<int> root_param_;
};

}  // namespace

TilePlan plan_tiles(const ir::Function& f) {
  return Planner(f).run();
}

}  // namespace kerf::jit::cpu
