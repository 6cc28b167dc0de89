// Sharding layouts: how an op's operands are split over a device mesh.
//
// An op that takes a Layout receives each operand's *local* shard. The layout
// names the mesh axes (with sizes) and, per operand, which mesh axis splits
// which dimension, like jax.sharding.PartitionSpec:
//
//   ops::Layout tp;                               // 4-way tensor parallel on in-features
//   tp.mesh = {{"tp", 4}};
//   tp.specs["W"] = {"", "tp"};                   // W [out, in]: in split over "tp"
//   tp.specs["A"] = {"", "tp"};                   // A [r, in]:  the same
//   ops::dora_norm_partial(W_local, A_local, B, s, sumsq, stream, {}, tp);
//
// A dimension may be split over several mesh axes at once, as JAX's
// P(None, ("dp", "tp")): tp.specs["W"] = {"", {"dp", "tp"}} (an entry in braces of
// its own lists the axes, major to minor).
//
// Operands not named in `specs` are replicated; a spec shorter than the
// operand's rank leaves the remaining dimensions whole. Splits are even:
// shard c of an axis of size n holds elements [c*local, (c+1)*local) of the
// dimension it splits; a dimension split over several axes ({"dp", "tp"})
// has as many shards as their sizes' product, numbered major to minor. Operands whose specs cannot work together are
// rejected before any launch, with a message that names both specs. Each op
// documents the layouts it takes (docs/ops.md) and which of its outputs are
// then partial sums to be summed over a mesh axis by the caller (e.g.
// torch.distributed.all_reduce or jax.lax.psum).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

namespace kerf::ops {

// One named axis of the device mesh.
struct MeshAxis {
  std::string name;
  int64_t size = 1;
};

// The mesh axes splitting one dimension of an operand, major to minor, as a
// jax.sharding.PartitionSpec entry: none ("" or {}), one axis ("tp"), or several
// ({"dp", "tp"}: the dimension is split over their product, dp's coordinate the
// major one: shard dp_coord * tp_size + tp_coord).
struct DimSplit {
  std::vector<std::string> axes;

  DimSplit() = default;
  DimSplit(const char* axis) : DimSplit(std::string(axis)) {}  // NOLINT: "" = not split
  DimSplit(std::string axis) {                                  // NOLINT
    if (!axis.empty()) axes.push_back(std::move(axis));
  }
  DimSplit(std::initializer_list<std::string> a) : axes(a) {}  // NOLINT
  explicit DimSplit(std::vector<std::string> a) : axes(std::move(a)) {}

  bool empty() const { return axes.empty(); }
  // As JAX prints it: "None", "'tp'", "('dp', 'tp')".
  std::string str() const;
  bool operator==(const DimSplit& o) const { return axes == o.axes; }
  bool operator!=(const DimSplit& o) const { return axes != o.axes; }
};

// Per dimension of one operand, the mesh axes that split it (none = whole).
struct PartitionSpec {
  std::vector<DimSplit> dims;

  PartitionSpec() = default;
  PartitionSpec(std::initializer_list<DimSplit> d) : dims(d) {}  // NOLINT
  explicit PartitionSpec(std::vector<DimSplit> d) : dims(std::move(d)) {}

  // The axes splitting dimension `dim` (empty when not split, or past the end).
  const DimSplit& axes_of(size_t dim) const;
  // As JAX prints it: "P(None, 'tp')", "P(None, ('dp', 'tp'))"; "P()" when nothing is split.
  std::string str() const;
};

struct Layout {
  std::vector<MeshAxis> mesh;
  std::map<std::string, PartitionSpec> specs;  // by operand name (as the op's docs name them)
  // This device's coordinate on each mesh axis, in `mesh` order. Only ops whose
  // shards index a global range read it (the vocab-parallel embedding); it is
  // not part of canonical().
  std::vector<int64_t> coords;

  // The size of a mesh axis (0 when the mesh has no such axis).
  int64_t axis_size(const std::string& axis) const;
  // This device's coordinate on `axis` (throws InvalidArgument when coords do not give it).
  int64_t coord(const std::string& axis) const;
  // How many shards the axes of `split` cut a dimension into (the product of their sizes),
  // and this device's shard among them (coordinates read major to minor; throws
  // InvalidArgument when coords do not give them).
  int64_t shard_count(const DimSplit& split) const;
  int64_t shard_index(const DimSplit& split) const;
  // Whether any operand is split (over a mesh axis of size > 1).
  bool sharded() const;
  // Throws InvalidArgument ("layout: ...") unless the mesh's axes are named (not empty,
  // none of the texts' ( ) [ ] , = or blanks, each once) with sizes >= 1 and every spec
  // names axes of the mesh, each for one dimension at most: what every op checks before
  // its own rules (an op's message starts with its name).
  void check() const;
  // A canonical text: the same for layouts that mean the same thing (trailing
  // unsplit dimensions and fully replicated operands dropped, operands sorted,
  // a split over an axis of size 1 counted as none, only the mesh axes that
  // split something kept, sorted by name), "" when nothing is split. Part of
  // kernel cache keys (the autotuner keys its choices by the local shapes the
  // shard runs, which is what its kernels see). Example: "mesh(tp=4) A[,tp] W[,tp]".
  // Of a layout that fails check(), the text may not parse back.
  std::string canonical() const;
  // The layout a canonical() text stands for ("" for none; coords left empty), e.g. to
  // name a layout on a command line (kerf-cache warm --layout). Throws InvalidArgument,
  // saying where, for text canonical() would not write.
  static Layout parse(const std::string& text);
};

}  // namespace kerf::ops
