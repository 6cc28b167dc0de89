// Tracing: runs a kernel body against a Builder and collects its IR.
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "builder_impl.h"

namespace kerf::dsl {
namespace {

thread_local Builder* g_tracing = nullptr;

// Makes `b` the builder of this thread for the scope of a trace.
class TraceScope {
 public:
  explicit TraceScope(Builder* b) : prev_(g_tracing) { g_tracing = b; }
  ~TraceScope() { g_tracing = prev_; }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Builder* prev_;
};

bool is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

}  // namespace

Builder* tracing_builder() { return g_tracing; }

const char* tracing_kernel() { return g_tracing ? g_tracing->kernel_name().c_str() : nullptr; }

Builder& current_builder(const char* op) {
  if (!g_tracing)
    throw DefinitionError(std::string("op '") + op +
                          "' was used outside a kernel body being traced");
  return *g_tracing;
}

ir::ValueId Builder::Impl::emit(ir::Operation op, const ir::Type* result_type) {
  ir::ValueId r = -1;
  if (result_type) {
    // Tiles index their elements in 32 bits, and the back ends size their storage from the
    // count: one that would not fit (or whose count wraps) is refused here, whatever made it.
    int64_t n = 1;
    bool over = false;
    for (const int64_t d : result_type->shape)
      over = over || __builtin_mul_overflow(n, d, &n) || n > INT32_MAX;
    if (over)
      fail(ir::op_name(op.kind), "a tile of shape " + ir::shape_string(result_type->shape) +
                                     " has more than 2^31 - 1 elements, the most a tile holds");
    r = fn.new_value(*result_type);
    op.results.push_back(r);
    defined_in.push_back(blocks.back());
  }
  blocks.back()->ops.push_back(std::move(op));
  return r;
}

void Builder::Impl::check_usable(const Value& v, const char* op) const {
  if (!v.valid()) fail(op, "an operand is an empty Value (default-constructed)");
  if (&v.builder().impl() != this)
    fail(op, "an operand belongs to another kernel's trace");
  const ir::Block* home = defined_in.at(size_t(v.id()));
  if (std::find(blocks.begin(), blocks.end(), home) == blocks.end())
    fail(op, "%" + std::to_string(v.id()) +
                 " was defined inside a loop body that has ended; return it from the body "
                 "as a carried value instead");
}

Builder::Builder(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  static std::atomic<uint64_t> next_serial{1};
  serial_ = next_serial.fetch_add(1, std::memory_order_relaxed);
  impl_->self = this;
}
Builder::~Builder() = default;

const std::string& Builder::kernel_name() const { return impl_->fn.name; }

Tensor Builder::tensor(const std::string& name, int rank) {
  Impl& s = *impl_;
  const int index = int(s.fn.params.size());
  if (name.empty()) s.fail("tensor", "argument " + std::to_string(index) + " needs a name");
  if (rank < 1 || rank > 8) s.fail("tensor", "'" + name + "' must have rank 1..8");
  if (size_t(index) >= s.args.size())
    s.fail("tensor", "argument " + std::to_string(index) + " '" + name +
                         "' is declared, but the call passes only " +
                         std::to_string(s.args.size()) + " arguments");
  const ArgSpec& a = s.args[size_t(index)];
  if (a.kind != ir::ParamKind::Tensor)
    s.fail("tensor", "argument " + std::to_string(index) + " '" + name +
                         "' is a tensor, but the call passes a scalar");
  if (a.rank != rank)
    s.fail("tensor", "argument " + std::to_string(index) + " '" + name + "' is declared rank " +
                         std::to_string(rank) + ", but the call passes a rank-" +
                         std::to_string(a.rank) + " tensor");
  for (const auto& p : s.fn.params)
    if (p.name == name) s.fail("tensor", "argument name '" + name + "' is used twice");
  ir::Param p;
  p.name = name;
  p.kind = ir::ParamKind::Tensor;
  p.dtype = a.dtype;
  p.rank = rank;
  p.facts = a.facts;
  s.fn.params.push_back(p);
  return Tensor(this, index, rank, a.dtype);
}

Tensor Builder::tensor(const std::string& name, int rank, DType fixed) {
  Impl& s = *impl_;
  const size_t index = s.fn.params.size();
  if (index < s.args.size() && s.args[index].kind == ir::ParamKind::Tensor &&
      s.args[index].dtype != fixed)
    s.fail("tensor", "argument " + std::to_string(index) + " '" + name + "' must be " +
                         dtype_name(fixed) + ", but the call passes " +
                         dtype_name(s.args[index].dtype));
  return tensor(name, rank);
}

Value Builder::scalar(const std::string& name, DType dtype) {
  Impl& s = *impl_;
  const int index = int(s.fn.params.size());
  if (name.empty()) s.fail("scalar", "argument " + std::to_string(index) + " needs a name");
  if (size_t(index) >= s.args.size())
    s.fail("scalar", "argument " + std::to_string(index) + " '" + name +
                         "' is declared, but the call passes only " +
                         std::to_string(s.args.size()) + " arguments");
  if (s.args[size_t(index)].kind != ir::ParamKind::Scalar)
    s.fail("scalar", "argument " + std::to_string(index) + " '" + name +
                         "' is a scalar, but the call passes a tensor");
  if (dtype == DType::i1 || dtype == DType::u8)
    s.fail("scalar", "'" + name + "': " + dtype_name(dtype) + " scalars are not supported");
  for (const auto& p : s.fn.params)
    if (p.name == name) s.fail("scalar", "argument name '" + name + "' is used twice");
  ir::Param p;
  p.name = name;
  p.kind = ir::ParamKind::Scalar;
  p.dtype = dtype;
  s.fn.params.push_back(p);
  ir::Operation op(ir::OpKind::Param);
  op.attrs.param = index;
  const ir::Type t{dtype, {}};
  return Value(this, s.emit(std::move(op), &t));
}

int64_t Builder::meta(const std::string& name) {
  Impl& s = *impl_;
  auto it = s.meta->find(name);
  if (it == s.meta->end())
    throw DefinitionError("kernel '" + s.fn.name + "': meta-parameter '" + name +
                          "' is not set and has no default");
  s.meta_used[name] = it->second;
  return it->second;
}

int64_t Builder::meta(const std::string& name, int64_t fallback) {
  Impl& s = *impl_;
  auto it = s.meta->find(name);
  const int64_t v = it == s.meta->end() ? fallback : it->second;
  if (it == s.meta->end())
    if (const auto seen = s.meta_used.find(name); seen != s.meta_used.end() && seen->second != v)
      throw DefinitionError("kernel '" + s.fn.name + "': meta-parameter '" + name + "' has two defaults, " +
                            std::to_string(seen->second) + " and " + std::to_string(v) +
                            "; give it one (or set it in the call)");
  s.meta_used[name] = v;
  return v;
}

// ---------------------------------------------------------------- Kernel

struct Kernel::State {
  std::string name;
  Body body;
  uint64_t id;
};

Kernel::Kernel(std::string name, Body body) {
  static std::atomic<uint64_t> next_id{1};
  if (name.empty()) throw DefinitionError("a kernel needs a name");
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_'))
      throw DefinitionError("kernel name '" + name +
                            "' may hold only letters, digits and underscores");
  if (!body) throw DefinitionError("kernel '" + name + "' has no body");
  state_ = std::make_shared<const State>(State{std::move(name), std::move(body), next_id++});
}

const std::string& Kernel::name() const { return state_->name; }
uint64_t Kernel::id() const { return state_->id; }

ir::Function Kernel::trace(const std::vector<ArgSpec>& args, const MetaMap& meta) const {
  // A body describes one program; one that launches (and so traces) kernels while it is
  // being traced would nest traces, or wait for its own build.
  if (g_tracing)
    throw DefinitionError("kernel '" + state_->name + "' was traced (launched?) inside the body of kernel '" +
                          g_tracing->kernel_name() + "' while that was being traced; a kernel body describes "
                          "one program and cannot launch or trace kernels");
  auto impl = std::make_unique<Builder::Impl>();
  impl->fn.name = state_->name;
  impl->args = args;
  impl->meta = &meta;
  impl->blocks.push_back(&impl->fn.body);
  Builder b(std::move(impl));
  Builder::Impl& s = b.impl();

  // Launch meta-parameters that every kernel has.
  const int64_t warps = b.meta("num_warps", 4);
  const int64_t stages = b.meta("num_stages", 1);
  if (!is_pow2(warps) || warps > 32)
    throw DefinitionError("kernel '" + s.fn.name + "': num_warps must be a power of two <= 32, got " +
                          std::to_string(warps));
  if (stages < 1 || stages > 8)
    throw DefinitionError("kernel '" + s.fn.name + "': num_stages must be in 1..8, got " +
                          std::to_string(stages));
  // The L2 prefetch size hint of pipelined copies (bytes), when given.
  if (meta.count("l2_prefetch")) {
    const int64_t bytes = b.meta("l2_prefetch");
    if (!is_l2_prefetch_size(bytes))
      throw DefinitionError("kernel '" + s.fn.name + "': l2_prefetch must be 0, 64, 128 or 256 (bytes), got " +
                            std::to_string(bytes));
  }
  // Code generation switches, 0 or 1 when given.
  const auto expect_flag = [&](const char* name) {
    if (!meta.count(name)) return;
    const int64_t on = b.meta(name);
    if (on != 0 && on != 1)
      throw DefinitionError("kernel '" + s.fn.name + "': " + name + " must be 0 or 1, got " + std::to_string(on));
  };
  // wgmma=1: tensor-core dots may use Hopper's warpgroup instructions (on sm_90a).
  expect_flag("wgmma");
  // wgmma_ss=1: those warpgroup dots read both operands from shared memory: A too where
  // its tile is kept in their 128-byte-swizzled layout (no fragments in registers), and
  // B tiles of 16 columns in their 32-byte-swizzled layout.
  expect_flag("wgmma_ss");
  // staged_adds=1: f32 atomic adds of a dot's accumulator go out through shared memory, as
  // whole-row vectors, instead of from the accumulator's registers.
  expect_flag("staged_adds");
  // acc_store=1: a plain store of a value in a tensor-core dot's accumulator layout goes out
  // from its registers (each thread's runs of adjacent columns), not through shared memory
  // into a blocked layout first.
  expect_flag("acc_store");
  // store_in_ring=1: such a store's move through shared memory into the blocked layout
  // reuses this iteration's slot of a pipelined load read in the accumulator's layout (each
  // thread overwrites the elements it read), not a buffer of its own.
  expect_flag("store_in_ring");
  // early_prologue=1: a pipelined loop's first copies go out as soon as the values they
  // need exist (before loads and atomics they do not depend on), not where the loop begins.
  expect_flag("early_prologue");
  // acc_col_run: a tensor-core dot's accumulator gives each thread runs of this many
  // consecutive columns (loads and stores of it as vectors, no shared memory).
  if (meta.count("acc_col_run")) {
    const int64_t run = b.meta("acc_col_run");
    if (run < 0 || run > 16 || (run > 0 && !is_pow2(run)))
      throw DefinitionError("kernel '" + s.fn.name + "': acc_col_run must be 0 or a power of two <= 16, got " +
                            std::to_string(run));
  }
  // cluster_size: consecutive programs along grid axis 0 that cluster_atomic_add sums over.
  if (meta.count("cluster_size")) {
    const int64_t c = b.meta("cluster_size");
    if (c < 1 || c > 8)
      throw DefinitionError("kernel '" + s.fn.name + "': cluster_size must be in 1..8, got " + std::to_string(c));
  }
  {
    TraceScope scope(&b);
    try {
      state_->body(b);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      // The author's own mistakes (a vector's .at(), a bad_alloc of a huge table) come back
      // as what every other definition mistake is, naming the kernel.
      throw DefinitionError("kernel '" + s.fn.name + "': its body threw: " + e.what());
    } catch (...) {
      throw DefinitionError("kernel '" + s.fn.name + "': its body threw something that is not a std::exception");
    }
  }
  if (s.fn.params.size() != args.size())
    throw DefinitionError("kernel '" + s.fn.name + "' declares " +
                          std::to_string(s.fn.params.size()) + " arguments, but the call passes " +
                          std::to_string(args.size()));
  for (const auto& [name, value] : meta)
    if (!s.meta_used.count(name))
      throw DefinitionError("kernel '" + s.fn.name + "': meta-parameter '" + name +
                            "' was given but the kernel does not use it");
  for (const auto& [name, value] : s.meta_used) s.fn.meta.push_back(ir::MetaValue{name, value});
  ir::verify(s.fn);
  ir::canonicalize(s.fn);
  ir::verify(s.fn);
  return std::move(s.fn);
}

}  // namespace kerf::dsl
