// How a tile is spread over the threads of a CTA: a linear layout.
//
// Each bit of (register index, lane, warp) contributes a power of two to one
// coordinate of the tile, or nothing (a zero basis: those threads or
// registers hold copies). The coordinate of register r of thread
// (warp w, lane l) is the sum of the contributions of the set bits of r, l
// and w; within one dimension the contributions are distinct powers of two,
// so "sum" and "or" agree. Tile dimensions are powers of two, so every
// layout kerf needs (blocked, MMA fragments, their slices) is one of these.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kerf/jit/ir.h"

namespace kerf::jit::cuda {

struct Basis {
  int dim = -1;       // -1: contributes nothing (replication)
  int64_t value = 0;  // a power of two

  bool zero() const { return dim < 0; }
  bool operator==(const Basis& o) const { return dim == o.dim && value == o.value; }
};

struct Layout {
  ir::Shape shape;
  std::vector<Basis> reg;   // never zero
  std::vector<Basis> lane;  // 5 entries
  std::vector<Basis> warp;  // log2(num_warps) entries

  int rank() const { return int(shape.size()); }
  int num_regs() const { return 1 << reg.size(); }
  int num_warps() const { return 1 << warp.size(); }
  // Coordinate of register r along dimension d (the register part only).
  int64_t reg_coord(int r, int d) const;
  // Lanes / warps whose bit does not change the coordinate (their threads hold copies).
  uint32_t replicated_lane_mask() const;
  uint32_t replicated_warp_mask() const;
  // How many consecutive registers (from a multiple of it) step by 1 along `dim`.
  int contiguous_regs(int dim) const;
  std::string key() const;  // canonical text, for interning and comments
  bool operator==(const Layout& o) const {
    return shape == o.shape && reg == o.reg && lane == o.lane && warp == o.warp;
  }
  // Throws InternalError unless each dimension is covered exactly once.
  void check() const;
};

// A coalesced layout: `vec` consecutive elements of the last dimension per
// thread, lanes along the last dimension first, warps along the first.
Layout blocked_layout(const ir::Shape& shape, int num_warps, int vec);

// The f32 accumulator of mma.sync.m16n8k16 for an [M, N] tile, with warps
// split `warps_m` x `warps_n` (copies where the tile is too small).
Layout mma_acc_layout(const ir::Shape& shape, int num_warps, int warps_m, int warps_n);
// The f32 accumulator of wgmma.m64nNk16 for an [M, N] tile: as mma_acc_layout
// (each warp 16 rows of an m16 tile, warps_m a multiple of 4 so that a
// warpgroup holds 64 consecutive rows), but each warp's columns are one range
// of N / warps_n, as one wgmma instruction writes them.
Layout wgmma_acc_layout(const ir::Shape& shape, int num_warps, int warps_m, int warps_n);
// mma_acc_layout with its columns numbered differently: each thread's first
// registers hold `run` consecutive columns (then its lanes' columns, then its
// other n tiles, then the warps' ranges), so that a tile in this layout is
// read and written straight from registers in `run`-element vectors. The
// instructions still write the accumulator in mma_acc_layout's register
// order; a dot in this layout multiplies by a B operand whose columns were
// put in the instructions' order (see `hw_to_logical`).
struct RunAcc {
  Layout layout;
  // Storage register bit j (mma_acc_layout's order) <- bit kept[j] of the layout's
  // registers (Tile::kept).
  std::vector<int> kept;
  // Bit i of a column as mma numbers it (mma_acc_layout) is bit hw_to_logical[i]
  // of the column in this layout.
  std::vector<int> hw_to_logical;
};
RunAcc mma_acc_layout_runs(const ir::Shape& shape, int num_warps, int warps_m, int warps_n, int run);
// `l` with the coordinates along `dim` renumbered bit by bit: a basis of value
// 2^i becomes 2^bit_map[i] (a permutation of that dimension's bits).
Layout map_dim_bits(const Layout& l, int dim, const std::vector<int>& bit_map);

// Chooses warps_m x warps_n for an [M, N] accumulator: rows first, or with
// want_warps_n > 0 up to that many warps on columns first (more where the rows
// run out, rather than warps that copy others' work).
void mma_warp_split(const ir::Shape& shape, int num_warps, int want_warps_n, int* warps_m, int* warps_n);

// A layout derived from another by dropping register bits (and renaming
// dimensions); `kept[j]` is the register bit of the source layout that
// became register bit j.
struct Derived {
  Layout layout;
  std::vector<int> kept;
};

// The layout of a reduction's result along `axis`: that dimension is dropped,
// its register bits summed away, its lane and warp bits become copies.
Derived slice_layout(const Layout& l, int axis);
// The layout of x when expand_dims(x, axis) is wanted in `l` (dim `axis` has size 1).
Derived squeeze_layout(const Layout& l, int axis);
// The layout of x when broadcast(x) is wanted in `l`: dimensions where x has
// size 1 lose their bits.
Derived unbroadcast_layout(const Layout& l, const ir::Shape& x_shape);
// The layout of x when trans(x) is wanted in `l`.
Derived transpose_layout(const Layout& l);

// Register index in a derived layout's storage of register `r` of the source:
// a bit-extraction expression over the C++ expression `r`.
std::string reg_map_expr(const std::vector<int>& kept, const std::string& r);
bool is_identity(const std::vector<int>& kept, int num_reg_bits);

}  // namespace kerf::jit::cuda
