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
// Operands not named in `specs` are replicated; a spec shorter than the
// operand's rank leaves the remaining dimensions whole. Splits are even:
// shard c of an axis of size n holds elements [c*local, (c+1)*local) of the
// dimension it splits. Operands whose specs cannot work together are
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

// Per dimension of one operand, the mesh axis that splits it ("" = not split).
struct PartitionSpec {
  std::vector<std::string> dims;

  PartitionSpec() = default;
  PartitionSpec(std::initializer_list<std::string> d) : dims(d) {}  // NOLINT
  explicit PartitionSpec(std::vector<std::string> d) : dims(std::move(d)) {}

  // The axis splitting dimension `dim` ("" when not split, or past the end).
  const std::string& axis_of(size_t dim) const;
  // As JAX prints it: "P(None, 'tp')"; "P()" when nothing is split.
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
  // Whether any operand is split (over a mesh axis of size > 1).
  bool sharded() const;
  // A canonical text: the same for layouts that mean the same thing (trailing
  // unsplit dimensions and fully replicated operands dropped, operands sorted,
  // a split over an axis of size 1 counted as none, only the mesh axes that
  // split something kept, sorted by name), "" when nothing is split. Part of
  // kernel cache keys (the autotuner keys its choices by the local shapes the
  // shard runs, which is what its kernels see). Example: "mesh(tp=4) A[,tp] W[,tp]".
  std::string canonical() const;
};

}  // namespace kerf::ops
