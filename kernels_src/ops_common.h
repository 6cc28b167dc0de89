// Helpers the ops share: argument checks with messages that name the op and
// the argument, and the choices that depend on the device.
#pragma once

#include <algorithm>
#include <array>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "kerf/error.h"
#include "kerf/jit/autotune.h"
#include "kerf/jit/launch.h"
#include "kerf/ops/ops.h"
#include "kerf/runtime/cuda.h"
#include "kerf/runtime/tensor.h"

namespace kerf::ops::detail {

inline int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

// A rank as the kernels' tiles hold it (R_PAD): the next power of two, at least 16.
inline int64_t rank_pad(int64_t r) { return std::max<int64_t>(16, next_pow2(std::max<int64_t>(r, 1))); }

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A kernel's LoRA product: the dtype its operands are converted into, and for f32
// operands whether the GPU multiplies them on its tensor cores as TF32 (f32's range, an
// f16's 10 mantissa bits; fp32 accumulation). Converts to and from its dtype.
struct Product {
  DType dtype = DType::f32;
  bool tf32 = false;
  constexpr Product() = default;
  constexpr Product(DType t, bool as_tf32 = false) : dtype(t), tf32(as_tf32) {}
  constexpr operator DType() const { return dtype; }
};

// The product over a base (or gradient) of dtype `base` with adapters of dtypes `a` and
// `b`: bf16 for a bf16 base (its range is f32's); for an f16 base, f16 when the adapters
// are f16 too, else f32 taken as TF32 (an f32 or bf16 adapter, or s times one, may lie
// beyond f16's 65504 and would turn into inf in f16; TF32 keeps f32's range, on the tensor
// cores, with each term of the product within 2^-11 of itself, an f16's precision: where
// large terms cancel, the answer's error is that of the terms, not of the answer); else
// f32 multiplied exactly (fp32 FMA, as PEFT forms the products of fp32 adapters).
inline Product product_dtype(DType base, DType a, DType b) {
  if (base == DType::bf16) return DType::bf16;
  if (base == DType::f16) return a == DType::f16 && b == DType::f16 ? Product(DType::f16) : Product(DType::f32, true);
  return DType::f32;
}

// A GPU default tile along the columns a step reads (`tile`), narrowed at ranks of 128
// and up so that the rank's operands (r_pad elements of `bytes` each per column or row,
// rank_bytes below) leave the tiles within an H100's 232448 bytes of shared memory:
// halved once r_pad * bytes reaches `from`, again at twice that, never below 16 (lower
// ranks keep it).
inline int64_t rank_narrowed(int64_t tile, int64_t r_pad, int64_t bytes, int64_t from) {
  if (r_pad < 128) return tile;
  for (int64_t at = from; r_pad * bytes >= at && tile > 16; at *= 2) tile /= 2;
  return tile;
}
// The bytes of a rank operand's element in shared memory: the product's, or the adapters'
// where they are wider (fp32 adapters of a half product are staged as they come and
// rounded per step: at rank 128 on the tiles of bf16 ones, merge and the MoE forward took
// 324608 bytes, at rank 256 the MoE and embedding backwards 276480 and 350208).
inline int64_t rank_bytes(const Product& dot, DType a, DType b) {
  return std::max({dtype_size_bytes(dot), dtype_size_bytes(a), dtype_size_bytes(b)});
}

std::string shape_str(const TensorView& t);

// The checks run on every call: they take initializer lists (no allocation) and
// build their messages only when something is wrong.
//
// Throws InvalidArgument unless `t` has `rank` and, where want[d] >= 0, that size.
void expect_shape(const char* op, const char* name, const TensorView& t, const int64_t* want,
                  size_t rank);
inline void expect_shape(const char* op, const char* name, const TensorView& t,
                         std::initializer_list<int64_t> want) {
  expect_shape(op, name, t, want.begin(), want.size());
}
inline void expect_shape(const char* op, const char* name, const TensorView& t,
                         const std::vector<int64_t>& want) {
  expect_shape(op, name, t, want.data(), want.size());
}
// Throws TypeError unless t.dtype is one of `allowed`.
void expect_dtype(const char* op, const char* name, const TensorView& t, const DType* allowed,
                  size_t count);
inline void expect_dtype(const char* op, const char* name, const TensorView& t,
                         std::initializer_list<DType> allowed) {
  expect_dtype(op, name, t, allowed.begin(), allowed.size());
}
inline void expect_dtype(const char* op, const char* name, const TensorView& t,
                         const std::vector<DType>& allowed) {
  expect_dtype(op, name, t, allowed.data(), allowed.size());
}
// Throws InvalidArgument unless every tensor is on the first one's device.
using NamedTensor = std::pair<const char*, const TensorView*>;
// Which of t's dims have stride 1, as bits (bit d: dim d), in a shape bucket's word:
// appended to an op's tuning bucket where its main operand is not row-major, so that
// W.T (PEFT's fan_in_fan_out) is tuned apart from W (row-major keys stay as they were).
inline int64_t unit_stride_dims(const TensorView& t) {
  int64_t bits = 0;
  for (int d = 0; d < t.rank; ++d)
    if (t.strides[size_t(d)] == 1) bits |= int64_t(1) << d;
  return bits;
}
inline void add_memory_order(std::vector<int64_t>& bucket, const TensorView& t) {
  const int64_t bits = unit_stride_dims(t);
  if (t.rank > 0 && bits != int64_t(1) << (t.rank - 1)) bucket.push_back(-1 - bits);  // negative: no size is
}
// The same for an op's two adapters, in one word of its own range (-65536 and below,
// apart from the main operand's): PEFT's flat expert lora_B, read as B[e] with its rank
// columns E apart, is tuned apart from a row-major [E, d1, r] (a kernel that reads B's
// tile per step may lose most of its speed to that gather; another tile may not). An
// op's two gradients of that shape take the next range down (`gradients`).
inline void add_adapter_order(std::vector<int64_t>& bucket, const TensorView& a, const TensorView& b,
                              bool gradients = false) {
  const int64_t ba = unit_stride_dims(a), bb = unit_stride_dims(b);
  const bool row_major = (a.rank == 0 || ba == int64_t(1) << (a.rank - 1)) && (b.rank == 0 || bb == int64_t(1) << (b.rank - 1));
  if (!row_major) bucket.push_back((gradients ? -131072 : -65536) - (ba << 8 | bb));
}

// Throws InvalidArgument unless the scale s is finite, also as a float32 (an inf or NaN
// s, or one beyond float's range, would write NaN into every element, in place for the
// merges, with no way back).
void expect_finite_scale(const char* op, double s);
// DoRA's eps: >= 0 and within float32 (the kernels add it in fp32); refused_eps says
// whether expect_eps would refuse it (a repeated call's fingerprint keeps refusals apart).
bool refused_eps(double eps);
void expect_eps(const char* op, double eps);

void expect_device(const char* op, const NamedTensor* ts, size_t count);
inline void expect_device(const char* op, std::initializer_list<NamedTensor> ts) {
  expect_device(op, ts.begin(), ts.size());
}
inline void expect_device(const char* op, const std::vector<NamedTensor>& ts) {
  expect_device(op, ts.data(), ts.size());
}

// The DoRA norms' SCALE_AFTER: f16 products (f16 adapters) take s in fp32 after the
// product, since s*B rounded to f16 would be inf beyond 65504; bf16 products keep s*B
// rounded once (bf16 has fp32's range; 2^-9 of the LoRA term, as documented).
inline void set_dora_scale_meta(dsl::MetaMap& meta, Product dot) {
  if (dot.dtype == DType::f16 && !dot.tf32) meta["SCALE_AFTER"] = 1;
}

// kerf-cache warm's compile-only items (a target with no device here): inside a
// ChecksOnly scope, an op called on views that are never dereferenced runs
// every check of its arguments, then returns before it plans, tunes, reads or
// launches anything. One thread's scope; they nest.
bool checks_only();
class ChecksOnly {
 public:
  ChecksOnly();
  ~ChecksOnly();
  ChecksOnly(const ChecksOnly&) = delete;
  ChecksOnly& operator=(const ChecksOnly&) = delete;

 private:
  bool before_;
};

// Whether the caller set any field of an ops::Config (it then wins over the autotuner).
inline bool has_config(const Config& c) {
  return c.block_m || c.block_k || c.split_k || c.num_warps || c.num_stages || !c.meta.empty();
}
// Throws InvalidArgument when a field of `config` is negative or split_k is
// beyond a grid's y extent (65535), or when config.meta names a meta-parameter
// `op` does not take (`allowed`) or gives one of them a value outside [lo, hi]
// or one its `takes` refuses. (Tile sizes that are not powers of two, warps and
// stages out of range are refused when the kernel is traced.)
struct MetaRange {
  const char* name;
  int64_t lo, hi;
  // When set: which values of [lo, hi] the op takes, and the message's words for them.
  bool (*takes)(int64_t) = nullptr;
  const char* takes_text = nullptr;
};
void expect_meta(const char* op, const Config& config, std::initializer_list<MetaRange> allowed);
inline bool zero_or_pow2(int64_t v) { return (v & (v - 1)) == 0; }
// The meta-parameters every op whose kernel has a tensor-core dot (WARPS_N), or
// pipelined copies (L2_PREFETCH), takes.
inline constexpr MetaRange kWarpsN{"WARPS_N", 0, 32, zero_or_pow2, "0 (kerf chooses) or a power of two"};
inline constexpr MetaRange kL2Prefetch{"L2_PREFETCH", 0, 256, dsl::is_l2_prefetch_size, "0, 64, 128 or 256 (bytes)"};
// Config.meta WGMMA (0 or 1), for ops whose tensor-core dots may run on Hopper's warpgroup instructions.
inline constexpr MetaRange kWgmma{"WGMMA", 0, 1};
// Config.meta WGMMA_SS (0 or 1), with WGMMA: the warpgroup dots read A from shared memory
// too where its tile is swizzled, and 16-column B tiles in the 32-byte swizzle (kernel
// meta wgmma_ss).
inline constexpr MetaRange kWgmmaSs{"WGMMA_SS", 0, 1};
// Config.meta CLUSTER (1..8), for ops whose per-step atomics may be summed over
// thread-block clusters of that many neighbouring programs first (kernel meta
// cluster_size; sm_90 and later, plain atomics elsewhere).
inline constexpr MetaRange kCluster{"CLUSTER", 1, 8};
// Config.meta STAGED_ADDS (0 or 1): a dot accumulator's per-step fp32 atomics go
// through shared memory as whole-line vectors (kernel meta staged_adds).
inline constexpr MetaRange kStagedAdds{"STAGED_ADDS", 0, 1};
// Config.meta ACC_STORE (0 or 1): stores of a dot accumulator's values go out from its
// registers, not through shared memory first (kernel meta acc_store).
inline constexpr MetaRange kAccStore{"ACC_STORE", 0, 1};
// Config.meta STORE_IN_RING (0 or 1): such a store's values move into the store's layout
// through the spent ring slot of the weight tile they were computed from, not a shared-memory
// buffer of their own (kernel meta store_in_ring): less shared memory, the same values.
inline constexpr MetaRange kStoreInRing{"STORE_IN_RING", 0, 1};
// Config.meta EARLY_PROLOGUE (0 or 1): a pipelined loop's first copies go out as soon as
// what they need exists, not where the loop begins (kernel meta early_prologue).
inline constexpr MetaRange kEarlyPrologue{"EARLY_PROLOGUE", 0, 1};
// Config.meta COLS_FIRST (0 or 1): the column slices of each row block on grid axis 0 (split_range.h).
inline constexpr MetaRange kColsFirst{"COLS_FIRST", 0, 1};
// Config.meta TF32 (0 or 1, default 1), for ops whose products of an f16 base with fp32 or
// bf16 adapters run as TF32 on the GPU: 0 multiplies them in fp32 FMA instead (set_product_meta).
inline constexpr MetaRange kTf32{"TF32", 0, 1};
// Config.split_k held to the column steps (more slices would only start programs
// with nothing to do) and to grid axis 1 (65535); 0 stays 0 (the op's default).
inline int64_t slices_within(int64_t asked, int64_t steps) {
  return std::min(asked, std::clamp<int64_t>(steps, 1, 65535));
}
// Config.meta STREAM (0 or 1), for ops whose programs walk a weight's columns
// adding a tensor-core product to each tile: one tile per program, read into the
// product's accumulator and written from it (kernel meta acc_col_run), no pipelining.
inline constexpr MetaRange kStream{"STREAM", 0, 1};
// Config.meta ONE_TILE (0 or 1), with STREAM: the kernel's one-tile form (merge, MoE forward),
// whose programs ask for W's tile before the adapters' and read it only after the product.
inline constexpr MetaRange kOneTile{"ONE_TILE", 0, 1};
// When `config` streams, sets the kernel meta of a weight of dtype `w` (after
// add_codegen_hints: no l2_prefetch or store_in_ring, one stage; ONE_TILE where the config asks
// for it and every column step gets a slice) and `split` to `steps`. Returns the config to order
// the grid by (row_slice_grid): `config`, with COLS_FIRST on when streaming.
Config stream_plan(const Config& config, DType w, int64_t steps, dsl::MetaMap& meta, int64_t* split);
// The grid of a kernel whose programs own (row block, column slice) pairs, `batch`
// on axis 2, in the order config's COLS_FIRST asks for; sets the kernel's
// COLS_FIRST meta to match. Where the row blocks would not fit grid axis 1
// (65535), the slices stay on axis 1: the same work in another order.
Grid row_slice_grid(int64_t row_blocks, int64_t slices, int64_t batch, const Config& config, dsl::MetaMap& meta);
// An op's own GPU config (for a call whose Config names no tile): `given` with the tile
// block_m x block_k, and the warps, stages and meta entries it does not name itself.
Config with_own_tile(const Config& given, int64_t block_m, int64_t block_k, int64_t warps, int64_t stages,
                     const std::map<std::string, int64_t>& meta);
// with_own_tile's ring tile, the MoE forward's and the merge's own on sm_90a: 64x128 on
// one warpgroup (WGMMA), three stages, the new tile moved to its store layout through the
// spent ring slot of the weight tile it came from (STORE_IN_RING), 128-byte L2 prefetches.
Config with_ring_tile(const Config& given);
// Whether an op's own tile may take the kernel's one-tile form (with_one_tile) for weight `W`
// under `given`: W's rows contiguous, and `given` names neither STREAM (0 asks for tiles that
// walk columns) nor WALK_ROWS, nor says ONE_TILE=0.
bool one_tile_own_allowed(const Config& given, const TensorView& W);
// with_own_tile's one-tile form: block_m x block_k on `warps` warps, one tile a program
// (STREAM) with W's tile asked for first (ONE_TILE).
Config with_one_tile(const Config& given, int64_t block_m, int64_t block_k, int64_t warps = 4);
// The code-generation hints of Config.meta as the kernel metas that carry them:
// L2_PREFETCH (0, 64, 128 or 256 bytes) as l2_prefetch, the L2 prefetch size hint
// of the kernel's pipelined copies, WGMMA 1 as wgmma, with it WGMMA_SS 1 (unset: the
// op's `wgmma_ss_default`) as wgmma_ss, STAGED_ADDS 1 as staged_adds, ACC_STORE 1 as
// acc_store and STORE_IN_RING 1 as store_in_ring.
void add_codegen_hints(const Config& config, dsl::MetaMap& meta, int64_t wgmma_ss_default = 0);
// Each of `names` that config.meta sets to a non-zero value, as the kernel
// meta-parameter of that name (EVICT, WARPS_N: kernels read 0 when unset).
void pass_meta(const Config& config, dsl::MetaMap& meta, std::initializer_list<const char*> names);
// config.meta's value of `name`, else `fallback`.
inline int64_t meta_or(const Config& c, const char* name, int64_t fallback) {
  auto it = c.meta.find(name);
  return it == c.meta.end() ? fallback : it->second;
}

// The kernel meta entries that name `p`: DOT (its dtype) and, for TF32, TF32 = 1 unless
// the caller's Config.meta TF32 is 0 (the products of an f16 base's fp32/bf16 adapters
// then run exactly, in fp32 FMA, as PEFT forms them, slower).
inline void set_product_meta(dsl::MetaMap& meta, Product p, const Config& config) {
  meta["DOT"] = int64_t(p.dtype);
  if (p.tf32 && meta_or(config, "TF32", 1)) meta["TF32"] = 1;
}

// Multiprocessors of the tensors' device (the number of CPU threads on the CPU).
int parallelism(const Device& dev);
// Whether `dev` is a GPU that kerf compiles for sm_90a (warpgroup dots, an H100's shared
// memory); false on the CPU and where no driver answers. Under a PlanningArch, whether
// its architecture is sm_90a, for any GPU device.
bool wgmma_target(const Device& dev);
// While one lives, plans made on this thread take every GPU device to be one of `arch`
// instead of asking the driver (wgmma_target): kerf-cache warm compiling an op's own
// tiles for a target other than the machine's, and tests planning an H100's kernels on
// any machine. Scopes nest; "" asks the device again.
class PlanningArch {
 public:
  explicit PlanningArch(std::string arch);
  ~PlanningArch();
  PlanningArch(const PlanningArch&) = delete;
  PlanningArch& operator=(const PlanningArch&) = delete;

 private:
  std::string previous_;
};
// The default number of programs sharing a row block's columns: enough for
// about three programs per multiprocessor (`programs`) over `blocks` row
// blocks, in whole steps (1 to `steps`).
int64_t split_for(int64_t blocks, int64_t programs, int64_t steps);
// The number of programs sharing a row block's columns that makes `waves` full
// waves of `programs` programs over `blocks` row blocks (1 to `steps`).
int64_t split_for_waves(int64_t blocks, int64_t programs, int64_t steps, int64_t waves);
// The WALK_ROWS programs of the merge and the MoE forward with no split named: the row slices for `col_blocks`
// programs' worth of columns (times the batch) over `programs` multiprocessors and
// `row_steps` BLOCK_M steps, for programs on `stages` stages: about four programs a
// multiprocessor in all on three or more stages (two waves of two at once), two on two
// stages (fewer programs, three at once, each walking longer slices), each slice at least 8
// steps where there are that many (its pipeline's start and end amortized); 1 to `row_steps`.
int64_t walk_rows_split(int64_t col_blocks, int64_t programs, int64_t row_steps, int64_t stages = 3);

// Scratch memory for kernels that accumulate across programs: at least `bytes`,
// zero, on `dev`, private to `stream` (to the calling thread on the CPU).
// Kernels using it must leave it zero when they finish. `lock` is held until
// the caller has queued the last launch using it (an accumulator one launch adds
// to and a later one flushes, or just the one launch), so that another thread's
// launches on the same stream cannot come between, nor its call regrow the
// buffer under them. Taken before run_a's scratch, never twice at once.
// While the stream captures a CUDA graph, the memory is instead the graph's own
// (`graph_owned`: allocated, zeroed and freed in the stream's order, so that each
// launch of the graph has it zero, and no later call's regrowth can free it under
// the graph); no lock is taken then.
struct WorkspaceLease {
  char* data = nullptr;
  std::unique_lock<std::mutex> lock;
  cuda::StreamOrderedBuffer graph_owned;
};
WorkspaceLease lease_workspace(const Device& dev, void* stream, size_t bytes);

// Whether `stream` on `dev` is capturing a CUDA graph (never on the CPU).
bool capturing(const Device& dev, void* stream);

// Stands for device memory a plan is only compiled for, never run with: aligned
// like real memory (64 KiB), so the specialization facts are the same.
void* unused_memory();

// Config.meta CAST_A: the dtype a plan with this config rounds an f32 A to once
// per call, before its kernel (f32: none), for a product in `product`.
DType cast_a_dtype(const Config& config, DType product);
// A (rank 2 or 3, any strides) as a plan's kernel reads it, in its compile list:
// when `to` asks to cast an f32 A, the cast's call (into unused memory) is
// appended to `calls` and its contiguous copy returned; otherwise A.
// With `release` the cast lets the kernel launched after it start while it runs (RELEASE, for a
// launch with LaunchOptions::overlap_prior whose kernel waits for it before reading the copy).
TensorView compiled_a(const TensorView& A, DType to, std::vector<autotune::KernelCall>& calls,
                      bool release = false);
// The same in a run: the cast (one kernels::cast_3d launch) is queued on
// `options.stream` into scratch memory private to that stream (to the calling
// thread on the CPU), with no zero promise; `lock` keeps it until the kernel
// reading the copy is queued, so another thread's launches on the same stream
// cannot come between the write and the read.
// Under a graph capture the copy lies in the graph's own memory (as WorkspaceLease).
struct RunA {
  TensorView a;
  std::unique_lock<std::mutex> lock;
  cuda::StreamOrderedBuffer graph_owned;
};
RunA run_a(const TensorView& A, DType to, const LaunchOptions& options, bool release = false);
// Contiguous copies of rank-3 views, each rounded to its dtype, in one stretch of the same
// stream-private scratch (as run_a, which is one such copy): `copies[i]` is xs[i].first in
// dtype xs[i].second. `at`: where the copies lie (unused_memory() for compile lists: views
// only, nothing launched); else the scratch is taken and the copies queued. With `release` each
// copy lets the next launch start while it runs (as compiled_a's).
struct RunCopies {
  std::vector<TensorView> copies;
  std::vector<autotune::KernelCall> calls;  // the copies' launches
  std::unique_lock<std::mutex> lock;
  cuda::StreamOrderedBuffer graph_owned;
};
RunCopies run_copies(const std::vector<std::pair<TensorView, DType>>& xs,
                     const LaunchOptions* options, bool release = false);
// Two adapters as a kernel reads them: each given a dtype (`a_to`, `b_to`) copied contiguous
// into it by run_copies (`options` as there), the other the view itself.
struct CopiedAdapters {
  TensorView A, B;
  RunCopies copies;
};
CopiedAdapters copied_adapters(const TensorView& A, std::optional<DType> a_to, const TensorView& B,
                               std::optional<DType> b_to, const LaunchOptions* options);

// out = x element by element, rounded to out's dtype (rank-3 views of one shape): one
// launch (plan_copy_3d's, ops_accumulate.h) on `options`'s stream.
void run_cast_3d(const TensorView& x, const TensorView& out, const LaunchOptions& options);

// Config.meta PACK of the MoE ops (on GPUs unless 0, on CPUs only with 1): an adapter whose
// elements are not adjacent along its last dim (PEFT's flat lora_B, B[e]'s rank columns E
// apart; the transposed layout's lora_A and lora_B) is first copied, once per call, into
// a contiguous copy the kernel reads (run_copies: a batched transpose, both sides whole
// vectors).
inline bool packs(const Config& config, bool gpu) { return meta_or(config, "PACK", gpu ? 1 : 0) != 0; }
// Whether rank-3 t's last dim is strided (elements not adjacent along it).
inline bool strided_last(const TensorView& t) { return t.shape[2] > 1 && t.strides[2] != 1; }

// ---------------------------------------------------------------- plans of repeated calls
// What identifies a call for its plan: sizes, dtypes, device, the caller's Config,
// whatever the plan depends on, as integers (unused trailing words stay 0).
struct CallKey {
  static constexpr size_t kWords = 24;
  std::array<int64_t, kWords> words{};
  size_t n = 0;
  CallKey& add(int64_t v) {
    if (n == kWords) throw InternalError("CallKey: more than 24 words");
    words[n++] = v;
    return *this;
  }
  CallKey& add(const TensorView& t);  // dtype, rank, sizes
  CallKey& add(const Device& d) { return add(int64_t(d.kind) << 32 | int64_t(d.index)); }
  CallKey& add(DType t) { return add(int64_t(t)); }
  CallKey& add(const Config& c);  // every field, meta as one hash
  bool operator==(const CallKey& o) const { return n == o.n && words == o.words; }
};
// What an op's checks of shapes, strides, dtypes and devices read from a call,
// as words compared exactly: every field of each view but its data pointer, of
// which the low four bits (its alignment, up to 16 bytes) stand in. A call with
// the fingerprint of one that passed those checks passes them too, and its plan
// and kernel specialization are the same; what depends on where the memory lies
// (an output overlapping an input) must be checked again. Past kWords words a
// fingerprint equals nothing.
class CallFingerprint {
 public:
  static constexpr size_t kWords = 64;
  CallFingerprint& add(uint64_t v) {
    if (n_ < kWords) words_[n_] = v;
    ++n_;
    return *this;
  }
  CallFingerprint& add(const TensorView& t) {
    add(uint64_t(t.dtype) | uint64_t(uint32_t(t.rank)) << 8 | uint64_t(t.device.kind) << 16 |
        uint64_t(uint32_t(t.device.index)) << 24 | uint64_t(reinterpret_cast<uintptr_t>(t.data) & 15) << 56);
    for (int d = 0; d < t.rank; ++d) add(uint64_t(t.shape[size_t(d)])).add(uint64_t(t.strides[size_t(d)]));
    return *this;
  }
  bool operator==(const CallFingerprint& o) const {
    return n_ == o.n_ && n_ <= kWords && std::equal(words_.begin(), words_.begin() + n_, o.words_.begin());
  }

 private:
  std::array<uint64_t, kWords> words_;  // the first n_ are set
  size_t n_ = 0;
};

struct CallKeyHash {
  size_t operator()(const CallKey& k) const;
};

// How many configs tuned_config() has given on this thread without tuning, because
// the op's stream was capturing a CUDA graph (nothing can be timed there) and no
// choice was known: a plan made from one serves that call only and is kept nowhere,
// so that the next call outside a capture tunes. Compare before and after a make.
uint64_t provisional_configs();
// Made before a plan is made: seen() says whether that plan came from a provisional config.
class ProvisionalWatch {
 public:
  bool seen() const { return provisional_configs() != at_; }

 private:
  uint64_t at_ = provisional_configs();
};

// An op's plans (autotuned config, meta-parameters, grid) by call, so that a
// repeated call skips the autotuner's lookup and the plan's construction: its
// host path is the checks, one lookup and the launch. Plans made before the
// autotuner's generation changed (forget_choices, a settings reload) are made
// again; the memo is cleared when it grows past `kMaxPlans` (a caller with ever
// new shapes). A plan made from a provisional config is not kept. Thread-safe.
template <class Plan>
class PlanMemo {
 public:
  template <class Make>
  std::shared_ptr<const Plan> get(const CallKey& key, Make&& make) {
    const uint64_t gen = autotune::generation();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gen == generation_) {
        auto it = plans_.find(key);
        if (it != plans_.end()) return it->second;
      }
    }
    const ProvisionalWatch provisional;
    auto plan = std::make_shared<const Plan>(make());  // may tune: outside the lock
    if (provisional.seen()) return plan;
    std::lock_guard<std::mutex> lock(mu_);
    if (gen != generation_) {
      plans_.clear();
      generation_ = gen;
    }
    if (plans_.size() >= kMaxPlans) plans_.clear();
    plans_[key] = plan;
    return plan;
  }

 private:
  static constexpr size_t kMaxPlans = 4096;
  std::mutex mu_;
  uint64_t generation_ = ~uint64_t(0);
  std::unordered_map<CallKey, std::shared_ptr<const Plan>, CallKeyHash> plans_;
};

}  // namespace kerf::ops::detail
