// kerf IR -> LLVM IR for one program of the grid.
//
// Scalars (uniform values) become SSA values at their place in the program.
// A tile is either an array on the stack, filled by a loop nest over its
// shape, or inline: a consumer's loop nest computes element [i, j, ...] from
// its operands' elements, remapping indices through splat / broadcast /
// expand_dims / transpose (tile_plan.h decides which). Stores and atomics are
// the roots that pull inline values through their own loop nest. LLVM's loop
// vectorizer then turns the innermost loops into SIMD code.
//
// Index arithmetic that feeds an address is evaluated in 64 bits (an i32
// `rows * stride + cols` does not wrap), which also lets LLVM see the
// addresses as affine functions of the loop counters.
#include "jit/cpu/llvm_codegen.h"

#include <llvm/IR/IRBuilder.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/Module.h>
#include <llvm/IR/Verifier.h>
#include <llvm/Support/raw_ostream.h>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "jit/cpu/element_ops.h"
#include "jit/cpu/half_float_ir.h"
#include "jit/cpu/tile_plan.h"
#include "kerf/error.h"

namespace kerf::jit::cpu {
namespace {

using ir::Operation;
using ir::OpKind;
using ir::Shape;
using ir::ValueId;
using Index = std::vector<llvm::Value*>;  // one i64 per tile dimension

constexpr unsigned kArrayAlignBytes = 64;
// Partial results kept by a reduction along the last axis (one SIMD register of f32 on AVX-512).
constexpr int64_t kReductionLanes = 16;

int64_t register_bytes(DType t) {
  switch (t) {
    case DType::i1:
      return 1;
    case DType::i64:
    case DType::f64:
      return 8;
    default:
      return 4;  // i32, f32, and the half types held as f32
  }
}

// A tensor parameter as the program sees it.
struct TensorArg {
  llvm::Value* data = nullptr;               // pointer to the memory type of its dtype
  std::vector<llvm::Value*> sizes, strides;  // i64
};

// `for (iv = 0; iv < n; ++iv)` with n >= 1 known; n == 1 needs no loop.
struct CountedLoop {
  int64_t n = 1;
  llvm::BasicBlock* header = nullptr;
  llvm::PHINode* phi = nullptr;
  llvm::Value* iv = nullptr;
};

class KernelEmitter {
 public:
  KernelEmitter(const ir::Function& f, llvm::Module& m)
      : f_(f),
        m_(m),
        ctx_(m.getContext()),
        b_(ctx_),
        half_(m),
        ops_(b_, half_),
        plan_(plan_tiles(f)),
        scalar_(f.types.size(), nullptr),
        array_(f.types.size(), nullptr) {}

  void emit(const std::string& entry_name) {
    llvm::Type* slot_ptr = b_.getInt64Ty()->getPointerTo();
    llvm::Type* i32_ptr = b_.getInt32Ty()->getPointerTo();
    auto* type = llvm::FunctionType::get(b_.getVoidTy(), {slot_ptr, i32_ptr, i32_ptr}, false);
    fn_ = llvm::Function::Create(type, llvm::GlobalValue::ExternalLinkage, entry_name, m_);
    fn_->addFnAttr(llvm::Attribute::NoUnwind);
    // Big tile arrays may exceed a guard page; probe the stack as the frame grows.
    fn_->addFnAttr("probe-stack", "inline-asm");
    const char* names[] = {"slots", "pid", "nprog"};
    for (unsigned i = 0; i < 3; ++i) {
      fn_->getArg(i)->setName(names[i]);
      fn_->addParamAttr(i, llvm::Attribute::NoAlias);
      fn_->addParamAttr(i, llvm::Attribute::NoCapture);
      fn_->addParamAttr(i, llvm::Attribute::ReadOnly);
    }
    alloca_block_ = llvm::BasicBlock::Create(ctx_, "entry", fn_);
    llvm::BasicBlock* body = llvm::BasicBlock::Create(ctx_, "body", fn_);
    b_.SetInsertPoint(body);
    read_arguments();
    emit_block(f_.body);
    b_.CreateRetVoid();
    llvm::IRBuilder<>(alloca_block_).CreateBr(body);
  }

  int64_t stack_bytes() const { return stack_bytes_; }

 private:
  // ------------------------------------------------------------ helpers
  [[noreturn]] void fail_internal(const std::string& what) const {
    throw InternalError("CPU back end, kernel '" + f_.name + "': " + what);
  }
  const ir::Type& type(ValueId v) const { return f_.type(v); }
  bool is_tile(ValueId v) const { return !type(v).is_scalar(); }

  // ------------------------------------------------------------ arguments
  void read_arguments() {
    llvm::Value* slots = fn_->getArg(0);
    auto slot = [&](size_t i) {
      llvm::Value* p = b_.CreateConstInBoundsGEP1_64(b_.getInt64Ty(), slots, i);
      return b_.CreateAlignedLoad(b_.getInt64Ty(), p, llvm::Align(8));
    };
    tensors_.resize(f_.params.size());
    param_value_.assign(f_.params.size(), nullptr);
    size_t next = 0;
    for (size_t i = 0; i < f_.params.size(); ++i) {
      const ir::Param& p = f_.params[i];
      if (p.kind == ir::ParamKind::Scalar) {
        param_value_[i] = scalar_from_slot(p.dtype, slot(next++));
        continue;
      }
      TensorArg& t = tensors_[i];
      llvm::Type* elem_ptr = ops_.memory_type(p.dtype)->getPointerTo();
      t.data = b_.CreateIntToPtr(slot(next), elem_ptr, p.name);
      if (p.facts.aligned16) b_.CreateAlignmentAssumption(m_.getDataLayout(), t.data, 16);
      for (int d = 0; d < p.rank; ++d) t.sizes.push_back(slot(next + 1 + size_t(d)));
      for (int d = 0; d < p.rank; ++d) {
        const bool unit = d == p.rank - 1 && p.facts.contiguous_last;  // known, not read
        t.strides.push_back(unit ? static_cast<llvm::Value*>(b_.getInt64(1))
                                 : slot(next + 1 + size_t(p.rank + d)));
      }
      next += 1 + 2 * size_t(p.rank);
    }
  }

  llvm::Value* scalar_from_slot(DType t, llvm::Value* raw) {
    switch (t) {
      case DType::i1:
        return b_.CreateICmpNE(raw, b_.getInt64(0));
      case DType::i32:
        return b_.CreateTrunc(raw, b_.getInt32Ty());
      case DType::u8:
        return b_.CreateAnd(b_.CreateTrunc(raw, b_.getInt32Ty()), b_.getInt32(255));
      case DType::i64:
        return raw;
      case DType::f16:
      case DType::bf16:
        return ops_.to_register(t, b_.CreateTrunc(raw, b_.getInt16Ty()));
      case DType::f32:
        return b_.CreateBitCast(b_.CreateTrunc(raw, b_.getInt32Ty()), b_.getFloatTy());
      case DType::f64:
        return b_.CreateBitCast(raw, b_.getDoubleTy());
    }
    return raw;
  }

  // ------------------------------------------------------------ arrays and loops
  llvm::Value* new_array(DType t, int64_t numel, const char* name) {
    llvm::IRBuilder<> at_entry(alloca_block_);
    llvm::AllocaInst* a =
        at_entry.CreateAlloca(ops_.register_type(t), at_entry.getInt64(uint64_t(numel)), name);
    a->setAlignment(llvm::Align(kArrayAlignBytes));
    stack_bytes_ += numel * register_bytes(t);
    return a;
  }

  // Row-major offset of `idx` in a tile of `shape`.
  llvm::Value* linear_offset(const Shape& shape, const Index& idx) {
    llvm::Value* off = nullptr;
    int64_t stride = 1;
    for (size_t d = shape.size(); d-- > 0;) {
      if (shape[d] != 1) {
        llvm::Value* term =
            stride == 1 ? idx[d]
                        : b_.CreateMul(idx[d], b_.getInt64(uint64_t(stride)), "", true, true);
        off = off ? b_.CreateAdd(off, term, "", true, true) : term;
      }
      stride *= shape[d];
    }
    return off ? off : b_.getInt64(0);
  }

  llvm::Value* array_element(llvm::Value* array, DType t, const Shape& shape, const Index& idx) {
    return b_.CreateInBoundsGEP(ops_.register_type(t), array, linear_offset(shape, idx));
  }

  CountedLoop open_loop(int64_t n) {
    CountedLoop loop;
    loop.n = n;
    if (n == 1) {
      loop.iv = b_.getInt64(0);
      return loop;
    }
    llvm::BasicBlock* before = b_.GetInsertBlock();
    loop.header = llvm::BasicBlock::Create(ctx_, "tile.loop", fn_);
    b_.CreateBr(loop.header);
    b_.SetInsertPoint(loop.header);
    loop.phi = b_.CreatePHI(b_.getInt64Ty(), 2, "i");
    loop.phi->addIncoming(b_.getInt64(0), before);
    loop.iv = loop.phi;
    return loop;
  }

  // `unroll` lets LLVM unroll the loop; otherwise only the vectorizer may
  // (by interleaving), which keeps code size and compile time in check.
  void close_loop(const CountedLoop& loop, bool unroll = false) {
    if (loop.n == 1) return;
    llvm::Value* next = b_.CreateAdd(loop.phi, b_.getInt64(1), "", true, true);
    loop.phi->addIncoming(next, b_.GetInsertBlock());
    llvm::BasicBlock* exit = llvm::BasicBlock::Create(ctx_, "tile.done", fn_);
    llvm::BranchInst* latch =
        b_.CreateCondBr(b_.CreateICmpULT(next, b_.getInt64(uint64_t(loop.n))), loop.header, exit);
    if (!unroll) forbid_unrolling(latch);
    b_.SetInsertPoint(exit);
  }

  void forbid_unrolling(llvm::BranchInst* latch) {
    llvm::MDNode* disable =
        llvm::MDNode::get(ctx_, {llvm::MDString::get(ctx_, "llvm.loop.unroll.disable")});
    llvm::MDNode* id = llvm::MDNode::getDistinct(ctx_, {nullptr, disable});
    id->replaceOperandWith(0, id);  // a loop ID names itself
    latch->setMetadata(llvm::LLVMContext::MD_loop, id);
  }

  // Runs `body` once per element of `shape`, last dimension innermost. Inline
  // elements computed for one nest are not reused outside it.
  void for_each_index(const Shape& shape, const std::function<void(const Index&)>& body) {
    cache_.clear();
    std::vector<CountedLoop> loops;
    Index idx;
    for (int64_t n : shape) {
      loops.push_back(open_loop(n));
      idx.push_back(loops.back().iv);
    }
    body(idx);
    for (size_t i = loops.size(); i-- > 0;) close_loop(loops[i]);
    cache_.clear();
  }

  // Writes every element of `v` into `dst` (an array of v's dtype and shape).
  void copy_into(llvm::Value* dst, ValueId v) {
    const ir::Type& t = type(v);
    if (llvm::Value* src = array_[size_t(v)]) {
      if (src != dst) {
        const uint64_t bytes = uint64_t(t.numel() * register_bytes(t.dtype));
        b_.CreateMemCpy(dst, llvm::Align(kArrayAlignBytes), src, llvm::Align(kArrayAlignBytes),
                        bytes);
      }
      return;
    }
    for_each_index(t.shape, [&](const Index& idx) {
      b_.CreateStore(elem(v, idx), array_element(dst, t.dtype, t.shape, idx));
    });
  }

  // ------------------------------------------------------------ elements
  // Element `idx` of `v`, in register form.
  llvm::Value* elem(ValueId v, const Index& idx) {
    const ir::Type& t = type(v);
    if (t.is_scalar()) {
      if (!scalar_[size_t(v)])
        fail_internal("scalar %" + std::to_string(v) + " used before it is computed");
      return scalar_[size_t(v)];
    }
    const CacheKey key{v, false, idx};
    if (auto it = cache_.find(key); it != cache_.end()) return it->second;
    llvm::Value* result;
    if (llvm::Value* array = array_[size_t(v)]) {
      result =
          b_.CreateLoad(ops_.register_type(t.dtype), array_element(array, t.dtype, t.shape, idx));
    } else {
      const Operation* op = plan_.def[size_t(v)];
      if (!op) fail_internal("tile %" + std::to_string(v) + " used before it is computed");
      result = compute(*op, idx);
    }
    cache_.emplace(key, result);
    return result;
  }

  // Element `idx` of the integer value `v` as i64, computing i32 index math without wrapping.
  llvm::Value* index_elem(ValueId v, const Index& idx) {
    const ir::Type& t = type(v);
    auto widen = [&](llvm::Value* x) {
      return t.dtype == DType::i64 ? x : b_.CreateSExt(x, b_.getInt64Ty());
    };
    if (t.is_scalar() || array_[size_t(v)]) return widen(elem(v, idx));
    const CacheKey key{v, true, idx};
    if (auto it = cache_.find(key); it != cache_.end()) return it->second;
    const Operation* op = plan_.def[size_t(v)];
    if (!op) fail_internal("tile %" + std::to_string(v) + " used before it is computed");
    llvm::Value* result = nullptr;
    switch (op->kind) {
      case OpKind::Arange:
        result = b_.CreateAdd(idx[0], b_.getInt64(uint64_t(op->attrs.start)));
        break;
      case OpKind::Splat:
        result = index_elem(op->operands[0], {});
        break;
      case OpKind::ExpandDims:
      case OpKind::Broadcast:
      case OpKind::Transpose:
        result = index_elem(op->operands[0], operand_index(*op, idx));
        break;
      case OpKind::Add:
        result = b_.CreateAdd(index_elem(op->operands[0], idx), index_elem(op->operands[1], idx));
        break;
      case OpKind::Sub:
        result = b_.CreateSub(index_elem(op->operands[0], idx), index_elem(op->operands[1], idx));
        break;
      case OpKind::Mul:
        result = b_.CreateMul(index_elem(op->operands[0], idx), index_elem(op->operands[1], idx));
        break;
      case OpKind::Cast: {
        const DType from = type(op->operands[0]).dtype;
        if (t.dtype == DType::i64 && (from == DType::i32 || from == DType::i64)) {
          result = index_elem(op->operands[0], idx);
          break;
        }
        result = widen(elem(v, idx));
        break;
      }
      default:
        result = widen(elem(v, idx));
        break;
    }
    cache_.emplace(key, result);
    return result;
  }

  // The index of the operand element that a shape op's element `idx` reads.
  Index operand_index(const Operation& op, const Index& idx) {
    switch (op.kind) {
      case OpKind::ExpandDims: {
        Index in = idx;
        in.erase(in.begin() + op.attrs.axis);
        return in;
      }
      case OpKind::Broadcast: {
        const Shape& from = type(op.operands[0]).shape;
        Index in = idx;
        for (size_t d = 0; d < from.size(); ++d)
          if (from[d] == 1) in[d] = b_.getInt64(0);
        return in;
      }
      case OpKind::Transpose:
        return Index{idx[1], idx[0]};
      default:
        return idx;
    }
  }

  // Element `idx` of the single result of `op`, computed from its operands' elements.
  llvm::Value* compute(const Operation& op, const Index& idx) {
    const ir::Type& rt = type(op.results[0]);
    const ir::Attrs& a = op.attrs;
    switch (op.kind) {
      case OpKind::Param:
        return param_value_[size_t(a.param)];
      case OpKind::Constant:
        return ops_.constant(rt.dtype, a.fvalue, a.ivalue);
      case OpKind::ProgramId:
      case OpKind::NumPrograms: {
        llvm::Value* base = fn_->getArg(op.kind == OpKind::ProgramId ? 1 : 2);
        llvm::Value* p = b_.CreateConstInBoundsGEP1_64(b_.getInt32Ty(), base, uint64_t(a.axis));
        return b_.CreateAlignedLoad(b_.getInt32Ty(), p, llvm::Align(4));
      }
      case OpKind::Arange:
        return b_.CreateAdd(b_.CreateTrunc(idx[0], b_.getInt32Ty()),
                            b_.getInt32(uint32_t(int32_t(a.start))));
      case OpKind::TensorDim:
        return b_.CreateTrunc(tensors_[size_t(a.param)].sizes[size_t(a.axis)], b_.getInt32Ty());
      case OpKind::TensorStride:
        return tensors_[size_t(a.param)].strides[size_t(a.axis)];
      case OpKind::Splat:
        return elem(op.operands[0], {});
      case OpKind::ExpandDims:
      case OpKind::Broadcast:
      case OpKind::Transpose:
        return elem(op.operands[0], operand_index(op, idx));
      case OpKind::Select:
        return b_.CreateSelect(elem(op.operands[0], idx), elem(op.operands[1], idx),
                               elem(op.operands[2], idx));
      case OpKind::Cast:
        return ops_.cast(type(op.operands[0]).dtype, rt.dtype, elem(op.operands[0], idx));
      case OpKind::Interleave: {
        // Position j of the last dimension is element j/2 of a (j even) or b (j odd).
        Index half = idx;
        half.back() = b_.CreateLShr(idx.back(), b_.getInt64(1));
        llvm::Value* odd = b_.CreateICmpNE(b_.CreateAnd(idx.back(), b_.getInt64(1)), b_.getInt64(0));
        return b_.CreateSelect(odd, elem(op.operands[1], half), elem(op.operands[0], half));
      }
      case OpKind::Gather: {
        // src[index mod n]: n is a power of two, so the low bits of the index.
        const int64_t n = type(op.operands[0]).shape[0];
        llvm::Value* i = index_elem(op.operands[1], idx);
        return elem(op.operands[0], Index{b_.CreateAnd(i, b_.getInt64(uint64_t(n - 1)))});
      }
      case OpKind::Load:
        return load_element(op, idx);
      default:
        break;
    }
    if (ir::is_elementwise_unary(op.kind))
      return ops_.unary(op.kind, rt.dtype, elem(op.operands[0], idx));
    if (ir::is_elementwise_binary(op.kind)) {
      llvm::Value* x = elem(op.operands[0], idx);
      llvm::Value* y = elem(op.operands[1], idx);
      return ops_.binary(op.kind, type(op.operands[0]).dtype, x, y);
    }
    fail_internal(std::string("op '") + ir::op_name(op.kind) + "' cannot be computed per element");
  }

  // ------------------------------------------------------------ memory
  llvm::Value* element_address(const Operation& op, const Index& idx) {
    const ir::Param& p = f_.params[size_t(op.attrs.param)];
    const TensorArg& t = tensors_[size_t(op.attrs.param)];
    llvm::Value* off = nullptr;
    for (int d = 0; d < p.rank; ++d) {
      llvm::Value* i = index_elem(op.operands[size_t(d)], idx);
      const bool unit_stride = d == p.rank - 1 && p.facts.contiguous_last;
      llvm::Value* term = unit_stride ? i : b_.CreateMul(i, t.strides[size_t(d)]);
      off = off ? b_.CreateAdd(off, term) : term;
    }
    if (!off) return t.data;
    return b_.CreateGEP(ops_.memory_type(p.dtype), t.data, off);
  }

  // Runs what `emit` writes only where `mask` holds; `mask` may be null (always).
  void guarded(llvm::Value* mask, const char* name, const std::function<void()>& emit) {
    if (!mask) {
      emit();
      return;
    }
    llvm::BasicBlock* on = llvm::BasicBlock::Create(ctx_, name, fn_);
    llvm::BasicBlock* done = llvm::BasicBlock::Create(ctx_, std::string(name) + ".done", fn_);
    b_.CreateCondBr(mask, on, done);
    b_.SetInsertPoint(on);
    emit();
    b_.CreateBr(done);
    b_.SetInsertPoint(done);
  }

  // A masked-off element is not read; it takes `other` (or zero). A cluster_share load's
  // elements whose last index lies outside the tensor's last dimension read zero too.
  llvm::Value* load_element(const Operation& op, const Index& idx) {
    const ir::Param& p = f_.params[size_t(op.attrs.param)];
    const DType t = p.dtype;
    const llvm::Align align(uint64_t(dtype_size_bytes(t)));
    llvm::Value* ptr = element_address(op, idx);
    const size_t rank = size_t(p.rank);
    llvm::Value* in_range = nullptr;
    if (op.attrs.cluster_share) {
      llvm::Value* last = index_elem(op.operands[rank - 1], idx);
      in_range = b_.CreateAnd(b_.CreateICmpSGE(last, b_.getInt64(0)),
                              b_.CreateICmpSLT(last, tensors_[size_t(op.attrs.param)].sizes[rank - 1]));
    }
    if (!op.attrs.has_mask && !in_range)
      return ops_.to_register(t, b_.CreateAlignedLoad(ops_.memory_type(t), ptr, align));
    llvm::Value* mask = op.attrs.has_mask ? elem(op.operands[rank], idx) : nullptr;
    if (in_range) mask = mask ? b_.CreateAnd(mask, in_range) : in_range;
    llvm::Value* other = op.attrs.has_other ? elem(op.operands[rank + 1], idx) : ops_.zero(t);
    llvm::BasicBlock* skipped_from = b_.GetInsertBlock();
    llvm::Value* loaded = nullptr;
    llvm::BasicBlock* loaded_from = nullptr;
    guarded(mask, "masked.load", [&] {
      loaded = ops_.to_register(t, b_.CreateAlignedLoad(ops_.memory_type(t), ptr, align));
      loaded_from = b_.GetInsertBlock();
    });
    llvm::PHINode* phi = b_.CreatePHI(ops_.register_type(t), 2);
    phi->addIncoming(loaded, loaded_from);
    phi->addIncoming(other, skipped_from);
    return phi;
  }

  // Returns the old value (in register form).
  llvm::Value* atomic_add(DType t, llvm::Value* ptr, llvm::Value* value, bool acq_rel) {
    const llvm::Align align(uint64_t(dtype_size_bytes(t)));
    const auto relaxed = acq_rel ? llvm::AtomicOrdering::AcquireRelease : llvm::AtomicOrdering::Monotonic;
    const auto load_order = acq_rel ? llvm::AtomicOrdering::Acquire : llvm::AtomicOrdering::Monotonic;
    switch (t) {
      case DType::f32:
      case DType::f64:
        return b_.CreateAtomicRMW(llvm::AtomicRMWInst::FAdd, ptr, value, align, relaxed);
      case DType::i32:
      case DType::i64:
        return b_.CreateAtomicRMW(llvm::AtomicRMWInst::Add, ptr, value, align, relaxed);
      case DType::f16:
      case DType::bf16: {
        // No 16-bit float atomics: add in f32, round, and publish with compare-exchange.
        llvm::LoadInst* first = b_.CreateAlignedLoad(b_.getInt16Ty(), ptr, align);
        first->setAtomic(load_order);
        llvm::BasicBlock* entry = b_.GetInsertBlock();
        llvm::BasicBlock* retry = llvm::BasicBlock::Create(ctx_, "atomic.cas", fn_);
        llvm::BasicBlock* done = llvm::BasicBlock::Create(ctx_, "atomic.done", fn_);
        b_.CreateBr(retry);
        b_.SetInsertPoint(retry);
        llvm::PHINode* old_bits = b_.CreatePHI(b_.getInt16Ty(), 2);
        old_bits->addIncoming(first, entry);
        llvm::Value* sum = ops_.binary(OpKind::Add, t, ops_.to_register(t, old_bits), value);
        llvm::Value* pair =
            b_.CreateAtomicCmpXchg(ptr, old_bits, ops_.to_memory(t, sum), align, relaxed, load_order);
        old_bits->addIncoming(b_.CreateExtractValue(pair, 0), b_.GetInsertBlock());
        b_.CreateCondBr(b_.CreateExtractValue(pair, 1), done, retry);
        b_.SetInsertPoint(done);
        return ops_.to_register(t, old_bits);
      }
      case DType::i1:
      case DType::u8:
        break;  // refused by emit_store_like
    }
    return nullptr;
  }

  // Store and AtomicAdd: one loop nest over the access shape.
  void emit_store_like(const Operation& op) {
    const ir::Param& p = f_.params[size_t(op.attrs.param)];
    const size_t rank = size_t(p.rank);
    const ValueId value = op.operands[rank];
    const ValueId mask = op.attrs.has_mask ? op.operands[rank + 1] : -1;
    const DType t = p.dtype;
    if (op.kind == OpKind::AtomicAdd && (t == DType::i1 || t == DType::u8))
      throw CompileError("kernel '" + f_.name + "': atomic_add on the " + dtype_name(t) + " tensor @" + p.name +
                             " is not supported",
                         "", "");
    // The old values of an atomic, when the kernel uses them (0 where masked off).
    const ValueId old = op.results.empty() || plan_.uses[size_t(op.results[0])] == 0 ? -1 : op.results[0];
    const Shape& shape = type(value).shape;
    llvm::Value* old_array = nullptr;
    if (old >= 0) {
      old_array = new_array(t, std::max<int64_t>(1, type(old).numel()), "atomic.old");
      for_each_index(shape, [&](const Index& idx) {
        b_.CreateStore(ops_.zero(t), array_element(old_array, t, shape, idx));
      });
    }
    for_each_index(shape, [&](const Index& idx) {
      llvm::Value* ptr = element_address(op, idx);
      llvm::Value* v = elem(value, idx);
      llvm::Value* m = mask >= 0 ? elem(mask, idx) : nullptr;
      guarded(m, op.kind == OpKind::Store ? "masked.store" : "masked.atomic", [&] {
        if (op.kind == OpKind::Store) {
          b_.CreateAlignedStore(ops_.to_memory(t, v), ptr,
                                llvm::Align(uint64_t(dtype_size_bytes(t))));
          return;
        }
        llvm::Value* prev = atomic_add(t, ptr, v, op.attrs.acq_rel);
        if (old_array) b_.CreateStore(prev, array_element(old_array, t, shape, idx));
      });
    });
    if (old_array) {
      if (shape.empty())
        scalar_[size_t(old)] = b_.CreateLoad(ops_.register_type(t), old_array);
      else
        array_[size_t(old)] = old_array;
    }
  }

  // ------------------------------------------------------------ ops that fill arrays
  void emit_reduction(const Operation& op) {
    const ValueId in = op.operands[0];
    const ValueId r = op.results[0];
    const ir::Type& it = type(in);
    const Shape& out_shape = type(r).shape;
    const DType t = it.dtype;
    const size_t axis = size_t(op.attrs.axis);
    llvm::Type* acc_type = ops_.register_type(t);
    llvm::Value* acc = new_array(t, type(r).numel(), "reduce");
    auto fill_identity = [&](llvm::Value* array, const Shape& shape) {
      for_each_index(shape, [&](const Index& idx) {
        b_.CreateStore(ops_.reduce_identity(op.kind, t), array_element(array, t, shape, idx));
      });
    };
    const int64_t length = it.shape[axis];
    if (axis + 1 == it.shape.size() && length >= 2 * kReductionLanes) {
      // Along the last axis, lane l reduces elements l, l + W, l + 2W, ...; the
      // loop over lanes is elementwise, so it vectorizes even for max and min.
      const int64_t lanes = kReductionLanes;
      Shape lane_shape = out_shape;
      lane_shape.push_back(lanes);
      llvm::Value* partial = new_array(t, type(r).numel() * lanes, "reduce.lanes");
      fill_identity(partial, lane_shape);
      Shape split = it.shape;
      split.back() = length / lanes;
      split.push_back(lanes);
      for_each_index(split, [&](const Index& idx) {
        Index element(idx.begin(), idx.end() - 1);
        element.back() = b_.CreateAdd(
            b_.CreateMul(idx[idx.size() - 2], b_.getInt64(uint64_t(lanes)), "", true, true),
            idx.back(), "", true, true);
        llvm::Value* x = elem(in, element);
        Index lane(idx.begin(), idx.end() - 2);
        lane.push_back(idx.back());
        llvm::Value* p = array_element(partial, t, lane_shape, lane);
        b_.CreateStore(ops_.reduce_step(op.kind, t, b_.CreateLoad(acc_type, p), x), p);
      });
      for_each_index(out_shape, [&](const Index& idx) {
        Index lane = idx;
        lane.push_back(b_.getInt64(0));
        llvm::Value* folded = b_.CreateLoad(acc_type, array_element(partial, t, lane_shape, lane));
        for (int64_t l = 1; l < lanes; ++l) {
          lane.back() = b_.getInt64(uint64_t(l));
          llvm::Value* x = b_.CreateLoad(acc_type, array_element(partial, t, lane_shape, lane));
          folded = ops_.reduce_step(op.kind, t, folded, x);
        }
        b_.CreateStore(folded, array_element(acc, t, out_shape, idx));
      });
    } else {
      fill_identity(acc, out_shape);
      for_each_index(it.shape, [&](const Index& idx) {
        llvm::Value* x = elem(in, idx);
        Index out_idx = idx;
        out_idx.erase(out_idx.begin() + int64_t(axis));
        llvm::Value* p = array_element(acc, t, out_shape, out_idx);
        b_.CreateStore(ops_.reduce_step(op.kind, t, b_.CreateLoad(acc_type, p), x), p);
      });
    }
    if (is_half(t)) {  // half types accumulate in f32 and round once
      for_each_index(out_shape, [&](const Index& idx) {
        llvm::Value* p = array_element(acc, t, out_shape, idx);
        b_.CreateStore(ops_.round(t, b_.CreateLoad(b_.getFloatTy(), p)), p);
      });
    }
    if (out_shape.empty())
      scalar_[size_t(r)] = b_.CreateLoad(ops_.register_type(t), acc);
    else
      array_[size_t(r)] = acc;
  }

  // An f32 array holding `v` (its own array when it already has one in float form).
  llvm::Value* f32_operand(ValueId v) {
    const ir::Type& t = type(v);
    llvm::Value* own = array_[size_t(v)];
    if (own && (t.dtype == DType::f32 || is_half(t.dtype))) return own;
    llvm::Value* arr = new_array(DType::f32, t.numel(), "dot.operand");
    for_each_index(t.shape, [&](const Index& idx) {
      b_.CreateStore(ops_.cast(t.dtype, DType::f32, elem(v, idx)),
                     array_element(arr, DType::f32, t.shape, idx));
    });
    return arr;
  }

  // `acc = dot(a, b, acc)` yielded straight back into the loop state can
  // accumulate in the loop state's own array.
  bool dot_accumulates_in_place(const Operation& op) const {
    if (op.operands.size() != 3 || loops_.empty()) return false;
    const ValueId acc = op.operands[2];
    const ValueId r = op.results[0];
    if (plan_.uses[size_t(acc)] != 1 || plan_.uses[size_t(r)] != 1) return false;
    const ir::Block& body = *loops_.back()->body;
    const Operation& yield = body.ops.back();
    for (size_t i = 0; i < yield.operands.size(); ++i)
      if (yield.operands[i] == r && body.args[i + 1] == acc) return true;
    return false;
  }

  // a[M,K] @ b[K,N] (+ acc) in f32: i, k, j order so that the inner loop runs along rows.
  void emit_dot(const Operation& op) {
    const ValueId r = op.results[0];
    const int64_t M = type(op.operands[0]).shape[0];
    const int64_t K = type(op.operands[0]).shape[1];
    const int64_t N = type(op.operands[1]).shape[1];
    llvm::Value* a = f32_operand(op.operands[0]);
    llvm::Value* bm = f32_operand(op.operands[1]);
    llvm::Value* d;
    if (dot_accumulates_in_place(op)) {
      d = array_[size_t(op.operands[2])];
    } else {
      d = new_array(DType::f32, M * N, "dot");
      if (op.operands.size() == 3)
        copy_into(d, op.operands[2]);
      else
        b_.CreateMemSet(d, b_.getInt8(0), uint64_t(M * N * 4), llvm::Align(kArrayAlignBytes));
    }
    llvm::Type* f32 = b_.getFloatTy();
    auto at = [&](llvm::Value* array, llvm::Value* row, int64_t cols, llvm::Value* col) {
      llvm::Value* off = b_.CreateAdd(
          b_.CreateMul(row, b_.getInt64(uint64_t(cols)), "", true, true), col, "", true, true);
      return b_.CreateInBoundsGEP(f32, array, off);
    };
    const CountedLoop i = open_loop(M);
    const CountedLoop k = open_loop(K);
    llvm::Value* a_ik = b_.CreateLoad(f32, at(a, i.iv, K, k.iv));
    const CountedLoop j = open_loop(N);
    llvm::Value* d_ij = at(d, i.iv, N, j.iv);
    llvm::Value* b_kj = b_.CreateLoad(f32, at(bm, k.iv, N, j.iv));
    llvm::Value* sum =
        b_.CreateIntrinsic(llvm::Intrinsic::fmuladd, {f32}, {a_ik, b_kj, b_.CreateLoad(f32, d_ij)});
    b_.CreateStore(sum, d_ij);
    // The product is the one place where unrolling pays: it keeps rows of b in registers.
    close_loop(j, true);
    close_loop(k, true);
    close_loop(i, true);
    array_[size_t(r)] = d;
  }

  // ------------------------------------------------------------ loops
  // Whether `v` reads the loop state array `own` only at the element being
  // written and no other state array of the loop, so it can be written in place.
  bool reads_state_elementwise(ValueId v, llvm::Value* own, const std::set<llvm::Value*>& state,
                               bool same_index) const {
    if (!is_tile(v)) return true;
    if (llvm::Value* arr = array_[size_t(v)]) {
      if (arr == own) return same_index;
      return state.count(arr) == 0;
    }
    const Operation* op = plan_.def[size_t(v)];
    if (!op) return false;
    const bool elementwise = ir::is_elementwise_unary(op->kind) ||
                             ir::is_elementwise_binary(op->kind) || op->kind == OpKind::Select ||
                             op->kind == OpKind::Cast || op->kind == OpKind::Load;
    for (ValueId operand : op->operands)
      if (!reads_state_elementwise(operand, own, state, same_index && elementwise)) return false;
    return true;
  }

  // Copies the yielded tiles into the loop state; returns the next values of scalar state.
  std::vector<llvm::Value*> emit_yield(const Operation& loop, const Operation& yield) {
    const ir::Block& body = *loop.body;
    const size_t carried = yield.operands.size();
    std::set<llvm::Value*> state;
    for (size_t i = 0; i < carried; ++i)
      if (llvm::Value* arr = array_[size_t(body.args[i + 1])]) state.insert(arr);

    std::vector<llvm::Value*> next(carried, nullptr);
    std::vector<llvm::Value*> source(carried, nullptr);  // arrays to copy from, after all reads
    std::vector<bool> in_place(carried, false);
    for (size_t i = 0; i < carried; ++i) {
      const ValueId y = yield.operands[i];
      const ValueId arg = body.args[i + 1];
      if (!is_tile(arg)) {
        next[i] = elem(y, {});
        continue;
      }
      llvm::Value* own = array_[size_t(arg)];
      llvm::Value* ready = array_[size_t(y)];
      if (ready == own) continue;  // unchanged, or a dot that accumulated in place
      if (ready && !state.count(ready)) {
        source[i] = ready;
      } else if (!ready && reads_state_elementwise(y, own, state, true)) {
        in_place[i] = true;
      } else {
        llvm::Value* tmp = new_array(type(y).dtype, type(y).numel(), "yield");
        copy_into(tmp, y);
        source[i] = tmp;
      }
    }
    for (size_t i = 0; i < carried; ++i)
      if (in_place[i]) copy_into(array_[size_t(body.args[i + 1])], yield.operands[i]);
    for (size_t i = 0; i < carried; ++i) {
      if (!source[i]) continue;
      const ir::Type& t = type(yield.operands[i]);
      b_.CreateMemCpy(array_[size_t(body.args[i + 1])], llvm::Align(kArrayAlignBytes), source[i],
                      llvm::Align(kArrayAlignBytes), uint64_t(t.numel() * register_bytes(t.dtype)));
    }
    return next;
  }

  // for (iv = lo; iv < hi; iv += step), counted in i64 so that it cannot wrap;
  // a step <= 0 runs no iteration.
  void emit_for(const Operation& op) {
    const ir::Block& body = *op.body;
    const size_t carried = op.results.size();
    llvm::Value* lo = b_.CreateSExt(elem(op.operands[0], {}), b_.getInt64Ty());
    llvm::Value* hi = b_.CreateSExt(elem(op.operands[1], {}), b_.getInt64Ty());
    llvm::Value* step = b_.CreateSExt(elem(op.operands[2], {}), b_.getInt64Ty());

    // Tile state lives in one array, shared by the body argument and the loop's result.
    std::vector<llvm::Value*> init(carried, nullptr);
    for (size_t i = 0; i < carried; ++i) {
      const ValueId arg = body.args[i + 1];
      const ValueId src = op.operands[3 + i];
      if (!is_tile(arg)) {
        init[i] = elem(src, {});
        continue;
      }
      llvm::Value* arr = new_array(type(arg).dtype, type(arg).numel(), "loop.state");
      copy_into(arr, src);
      array_[size_t(arg)] = arr;
      array_[size_t(op.results[i])] = arr;
    }

    llvm::BasicBlock* before = b_.GetInsertBlock();
    llvm::BasicBlock* header = llvm::BasicBlock::Create(ctx_, "for.body", fn_);
    llvm::BasicBlock* exit = llvm::BasicBlock::Create(ctx_, "for.done", fn_);
    llvm::Value* runs =
        b_.CreateAnd(b_.CreateICmpSGT(step, b_.getInt64(0)), b_.CreateICmpSLT(lo, hi));
    b_.CreateCondBr(runs, header, exit);

    b_.SetInsertPoint(header);
    llvm::PHINode* iv = b_.CreatePHI(b_.getInt64Ty(), 2, "iv");
    iv->addIncoming(lo, before);
    std::vector<llvm::PHINode*> phis(carried, nullptr);
    for (size_t i = 0; i < carried; ++i) {
      if (!init[i]) continue;
      phis[i] = b_.CreatePHI(init[i]->getType(), 2);
      phis[i]->addIncoming(init[i], before);
      scalar_[size_t(body.args[i + 1])] = phis[i];
    }
    // The counter runs in i64 (no overflow near INT32_MAX); an i32 loop sees it truncated.
    scalar_[size_t(body.args[0])] =
        type(body.args[0]).dtype == DType::i64 ? static_cast<llvm::Value*>(iv) : b_.CreateTrunc(iv, b_.getInt32Ty());

    loops_.push_back(&op);
    emit_block(body);
    const std::vector<llvm::Value*> next = emit_yield(op, body.ops.back());
    loops_.pop_back();

    llvm::Value* next_iv = b_.CreateAdd(iv, step);
    llvm::BasicBlock* latch = b_.GetInsertBlock();
    iv->addIncoming(next_iv, latch);
    for (size_t i = 0; i < carried; ++i)
      if (phis[i]) phis[i]->addIncoming(next[i], latch);
    forbid_unrolling(b_.CreateCondBr(b_.CreateICmpSLT(next_iv, hi), header, exit));

    b_.SetInsertPoint(exit);
    for (size_t i = 0; i < carried; ++i) {
      if (!init[i]) continue;
      llvm::PHINode* result = b_.CreatePHI(init[i]->getType(), 2);
      result->addIncoming(init[i], before);
      result->addIncoming(next[i], latch);
      scalar_[size_t(op.results[i])] = result;
    }
  }

  // ------------------------------------------------------------ blocks
  void emit_block(const ir::Block& block) {
    for (const Operation& op : block.ops) emit_op(op);
  }

  void emit_op(const Operation& op) {
    switch (op.kind) {
      case OpKind::For:
        emit_for(op);
        return;
      case OpKind::Yield:
        return;  // emit_for copies the yielded values
      case OpKind::GridWait:
      case OpKind::GridRelease:
        return;  // CPU launches run one after another: nothing overlaps
      case OpKind::GridSync:
        throw InvalidArgument("kernel '" + f_.name + "' uses " + ir::grid_barrier_name(op) +
                              " (all programs waiting for each other), which the CPU back end does not run: its "
                              "programs run one after another");
      case OpKind::L2EvictNormal:
        return;  // an L2 eviction hint of the GPU: nothing to do on the CPU
      case OpKind::Store:
      case OpKind::AtomicAdd:
        emit_store_like(op);
        return;
      default:
        break;
    }
    if (op.results.size() != 1)
      fail_internal(std::string("op '") + ir::op_name(op.kind) + "' has no result");
    const ValueId r = op.results[0];
    const ir::Type& rt = type(r);
    if (rt.is_scalar()) {
      if (ir::is_reduction(op.kind))
        emit_reduction(op);
      else
        scalar_[size_t(r)] = compute(op, {});
      return;
    }
    // Inline tiles are computed where they are used; unused ones never.
    if (!plan_.materialized[size_t(r)] || plan_.uses[size_t(r)] == 0) return;
    if (op.kind == OpKind::Dot) {
      emit_dot(op);
    } else if (ir::is_reduction(op.kind)) {
      emit_reduction(op);
    } else {
      llvm::Value* arr = new_array(rt.dtype, rt.numel(), ir::op_name(op.kind));
      for_each_index(rt.shape, [&](const Index& idx) {
        b_.CreateStore(compute(op, idx), array_element(arr, rt.dtype, rt.shape, idx));
      });
      array_[size_t(r)] = arr;
    }
  }

  using CacheKey = std::tuple<ValueId, bool, Index>;  // value, as i64 index?, element

  const ir::Function& f_;
  llvm::Module& m_;
  llvm::LLVMContext& ctx_;
  llvm::IRBuilder<> b_;
  HalfFloatIR half_;
  ElementOps ops_;
  TilePlan plan_;
  llvm::Function* fn_ = nullptr;
  llvm::BasicBlock* alloca_block_ = nullptr;
  std::vector<llvm::Value*> scalar_;       // by ValueId
  std::vector<llvm::Value*> array_;        // by ValueId: the stack array of a materialized tile
  std::vector<TensorArg> tensors_;         // by parameter
  std::vector<llvm::Value*> param_value_;  // by parameter: scalar arguments
  std::vector<const Operation*> loops_;    // the For ops being emitted, innermost last
  std::map<CacheKey, llvm::Value*> cache_;
  int64_t stack_bytes_ = 0;
};

}  // namespace

GeneratedModule generate_llvm_module(const ir::Function& f, llvm::LLVMContext& ctx,
                                     const std::string& entry_name) {
  GeneratedModule out;
  out.module = std::make_unique<llvm::Module>("kerf." + f.name, ctx);
  KernelEmitter emitter(f, *out.module);
  emitter.emit(entry_name);
  out.stack_bytes = emitter.stack_bytes();
  std::string problems;
  llvm::raw_string_ostream os(problems);
  if (llvm::verifyModule(*out.module, &os)) {
    std::string text;
    llvm::raw_string_ostream ts(text);
    out.module->print(ts, nullptr);
    throw CompileError(
        "kernel '" + f.name + "': the generated LLVM IR is invalid (a kerf bug): " + os.str(),
        os.str(), ts.str());
  }
  return out;
}

}  // namespace kerf::jit::cpu
