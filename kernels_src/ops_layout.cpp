// Sharding layouts: canonical text and the checks every sharded op runs first.
#include "ops_layout.h"

#include <set>

#include "kerf/error.h"

namespace kerf::ops {

namespace {

// Whether mesh axis `axis` splits the dimension it is given for: named, and not of
// size 1 (one shard splits nothing).
bool splits_along(const Layout& layout, const std::string& axis) {
  return !axis.empty() && layout.axis_size(axis) != 1;
}

}  // namespace

const std::string& PartitionSpec::axis_of(size_t dim) const {
  static const std::string none;
  return dim < dims.size() ? dims[dim] : none;
}

std::string PartitionSpec::str() const {
  size_t n = dims.size();
  while (n > 0 && dims[n - 1].empty()) --n;
  std::string s = "P(";
  for (size_t i = 0; i < n; ++i)
    s += (i ? ", " : "") + (dims[i].empty() ? "None" : "'" + dims[i] + "'");
  return s + ")";
}

int64_t Layout::axis_size(const std::string& axis) const {
  for (const MeshAxis& a : mesh)
    if (a.name == axis) return a.size;
  return 0;
}

int64_t Layout::coord(const std::string& axis) const {
  for (size_t i = 0; i < mesh.size(); ++i) {
    if (mesh[i].name != axis) continue;
    if (coords.size() != mesh.size())
      throw InvalidArgument(
          "layout: this device's coordinates are needed (Layout::coords, one per mesh axis: " +
          std::to_string(mesh.size()) + "), got " + std::to_string(coords.size()));
    if (coords[i] < 0 || coords[i] >= mesh[i].size)
      throw InvalidArgument("layout: coordinate " + std::to_string(coords[i]) + " on mesh axis '" +
                            axis + "' is outside [0, " + std::to_string(mesh[i].size) + ")");
    return coords[i];
  }
  throw InvalidArgument("layout: the mesh has no axis '" + axis + "'");
}

bool Layout::sharded() const {
  for (const auto& [name, spec] : specs)
    for (const std::string& a : spec.dims)
      if (splits_along(*this, a)) return true;
  return false;
}

std::string Layout::canonical() const {
  // A split over an axis of size 1 splits nothing, and the mesh's axes are listed by name:
  // layouts that mean the same give the same text.
  std::set<std::string> used;
  std::string ops_text;
  for (const auto& [name, spec] : specs) {  // std::map: sorted by operand name
    size_t n = spec.dims.size();
    while (n > 0 && !splits_along(*this, spec.dims[n - 1])) --n;
    if (n == 0) continue;
    ops_text += " " + name + "[";
    for (size_t i = 0; i < n; ++i) {
      const bool split = splits_along(*this, spec.dims[i]);
      ops_text += (i ? "," : "") + (split ? spec.dims[i] : std::string());
      if (split) used.insert(spec.dims[i]);
    }
    ops_text += "]";
  }
  if (used.empty()) return "";
  std::string mesh_text;
  for (const std::string& a : used)  // sorted
    mesh_text += (mesh_text.empty() ? "" : ",") + a + "=" + std::to_string(axis_size(a));
  return "mesh(" + mesh_text + ")" + ops_text;
}

namespace detail {

const std::string& LayoutSplits::of(const std::string& dim) const {
  static const std::string none;
  auto it = axis.find(dim);
  return it == axis.end() ? none : it->second;
}

std::string spec_text(const Layout& layout, const std::string& operand) {
  auto it = layout.specs.find(operand);
  return operand + " " + (it == layout.specs.end() ? PartitionSpec().str() : it->second.str());
}

namespace {

std::string split_words(const std::string& axis) {
  return axis.empty() ? "not split" : "'" + axis + "'";
}

}  // namespace

LayoutSplits check_layout(const char* op, const Layout& layout,
                          const std::vector<OperandDims>& operands) {
  if (names_nothing(layout)) return {};
  const std::string p = std::string(op) + ": layout: ";
  std::set<std::string> names;
  for (const MeshAxis& a : layout.mesh) {
    if (a.name.empty()) throw InvalidArgument(p + "a mesh axis has an empty name");
    if (!names.insert(a.name).second)
      throw InvalidArgument(p + "mesh axis '" + a.name + "' is named twice");
    if (a.size < 1)
      throw InvalidArgument(p + "mesh axis '" + a.name + "' must have size >= 1, got " +
                            std::to_string(a.size));
  }
  // Coordinates, when given, are checked whether or not this op needs them.
  if (!layout.coords.empty()) {
    if (layout.coords.size() != layout.mesh.size())
      throw InvalidArgument(p + "coords gives " + std::to_string(layout.coords.size()) +
                            " coordinates for a mesh of " + std::to_string(layout.mesh.size()) + " axes");
    for (size_t i = 0; i < layout.mesh.size(); ++i)
      if (layout.coords[i] < 0 || layout.coords[i] >= layout.mesh[i].size)
        throw InvalidArgument(p + "coordinate " + std::to_string(layout.coords[i]) + " on mesh axis '" +
                              layout.mesh[i].name + "' is outside [0, " + std::to_string(layout.mesh[i].size) + ")");
  }
  for (const auto& [name, spec] : layout.specs) {
    const OperandDims* od = nullptr;
    for (const OperandDims& o : operands)
      if (o.name == name) od = &o;
    if (!od) {
      std::string known;
      for (const OperandDims& o : operands) known += (known.empty() ? "" : ", ") + o.name;
      throw InvalidArgument(p + "there is no operand '" + name + "' (the operands are " + known +
                            ")");
    }
    if (spec.dims.size() > od->dims.size()) {
      std::string all;  // every entry, trailing Nones too (str() drops them)
      for (const std::string& a : spec.dims) all += (all.empty() ? "" : ", ") + (a.empty() ? "None" : "'" + a + "'");
      throw InvalidArgument(p + name + " has rank " + std::to_string(od->dims.size()) + " but its spec P(" + all +
                            ") names " + std::to_string(spec.dims.size()) + " dimensions");
    }
    std::set<std::string> seen;
    for (const std::string& a : spec.dims) {
      if (a.empty()) continue;
      if (!names.count(a))
        throw InvalidArgument(p + spec_text(layout, name) + " names mesh axis '" + a +
                              "', which the mesh lacks");
      if (!seen.insert(a).second)
        throw InvalidArgument(p + spec_text(layout, name) +
                              " splits two dimensions over mesh axis '" + a + "'");
    }
  }
  LayoutSplits s;
  for (const OperandDims& o : operands) {
    auto it = layout.specs.find(o.name);
    const PartitionSpec none;
    const PartitionSpec& spec = it == layout.specs.end() ? none : it->second;
    for (size_t d = 0; d < o.dims.size(); ++d) {
      const std::string& dim = o.dims[d];
      // A mesh axis of size 1 splits nothing: the dimension is whole.
      static const std::string whole;
      const std::string& axis = splits_along(layout, spec.axis_of(d)) ? spec.axis_of(d) : whole;
      auto known = s.axis.find(dim);
      if (known == s.axis.end()) {
        s.axis[dim] = axis;
        s.fixed_by[dim] = o.name;
        s.fixed_at[dim] = d;
        continue;
      }
      if (known->second == axis) continue;
      const std::string& other = s.fixed_by[dim];
      // Where each operand holds the dimension: two specs may print alike and split different dims.
      throw InvalidArgument(p + spec_text(layout, o.name) + " and " + spec_text(layout, other) +
                            " split dimension '" + dim + "' (" + o.name + "'s dim " + std::to_string(d) + ", " +
                            other + "'s dim " + std::to_string(s.fixed_at[dim]) + ") differently (" +
                            split_words(axis) + " vs " + split_words(known->second) +
                            "); operands sharing a dimension must split it alike");
    }
  }
  // Two logical dimensions may not share a mesh axis either (a shard would then
  // hold a block that is not a product of local ranges).
  std::map<std::string, std::string> dim_of_axis;
  for (const auto& [dim, axis] : s.axis) {
    if (axis.empty()) continue;
    auto [it, fresh] = dim_of_axis.emplace(axis, dim);
    if (!fresh)
      throw InvalidArgument(p + spec_text(layout, s.fixed_by[dim]) + " and " +
                            spec_text(layout, s.fixed_by[it->second]) + " split dimensions '" +
                            it->second + "' and '" + dim + "' over the same mesh axis '" + axis +
                            "'");
  }
  return s;
}

void expect_unsplit(const char* op, const Layout& layout, const LayoutSplits& splits,
                    const std::string& dim, const std::string& why) {
  const std::string& axis = splits.of(dim);
  if (axis.empty()) return;
  throw InvalidArgument(std::string(op) + ": layout: " +
                        spec_text(layout, splits.fixed_by.at(dim)) + " splits dimension '" + dim +
                        "' over '" + axis + "', which this op does not support: " + why);
}

}  // namespace detail
}  // namespace kerf::ops
