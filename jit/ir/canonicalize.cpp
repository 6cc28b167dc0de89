// Canonical form of a traced Function: identical pure ops merged (CSE), pure
// ops nothing needs dropped, the rest ordered by a depth-first walk from the
// ops with effects (loads, stores, atomics, loops, yields) in program order,
// and values numbered in that order. The result depends only on what the
// kernel computes, not on the order in which C++ evaluated the operands of its
// expressions (which compilers choose freely), so the text and hash of a
// kernel are the same whichever compiler built the program that traced it.
#include <cstring>
#include <map>
#include <tuple>

#include "kerf/error.h"
#include "kerf/jit/ir.h"

namespace kerf::ir {
namespace {

bool has_effects(OpKind k) {
  return k == OpKind::Load || k == OpKind::Store || k == OpKind::AtomicAdd || k == OpKind::For ||
         k == OpKind::Yield || k == OpKind::GridWait || k == OpKind::GridRelease || k == OpKind::GridSync ||
         k == OpKind::L2EvictNormal;
}

using OpKey = std::tuple<int, std::vector<ValueId>, int64_t, int64_t, int64_t, int64_t, int64_t, uint64_t,
                         std::string, bool>;

uint64_t double_bits(double d) {
  uint64_t u;
  static_assert(sizeof u == sizeof d);
  std::memcpy(&u, &d, sizeof u);
  return u;
}

class Canonicalizer {
 public:
  explicit Canonicalizer(Function& f) : f_(f), rep_(f.types.size()), def_(f.types.size(), nullptr) {
    for (size_t i = 0; i < rep_.size(); ++i) rep_[i] = ValueId(i);
  }

  void run() {
    // 1. Merge identical pure ops, block by block, visible from inner blocks.
    std::vector<std::map<OpKey, ValueId>> scopes(1);
    merge(f_.body, scopes);
    // 2. Rebuild every block in canonical order, renumbering as we go.
    new_types_.clear();
    new_id_.assign(f_.types.size(), -1);
    Block body = rebuild(f_.body, nullptr);
    f_.body = std::move(body);
    f_.types = std::move(new_types_);
  }

 private:
  ValueId rep(ValueId v) const { return rep_[size_t(v)]; }

  OpKey key(const Operation& op) const {
    std::vector<ValueId> ops;
    for (ValueId v : op.operands) ops.push_back(rep(v));
    const Attrs& a = op.attrs;
    return OpKey(int(op.kind), ops, a.axis, a.param, a.start, a.end, a.ivalue, double_bits(a.fvalue),
                 to_string(f_.type(op.results[0])), a.tf32);
  }

  void merge(Block& b, std::vector<std::map<OpKey, ValueId>>& scopes) {
    for (Operation& op : b.ops) {
      for (ValueId r : op.results) def_[size_t(r)] = &op;
      if (op.body) {
        scopes.emplace_back();
        merge(*op.body, scopes);
        scopes.pop_back();
      }
      if (has_effects(op.kind) || op.results.size() != 1) continue;
      const OpKey k = key(op);
      bool found = false;
      for (auto it = scopes.rbegin(); it != scopes.rend() && !found; ++it) {
        auto hit = it->find(k);
        if (hit != it->end()) {
          rep_[size_t(op.results[0])] = hit->second;
          found = true;
        }
      }
      if (!found) scopes.back()[k] = op.results[0];
    }
  }

  ValueId renumber(ValueId old) {
    ValueId& n = new_id_[size_t(old)];
    if (n < 0) {
      n = ValueId(new_types_.size());
      new_types_.push_back(f_.types[size_t(old)]);
    }
    return n;
  }

  // Emits the pure op defining `v` (after its operands) into the block that
  // defines it; `out` is the block being built for `home`.
  struct Builder {
    const Block* home;
    Block* out;
    Builder* parent;
  };

  void need(ValueId v, Builder& at) {
    v = rep(v);
    if (new_id_[size_t(v)] >= 0) return;  // already emitted (or a block argument)
    const Operation* op = def_[size_t(v)];
    if (!op || has_effects(op->kind))
      throw InternalError("canonicalize: %" + std::to_string(v) + " is used before it is defined");
    // Find the builder of the block that defines the op.
    Builder* b = &at;
    while (b && !defines(*b->home, op)) b = b->parent;
    if (!b) throw InternalError("canonicalize: the definition of %" + std::to_string(v) + " is out of scope");
    for (ValueId o : op->operands) need(o, *b);
    Operation copy(op->kind);
    copy.attrs = op->attrs;
    for (ValueId o : op->operands) copy.operands.push_back(new_id_[size_t(rep(o))]);
    copy.results.push_back(renumber(v));
    b->out->ops.push_back(std::move(copy));
  }

  bool defines(const Block& b, const Operation* op) const {
    for (const Operation& o : b.ops)
      if (&o == op) return true;
    return false;
  }

  Block rebuild(const Block& b, Builder* parent) {
    Block out;
    Builder here{&b, &out, parent};
    for (ValueId a : b.args) out.args.push_back(renumber(a));
    for (const Operation& op : b.ops) {
      if (!has_effects(op.kind)) continue;
      for (ValueId o : op.operands) need(o, here);
      Operation copy(op.kind);
      copy.attrs = op.attrs;
      for (ValueId o : op.operands) copy.operands.push_back(new_id_[size_t(rep(o))]);
      if (op.body) copy.body = std::make_unique<Block>(rebuild(*op.body, &here));
      for (ValueId r : op.results) copy.results.push_back(renumber(r));
      out.ops.push_back(std::move(copy));
    }
    return out;
  }

  Function& f_;
  std::vector<ValueId> rep_;
  std::vector<const Operation*> def_;
  std::vector<ValueId> new_id_;
  std::vector<Type> new_types_;
};

}  // namespace

void canonicalize(Function& f) { Canonicalizer(f).run(); }

}  // namespace kerf::ir
