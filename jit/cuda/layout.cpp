#include "layout.h"

#include <algorithm>

#include "kerf/error.h"

namespace kerf::jit::cuda {
namespace {

int log2i(int64_t x) {
  int n = 0;
  while ((int64_t(1) << n) < x) ++n;
  return n;
}

// Hands out the bits of each dimension from the lowest up.
class BitPool {
 public:
  explicit BitPool(const ir::Shape& shape) {
    for (int64_t s : shape) {
      left_.push_back(log2i(s));
      next_.push_back(1);
    }
  }
  bool has(int d) const { return left_[size_t(d)] > 0; }
  Basis take(int d) {
    Basis b{d, next_[size_t(d)]};
    next_[size_t(d)] *= 2;
    left_[size_t(d)]--;
    return b;
  }
  // The bits of an m16n8 fragment (cols 1, 2, 4 and rows 1, 2, 4, 8), as fragment_16x8 uses them.
  void take_fragment_bits() {
    for (int i = 0; i < 3; ++i) take(1);
    for (int i = 0; i < 4; ++i) take(0);
  }

 private:
  std::vector<int> left_;
  std::vector<int64_t> next_;
};

std::string basis_list(const std::vector<Basis>& v) {
  std::string s;
  for (const Basis& b : v) {
    if (!s.empty()) s += ",";
    s += b.zero() ? "_" : std::to_string(b.dim) + ":" + std::to_string(b.value);
  }
  return s;
}

// Renumbers dimensions after dropping `axis`.
Basis drop_dim(Basis b, int axis) {
  if (b.zero()) return b;
  if (b.dim == axis) return Basis{};
  if (b.dim > axis) b.dim--;
  return b;
}

}  // namespace

int64_t Layout::reg_coord(int r, int d) const {
  int64_t c = 0;
  for (size_t i = 0; i < reg.size(); ++i)
    if ((r >> i) & 1)
      if (reg[i].dim == d) c += reg[i].value;
  return c;
}

uint32_t Layout::replicated_lane_mask() const {
  uint32_t m = 0;
  for (size_t i = 0; i < lane.size(); ++i)
    if (lane[i].zero()) m |= 1u << i;
  return m;
}

uint32_t Layout::replicated_warp_mask() const {
  uint32_t m = 0;
  for (size_t i = 0; i < warp.size(); ++i)
    if (warp[i].zero()) m |= 1u << i;
  return m;
}

int Layout::contiguous_regs(int dim) const {
  int n = 1;
  for (size_t i = 0; i < reg.size(); ++i) {
    if (reg[i].dim != dim || reg[i].value != n) break;
    n *= 2;
  }
  return n;
}

std::string Layout::key() const {
  return ir::shape_string(shape) + "{r:" + basis_list(reg) + " l:" + basis_list(lane) +
         " w:" + basis_list(warp) + "}";
}

void Layout::check() const {
  for (int d = 0; d < rank(); ++d) {
    int64_t covered = 0;
    auto add = [&](const Basis& b) {
      if (b.dim != d) return;
      if (covered & b.value) throw InternalError("layout " + key() + " covers a bit twice");
      covered |= b.value;
    };
    for (const Basis& b : reg) {
      if (b.zero()) throw InternalError("layout " + key() + " has a zero register basis");
      add(b);
    }
    for (const Basis& b : lane) add(b);
    for (const Basis& b : warp) add(b);
    if (covered != shape[size_t(d)] - 1)
      throw InternalError("layout " + key() + " does not cover dimension " + std::to_string(d));
  }
}

Layout blocked_layout(const ir::Shape& shape, int num_warps, int vec) {
  Layout l;
  l.shape = shape;
  const int r = int(shape.size());
  const int warp_bits = log2i(num_warps);
  if (r == 0) {
    l.lane.assign(5, Basis{});
    l.warp.assign(size_t(warp_bits), Basis{});
    return l;
  }
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  // Spread the tile over the whole CTA before giving a thread several vectors.
  const int64_t threads = 32 * int64_t(num_warps);
  int64_t v = std::min<int64_t>(vec, shape[size_t(r - 1)]);
  while (v > 1 && numel / v < threads) v /= 2;
  BitPool pool(shape);
  for (int i = 0; i < log2i(v); ++i) l.reg.push_back(pool.take(r - 1));
  for (int i = 0; i < 5; ++i) {
    int d = r - 1;
    while (d >= 0 && !pool.has(d)) --d;
    l.lane.push_back(d >= 0 ? pool.take(d) : Basis{});
  }
  for (int i = 0; i < warp_bits; ++i) {
    int d = 0;
    while (d < r && !pool.has(d)) ++d;
    l.warp.push_back(d < r ? pool.take(d) : Basis{});
  }
  for (int d = r - 1; d >= 0; --d)
    while (pool.has(d)) l.reg.push_back(pool.take(d));
  l.check();
  return l;
}

namespace {

// The part every tensor-core accumulator shares: the f32 C fragment of an
// m16n8 tile (registers: col 1, row 8; lanes: cols 2, 4, rows 1, 2, 4).
Layout fragment_16x8(const ir::Shape& shape) {
  BitPool pool(shape);
  const Basis c1 = pool.take(1), c2 = pool.take(1), c4 = pool.take(1);
  const Basis r1 = pool.take(0), r2 = pool.take(0), r4 = pool.take(0), r8 = pool.take(0);
  Layout l;
  l.shape = shape;
  l.reg = {c1, r8};
  l.lane = {c2, c4, r1, r2, r4};
  return l;
}

}  // namespace

Layout wgmma_acc_layout(const ir::Shape& shape, int num_warps, int warps_m, int warps_n) {
  if (shape.size() != 2 || shape[0] < 64 || shape[1] < 8 * warps_n || warps_m % 4)
    throw InternalError("wgmma accumulator layout needs an [M>=64, N] tile and warps_m a multiple of 4, got " +
                        ir::shape_string(shape));
  Layout l = fragment_16x8(shape);
  BitPool pool(shape);
  pool.take_fragment_bits();
  for (int w = 1; w < warps_m; w *= 2) l.warp.push_back(pool.take(0));
  // A warp's n tiles are consecutive: the low column bits stay in registers and
  // the warps along N take the high ones, so that each warpgroup's columns are one range.
  std::vector<Basis> n_tiles;
  const int64_t per_warp_n = shape[1] / warps_n;
  for (int64_t c = 8; c < per_warp_n; c *= 2) n_tiles.push_back(pool.take(1));
  for (int w = 1; w < warps_n; w *= 2) l.warp.push_back(pool.take(1));
  for (int w = warps_m * warps_n; w < num_warps; w *= 2) l.warp.push_back(Basis{});  // copies
  for (const Basis& b : n_tiles) l.reg.push_back(b);
  while (pool.has(0)) l.reg.push_back(pool.take(0));  // m tiles
  l.check();
  return l;
}

void mma_warp_split(const ir::Shape& shape, int num_warps, int want_warps_n, int* warps_m, int* warps_n) {
  int wm = 1, wn = 1;
  if (want_warps_n > 0) {  // columns first, as asked, then rows, then columns again
    while (wn * 2 <= want_warps_n && wn * 2 <= num_warps && int64_t(wn * 2) * 8 <= shape[1]) wn *= 2;
    while (wm * wn * 2 <= num_warps && int64_t(wm * 2) * 16 <= shape[0]) wm *= 2;
    while (wm * wn * 2 <= num_warps && int64_t(wn * 2) * 8 <= shape[1]) wn *= 2;
  } else {
    while (wm * 2 <= num_warps && int64_t(wm * 2) * 16 <= shape[0]) wm *= 2;
    while (wm * wn * 2 <= num_warps && int64_t(wn * 2) * 8 <= shape[1]) wn *= 2;
  }
  *warps_m = wm;
  *warps_n = wn;
}

Layout mma_acc_layout(const ir::Shape& shape, int num_warps, int warps_m, int warps_n) {
  if (shape.size() != 2 || shape[0] < 16 || shape[1] < 8)
    throw InternalError("mma accumulator layout needs an [M>=16, N>=8] tile, got " +
                        ir::shape_string(shape));
  Layout l = fragment_16x8(shape);
  BitPool pool(shape);
  pool.take_fragment_bits();
  for (int w = 1; w < warps_m; w *= 2) l.warp.push_back(pool.has(0) ? pool.take(0) : Basis{});
  for (int w = 1; w < warps_n; w *= 2) l.warp.push_back(pool.has(1) ? pool.take(1) : Basis{});
  for (int w = warps_m * warps_n; w < num_warps; w *= 2) l.warp.push_back(Basis{});  // copies
  while (pool.has(1)) l.reg.push_back(pool.take(1));  // n tiles
  while (pool.has(0)) l.reg.push_back(pool.take(0));  // m tiles
  l.check();
  return l;
}

RunAcc mma_acc_layout_runs(const ir::Shape& shape, int num_warps, int warps_m, int warps_n, int run) {
  const Layout hw = mma_acc_layout(shape, num_warps, warps_m, warps_n);
  const int bits = log2i(shape[1]);
  RunAcc out;
  out.hw_to_logical.assign(size_t(bits), -1);
  int next = 0;
  const auto number = [&](const Basis& b) { out.hw_to_logical[size_t(log2i(b.value))] = next++; };
  // The column bits of the registers (the pair, then the n tiles), in mma's order.
  std::vector<size_t> reg_cols;
  for (size_t i = 0; i < hw.reg.size(); ++i)
    if (hw.reg[i].dim == 1) reg_cols.push_back(i);
  const size_t first = std::min(reg_cols.size(), size_t(log2i(std::max(run, 1))));
  for (size_t k = 0; k < first; ++k) number(hw.reg[reg_cols[k]]);
  for (const Basis& b : hw.lane)
    if (b.dim == 1) number(b);
  for (size_t k = first; k < reg_cols.size(); ++k) number(hw.reg[reg_cols[k]]);
  for (const Basis& b : hw.warp)
    if (b.dim == 1) number(b);
  if (next != bits) throw InternalError("mma_acc_layout_runs: the columns of " + hw.key() + " are not all covered");
  // Registers: the run's column bits first, then the others in mma's order.
  std::vector<size_t> order(reg_cols.begin(), reg_cols.begin() + std::ptrdiff_t(first));
  for (size_t i = 0; i < hw.reg.size(); ++i)
    if (std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
  const Layout renamed = map_dim_bits(hw, 1, out.hw_to_logical);
  out.layout = renamed;
  out.kept.assign(order.size(), 0);
  for (size_t j = 0; j < order.size(); ++j) {
    out.layout.reg[j] = renamed.reg[order[j]];
    out.kept[order[j]] = int(j);
  }
  out.layout.check();
  return out;
}

Layout map_dim_bits(const Layout& l, int dim, const std::vector<int>& bit_map) {
  const auto map = [&](Basis b) {
    if (b.dim == dim) b.value = int64_t(1) << bit_map.at(size_t(log2i(b.value)));
    return b;
  };
  Layout out = l;
  for (Basis& b : out.reg) b = map(b);
  for (Basis& b : out.lane) b = map(b);
  for (Basis& b : out.warp) b = map(b);
  out.check();
  return out;
}

Derived slice_layout(const Layout& l, int axis) {
  Derived out;
  out.layout.shape = l.shape;
  out.layout.shape.erase(out.layout.shape.begin() + axis);
  for (size_t i = 0; i < l.reg.size(); ++i) {
    if (l.reg[i].dim == axis) continue;
    out.layout.reg.push_back(drop_dim(l.reg[i], axis));
    out.kept.push_back(int(i));
  }
  for (const Basis& b : l.lane) out.layout.lane.push_back(drop_dim(b, axis));
  for (const Basis& b : l.warp) out.layout.warp.push_back(drop_dim(b, axis));
  out.layout.check();
  return out;
}

Derived squeeze_layout(const Layout& l, int axis) {
  if (l.shape[size_t(axis)] != 1) throw InternalError("squeeze of a dimension of size > 1");
  return slice_layout(l, axis);
}

Derived unbroadcast_layout(const Layout& l, const ir::Shape& x_shape) {
  Derived out;
  out.layout.shape = x_shape;
  auto keep = [&](const Basis& b) {
    return b.zero() || x_shape[size_t(b.dim)] != 1 ? b : Basis{};
  };
  for (size_t i = 0; i < l.reg.size(); ++i) {
    if (x_shape[size_t(l.reg[i].dim)] == 1) continue;
    out.layout.reg.push_back(l.reg[i]);
    out.kept.push_back(int(i));
  }
  for (const Basis& b : l.lane) out.layout.lane.push_back(keep(b));
  for (const Basis& b : l.warp) out.layout.warp.push_back(keep(b));
  out.layout.check();
  return out;
}

Derived transpose_layout(const Layout& l) {
  Derived out;
  out.layout.shape = {l.shape[1], l.shape[0]};
  auto swap = [](Basis b) {
    if (!b.zero()) b.dim = 1 - b.dim;
    return b;
  };
  for (size_t i = 0; i < l.reg.size(); ++i) {
    out.layout.reg.push_back(swap(l.reg[i]));
    out.kept.push_back(int(i));
  }
  for (const Basis& b : l.lane) out.layout.lane.push_back(swap(b));
  for (const Basis& b : l.warp) out.layout.warp.push_back(swap(b));
  return out;
}

bool is_identity(const std::vector<int>& kept, int num_reg_bits) {
  if (int(kept.size()) != num_reg_bits) return false;
  for (size_t j = 0; j < kept.size(); ++j)
    if (kept[j] != int(j)) return false;
  return true;
}

std::string reg_map_expr(const std::vector<int>& kept, const std::string& r) {
  if (kept.empty()) return "0";
  // Group runs of consecutive source bits into one shift-and-mask term.
  std::string expr;
  size_t j = 0;
  while (j < kept.size()) {
    size_t k = j;
    while (k + 1 < kept.size() && kept[k + 1] == kept[k] + 1) ++k;
    const int src = kept[j];
    const int len = int(k - j + 1);
    const int dst = int(j);
    std::string term = "(((" + r + ") >> " + std::to_string(src) + ") & " +
                       std::to_string((1 << len) - 1) + ")";
    if (dst) term = "(" + term + " << " + std::to_string(dst) + ")";
    expr += (expr.empty() ? "" : " | ") + term;
    j = k + 1;
  }
  return "(" + expr + ")";
}

}  // namespace kerf::jit::cuda
