// Checking a sharding layout (include/kerf/ops/layout.h) against an op's operands.
#pragma once

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kerf/ops/layout.h"

namespace kerf::ops::detail {

// One operand as the layout check sees it: its name (the key of Layout::specs)
// and the logical name of each of its dimensions ("out", "in", "r", "E", ...).
struct OperandDims {
  std::string name;
  std::vector<std::string> dims;
};

// The mesh axes that split each logical dimension (none when it is whole; axes of
// size 1 left out, as they split nothing).
struct LayoutSplits {
  std::map<std::string, DimSplit> axes;
  // Which operand first fixed each logical dimension's split, for messages.
  std::map<std::string, std::string> fixed_by;
  std::map<std::string, size_t> fixed_at;  // and at which of its dimensions
  // The logical dimensions some spec names a mesh axis for, axes of size 1 included.
  std::set<std::string> named;
  const DimSplit& of(const std::string& dim) const;
  bool split(const std::string& dim) const { return !of(dim).empty(); }
};

// An unsharded call's layout (no mesh, no specs): every dimension whole, nothing to check.
inline bool names_nothing(const Layout& layout) {
  return layout.mesh.empty() && layout.specs.empty() && layout.coords.empty();
}

// Checks the mesh (names unique and non-empty, sizes >= 1), that every spec
// names one of the op's operands, fits its rank and names mesh axes, that no
// operand uses an axis twice, that operands sharing a logical dimension split
// it the same way, and that no mesh axis splits two logical dimensions.
// Throws InvalidArgument (naming both specs on a disagreement) before anything runs.
LayoutSplits check_layout(const char* op, const Layout& layout,
                          const std::vector<OperandDims>& operands);

// The same, the operand list built by `make` only when the layout names a mesh or
// a spec (!names_nothing), so the common unsharded call builds no list of names.
template <class MakeOperands, class = decltype(std::declval<MakeOperands&>()())>
LayoutSplits check_layout(const char* op, const Layout& layout, MakeOperands&& make) {
  if (names_nothing(layout)) return {};
  return check_layout(op, layout, make());
}

// Throws InvalidArgument unless logical dimension `dim` is whole; `why` ends the message.
void expect_unsplit(const char* op, const Layout& layout, const LayoutSplits& splits,
                    const std::string& dim, const std::string& why);

// The layout a canonical() text stands for (Layout::parse), this device at coordinate 0
// of every mesh axis: what kerf-cache warm runs and compiles a sharded op's kernels with.
Layout layout_at_origin(const std::string& text);

// "W P(None, 'tp')": an operand's name and its spec as the layout gives it.
std::string spec_text(const Layout& layout, const std::string& operand);

}  // namespace kerf::ops::detail
