// kerf's kernel IR: typed, SSA, with structured loops.
//
// A Function is one specialization of a DSL kernel: its meta-parameters are
// baked into static tile shapes and constants, its parameters carry the
// dtypes and the facts (contiguity, alignment) that code generation may use.
// Every value has a Type: an element dtype and a static tile shape (empty
// shape = a scalar, uniform across the program). Tile dimensions are powers
// of two, so that the GPU back end can spread them over threads exactly.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kerf/dtype.h"

namespace kerf::ir {

using Shape = std::vector<int64_t>;
using ValueId = int32_t;

struct Type {
  DType dtype = DType::f32;
  Shape shape;  // empty: scalar

  bool is_scalar() const { return shape.empty(); }
  int rank() const { return int(shape.size()); }
  int64_t numel() const;
  bool operator==(const Type& o) const { return dtype == o.dtype && shape == o.shape; }
  bool operator!=(const Type& o) const { return !(*this == o); }
};

std::string to_string(const Type& t);    // "f32[64,128]", "i32"
std::string shape_string(const Shape& s);  // "[64,128]"

enum class OpKind : uint8_t {
  // ---- leaves
  Param,        // the value of scalar kernel parameter `attrs.param`
  Constant,     // a scalar constant (attrs.fvalue for floats, attrs.ivalue for ints)
  ProgramId,    // this program's index along grid axis attrs.axis (i32 scalar)
  NumPrograms,  // the grid size along axis attrs.axis (i32 scalar)
  Arange,       // i32 tile [end-start]: start, start+1, ..., end-1
  TensorDim,    // size of dimension attrs.axis of tensor parameter attrs.param (i32 scalar)
  TensorStride, // stride (in elements) of that dimension (i64 scalar)
  // ---- shape
  Splat,        // a scalar repeated over a tile
  ExpandDims,   // insert a size-1 dimension at attrs.axis
  Broadcast,    // stretch size-1 dimensions to the result shape
  Transpose,    // swap the two dimensions of a rank-2 tile
  Interleave,   // a, b [..., n] -> [..., 2n]: even positions from a, odd ones from b
  // ---- elementwise, unary
  Neg, Not, Abs, Sqrt, Rsqrt, Exp, Log,
  // ---- elementwise, binary (operands of one type; comparisons give i1)
  Add, Sub, Mul, Div, Rem, Min, Max, And, Or, Xor, Shl, Shr,
  Lt, Le, Gt, Ge, Eq, Ne,
  Select,       // cond ? a : b, elementwise
  Gather,       // src[idx & (n-1)] for a rank-1 src tile of n <= 32 elements and an
                // integer idx tile; the result has idx's shape and src's dtype
  Cast,         // convert to the result dtype (round to nearest even; float->int truncates)
  // ---- reductions over attrs.axis (half types accumulate in f32)
  ReduceSum, ReduceMax, ReduceMin,
  // ---- matrix product: a[M,K] x b[K,N] (+ acc[M,N]) -> f32[M,N] (fp32 accumulation)
  Dot,
  // ---- memory (attrs.param names the tensor parameter; the index operands,
  //      one per tensor dimension, and the mask all have the access's shape)
  Load,         // operands: idx..., [mask], [other]
  Store,        // operands: idx..., value, [mask]
  AtomicAdd,    // operands: idx..., value, [mask]; optional result: the old values
                // (0 where masked off). Device scope; attrs.acq_rel orders it
                // after every earlier write of the program and before every later read.
                // attrs.cluster_sum: the value is first summed over the programs of the
                // program's cluster (meta cluster_size), one of which adds each element.
  // ---- grid dependencies (programmatic dependent launch; no operands, no results)
  GridWait,     // what the grid launched before this one on the stream wrote is visible
                // from here on (it may still be running before this point); nothing
                // after it in program order is moved ahead of it
  GridRelease,  // a grid launched after this one may start before this one ends
  GridSync,     // every program of the grid waits here for all the others (attrs.param: an i32
                // counter tensor, zero on entry, left zero); writes before it are visible after
                // it in every program. Top level of the kernel only; the kernel is launched
                // cooperatively (all programs resident at once). attrs.axis: 0 the whole
                // barrier, 1 only the arrival (dsl::grid_arrive), 2 only the wait for
                // every program's arrivals so far (dsl::grid_await)
  // ---- control
  For,          // operands: lo, hi, step, init...; body args: iv, carried...; results: carried
  Yield,        // terminator of a For body: the next carried values
  // ---- memory hints (last, so that the kinds before keep their numbers: IR hashes of
  //      existing kernels, and the caches and bundles keyed by them, stay valid)
  L2EvictNormal,  // operands: idx..., [mask]; no result. The L2 lines holding these elements
                  // go back to normal eviction priority (after an evict-last access); no
                  // data moves and no result changes
};

const char* op_name(OpKind k);
bool is_elementwise_unary(OpKind k);
bool is_elementwise_binary(OpKind k);
bool is_comparison(OpKind k);
bool is_reduction(OpKind k);

struct Attrs {
  int64_t axis = 0;     // ProgramId, NumPrograms, ExpandDims, reductions, TensorDim/Stride;
                        // Dot: warps sharing the result's columns on the GPU (0: codegen's choice)
  int64_t param = -1;   // Param, TensorDim/Stride, Load/Store/AtomicAdd
  int64_t start = 0;    // Arange
  int64_t end = 0;      // Arange
  int64_t ivalue = 0;   // Constant (integer dtypes)
  double fvalue = 0.0;  // Constant (float dtypes)
  bool has_mask = false;   // Load/Store/AtomicAdd
  bool has_other = false;  // Load
  bool acq_rel = false;    // AtomicAdd: acquire-release instead of relaxed
  bool cluster_sum = false;  // AtomicAdd: summed over the cluster's programs first (dsl::cluster_atomic_add)
  bool cluster_share = false;  // Load: read together by the cluster's programs (dsl::cluster_load);
                               // elements whose last index is outside the last dimension read 0
  uint8_t evict = 0;       // Load/Store: L2 eviction hint (0 normal, 1 evict first, 2 evict last)
  bool tf32 = false;       // Dot: f32 operands multiplied as TF32 on the GPU's tensor cores
};

struct Block;

struct Operation {
  OpKind kind;
  std::vector<ValueId> operands;
  std::vector<ValueId> results;
  Attrs attrs;
  std::unique_ptr<Block> body;  // For only

  Operation(OpKind k) : kind(k) {}
  Operation(Operation&&) = default;
  Operation& operator=(Operation&&) = default;
};

// OpKind::GridSync's part (attrs.axis): the whole barrier, only the arrival, only the wait.
inline constexpr int64_t kGridSyncWhole = 0, kGridArrive = 1, kGridAwait = 2;
// A GridSync op's name in the DSL: "grid_sync", "grid_arrive" or "grid_await" (the CUDA
// device library's functions are named alike).
const char* grid_barrier_name(const Operation& op);

struct Block {
  std::vector<ValueId> args;
  std::vector<Operation> ops;
};

enum class ParamKind : uint8_t { Tensor, Scalar };

// Facts about a tensor argument that change the generated code; they are part
// of the specialization (and so of the IR text and its hash). "div16" means
// divisible by 16 elements, the granularity of kerf's vector accesses; "div8"
// divisible by 8 (enough for 16-byte vectors of 2- and 4-byte dtypes, so a
// bf16 row of 8200 elements still moves in 16-byte vectors).
struct TensorFacts {
  bool contiguous_last = false;  // the last dimension has stride 1
  bool aligned16 = false;        // the data address is a multiple of 16 bytes
  uint32_t dims_div16 = 0;       // bit d: size of dimension d is a multiple of 16
  uint32_t strides_div16 = 0;    // bit d: stride of dimension d is a multiple of 16
  uint32_t dims_div8 = 0;        // bit d: size of dimension d is a multiple of 8 (set with div16 too)
  uint32_t strides_div8 = 0;     // bit d: stride of dimension d is a multiple of 8 (set with div16 too)
  bool operator==(const TensorFacts& o) const {
    return contiguous_last == o.contiguous_last && aligned16 == o.aligned16 &&
           dims_div16 == o.dims_div16 && strides_div16 == o.strides_div16 &&
           dims_div8 == o.dims_div8 && strides_div8 == o.strides_div8;
  }
  // The power of two (16, 8 or 1) known to divide the size or stride of dimension d.
  int64_t dim_divisor(int d) const { return divisor(dims_div16, dims_div8, d); }
  int64_t stride_divisor(int d) const { return divisor(strides_div16, strides_div8, d); }

 private:
  static int64_t divisor(uint32_t div16, uint32_t div8, int d) {
    return (div16 >> d) & 1 ? 16 : (div8 >> d) & 1 ? 8 : 1;
  }
};

struct Param {
  std::string name;
  ParamKind kind = ParamKind::Tensor;
  DType dtype = DType::f32;
  int rank = 0;  // tensors only
  TensorFacts facts;
};

struct MetaValue {
  std::string name;
  int64_t value = 0;
};

struct Function {
  std::string name;
  std::vector<Param> params;
  std::vector<MetaValue> meta;  // sorted by name
  std::vector<Type> types;      // indexed by ValueId
  Block body;

  const Type& type(ValueId v) const { return types.at(size_t(v)); }
  ValueId new_value(Type t) {
    types.push_back(std::move(t));
    return ValueId(types.size() - 1);
  }
  int64_t meta_value(const std::string& name, int64_t fallback) const;
};

// Canonical text: deterministic, the same for the same kernel in every process.
std::string print(const Function& f);

// XXH3-128 of the canonical text, as 32 lowercase hex digits.
struct Hash128 {
  uint64_t hi = 0, lo = 0;
  std::string hex() const;
  bool operator==(const Hash128& o) const { return hi == o.hi && lo == o.lo; }
  bool operator!=(const Hash128& o) const { return !(*this == o); }
};
Hash128 hash_bytes(const void* data, size_t size);
Hash128 hash(const Function& f);

// Throws kerf::InternalError naming the op when the IR is ill-typed.
void verify(const Function& f);

// Puts a traced Function in canonical form: identical pure ops merged, unused
// pure ops dropped, ops ordered and values numbered by a walk from the ops with
// effects in program order, so the text does not depend on the order in which
// C++ evaluated the operands of the kernel's expressions.
void canonicalize(Function& f);

// Whether `b` or a loop body inside it holds an op of kind `k`.
bool contains(const Block& b, OpKind k);

// Number of uses of each value (index = ValueId), counting uses inside loop bodies.
std::vector<int> count_uses(const Function& f);

}  // namespace kerf::ir
