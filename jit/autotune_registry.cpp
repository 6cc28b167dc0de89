// The ops that can be tuned and warmed, registered by the ops themselves.
#include <mutex>
#include <vector>

#include "kerf/jit/autotune.h"

namespace kerf::autotune {
namespace {

struct Registry {
  std::mutex mu;
  std::vector<TunableOp> ops;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_op(TunableOp op) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (TunableOp& existing : r.ops)
    if (existing.name == op.name) {
      existing = std::move(op);
      return;
    }
  r.ops.push_back(std::move(op));
}

std::vector<TunableOp> tunable_ops() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.ops;
}

}  // namespace kerf::autotune
