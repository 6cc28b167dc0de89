// The CUDA code generator's state and steps, shared by the files that
// implement it: codegen.cpp (analysis, layouts, statements), codegen_values.cpp
// (scalars, tiles, layout conversions), codegen_memory.cpp (loads, stores,
// atomics), codegen_pipeline.cpp (cp.async software pipelining), codegen_dot.cpp
// (tensor-core and FMA dots) and codegen_reduce.cpp (reductions).
#pragma once

#include <algorithm>
#include <cstdio>
#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "device_library.h"
#include "jit/ir/axis_info.h"
#include "kerf/error.h"
#include "kerf/jit/abi.h"
#include "kerf/jit/cuda_codegen.h"
#include "layout.h"

namespace kerf::jit::cuda::detail {

using ir::Operation;
using ir::OpKind;
using ir::Shape;
using ir::ValueId;

inline std::string S(int64_t v) {
  return std::to_string(v);
}

inline int log2i(int64_t x) {
  int n = 0;
  while ((int64_t(1) << n) < x) ++n;
  return n;
}

// C++ type that holds one element in registers and memory.
inline std::string storage_type(DType t) {
  switch (t) {
    case DType::i1:
      return "bool";
    case DType::i32:
      return "int";
    case DType::i64:
      return "long long";
    case DType::f16:
    case DType::bf16:
      return "unsigned short";
    case DType::f32:
      return "float";
    case DType::f64:
      return "double";
    case DType::u8:
      return "unsigned char";
  }
  return "?";
}

// Type arithmetic happens in: 16-bit floats compute in f32.
inline DType compute_dtype(DType t) {
  return is_half(t) ? DType::f32 : t;
}
inline std::string compute_type(DType t) {
  return storage_type(compute_dtype(t));
}

inline std::string to_compute(DType t, const std::string& x) {
  if (t == DType::bf16) return "kerf_dev::bf16_to_f32(" + x + ")";
  if (t == DType::f16) return "kerf_dev::f16_to_f32(" + x + ")";
  return x;
}

inline std::string from_compute(DType t, const std::string& x) {
  if (t == DType::bf16) return "kerf_dev::f32_to_bf16(" + x + ")";
  if (t == DType::f16) return "kerf_dev::f32_to_f16(" + x + ")";
  return x;
}

inline std::string float_literal(double v, DType t) {
  if (v != v)
    return t == DType::f64 ? "__longlong_as_double(0x7ff8000000000000LL)"
                           : "__int_as_float(0x7fc00000)";
  if (v == 1.0 / 0.0)
    return t == DType::f64 ? "__longlong_as_double(0x7ff0000000000000LL)"
                           : "__int_as_float(0x7f800000)";
  if (v == -1.0 / 0.0)
    return t == DType::f64 ? "__longlong_as_double(0xfff0000000000000LL)"
                           : "__int_as_float(0xff800000)";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  std::string s = buf;
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return t == DType::f64 ? s : s + "f";
}

inline std::string int_literal(int64_t v, DType t) {
  if (t == DType::i64) return "(" + S(v) + "LL)";
  if (t == DType::i1) return v ? "true" : "false";
  if (t == DType::u8) return "((unsigned char)" + S(v & 255) + ")";
  if (v == INT32_MIN) return "(-2147483647 - 1)";
  return S(v);
}

// Converts a compute-typed expression of dtype `from` to storage of dtype `to`.
inline std::string convert(DType from, DType to, const std::string& x) {
  if (from == to) return x;
  if (to == DType::i1) return "(" + to_compute(from, x) + " != 0)";
  const std::string c = to_compute(from, x);
  if (is_half(to)) {
    const char* half = to == DType::bf16 ? "bf16" : "f16";
    if (from == DType::f64) return std::string("kerf_dev::f64_to_") + half + "(" + c + ")";
    // i32 values beyond 2^24 would round twice through f32; i64 through f64 exactly or to odd.
    if (from == DType::i32 || from == DType::i64 || from == DType::u8)
      return std::string("kerf_dev::i64_to_") + half + "((long long)(" + c + "))";
    return from_compute(to, is_float(from) ? c : "(float)(" + c + ")");
  }
  if (to == DType::u8 && is_float(from)) return "kerf_dev::f_to_u8(" + c + ")";
  return "(" + storage_type(to) + ")(" + c + ")";
}

struct Tile {
  std::string name;       // register array (or a scalar expression when `scalar`)
  bool scalar = false;    // the same value for every register
  std::vector<int> kept;  // storage register bit j <- requested layout's register bit kept[j]
  bool identity = true;
};

struct Staged {        // a rank-2 tile written row-major into shared memory
  std::string offset;  // byte offset into kerf_smem (a C++ expression)
  int64_t pitch = 0;   // elements per row
  // The shared memory holds the tile's transpose (a trans() of a staged or
  // pipelined tile reads the same bytes the other way round).
  bool transposed = false;
  // Non-zero: the tile is in wgmma's 128-byte-swizzled layout (see sw128_candidate)
  // with this many rows, not row-major with `pitch`.
  int64_t sw_rows = 0;
  // The tile is [rows, 16] in wgmma's 32-byte-swizzled layout (see sw32_candidate).
  bool sw32 = false;
};

// Code and emitted tiles of one loop level.
struct Frame {
  std::string code;
  std::map<std::pair<ValueId, int>, Tile> memo;
  // Every thread has passed a barrier since the previous run of this frame's
  // code (the kernel's own frame, or a pipelined loop body after its wait).
  bool fenced = false;
};

// A load inside a pipelined loop: copied global -> shared memory with
// cp.async, `stages` iterations ahead, into a ring of buffers.
struct AsyncLoad {
  int ring_offset = 0;      // bytes into kerf_smem
  int64_t stage_bytes = 0;  // one tile, rows padded
  std::vector<int64_t> pitch;
  std::string stage;  // C++ expression: the ring slot of this iteration
  int64_t sw_rows = 0;   // non-zero: slots in wgmma's 128-byte-swizzled layout (Staged::sw_rows)
  bool sw32 = false;     // slots in wgmma's 32-byte-swizzled layout (Staged::sw32)
  std::string base;      // C++ expression: the byte offset of slot 0 (1024-aligned when swizzled)
  int64_t region_bytes = 0;  // bytes allocated for the ring
};

class Codegen {
 public:
  // ---- entry (codegen.cpp)
  Codegen(const ir::Function& f, const std::string& arch);

  KernelCode run();

 private:
  // ---- analysis (codegen.cpp)

  bool is_pure(OpKind k) const;

  // Records each value's defining op and placement level.
  void scan_block(const ir::Block& b, int level);

  const ir::Type& type(ValueId v) const;

  void choose_blocked_vectors(const ir::Block& b);

  int blocked(const Shape& shape);

  bool mma_eligible(const Operation& op) const;

  // wgmma (sm_90a, kernel meta wgmma=1): a tensor-core dot whose B operand is a
  // 16-bit [rows, cols] tile (or its trans()) with rows % 8 == 0 and cols % 64
  // == 0, read by nothing but tensor-core dots, so that it may live in shared
  // memory in the 128-byte-swizzled layout wgmma reads (element (r, c) at
  // sw128 offset: 64-column blocks of rows x 128 bytes, 16-byte chunk c/8 of
  // row r at chunk (c/8) ^ (r % 8)), and whose warp split gives each
  // warpgroup 64 consecutive rows per m tile.
  bool wgmma_dot(const Operation& op) const;
  // The value a dot operand is staged from (under a trans() of the same dtype).
  ValueId dot_source(ValueId v, bool* transposed) const;
  bool sw128_candidate(ValueId v) const;
  // With meta wgmma_ss, a 16-bit [rows, 16] tile with rows % 8 == 0, read by nothing but
  // dots as their B operand (no trans()) whose warp split gives each warpgroup all 16
  // columns: it may live in shared memory in the 32-byte-swizzled layout wgmma reads as
  // an MN-major B (rows of 32 bytes, the 16-byte chunk c/8 of row r at chunk
  // (c/8) ^ ((r / 4) % 2)).
  bool sw32_candidate(ValueId v) const;
  // Whether a tensor-core dot's warp split lets it run as wgmma (each warpgroup 64
  // consecutive rows per m tile); sets the columns of one warpgroup.
  bool wgmma_split(const Operation& op, int64_t* cols_per_warpgroup) const;
  // The row padding (elements) of `v`'s tile in shared memory: 8 floats where every use
  // reads it one 32-bit register at a time for a TF32 dot (rows k, a warp's lanes 4 k's by
  // 8 columns: conflict-free at a pitch of 8 mod 32 words, i.e. rows of 16 floats or more
  // a multiple of 32 apart), else the default (-1).
  int64_t smem_pad(ValueId v) const;

  int acc_layout(const Operation& op);
  // Whether the dot may use mma_acc_layout_runs (meta acc_col_run): mma.sync
  // (not wgmma), B staged row-major from a value no other dot reads.
  bool runs_eligible(const Operation& op) const;
  // Gives the values (used once) that a dot in a runs layout accumulates onto,
  // or that are combined elementwise with its result, and the casts and loads
  // they come from, that layout as their preference: loads read straight into it.
  void prefer_runs_for_acc_inputs();

  int merge_prefs(const std::vector<int>& ls) const;

  // A layout each expensive value would like to live in.
  void compute_prefs(const ir::Block& b);

  // ---- layouts (codegen.cpp)

  int intern(const Layout& l);

  bool thread_part_nonzero(int l, int d) const;

  // Coordinate along `d` of register `r` (a C++ expression) of layout `l`.
  std::string coord(int l, int d, const std::string& r);

  std::string prologue();

  // True when this thread is the first of the threads holding copies of its elements.
  std::string owner_predicate(int l) const;

  // ---- code buffers (codegen.cpp)

  Frame& frame(int level);
  int depth() const;

  void line(int level, const std::string& s);

  const Tile* find_memo(const std::pair<ValueId, int>& key);

  // Opens a fresh frame for `level` (a loop body, or a prefetch block that
  // stands in for one); returns the frame it replaced, or -1 for a new level.
  int open_frame(int level);

  // Closes the frame of `level` and returns its code.
  std::string close_frame(int level, int replaced);

  std::string fresh(const std::string& base);

  int alloc_smem(int64_t bytes);
  int take_smem(int64_t bytes, int align);

  std::string elem(const Tile& t, const std::string& r) const;

  // A Tile of a value requested in layout `l`, given the tile of that value in
  // a layout derived from `l` by dropping register bits.
  Tile compose(Tile inner, const Derived& d, int l) const;

  // ---- scalars (codegen_values.cpp)

  std::string scalar(ValueId v);

  // The expression of an elementwise op on storage-typed operand expressions.
  template <class DtypeOf>
  std::string elementwise_expr(const Operation& op, const std::vector<std::string>& x,
                               DtypeOf dtype_of) {
    const DType rt = type(op.results[0]).dtype;
    if (op.kind == OpKind::Cast) return convert(dtype_of(0), rt, x[0]);
    if (op.kind == OpKind::Select) return "(" + x[0] + " ? " + x[1] + " : " + x[2] + ")";
    const DType t = dtype_of(0);
    const std::string ct = compute_type(t);
    auto c = [&](size_t i) { return to_compute(t, x[i]); };
    const bool f = is_float(t);
    const bool dbl = t == DType::f64;
    std::string e;
    switch (op.kind) {
      case OpKind::Neg:
        e = "(-" + c(0) + ")";
        break;
      case OpKind::Not:
        e = t == DType::i1 ? "(!" + c(0) + ")" : "(~" + c(0) + ")";
        break;
      case OpKind::Abs:
        e = f ? (dbl ? "fabs(" : "fabsf(") + c(0) + ")"
              : (t == DType::i64 ? "llabs(" : "abs(") + c(0) + ")";
        break;
      case OpKind::Sqrt:
        e = (dbl ? "sqrt(" : "sqrtf(") + c(0) + ")";
        break;
      case OpKind::Rsqrt:
        e = (dbl ? "rsqrt(" : "rsqrtf(") + c(0) + ")";
        break;
      case OpKind::Exp:
        e = (dbl ? "exp(" : "expf(") + c(0) + ")";
        break;
      case OpKind::Log:
        e = (dbl ? "log(" : "logf(") + c(0) + ")";
        break;
      case OpKind::Add:
        e = "(" + c(0) + " + " + c(1) + ")";
        break;
      case OpKind::Sub:
        e = "(" + c(0) + " - " + c(1) + ")";
        break;
      case OpKind::Mul:
        e = "(" + c(0) + " * " + c(1) + ")";
        break;
      case OpKind::Div:
        e = f ? "(" + c(0) + " / " + c(1) + ")"
              : "kerf_dev::idiv<" + ct + ">(" + c(0) + ", " + c(1) + ")";
        break;
      case OpKind::Rem:
        e = f ? (dbl ? "fmod(" : "fmodf(") + c(0) + ", " + c(1) + ")"
              : "kerf_dev::irem<" + ct + ">(" + c(0) + ", " + c(1) + ")";
        break;
      case OpKind::Min:
        e = f ? (dbl ? "fmin(" : "fminf(") + c(0) + ", " + c(1) + ")"
              : "(" + c(0) + " < " + c(1) + " ? " + c(0) + " : " + c(1) + ")";
        break;
      case OpKind::Max:
        e = f ? (dbl ? "fmax(" : "fmaxf(") + c(0) + ", " + c(1) + ")"
              : "(" + c(0) + " > " + c(1) + " ? " + c(0) + " : " + c(1) + ")";
        break;
      case OpKind::And:
        e = "(" + ct + ")(" + c(0) + " & " + c(1) + ")";
        break;
      case OpKind::Or:
        e = "(" + ct + ")(" + c(0) + " | " + c(1) + ")";
        break;
      case OpKind::Xor:
        e = "(" + ct + ")(" + c(0) + " ^ " + c(1) + ")";
        break;
      case OpKind::Shl:
        e = "kerf_dev::shl<" + ct + ">(" + c(0) + ", " + c(1) + ")";
        break;
      case OpKind::Shr:
        e = "kerf_dev::shr<" + ct + ">(" + c(0) + ", " + c(1) + ")";
        break;
      case OpKind::Lt:
        return "(" + c(0) + " < " + c(1) + ")";
      case OpKind::Le:
        return "(" + c(0) + " <= " + c(1) + ")";
      case OpKind::Gt:
        return "(" + c(0) + " > " + c(1) + ")";
      case OpKind::Ge:
        return "(" + c(0) + " >= " + c(1) + ")";
      case OpKind::Eq:
        return "(" + c(0) + " == " + c(1) + ")";
      case OpKind::Ne:
        return "(" + c(0) + " != " + c(1) + ")";
      default:
        throw InternalError(std::string("CUDA codegen: no expression for op ") +
                            ir::op_name(op.kind));
    }
    return from_compute(rt, e);
  }

  // ---- tiles (codegen_values.cpp)

  Tile get(ValueId v, int l);

  Tile compute(ValueId v, int l);

  // An expensive value in its home layout, converted to `l` if that differs.
  Tile from_home(ValueId v, int l);

  int home_layout(ValueId v);

  Tile home_tile(ValueId v, int h);

  // Register-only remapping when the threads already hold what `to` needs.
  bool register_subset(int from, int to, std::vector<int>* kept) const;

  // Row-major offsets of a tile in shared memory; rows padded by 16 bytes
  // so that column accesses of successive rows fall in different banks.
  // `pad`: elements after each row (< 0: 16 bytes' worth, what ldmatrix wants).
  std::vector<int64_t> smem_pitches(const Shape& shape, int elem_bytes, int64_t pad = -1) const;

  int64_t smem_bytes_for(const Shape& shape, int elem_bytes, int64_t pad = -1) const;

  std::string smem_offset(int l, const std::vector<int64_t>& pitch, const std::string& r,
                          int64_t sw_rows = 0, bool sw32 = false);
  // The byte offset expression of a 1024-aligned region of `bytes` (1024 more are allocated).
  std::string alloc_smem_1024(int lv, int64_t bytes, int* offset);

  // Room in shared memory for one tile of `v` (row-major, rows padded).
  struct SmemTile {
    DType dtype;
    std::vector<int64_t> pitch;
    int offset;
  };
  SmemTile alloc_smem_tile(ValueId v);

  // Writes a tile into shared memory (row-major, padded). Emitted at `lv`.
  void write_smem(int lv, const Tile& t, int l, DType dt, const std::string& buf,
                  const std::vector<int64_t>& pitch, int64_t sw_rows = 0, bool sw32 = false);

  // `slot` (a C++ byte offset into kerf_smem, "" for none): the buffer to move the tile
  // through, a ring slot that in_place_slot found, instead of a transient one.
  Tile convert_tile(ValueId v, const Tile& src, int from, int to, const std::string& slot = "");
  // With meta store_in_ring: a ring slot of this iteration that the conversion of `value`
  // (stored by `store`) from layout `from` may overwrite, as its byte offset ("" if none).
  // Each thread then writes exactly the elements it read from the slot, all its reads
  // are done, and nothing later in the iteration reads it; the next copy into it comes
  // after the loop's next barrier.
  std::string in_place_slot(const Operation& store, ValueId value, int from, int level);
  bool depends_on(ValueId v, ValueId u, int level, std::set<ValueId>& seen) const;

  // Reads a row-major padded tile from shared memory into registers of layout `to`.
  Tile read_smem(int lv, ValueId v, const std::string& buf, int to, DType dt,
                 const std::vector<int64_t>& pitch);

  // ---- pipelined loads (codegen_pipeline.cpp)

  std::string async_slot_offset(const AsyncLoad& a) const;

  Tile from_async(ValueId v, int l);

  // Whether `v` (inside the loop body at `inner`) depends on the loop only
  // through its induction variable, with no memory reads.
  bool iv_only(ValueId v, ValueId iv, int inner, std::set<ValueId>& seen) const;

  // The value under broadcasts and expand_dims.
  ValueId strip_shape_ops(ValueId v) const;

  // Whether `idx` is iv + arange(0, n) (in any broadcast form); sets n.
  bool iv_plus_range(ValueId idx, ValueId iv, int64_t* n) const;

  // A load from a tensor the kernel also writes may still run ahead when every
  // write to that tensor is in this loop at the same indices, and one index is
  // iv + arange(n) with a constant step >= n: each iteration then reads and
  // writes its own tile, disjoint from every other iteration's (in-place
  // updates such as W += s*B@A).
  bool disjoint_in_place(const Operation& load, const Operation& loop) const;

  static void count_writes(const ir::Block& b, std::map<int64_t, int>& out);

  // Loads of a loop body that can be issued iterations ahead as cp.async copies.
  std::vector<const Operation*> pipelinable_loads(const Operation& loop, int inner);
  void emit_prologue(const Operation& loop, int lv);
  std::map<const Operation*, size_t> early_prologues(const ir::Block& b, int lv);

  static void collect_written(const ir::Block& b, std::set<int64_t>& out);

  // Emits, into `target` level, a block that issues the cp.async copies of
  // `op` for the iteration whose induction variable is `iv_value` into ring
  // slot `slot`; `valid` says whether that iteration exists.
  void emit_prefetch(const Operation& op, int target, int inner, ValueId iv,
                     const std::string& iv_value, const std::string& slot,
                     const std::string& valid);

  // ---- memory (codegen_memory.cpp)

  const ir::Param& tensor_of(const Operation& op) const;

  std::string pointer_expr(const Operation& op);
  // The L2 cache policy a hinted tile load or store uses ("" for none, or
  // before sm_80), made once at the kernel's start.
  std::string l2_policy(const Operation& op);

  // The kernel argument holding the size of dimension d of tensor parameter `param`.
  std::string dim_arg(int64_t param, int d) const;
  std::string stride_expr(const Operation& op, int d);

  std::string offset_expr(const Operation& op, const std::vector<Tile>& idx, const std::string& r);

  // Elements per vector access for a load/store of `op` in layout `l`.
  int vector_width(const Operation& op, int l) const;

  std::string scalar_load(const Operation& op);
  // The index tiles of memory access `op` in layout `l`, one per tensor dimension.
  std::vector<Tile> index_tiles(const Operation& op, int l);

  Tile emit_load(const Operation& op, int l);
  // A cluster_load (attrs.cluster_share) where the programs run in clusters (cluster_ > 1).
  Tile emit_cluster_load(const Operation& op, int l);

  // Store and atomic_add: the layout they write from.
  int store_layout(ValueId value);

  void emit_store(const Operation& op, int level);
  void emit_l2_evict_normal(const Operation& op, int level);

  std::string store_stmt(DType t, bool atomic, const std::string& addr, const std::string& val);
  // An f32 atomic_add summed over the cluster first (cluster_ > 1): see codegen_memory.cpp.
  void emit_cluster_add(const Operation& op, int level, int l, const std::vector<Tile>& idx, const Tile& val,
                        const Tile& mask, int w);
  // Emits the pending second half of a cluster sum at `level` (the end of its block, or before the next).
  void flush_cluster(int level);

  // ---- dot (codegen_dot.cpp)

  Staged stage(ValueId v);
  // Whether v, at loop level lv, is a choice by a uniform condition among tiles defined
  // outside that loop (or such choices): stage() then stages each of them once.
  bool invariant_choice(ValueId v, int lv) const;

  Tile emit_dot(const Operation& op, int h);

  static std::string to_compute_float(DType t, const std::string& x);

  // ---- reductions (codegen_reduce.cpp)

  std::string emit_reduce(const Operation& op);

  // ---- statements (codegen.cpp)

  void emit_block(const ir::Block& b);

  void emit_for(const Operation& op, int lv);

  // ---- state

  const ir::Function& f_;
  std::string arch_;
  int sm_ = 80;
  int num_warps_ = 4;
  int num_stages_ = 1;
  int l2_prefetch_ = 0;  // meta l2_prefetch: the L2 prefetch size hint of cp.async copies (bytes)
  bool wgmma_ = false;        // meta wgmma=1 on an sm_90a target
  // meta wgmma_ss: wgmma reads a swizzled A tile from shared memory, and B tiles 16 wide
  // in the 32-byte swizzle (sw32_candidate)
  bool wgmma_ss_ = false;
  std::set<int> wgmma_sizes_;  // N of the wgmma instructions emitted (their wrappers go in the source)
  int grid_arrivals_ = 0;       // grid_sync and grid_arrive arrivals emitted so far
  const Operation* last_grid_barrier_ = nullptr;  // the kernel's last grid_sync, grid_arrive or grid_await
  std::string grid_sync_ptr_;   // their counter's pointer
  bool staged_adds_ = false;   // meta staged_adds: accumulators' f32 atomic adds go through shared memory
  bool acc_store_ = false;     // meta acc_store: stores of an accumulator's values from its registers
  bool store_in_ring_ = false;  // meta store_in_ring: stores' layout conversions through a spent ring slot
  std::map<ValueId, std::set<int>> async_reads_;  // pipelined loads -> the layouts read from their slots
  std::set<ValueId> ring_staged_;  // pipelined loads whose slot a store's conversion has used
  const ir::Block* cur_block_ = nullptr;  // the block emit_block is in, and the op it emits
  size_t cur_index_ = 0;
  // meta early_prologue: a pipelined loop's first copies go out as soon as what they
  // need exists (emit_block), not where the loop begins.
  bool early_prologue_ = false;
  std::set<const Operation*> prologue_done_;
  int acc_col_run_ = 0;        // meta acc_col_run: columns per thread run of a dot's accumulator (0: mma's order)
  // Layouts from mma_acc_layout_runs: the kept map of the dot tiles in them (storage in mma's order).
  std::map<int, std::vector<int>> run_kept_;
  std::vector<const Operation*> run_dots_;
  // B operands of dots in a runs layout: logical column bit -> the bit mma reads it at.
  std::map<ValueId, std::vector<int>> staged_cols_;
  int cluster_ = 1;            // meta cluster_size on sm_90+ (1 elsewhere: cluster sums are plain atomics)
  std::vector<std::string> cluster_phases_;  // a double-buffer phase per cluster-summed atomic emitted
  bool cluster_rank_used_ = false;  // kerf_crank is read (cluster sums, cluster_load)
  // Top-level cluster_load buffers (offset, bytes), free after their exchange: the regions
  // allocated after them take their place.
  std::vector<std::pair<int, int64_t>> spent_smem_;
  std::map<int, std::vector<std::string>> cluster_pending_;  // level -> the second half of a cluster sum
  std::map<ValueId, std::vector<std::pair<const Operation*, int>>> users_;  // value -> (op, operand index)
  std::vector<ir::AxisInfo> axis_;
  std::vector<int> uses_;
  std::vector<const Operation*> def_op_;
  std::vector<int> level_of_;
  std::vector<int> pref_;
  std::map<Shape, int> blocked_vec_;
  std::map<ValueId, int> reduce_input_;
  std::set<int> acc_layouts_;
  std::deque<Layout> layouts_;  // deque: references stay valid while interning
  std::set<std::pair<int, int>> used_thread_coords_;

  std::vector<Frame> frames_;
  std::vector<int> active_;  // loop level -> frame
  std::map<ValueId, AsyncLoad> async_;
  std::map<ValueId, std::string> scalars_;
  std::map<ValueId, int> scalar_level_;
  std::map<ValueId, int> home_;
  std::map<ValueId, Staged> staged_;
  // Shared memory no longer in use (rings of finished top-level loops): offset, bytes.
  // Only transient buffers (written, read back at once, between two barriers) go there.
  std::vector<std::pair<int, int64_t>> free_smem_;
  int transient_smem(int64_t bytes, bool* reused = nullptr);
  std::map<ValueId, std::string> reduced_;
  std::map<std::pair<ValueId, int64_t>, std::string> afrags_;  // (A, warp split) -> fragments
  std::map<std::pair<ValueId, int64_t>, std::string> bfrags_;  // (B, warp split) -> fragments
  // The most registers a thread gives to a loop-invariant B operand's fragments.
  static constexpr int64_t kMaxHoistedBRegs = 32;
  std::set<std::string> pointers_;
  std::string pointer_lines_;
  int counter_ = 0;
  int smem_top_ = 0;
  bool smem_1024_ = false;  // some region is 1024-aligned (alloc_smem_1024): kerf_smem is too

 public:
  const std::string& pointer_lines() const;
};

}  // namespace kerf::jit::cuda::detail
