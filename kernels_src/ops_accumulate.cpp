#include "ops_accumulate.h"

#include <algorithm>
#include <climits>

#include "kerf/kernels/kernels.h"
#include "ops_checks.h"
#include "ops_common.h"

namespace kerf::ops::detail {

namespace {

// Tiles of about 2048 elements, as wide as the last dim allows.
dsl::MetaMap tile_meta(const TensorView& t, Grid* grid) {
  const int64_t bk = std::clamp<int64_t>(next_pow2(t.shape[2]), 16, 256);
  const int64_t bm = std::max<int64_t>(1, 2048 / bk);
  *grid =
      Grid{uint32_t(cdiv(t.shape[2], bk)), uint32_t(cdiv(t.shape[1], bm)), uint32_t(t.shape[0])};
  return {{"BLOCK_M", bm}, {"BLOCK_K", bk}};
}

// The dim along which t's elements are adjacent (the last such; -1: none). Dims of size 1
// have no neighbours.
int unit_dim(const TensorView& t) {
  for (int d = 2; d >= 0; --d)
    if (t.strides[size_t(d)] == 1 && t.shape[size_t(d)] > 1) return d;
  return -1;
}

// t with its dims in the order d0, d1, d2.
TensorView permuted(const TensorView& t, size_t d0, size_t d1, size_t d2) {
  return restride(t, {t.shape[d0], t.shape[d1], t.shape[d2]}, {t.strides[d0], t.strides[d1], t.strides[d2]});
}

// cast_3d's tile: [BLOCK_M, BLOCK_K] of a rank-3 view per program.
constexpr int64_t kCastRows = 8, kCastCols = 256;

}  // namespace

CopyLaunch plan_copy_3d(const TensorView& x, const TensorView& out, bool flush) {
  const int ux = unit_dim(x), uo = unit_dim(out);
  if (ux >= 0 && uo >= 0 && ux != uo) {
    // x as [D0, D1, D2] with its unit stride last and out's on D1; out as [D0, D2, D1].
    const size_t rest = size_t(3 - ux - uo), sx = size_t(ux), so = size_t(uo);
    const TensorView xk = permuted(x, rest, so, sx), ok = permuted(out, rest, sx, so);
    const int64_t d0 = xk.shape[0], d1 = xk.shape[1], d2 = xk.shape[2];
    // Tiles of 4096 elements at most, each side at least 8 (a 16-byte vector of 2-byte elements).
    const int64_t bj = std::clamp<int64_t>(next_pow2(d2), 8, 64);
    const int64_t bi = std::clamp<int64_t>(next_pow2(d1), 8, std::max<int64_t>(64, 4096 / bj));
    const int64_t programs_x = cdiv(d2, bj) * d0;
    if (programs_x <= int64_t(INT32_MAX) && cdiv(d1, bi) <= 65535) {
      dsl::MetaMap meta = {{"BLOCK_M", bi}, {"BLOCK_K", bj}};
      if (flush) meta["FLUSH"] = 1;
      return {{&kernels::transpose_3d(), {xk, ok}, meta}, Grid{uint32_t(programs_x), uint32_t(cdiv(d1, bi)), 1}};
    }
  }
  if (flush) {
    Grid grid;
    const dsl::MetaMap meta = tile_meta(out, &grid);
    return {{&kernels::flush_accumulator(), {x, out}, meta}, grid};
  }
  return {{&kernels::cast_3d(), {x, out}, {{"BLOCK_M", kCastRows}, {"BLOCK_K", kCastCols}}},
          Grid{uint32_t(cdiv(out.shape[2], kCastCols)), uint32_t(cdiv(out.shape[1], kCastRows)),
               uint32_t(out.shape[0])}};
}

bool fill_3d(const TensorView& t, double value, const LaunchOptions& options, bool release, bool keep_in_l2) {
  if (t.numel() == 0) return false;
  Grid grid;
  dsl::MetaMap meta = tile_meta(t, &grid);
  if (release) meta["RELEASE"] = 1;
  if (keep_in_l2) meta["EVICT_LAST"] = 1;
  launch(kernels::fill_3d(), {t, Scalar(value)}, grid, meta, options);
  return true;
}

bool fill_pair_3d(const TensorView& a, const TensorView& b, double value, const LaunchOptions& options,
                  bool release, bool keep_in_l2) {
  if (a.numel() == 0) return fill_3d(b, value, options, release, keep_in_l2);
  if (b.numel() == 0) return fill_3d(a, value, options, release, keep_in_l2);
  Grid ga, gb;
  const dsl::MetaMap ma = tile_meta(a, &ga), mb = tile_meta(b, &gb);
  const int64_t tiles = int64_t(ga.x) * ga.y * ga.z + int64_t(gb.x) * gb.y * gb.z;
  dsl::MetaMap meta = {{"BLOCK_M0", ma.at("BLOCK_M")}, {"BLOCK_K0", ma.at("BLOCK_K")},
                       {"BLOCK_M1", mb.at("BLOCK_M")}, {"BLOCK_K1", mb.at("BLOCK_K")}};
  if (release) meta["RELEASE"] = 1;
  if (keep_in_l2) meta["EVICT_LAST"] = 1;
  launch(kernels::fill_pair(), {a, b, Scalar(value)}, Grid{uint32_t(tiles), 1, 1}, meta, options);
  return true;
}

bool zero_fills(const TensorView& a, bool zero_a, const TensorView& b, bool zero_b, const LaunchOptions& options,
                bool release, bool keep_in_l2) {
  if (zero_a && zero_b) return fill_pair_3d(a, b, 0.0, options, release, keep_in_l2);
  if (zero_a) return fill_3d(a, 0.0, options, release, keep_in_l2);
  if (zero_b) return fill_3d(b, 0.0, options, release, keep_in_l2);
  return false;
}

void flush_accumulator(const TensorView& acc, const TensorView& out, const LaunchOptions& options,
                       bool overlap) {
  if (out.numel() == 0) return;
  CopyLaunch c = plan_copy_3d(acc, out, true);
  LaunchOptions o = options;
  if (overlap && out.device.is_cuda()) {
    c.call.meta["WAIT_PRIOR"] = 1;
    o.overlap_prior = true;
  }
  launch(*c.call.kernel, c.call.args, c.grid, c.call.meta, o);
}

size_t carved_bytes(int64_t d0, int64_t d1, int64_t d2) {
  return (size_t(d0 * d1 * d2) * 4 + 15) / 16 * 16;
}

TensorView carve_f32(char** cursor, int64_t d0, int64_t d1, int64_t d2, const Device& dev) {
  TensorView v = TensorView::contiguous(*cursor, DType::f32, {d0, d1, d2}, dev);
  *cursor += carved_bytes(d0, d1, d2);
  return v;
}

TensorView as_3d(const TensorView& t) {
  return TensorView::strided(t.data, t.dtype, {1, t.shape[0], t.shape[1]},
                             {0, t.strides[0], t.strides[1]}, t.device);
}

}  // namespace kerf::ops::detail
