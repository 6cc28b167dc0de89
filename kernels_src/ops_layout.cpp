// Sharding layouts: canonical text and the checks every sharded op runs first.
#include "ops_layout.h"

#include <algorithm>
#include <set>

#include "kerf/error.h"

namespace kerf::ops {

namespace {

// Whether mesh axis `axis` splits the dimension it is given for: named, and not of
// size 1 (one shard splits nothing).
bool splits_along(const Layout& layout, const std::string& axis) {
  return !axis.empty() && layout.axis_size(axis) != 1;
}

std::string quoted(const std::string& axis) { return "'" + axis + "'"; }

// The axes of `split` that split anything (size-1 axes dropped): what the split means.
DimSplit effective(const Layout& layout, const DimSplit& split) {
  DimSplit e;
  for (const std::string& a : split.axes)
    if (splits_along(layout, a)) e.axes.push_back(a);
  return e;
}

// The product of the sizes of `split`'s axes into *n; false when it passes 64 bits.
bool shard_product(const Layout& layout, const DimSplit& split, int64_t* n) {
  *n = 1;
  for (const std::string& a : split.axes)
    if (__builtin_mul_overflow(*n, layout.axis_size(a), n)) return false;
  return true;
}

// The characters canonical() writes around names: a name holding one could make two
// different layouts print alike, and would end a name where parse() reads one.
constexpr const char* kLayoutSyntax = "()[],= \t\n";

}  // namespace

std::string DimSplit::str() const {
  if (axes.empty()) return "None";
  if (axes.size() == 1) return quoted(axes[0]);
  std::string s = "(";
  for (size_t i = 0; i < axes.size(); ++i) s += (i ? ", " : "") + quoted(axes[i]);
  return s + ")";
}

const DimSplit& PartitionSpec::axes_of(size_t dim) const {
  static const DimSplit none;
  return dim < dims.size() ? dims[dim] : none;
}

std::string PartitionSpec::str() const {
  size_t n = dims.size();
  while (n > 0 && dims[n - 1].empty()) --n;
  std::string s = "P(";
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + dims[i].str();
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

int64_t Layout::shard_count(const DimSplit& split) const {
  for (const std::string& a : split.axes) {
    const int64_t size = axis_size(a);
    if (size < 1) {
      const bool named = std::any_of(mesh.begin(), mesh.end(), [&](const MeshAxis& m) { return m.name == a; });
      throw InvalidArgument(named ? "layout: mesh axis '" + a + "' must have size >= 1, got " + std::to_string(size)
                                  : "layout: the mesh has no axis '" + a + "'");
    }
  }
  int64_t n;
  if (!shard_product(*this, split, &n))
    throw InvalidArgument("layout: the shard count of " + split.str() + " overflows 64 bits");
  return n;
}

int64_t Layout::shard_index(const DimSplit& split) const {
  (void)shard_count(split);  // every axis is in the mesh, and no index below overflows
  int64_t c = 0;
  for (const std::string& a : split.axes) {
    const int64_t size = axis_size(a);
    if (size > 1) c = c * size + coord(a);  // an axis of size 1 needs no coordinate
  }
  return c;
}

bool Layout::sharded() const {
  for (const auto& [name, spec] : specs)
    for (const DimSplit& d : spec.dims)
      if (!effective(*this, d).empty()) return true;
  return false;
}

std::string Layout::canonical() const {
  // A split over an axis of size 1 splits nothing, and the mesh's axes are listed by name:
  // layouts that mean the same give the same text. A dimension split over several axes
  // prints them in order, in parentheses; one left of them prints as that axis alone.
  std::set<std::string> used;
  std::string ops_text;
  for (const auto& [name, spec] : specs) {  // std::map: sorted by operand name
    size_t n = spec.dims.size();
    while (n > 0 && effective(*this, spec.dims[n - 1]).empty()) --n;
    if (n == 0) continue;
    ops_text += " " + name + "[";
    for (size_t i = 0; i < n; ++i) {
      const DimSplit e = effective(*this, spec.dims[i]);
      std::string text;
      for (const std::string& a : e.axes) {
        text += (text.empty() ? "" : ",") + a;
        used.insert(a);
      }
      if (e.axes.size() > 1) text = "(" + text + ")";
      ops_text += (i ? "," : "") + text;
    }
    ops_text += "]";
  }
  if (used.empty()) return "";
  std::string mesh_text;
  for (const std::string& a : used)  // sorted
    mesh_text += (mesh_text.empty() ? "" : ",") + a + "=" + std::to_string(axis_size(a));
  return "mesh(" + mesh_text + ")" + ops_text;
}

namespace {

// A reader of canonical() text: names end at the characters the text uses around them.
class LayoutText {
 public:
  explicit LayoutText(const std::string& text) : t_(text) {}
  bool done() const { return i_ == t_.size(); }
  bool peek(char c) const { return i_ < t_.size() && t_[i_] == c; }
  void expect(char c) {
    if (!peek(c)) fail(std::string("'") + c + "'");
    ++i_;
  }
  void expect(const std::string& word) {
    if (t_.compare(i_, word.size(), word) != 0) fail("'" + word + "'");
    i_ += word.size();
  }
  std::string name() {
    const size_t end = t_.find_first_of(kLayoutSyntax, i_);
    const size_t stop = end == std::string::npos ? t_.size() : end;
    if (stop == i_) fail("a name");
    std::string n = t_.substr(i_, stop - i_);
    i_ = stop;
    return n;
  }
  int64_t size() {
    size_t j = i_;
    int64_t v = 0;
    while (j < t_.size() && t_[j] >= '0' && t_[j] <= '9') {
      if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, int64_t(t_[j] - '0'), &v))
        fail("a size within 64 bits");
      ++j;
    }
    if (j == i_) fail("a size");
    i_ = j;
    return v;
  }
  [[noreturn]] void fail(const std::string& wanted) const {
    throw InvalidArgument("layout text '" + t_ + "': expected " + wanted + " at position " + std::to_string(i_) +
                          " (the form Layout::canonical() writes, e.g. \"mesh(tp=4) A[,tp] W[,tp]\")");
  }

 private:
  const std::string& t_;
  size_t i_ = 0;
};

}  // namespace

Layout Layout::parse(const std::string& text) {
  Layout l;
  if (text.empty()) return l;
  LayoutText in(text);
  in.expect("mesh(");
  do {
    if (!l.mesh.empty()) in.expect(',');
    MeshAxis a;
    a.name = in.name();
    in.expect('=');
    a.size = in.size();
    l.mesh.push_back(a);
  } while (!in.peek(')'));
  in.expect(')');
  while (!in.done()) {
    in.expect(' ');
    const std::string operand = in.name();
    in.expect('[');
    PartitionSpec spec;
    for (bool first = true; !in.peek(']'); first = false) {
      if (!first) in.expect(',');
      DimSplit d;
      if (in.peek('(')) {
        in.expect('(');
        do {
          if (!d.axes.empty()) in.expect(',');
          d.axes.push_back(in.name());
        } while (!in.peek(')'));
        in.expect(')');
      } else if (!in.peek(',') && !in.peek(']')) {
        d.axes.push_back(in.name());
      }
      spec.dims.push_back(std::move(d));
    }
    in.expect(']');
    if (!l.specs.emplace(operand, std::move(spec)).second) in.fail("each operand once, not '" + operand + "' again");
  }
  return l;
}

namespace detail {

const DimSplit& LayoutSplits::of(const std::string& dim) const {
  static const DimSplit none;
  auto it = axes.find(dim);
  return it == axes.end() ? none : it->second;
}

std::string spec_text(const Layout& layout, const std::string& operand) {
  auto it = layout.specs.find(operand);
  return operand + " " + (it == layout.specs.end() ? PartitionSpec().str() : it->second.str());
}

namespace {

std::string split_words(const DimSplit& split) {
  return split.empty() ? "not split" : split.str();
}

}  // namespace

namespace {

// The mesh's axes: named (not empty, none of the texts' syntax, once each), sizes >= 1.
// Returns their names. `p` starts each message.
std::set<std::string> checked_mesh(const std::string& p, const Layout& layout) {
  std::set<std::string> names;
  for (const MeshAxis& a : layout.mesh) {
    if (a.name.empty()) throw InvalidArgument(p + "a mesh axis has an empty name");
    if (a.name.find_first_of(kLayoutSyntax) != std::string::npos)
      throw InvalidArgument(p + "mesh axis name '" + a.name +
                            "' holds one of ( ) [ ] , = or a blank, which kerf's layout texts use");
    if (!names.insert(a.name).second)
      throw InvalidArgument(p + "mesh axis '" + a.name + "' is named twice");
    if (a.size < 1)
      throw InvalidArgument(p + "mesh axis '" + a.name + "' must have size >= 1, got " +
                            std::to_string(a.size));
  }
  return names;
}

// Operand `name`'s spec names mesh axes the mesh has, each for one dimension at most.
void check_spec_axes(const std::string& p, const Layout& layout, const std::string& name,
                     const PartitionSpec& spec, const std::set<std::string>& names) {
  std::map<std::string, size_t> seen;  // axis -> the dimension it splits
  for (size_t d = 0; d < spec.dims.size(); ++d)
    for (const std::string& a : spec.dims[d].axes) {
      if (a.empty())
        throw InvalidArgument(p + spec_text(layout, name) +
                              " names a mesh axis with an empty name");
      if (!names.count(a))
        throw InvalidArgument(p + spec_text(layout, name) + " names mesh axis '" + a +
                              "', which the mesh lacks");
      const auto [at, fresh] = seen.emplace(a, d);
      if (!fresh)
        throw InvalidArgument(p + spec_text(layout, name) +
                              (at->second == d
                                   ? " names mesh axis '" + a + "' twice for one dimension"
                                   : " splits two dimensions over mesh axis '" + a + "'"));
    }
}

}  // namespace

LayoutSplits check_layout(const char* op, const Layout& layout,
                          const std::vector<OperandDims>& operands) {
  if (names_nothing(layout)) return {};
  const std::string p = std::string(op) + ": layout: ";
  const std::set<std::string> names = checked_mesh(p, layout);
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
      for (const DimSplit& d : spec.dims) all += (all.empty() ? "" : ", ") + d.str();
      throw InvalidArgument(p + name + " has rank " + std::to_string(od->dims.size()) + " but its spec P(" + all +
                            ") names " + std::to_string(spec.dims.size()) + " dimensions");
    }
    check_spec_axes(p, layout, name, spec, names);
  }
  LayoutSplits s;
  for (const OperandDims& o : operands) {
    auto it = layout.specs.find(o.name);
    const PartitionSpec none;
    const PartitionSpec& spec = it == layout.specs.end() ? none : it->second;
    for (size_t d = 0; d < o.dims.size(); ++d) {
      const std::string& dim = o.dims[d];
      // A mesh axis of size 1 splits nothing: such axes are dropped, and a dimension
      // left with none is whole.
      const DimSplit split = effective(layout, spec.axes_of(d));
      if (!spec.axes_of(d).empty()) s.named.insert(dim);
      auto known = s.axes.find(dim);
      if (known == s.axes.end()) {
        s.axes[dim] = split;
        s.fixed_by[dim] = o.name;
        s.fixed_at[dim] = d;
        continue;
      }
      if (known->second == split) continue;
      const std::string& other = s.fixed_by[dim];
      // Where each operand holds the dimension: two specs may print alike and split different dims.
      throw InvalidArgument(p + spec_text(layout, o.name) + " and " + spec_text(layout, other) +
                            " split dimension '" + dim + "' (" + o.name + "'s dim " + std::to_string(d) + ", " +
                            other + "'s dim " + std::to_string(s.fixed_at[dim]) + ") differently (" +
                            split_words(split) + " vs " + split_words(known->second) +
                            "); operands sharing a dimension must split it alike");
    }
  }
  // Two logical dimensions may not share a mesh axis either (a shard would then
  // hold a block that is not a product of local ranges).
  std::map<std::string, std::string> dim_of_axis;
  for (const auto& [dim, split] : s.axes)
    for (const std::string& axis : split.axes) {
      auto [it, fresh] = dim_of_axis.emplace(axis, dim);
      if (!fresh)
        throw InvalidArgument(p + spec_text(layout, s.fixed_by[dim]) + " and " +
                              spec_text(layout, s.fixed_by[it->second]) + " split dimensions '" + dim +
                              "' and '" + it->second + "' over the same mesh axis '" + axis + "'");
    }
  // Shard counts past 64 bits (a product of axis sizes) are refused here, once.
  for (const auto& [dim, split] : s.axes) {
    int64_t n;
    if (!shard_product(layout, split, &n))
      throw InvalidArgument(p + spec_text(layout, s.fixed_by[dim]) + " splits dimension '" + dim + "' over " +
                            split.str() + ", more shards than 64 bits count");
  }
  return s;
}

Layout layout_at_origin(const std::string& text) {
  Layout l = Layout::parse(text);
  l.coords.assign(l.mesh.size(), 0);
  return l;
}

void expect_unsplit(const char* op, const Layout& layout, const LayoutSplits& splits,
                    const std::string& dim, const std::string& why) {
  const DimSplit& split = splits.of(dim);
  if (split.empty()) return;
  throw InvalidArgument(std::string(op) + ": layout: " +
                        spec_text(layout, splits.fixed_by.at(dim)) + " splits dimension '" + dim +
                        "' over " + split.str() + ", which this op does not support: " + why);
}

}  // namespace detail

void Layout::check() const {
  const std::string p = "layout: ";
  const std::set<std::string> names = detail::checked_mesh(p, *this);
  for (const auto& [name, spec] : specs) detail::check_spec_axes(p, *this, name, spec, names);
}

}  // namespace kerf::ops
