// kerf's embedded tile DSL.
//
// A kernel is a C++ callable that receives a Builder and describes what one
// *program* (a CTA on the GPU, a task on the CPU) computes, on tiles of static
// shape. The callable runs once per specialization (meta-parameters, argument
// dtypes and facts) and records IR; it never touches data. Mistakes (shapes
// that do not broadcast, a dot of mismatched tiles, a store of the wrong dtype,
// a meta-parameter left unset) throw kerf::DefinitionError naming the kernel
// and the op.
//
//   Kernel add("vec_add", [](Builder& k) {
//     auto x = k.tensor("x", 1), y = k.tensor("y", 1), out = k.tensor("out", 1);
//     const int64_t B = k.meta("BLOCK");
//     auto i = program_id(0) * B + arange(B);
//     auto m = i < x.dim(0);
//     store(out, {i}, load(x, {i}, m) + load(y, {i}, m), m);
//   });
//
// Element semantics, the same on the CPU and the GPU back ends:
//  - integer division and remainder truncate; a zero divisor (and MIN / -1) gives 0;
//  - shifts by the bit width or more, or by a negative amount, give 0 (<<) or the
//    sign fill (>>, arithmetic);
//  - float -> integer truncates toward zero and saturates, NaN gives 0 (u8: to [0, 255]);
//    anything -> i1 is != 0; f64 and integers -> bf16/f16 round once, to nearest even;
//  - minimum/maximum and min/max reductions skip NaNs (fminf/fmaxf); a reduction
//    whose elements are all NaN gives NaN;
//  - i1 tiles take logic (&, |, ^, !), comparisons and where(); arithmetic between two
//    i1 tiles asks for a cast, while beside another dtype (or a literal) an i1 tile counts
//    as 0 or 1 of that dtype (mask * 2.5); an i1 tensor's bytes must be 0 or 1 (as
//    PyTorch's and NumPy's bools are);
//  - integer constants and arange must fit their dtype (refused when traced);
//  - tile dims are powers of two, and a tile holds at most 2^31 - 1 elements (arange
//    2^20); the back ends refuse tiles their memory cannot hold (the CPU's stack
//    budget, the GPU's registers and shared memory) when they compile.
// Not the same: i32/i64 arithmetic that overflows is undefined on the GPU (CUDA C++'s
// rule, which lets index arithmetic stay fast) and wraps on the CPU, where an index
// computed that way may not match its mask: compute indices that can pass 2^31 in i64.
// A for_range counts in i64 when a bound or the step is an i64 value, else in i32 (for
// speed); an i32 counter that would step past INT32_MAX (hi within one step of it, or
// within num_stages - 1 steps for a loop whose loads are pipelined: their copies run
// that far ahead) is undefined on the GPU: give such loops i64 bounds.
// The GPU contracts a * b + c into one fused multiply-add (NVRTC's default), so f32
// results may differ from the CPU's in the last bit. dot() takes f64 operands as f32.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <concepts>
#include <type_traits>
#include <vector>

#include "kerf/dtype.h"
#include "kerf/jit/ir.h"

namespace kerf::dsl {

class Builder;

// What a call passes for one kernel argument, in declaration order.
struct ArgSpec {
  ir::ParamKind kind = ir::ParamKind::Tensor;
  DType dtype = DType::f32;  // tensors: the element type; scalars: ignored (the kernel fixes it)
  int rank = 0;
  ir::TensorFacts facts;

  static ArgSpec tensor(DType t, int rank, ir::TensorFacts facts = {}) {
    return ArgSpec{ir::ParamKind::Tensor, t, rank, facts};
  }
  static ArgSpec scalar() { return ArgSpec{ir::ParamKind::Scalar, DType::f32, 0, {}}; }
};

using MetaMap = std::map<std::string, int64_t>;

// Indexing helpers: x[{_, newaxis}] is x expanded to [n, 1]; x[{newaxis, _}] to [1, n].
enum class Axis { all, newaxis };
inline constexpr Axis _ = Axis::all;
inline constexpr Axis newaxis = Axis::newaxis;

// A symbolic tile (or scalar) inside a kernel being traced.
class Value {
 public:
  Value() = default;
  Value(Builder* b, ir::ValueId id);

  bool valid() const { return b_ != nullptr; }
  ir::ValueId id() const { return id_; }
  Builder& builder() const;
  const ir::Type& type() const;
  DType dtype() const { return type().dtype; }
  const ir::Shape& shape() const { return type().shape; }
  bool is_scalar() const { return type().is_scalar(); }

  Value operator[](std::initializer_list<Axis> axes) const;
  Value col() const;  // [n] -> [n, 1]
  Value row() const;  // [n] -> [1, n]
  Value to(DType t) const;  // cast

 private:
  Builder* b_ = nullptr;
  uint64_t trace_ = 0;  // the trace that made it: a Value kept past its trace is refused, never read
  ir::ValueId id_ = -1;
};

// A tensor argument: a base address with per-dimension sizes and strides.
class Tensor {
 public:
  Tensor() = default;
  Tensor(Builder* b, int param, int rank, DType dtype);
  Value dim(int d) const;     // i32 scalar
  Value stride(int d) const;  // i64 scalar, in elements
  int rank() const { return rank_; }
  DType dtype() const { return dtype_; }
  int param() const { return param_; }
  Builder& builder() const;

 private:
  Builder* b_ = nullptr;
  uint64_t trace_ = 0;  // as Value's
  int param_ = -1;
  int rank_ = 0;
  DType dtype_ = DType::f32;
};

class Builder {
 public:
  // Declares the next tensor argument. Its dtype comes from the call unless fixed here.
  Tensor tensor(const std::string& name, int rank);
  Tensor tensor(const std::string& name, int rank, DType fixed_dtype);
  // Declares the next scalar argument; the kernel fixes its dtype.
  Value scalar(const std::string& name, DType dtype = DType::f32);
  // A meta-parameter: a compile-time integer (block sizes, ...).
  int64_t meta(const std::string& name);
  int64_t meta(const std::string& name, int64_t fallback);
  const std::string& kernel_name() const;

  // ---- used by the DSL's free functions; not needed by kernel authors.
  struct Impl;
  explicit Builder(std::unique_ptr<Impl> impl);
  ~Builder();
  Impl& impl() { return *impl_; }
  const Impl& impl() const { return *impl_; }
  uint64_t trace_serial() const { return serial_; }  // unique in the process

 private:
  std::unique_ptr<Impl> impl_;
  uint64_t serial_ = 0;
};

// Whether `bytes` is an L2 prefetch size the meta-parameter l2_prefetch takes:
// 0 (none given), 64, 128 or 256.
constexpr bool is_l2_prefetch_size(int64_t bytes) { return bytes == 0 || bytes == 64 || bytes == 128 || bytes == 256; }

// A DSL kernel: a name and a body. Cheap to copy; the body runs at trace time.
class Kernel {
 public:
  using Body = std::function<void(Builder&)>;
  Kernel(std::string name, Body body);

  const std::string& name() const;
  uint64_t id() const;  // unique within the process

  // Runs the body for one specialization and returns verified IR.
  // `meta` may set num_warps (default 4), num_stages (default 1),
  // l2_prefetch (the L2 prefetch size of pipelined copies: is_l2_prefetch_size)
  // wgmma (0 or 1: tensor-core dots on Hopper's warpgroup instructions,
  // on sm_90a targets; see the CUDA back end), cluster_size (1..8: the
  // programs along grid axis 0 that cluster_atomic_add sums over), and the
  // CUDA code-generation switches acc_col_run, staged_adds and early_prologue
  // (docs/cuda-backend.md).
  ir::Function trace(const std::vector<ArgSpec>& args, const MetaMap& meta) const;

 private:
  struct State;
  std::shared_ptr<const State> state_;
};

// ---------------------------------------------------------------- free functions
// They act on the kernel being traced on this thread.

// The name of the kernel whose body is being traced on this thread, or null when none is.
const char* tracing_kernel();
Value program_id(int axis);
Value num_programs(int axis);
Value arange(int64_t start, int64_t end);
inline Value arange(int64_t n) { return arange(0, n); }
Value constant(double value, DType dtype);
Value full(const ir::Shape& shape, double value, DType dtype);
inline Value zeros(const ir::Shape& shape, DType dtype = DType::f32) {
  return full(shape, 0.0, dtype);
}

Value cast(const Value& v, DType t);
Value where(const Value& cond, const Value& a, const Value& b);
// With a literal for one side (where(m, x, 0)): the literal takes the tile's dtype as it
// would in arithmetic (an integer literal beside an integer tile stays an integer).
Value where(const Value& cond, const Value& a, double b, bool b_is_int);
Value where(const Value& cond, double a, bool a_is_int, const Value& b);
Value sqrt(const Value& v);
Value rsqrt(const Value& v);
Value exp(const Value& v);
Value log(const Value& v);
Value abs(const Value& v);
Value maximum(const Value& a, const Value& b);
Value minimum(const Value& a, const Value& b);
Value cdiv(const Value& a, const Value& b);  // ceil(a / b) for non-negative integers

Value expand_dims(const Value& v, int axis);
Value broadcast_to(const Value& v, const ir::Shape& shape);
Value trans(const Value& v);
// a, b [..., n] -> [..., 2n] with a's elements at the even positions of the
// last dimension and b's at the odd ones (two halves of packed data, such as
// the high and low nibbles of bytes, back in memory order). The operands
// broadcast to one shape and promote to one dtype. On the GPU it moves no data
// when the consumer's layout keeps neighbouring elements in one thread (a dot
// accumulator does).
Value interleave(const Value& a, const Value& b);
// Table lookup: element i of the result is src[index[i] mod n], for a rank-1
// `src` of n <= 32 elements (a small table such as a 4-bit code book) and an
// integer `index` tile of any shape; the result has index's shape and src's
// dtype. An index outside [0, n) wraps (it never reads outside src). On the
// GPU each lookup is one warp shuffle: no memory is read.
Value gather(const Value& src, const Value& index);

// Reductions over one axis (a negative axis counts from the last, as in NumPy: -1
// is the last); half types accumulate in f32 and round once.
Value sum(const Value& v, int axis);
Value max(const Value& v, int axis);
Value min(const Value& v, int axis);

// a[M,K] @ b[K,N] -> f32[M,N], accumulated in fp32 (tensor cores for bf16/f16 on the GPU).
Value dot(const Value& a, const Value& b);
Value dot(const Value& a, const Value& b, const Value& acc);
// The same, with how many warps share the result's columns on the GPU's
// tensor cores (`warps_n`: 0 lets kerf choose, which puts warps on rows first;
// otherwise a power of two up to 32, reduced where the tile or the program has
// too few columns or warps, raised where the rows run out). Each warp reads b's columns for its share only,
// so a tall a and a wide b read b from shared memory fewer times; each warp
// then keeps more of a's rows in registers. Results are the same; the CPU back
// end ignores it.
Value dot(const Value& a, const Value& b, const Value& acc, int64_t warps_n);
// How the GPU multiplies f32 operands (Triton's input_precision): ieee, fp32 FMA on the
// threads; tf32, on the tensor cores with each operand rounded to TF32 (f32's range,
// 10 mantissa bits: an f16's precision; the products accumulate in fp32), several times
// faster. bf16/f16 operands are on the tensor cores either way and take only ieee. The
// CPU back end multiplies in full f32 for both (at least as precise).
enum class DotPrecision : uint8_t { ieee, tf32 };
Value dot(const Value& a, const Value& b, const Value& acc, int64_t warps_n, DotPrecision precision);

// Memory. One index tile per tensor dimension; indices, mask (and the stored
// value) broadcast to a common shape. Masked-off lanes are not accessed;
// loads give `other` (default 0) there.
Value load(const Tensor& t, const std::vector<Value>& idx, const Value& mask = {},
           const Value& other = {});
Value load(const Tensor& t, const std::vector<Value>& idx, const Value& mask, double other);
void store(const Tensor& t, const std::vector<Value>& idx, const Value& value,
           const Value& mask = {});
// The same with a hint for how long the lines they touch should stay in the
// GPU's L2 cache: evict first (data streamed once, so that it leaves the cache
// to what is re-read) or last (data other programs re-read). A hint never
// changes a result; sm_80 and later take it, other targets and the CPU back
// end ignore it.
enum class Evict : uint8_t { normal, first, last };
Value load(const Tensor& t, const std::vector<Value>& idx, const Value& mask, Evict evict);
Value load(const Tensor& t, const std::vector<Value>& idx, const Value& mask, const Value& other, Evict evict);
void store(const Tensor& t, const std::vector<Value>& idx, const Value& value, const Value& mask, Evict evict);
// The L2 lines that hold t[idx] (where mask is on) go back to normal eviction
// priority, for memory written or read with Evict::last that the rest of the
// program no longer needs kept: no data moves, no result changes. One element
// per 128-byte line is enough (applypriority on sm_80 and later; other targets
// and the CPU back end ignore it).
void l2_evict_normal(const Tensor& t, const std::vector<Value>& idx, const Value& mask = Value());
// Memory ordering of an atomic: relaxed, or acquire-release (the atomic comes
// after every earlier write of the program and before every later read, so a
// program that sees a counter reach its final value sees the writes that came
// before each increment). A scalar atomic is performed once per program.
enum class MemoryOrder { relaxed, acq_rel };

// Adds `value` and returns the old values (0 where masked off).
Value atomic_add(const Tensor& t, const std::vector<Value>& idx, const Value& value,
                 const Value& mask = {}, MemoryOrder order = MemoryOrder::relaxed);

// Adds the sum of `value` over the programs of this program's cluster: the
// meta-parameter cluster_size (1..8, default 1) groups that many consecutive
// programs along grid axis 0, and the grid's first axis must be a multiple of
// it. On sm_90 and later the cluster's programs run together and sum their
// values on chip (distributed shared memory), so each element is added to
// memory once per cluster instead of once per program. Every program of a
// cluster must reach each cluster_atomic_add equally often (programs wait
// there for each other) with the same indices wherever their masks are on;
// masks may differ: a program's masked-off elements count as zero, and an
// element is added where any program's mask is on. Relaxed, f32 tensors, no
// old values. Where there are no clusters (cluster_size 1, targets before
// sm_90, the CPU) it is atomic_add.
void cluster_atomic_add(const Tensor& t, const std::vector<Value>& idx, const Value& value,
                        const Value& mask = {});

// A load that the programs of a cluster (cluster_size of them, consecutive along grid
// axis 0, as for cluster_atomic_add) make together: the program of rank q in its
// cluster reads t[idx..., j + q], where `last` is j + q for it (j the same for the whole
// cluster, a multiple of cluster_size for the fast path) and idx and mask are the same for
// every program of the cluster. The result is load(t, {idx..., last}, mask), and zero where
// `last` lies outside t's last dimension (a program past its end still takes part and hands
// the others their values). On sm_90 and
// later, with t's last dimension contiguous, each program reads a cluster_size-th of the
// tile's elements for every program of its cluster (cluster_size neighbours of the last
// dimension in one vector) and hands each program its values through distributed shared
// memory: memory whose last dimension interleaves what the programs need (PEFT's flat
// lora_B, [out, r*E] with the expert fastest) is read in whole sectors once per cluster
// instead of a sector per element per program. Every program of a cluster must reach each
// cluster_load equally often (they wait there for each other). Where there are no
// clusters (cluster_size 1, targets before sm_90, the CPU) it is that load.
Value cluster_load(const Tensor& t, const std::vector<Value>& idx, const Value& last, const Value& mask = {});

// Programmatic dependent launch (CUDA, sm_90 and later). A kernel launched with
// LaunchOptions::overlap_prior may start while the kernel launched just before it
// on the same stream is still running: wait_prior_grid() is the point from which
// that kernel's writes are visible, so everything the kernel reads or writes that
// the previous kernel writes must come after it, and what comes before it may
// read only memory that was complete before the previous kernel started. Nothing
// that follows it is moved ahead of it: in a for_range body, the loads after it
// are not issued iterations ahead, while those before it may be (so they, too,
// must not read what the previous kernel writes); it costs next to nothing once
// the previous kernel is done. release_dependents() lets the kernel launched
// after this one (with overlap_prior) start before this one ends; without it,
// that kernel starts as this one's programs finish. A kernel launched without
// overlap_prior, the CPU back end and GPUs before sm_90 pass both by.
void wait_prior_grid();
void release_dependents();

// A barrier of the whole grid: every program waits here until all programs have
// reached it, and what any program wrote before it (stores and atomics) is
// visible to every program after it. `counter` is an i32 tensor (one element is
// used) that is zero when the kernel starts; the programs count their arrivals
// there and the last one to end the kernel sets it back to zero, so the same
// memory serves the next launch. Every grid_sync of a kernel takes the same
// counter and stands at the kernel's top level (not in a for_range). A kernel
// with one is launched cooperatively: the driver starts it only if all its
// programs fit on the GPU at once (else the launch fails with the driver's
// message), so the grid must be sized to the GPU (one program per
// multiprocessor always fits). The CPU back end, whose programs run one after
// another, refuses such a kernel.
void grid_sync(const Tensor& counter);
// grid_sync in two halves, with other work between them. grid_arrive counts this
// program's arrival (what it wrote before is then visible to every program that
// waits for it) and goes on; grid_await waits until every program has arrived as
// many times as this one has so far (at grid_arrive or grid_sync). Same counter,
// top level and launch as grid_sync; a grid_await needs an arrival before it that
// no grid_await or grid_sync has waited for.
void grid_arrive(const Tensor& counter);
void grid_await(const Tensor& counter);

// An integer scalar operand: a Value or a C++ integer (a constant of the trace).
class IntArg {
 public:
  IntArg(const Value& v) : value_(v) {}  // NOLINT(google-explicit-constructor)
  template <std::integral T>
  IntArg(T v) : constant_(int64_t(v)), is_constant_(true) {}  // NOLINT
  Value value() const;

 private:
  Value value_;
  int64_t constant_ = 0;
  bool is_constant_ = false;
};

// Structured loop: for (iv = lo; iv < hi; iv += step). Carried values keep
// their types from one iteration to the next. A step <= 0 runs no iteration.
// lo, hi and step are integer scalars (or constants); iv is i64 when any of them is
// i64 (constants count as i64 only past the i32 range), else i32.
using LoopBody = std::function<std::vector<Value>(const Value& iv, const std::vector<Value>&)>;
std::vector<Value> for_range(IntArg lo, IntArg hi, IntArg step, const std::vector<Value>& init,
                             const LoopBody& body);
Value for_range(IntArg lo, IntArg hi, IntArg step, const Value& init,
                const std::function<Value(const Value& iv, const Value& carried)>& body);
void for_range(IntArg lo, IntArg hi, IntArg step,
               const std::function<void(const Value& iv)>& body);

// An integer or float literal as a scalar Value of the kernel being traced: an integer
// is i32 when it fits, else i64; a float is always f32 (literal(0.1) beside an f64 tile
// is 0.1f; write `x + 0.1`, whose literal takes the tile's dtype, or
// constant(0.1, DType::f64)).
Value literal(int64_t v);
Value literal(double v);
// Any other integer type (literal(0), literal(3u)) as int64_t; not bool.
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                        !std::is_same_v<T, int64_t>,
                                    int> = 0>
Value literal(T v) {
  return literal(int64_t(v));
}

// ---------------------------------------------------------------- operators
enum class BinOp { add, sub, mul, div, rem, min, max, band, bor, bxor, shl, shr,
                   lt, le, gt, ge, eq, ne };
Value binary(BinOp op, const Value& a, const Value& b);
Value binary(BinOp op, const Value& a, double b, bool b_is_int);
Value binary(BinOp op, double a, bool a_is_int, const Value& b);

template <class T>
concept Number = std::is_arithmetic_v<T>;

#define KERF_DSL_BINARY(sym, op)                                                       \
  inline Value operator sym(const Value& a, const Value& b) { return binary(op, a, b); } \
  template <Number T>                                                                  \
  Value operator sym(const Value& a, T b) {                                            \
    return binary(op, a, double(b), std::is_integral_v<T>);                            \
  }                                                                                    \
  template <Number T>                                                                  \
  Value operator sym(T a, const Value& b) {                                            \
    return binary(op, double(a), std::is_integral_v<T>, b);                            \
  }
template <Number T>
Value where(const Value& cond, const Value& a, T b) {
  return where(cond, a, double(b), std::is_integral_v<T>);
}
template <Number T>
Value where(const Value& cond, T a, const Value& b) {
  return where(cond, double(a), std::is_integral_v<T>, b);
}

KERF_DSL_BINARY(+, BinOp::add)
KERF_DSL_BINARY(-, BinOp::sub)
KERF_DSL_BINARY(*, BinOp::mul)
KERF_DSL_BINARY(/, BinOp::div)
KERF_DSL_BINARY(%, BinOp::rem)
KERF_DSL_BINARY(&, BinOp::band)
KERF_DSL_BINARY(|, BinOp::bor)
KERF_DSL_BINARY(^, BinOp::bxor)
KERF_DSL_BINARY(<<, BinOp::shl)
KERF_DSL_BINARY(>>, BinOp::shr)
KERF_DSL_BINARY(<, BinOp::lt)
KERF_DSL_BINARY(<=, BinOp::le)
KERF_DSL_BINARY(>, BinOp::gt)
KERF_DSL_BINARY(>=, BinOp::ge)
KERF_DSL_BINARY(==, BinOp::eq)
KERF_DSL_BINARY(!=, BinOp::ne)
#undef KERF_DSL_BINARY

Value operator-(const Value& v);
Value operator!(const Value& v);  // logical not of an i1 tile
Value operator~(const Value& v);  // bitwise not of an integer tile

}  // namespace kerf::dsl
