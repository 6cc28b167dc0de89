// kerf IR -> CUDA C++.
//
// Every tile value is computed into per-thread register arrays laid out by a
// linear layout (layout.h). Loads and stores use a coalesced "blocked" layout
// with vector accesses where the axis analysis proves them safe; dot results
// live in the tensor-core accumulator layout; reductions keep the layout of
// their input minus the reduced axis. Cheap values (indices, constants,
// elementwise math) are computed directly in whatever layout a consumer asks
// for; expensive ones (loads, dots, reductions, loop-carried values) have one
// home layout and are converted through shared memory when needed elsewhere.
//
// Placement: a pure value is emitted in the outermost loop level where all of
// its operands exist (loop-invariant code leaves the loop); loads, stores and
// atomics stay where the kernel put them, in program order.
#include <algorithm>
#include <cstdio>
#include <deque>
#include <map>
#include <set>
#include <sstream>

#include "device_library.h"
#include "kerf/error.h"
#include "kerf/jit/abi.h"
#include "kerf/jit/cuda_codegen.h"
#include "jit/ir/axis_info.h"
#include "layout.h"

namespace kerf::jit::cuda {
namespace {

using ir::OpKind;
using ir::Operation;
using ir::Shape;
using ir::ValueId;

std::string S(int64_t v) { return std::to_string(v); }

int log2i(int64_t x) {
  int n = 0;
  while ((int64_t(1) << n) < x) ++n;
  return n;
}

// C++ type that holds one element in registers and memory.
std::string storage_type(DType t) {
  switch (t) {
    case DType::i1: return "bool";
    case DType::i32: return "int";
    case DType::i64: return "long long";
    case DType::f16:
    case DType::bf16: return "unsigned short";
    case DType::f32: return "float";
    case DType::f64: return "double";
  }
  return "?";
}

// Type arithmetic happens in: 16-bit floats compute in f32.
DType compute_dtype(DType t) { return is_half(t) ? DType::f32 : t; }
std::string compute_type(DType t) { return storage_type(compute_dtype(t)); }

std::string to_compute(DType t, const std::string& x) {
  if (t == DType::bf16) return "kerf_dev::bf16_to_f32(" + x + ")";
  if (t == DType::f16) return "kerf_dev::f16_to_f32(" + x + ")";
  return x;
}

std::string from_compute(DType t, const std::string& x) {
  if (t == DType::bf16) return "kerf_dev::f32_to_bf16(" + x + ")";
  if (t == DType::f16) return "kerf_dev::f32_to_f16(" + x + ")";
  return x;
}

std::string float_literal(double v, DType t) {
  if (v != v) return t == DType::f64 ? "__longlong_as_double(0x7ff8000000000000LL)" : "__int_as_float(0x7fc00000)";
  if (v == 1.0 / 0.0) return t == DType::f64 ? "__longlong_as_double(0x7ff0000000000000LL)" : "__int_as_float(0x7f800000)";
  if (v == -1.0 / 0.0) return t == DType::f64 ? "__longlong_as_double(0xfff0000000000000LL)" : "__int_as_float(0xff800000)";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  std::string s = buf;
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return t == DType::f64 ? s : s + "f";
}

std::string int_literal(int64_t v, DType t) {
  if (t == DType::i64) return "(" + S(v) + "LL)";
  if (t == DType::i1) return v ? "true" : "false";
  if (v == INT32_MIN) return "(-2147483647 - 1)";
  return S(v);
}

// Converts a compute-typed expression of dtype `from` to storage of dtype `to`.
std::string convert(DType from, DType to, const std::string& x) {
  if (from == to) return x;
  if (to == DType::i1) return "(" + to_compute(from, x) + " != 0)";
  const std::string c = to_compute(from, x);
  if (is_half(to)) return from_compute(to, is_float(from) ? c : "(float)(" + c + ")");
  return "(" + storage_type(to) + ")(" + c + ")";
}

struct Tile {
  std::string name;       // register array (or a scalar expression when `scalar`)
  bool scalar = false;    // the same value for every register
  std::vector<int> kept;  // storage register bit j <- requested layout's register bit kept[j]
  bool identity = true;
};

struct Staged {  // a rank-2 tile written row-major into shared memory
  std::string offset;  // byte offset into kerf_smem (a C++ expression)
  int64_t pitch = 0;   // elements per row
};

// Code and emitted tiles of one loop level.
struct Frame {
  std::string code;
  std::map<std::pair<ValueId, int>, Tile> memo;
};

// A load inside a pipelined loop: copied global -> shared memory with
// cp.async, `stages` iterations ahead, into a ring of buffers.
struct AsyncLoad {
  int ring_offset = 0;      // bytes into kerf_smem
  int64_t stage_bytes = 0;  // one tile, rows padded
  std::vector<int64_t> pitch;
  std::string stage;        // C++ expression: the ring slot of this iteration
};

class Codegen {
 public:
  Codegen(const ir::Function& f, const std::string& arch) : f_(f), arch_(arch) {
    num_warps_ = int(f.meta_value("num_warps", 4));
    num_stages_ = int(f.meta_value("num_stages", 1));
    sm_ = parse_sm(arch);
  }

  KernelCode run() {
    axis_ = ir::analyze_axis_info(f_);
    uses_ = ir::count_uses(f_);
    def_op_.assign(f_.types.size(), nullptr);
    level_of_.assign(f_.types.size(), 0);
    pref_.assign(f_.types.size(), -1);
    scan_block(f_.body, 0);
    choose_blocked_vectors(f_.body);
    compute_prefs(f_.body);

    frames_.assign(1, Frame{});
    active_.assign(1, 0);
    emit_block(f_.body);

    KernelCode out;
    out.threads = 32 * num_warps_;
    out.smem_bytes = smem_top_;
    out.num_slots = int(slot_count(f_.params));
    const ir::Hash128 h = ir::hash(f_);
    out.entry = "kerf_" + f_.name + "_" + h.hex().substr(0, 12);
    std::ostringstream src;
    src << "// kerf: generated for " << arch_ << " from kernel '" << f_.name << "'\n";
    src << "// IR hash " << h.hex() << "; " << out.threads << " threads, " << out.smem_bytes
        << " bytes of shared memory\n";
    src << "#include <cuda/std/cstdint>\n";
    src << device_library_source();
    src << "\nextern \"C\" __global__ void __launch_bounds__(" << out.threads << ") " << out.entry
        << "(const __grid_constant__ kerf_dev::Args<" << std::max(1, out.num_slots)
        << "> args) {\n";
    src << "  extern __shared__ __align__(16) unsigned char kerf_smem[];\n";
    src << "  const int lane = threadIdx.x & 31;\n";
    src << "  const int warp = threadIdx.x >> 5;\n";
    src << "  (void)lane; (void)warp;\n";
    src << prologue();
    src << frames_[0].code;
    src << "}\n";
    out.source = src.str();
    return out;
  }

 private:
  // ------------------------------------------------------------ analysis

  static int parse_sm(const std::string& arch) {
    int v = 0;
    for (char c : arch)
      if (c >= '0' && c <= '9') v = v * 10 + (c - '0');
    return v;
  }

  bool is_pure(OpKind k) const {
    return k != OpKind::Load && k != OpKind::Store && k != OpKind::AtomicAdd && k != OpKind::For &&
           k != OpKind::Yield;
  }

  // Records each value's defining op and placement level.
  void scan_block(const ir::Block& b, int level) {
    for (const Operation& op : b.ops) {
      for (ValueId r : op.results) def_op_[size_t(r)] = &op;
      if (op.kind == OpKind::For) {
        for (ValueId a : op.body->args) level_of_[size_t(a)] = level + 1;
        scan_block(*op.body, level + 1);
        for (ValueId r : op.results) level_of_[size_t(r)] = level;
        continue;
      }
      int lv = level;
      if (is_pure(op.kind)) {
        lv = 0;
        for (ValueId v : op.operands) lv = std::max(lv, level_of_[size_t(v)]);
      }
      for (ValueId r : op.results) level_of_[size_t(r)] = lv;
    }
  }

  const ir::Type& type(ValueId v) const { return f_.type(v); }

  void choose_blocked_vectors(const ir::Block& b) {
    for (const Operation& op : b.ops) {
      if (op.kind == OpKind::For) choose_blocked_vectors(*op.body);
      const ir::Type* t = nullptr;
      if (op.kind == OpKind::Load) t = &type(op.results[0]);
      if (op.kind == OpKind::Store || op.kind == OpKind::AtomicAdd)
        t = &type(op.operands[size_t(f_.params[size_t(op.attrs.param)].rank)]);
      if (!t || t->is_scalar()) continue;
      const int vec = 16 / dtype_size_bytes(t->dtype);
      int& v = blocked_vec_[t->shape];
      v = std::max(v, vec);
    }
  }

  int blocked(const Shape& shape) {
    auto it = blocked_vec_.find(shape);
    const int vec = it == blocked_vec_.end() ? 4 : it->second;
    return intern(blocked_layout(shape, num_warps_, vec));
  }

  bool mma_eligible(const Operation& op) const {
    const ir::Type& a = type(op.operands[0]);
    const ir::Type& b = type(op.operands[1]);
    if (sm_ < 80 || !is_half(a.dtype)) return false;
    const int64_t M = a.shape[0], K = a.shape[1], N = b.shape[1];
    return M % 16 == 0 && N % 8 == 0 && K % 16 == 0;
  }

  int acc_layout(const Operation& op) {
    const Shape& shape = type(op.results[0]).shape;
    int l;
    if (mma_eligible(op)) {
      int wm, wn;
      mma_warp_split(shape, num_warps_, &wm, &wn);
      l = intern(mma_acc_layout(shape, num_warps_, wm, wn));
    } else {
      l = intern(blocked_layout(shape, num_warps_, 4));
    }
    acc_layouts_.insert(l);
    return l;
  }

  int merge_prefs(const std::vector<int>& ls) const {
    for (int l : ls)
      if (acc_layouts_.count(l)) return l;
    for (int l : ls)
      if (l >= 0) return l;
    return -1;
  }

  // A layout each expensive value would like to live in.
  void compute_prefs(const ir::Block& b) {
    for (const Operation& op : b.ops) {
      if (op.kind == OpKind::For) {
        const ir::Block& body = *op.body;
        const size_t n = op.results.size();
        for (size_t i = 0; i < n; ++i) pref_[size_t(body.args[i + 1])] = pref_[size_t(op.operands[i + 3])];
        for (int iter = 0; iter < 4; ++iter) {
          compute_prefs(body);
          bool changed = false;
          const Operation& y = body.ops.back();
          for (size_t i = 0; i < n; ++i) {
            const ValueId arg = body.args[i + 1];
            const int m = merge_prefs({pref_[size_t(arg)], pref_[size_t(y.operands[i])]});
            if (m != pref_[size_t(arg)]) {
              pref_[size_t(arg)] = m;
              changed = true;
            }
          }
          if (!changed) break;
        }
        for (size_t i = 0; i < n; ++i) {
          const ValueId arg = body.args[i + 1];
          if (pref_[size_t(arg)] < 0 && !type(arg).is_scalar())
            pref_[size_t(arg)] = blocked(type(arg).shape);
          pref_[size_t(op.results[i])] = pref_[size_t(arg)];
        }
        continue;
      }
      if (op.results.size() != 1) continue;
      const ValueId r = op.results[0];
      if (type(r).is_scalar()) continue;
      switch (op.kind) {
        case OpKind::Load: pref_[size_t(r)] = blocked(type(r).shape); break;
        case OpKind::Dot: pref_[size_t(r)] = acc_layout(op); break;
        case OpKind::ReduceSum:
        case OpKind::ReduceMax:
        case OpKind::ReduceMin: {
          const ValueId x = op.operands[0];
          int p = pref_[size_t(x)];
          if (p < 0) p = blocked(type(x).shape);
          reduce_input_[r] = p;
          pref_[size_t(r)] = intern(slice_layout(layouts_[size_t(p)], int(op.attrs.axis)).layout);
          break;
        }
        case OpKind::Transpose: {
          const int p = pref_[size_t(op.operands[0])];
          if (p >= 0) pref_[size_t(r)] = intern(transpose_layout(layouts_[size_t(p)]).layout);
          break;
        }
        default:
          if (ir::is_elementwise_unary(op.kind) || ir::is_elementwise_binary(op.kind) ||
              op.kind == OpKind::Select || op.kind == OpKind::Cast) {
            std::vector<int> ps;
            for (ValueId v : op.operands)
              if (!type(v).is_scalar()) ps.push_back(pref_[size_t(v)]);
            pref_[size_t(r)] = merge_prefs(ps);
          }
          break;
      }
    }
  }

  // ------------------------------------------------------------ layouts

  int intern(const Layout& l) {
    for (size_t i = 0; i < layouts_.size(); ++i)
      if (layouts_[i] == l) return int(i);
    layouts_.push_back(l);
    return int(layouts_.size() - 1);
  }

  bool thread_part_nonzero(int l, int d) const {
    const Layout& L = layouts_[size_t(l)];
    for (const Basis& b : L.lane)
      if (b.dim == d) return true;
    for (const Basis& b : L.warp)
      if (b.dim == d) return true;
    return false;
  }

  // Coordinate along `d` of register `r` (a C++ expression) of layout `l`.
  std::string coord(int l, int d, const std::string& r) {
    const Layout& L = layouts_[size_t(l)];
    std::string reg;
    for (size_t i = 0; i < L.reg.size(); ++i) {
      if (L.reg[i].dim != d) continue;
      const std::string term = "(((" + r + ") >> " + S(int64_t(i)) + ") & 1) * " + S(L.reg[i].value);
      reg += (reg.empty() ? "" : " + ") + term;
    }
    std::string thread;
    if (thread_part_nonzero(l, d)) {
      used_thread_coords_.insert({l, d});
      thread = "tc" + S(l) + "_" + S(d);
    }
    if (reg.empty() && thread.empty()) return "0";
    if (reg.empty()) return thread;
    if (thread.empty()) return "(" + reg + ")";
    return "(" + thread + " + " + reg + ")";
  }

  std::string prologue() {
    std::string out;
    for (const auto& [l, d] : used_thread_coords_) {
      const Layout& L = layouts_[size_t(l)];
      std::string e;
      for (size_t i = 0; i < L.lane.size(); ++i)
        if (L.lane[i].dim == d)
          e += (e.empty() ? "" : " + ") + std::string("((lane >> ") + S(int64_t(i)) + ") & 1) * " +
               S(L.lane[i].value);
      for (size_t i = 0; i < L.warp.size(); ++i)
        if (L.warp[i].dim == d)
          e += (e.empty() ? "" : " + ") + std::string("((warp >> ") + S(int64_t(i)) + ") & 1) * " +
               S(L.warp[i].value);
      out += "  const int tc" + S(l) + "_" + S(d) + " = " + e + ";  // " + L.key() + "\n";
    }
    return out;
  }

  // True when this thread is the first of the threads holding copies of its elements.
  std::string owner_predicate(int l) const {
    const Layout& L = layouts_[size_t(l)];
    const uint32_t lm = L.replicated_lane_mask(), wm = L.replicated_warp_mask();
    std::string p;
    if (lm) p += "(lane & " + S(lm) + ") == 0";
    if (wm) p += std::string(p.empty() ? "" : " && ") + "(warp & " + S(wm) + ") == 0";
    return p;
  }

  // ------------------------------------------------------------ code buffers

  Frame& frame(int level) { return frames_[size_t(active_.at(size_t(level)))]; }
  int depth() const { return int(active_.size()); }

  void line(int level, const std::string& s) {
    std::string& code = frame(level).code;
    code.append(size_t(2 * (level + 1)), ' ');
    code += s;
    code += '\n';
  }

  const Tile* find_memo(const std::pair<ValueId, int>& key) {
    for (int lv = depth() - 1; lv >= 0; --lv) {
      auto& memo = frame(lv).memo;
      auto it = memo.find(key);
      if (it != memo.end()) return &it->second;
    }
    return nullptr;
  }

  // Opens a fresh frame for `level` (a loop body, or a prefetch block that
  // stands in for one); returns the frame it replaced, or -1 for a new level.
  int open_frame(int level) {
    frames_.emplace_back();
    const int idx = int(frames_.size()) - 1;
    if (level < depth()) {
      const int prev = active_[size_t(level)];
      active_[size_t(level)] = idx;
      return prev;
    }
    active_.push_back(idx);
    return -1;
  }

  // Closes the frame of `level` and returns its code.
  std::string close_frame(int level, int replaced) {
    std::string code = std::move(frame(level).code);
    if (replaced >= 0) {
      active_[size_t(level)] = replaced;
    } else {
      active_.pop_back();
    }
    return code;
  }

  std::string fresh(const std::string& base) { return base + "_" + S(counter_++); }

  int alloc_smem(int64_t bytes) {
    const int off = (smem_top_ + 15) & ~15;
    smem_top_ = off + int(bytes);
    return off;
  }

  std::string elem(const Tile& t, const std::string& r) const {
    if (t.scalar) return t.name;
    if (t.identity) return t.name + "[" + r + "]";
    return t.name + "[" + reg_map_expr(t.kept, r) + "]";
  }

  // A Tile of a value requested in layout `l`, given the tile of that value in
  // a layout derived from `l` by dropping register bits.
  Tile compose(Tile inner, const Derived& d, int l) const {
    if (inner.scalar) return inner;
    std::vector<int> kept;
    if (inner.identity) {
      kept = d.kept;
    } else {
      for (int j : inner.kept) kept.push_back(d.kept[size_t(j)]);
    }
    inner.identity = is_identity(kept, int(layouts_[size_t(l)].reg.size()));
    inner.kept = std::move(kept);
    return inner;
  }

  // ------------------------------------------------------------ scalars

  std::string scalar(ValueId v) {
    auto it = scalars_.find(v);
    if (it != scalars_.end()) return it->second;
    const Operation* op = def_op_[size_t(v)];
    if (!op) throw InternalError("scalar %" + S(v) + " has no definition");
    const int lv = level_of_[size_t(v)];
    const DType t = type(v).dtype;
    const ir::Attrs& a = op->attrs;
    std::string expr;
    switch (op->kind) {
      case OpKind::Param: {
        const size_t slot = slot_offsets(f_.params)[size_t(a.param)];
        expr = "*reinterpret_cast<const " + storage_type(t) + "*>(&args.s[" + S(int64_t(slot)) + "])";
        break;
      }
      case OpKind::Constant:
        expr = is_float(t) ? float_literal(a.fvalue, t) : int_literal(a.ivalue, t);
        if (is_half(t)) expr = from_compute(t, float_literal(a.fvalue, DType::f32));
        break;
      case OpKind::ProgramId: expr = std::string("(int)blockIdx.") + "xyz"[a.axis]; break;
      case OpKind::NumPrograms: expr = std::string("(int)gridDim.") + "xyz"[a.axis]; break;
      case OpKind::TensorDim: {
        const size_t slot = slot_offsets(f_.params)[size_t(a.param)] + 1 + size_t(a.axis);
        expr = "(int)args.s[" + S(int64_t(slot)) + "]";
        break;
      }
      case OpKind::TensorStride: {
        const ir::Param& p = f_.params[size_t(a.param)];
        if (p.facts.contiguous_last && a.axis == p.rank - 1) {
          expr = "1LL";
        } else {
          const size_t slot = slot_offsets(f_.params)[size_t(a.param)] + 1 + size_t(p.rank) + size_t(a.axis);
          expr = "(long long)args.s[" + S(int64_t(slot)) + "]";
        }
        break;
      }
      case OpKind::Load: {
        expr = scalar_load(*op);
        break;
      }
      case OpKind::ReduceSum:
      case OpKind::ReduceMax:
      case OpKind::ReduceMin: {
        const std::string arr = emit_reduce(*op);
        expr = arr + "[0]";
        break;
      }
      default: {
        std::vector<std::string> xs;
        for (ValueId o : op->operands) xs.push_back(scalar(o));
        expr = elementwise_expr(*op, xs, [&](size_t i) { return type(op->operands[i]).dtype; });
        break;
      }
    }
    const std::string name = "v" + S(v);
    line(lv, "const " + storage_type(t) + " " + name + " = " + expr + ";  // " +
                 std::string(ir::op_name(op->kind)));
    scalars_[v] = name;
    scalar_level_[v] = lv;
    return name;
  }

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
      case OpKind::Neg: e = "(-" + c(0) + ")"; break;
      case OpKind::Not: e = t == DType::i1 ? "(!" + c(0) + ")" : "(~" + c(0) + ")"; break;
      case OpKind::Abs:
        e = f ? (dbl ? "fabs(" : "fabsf(") + c(0) + ")"
              : (t == DType::i64 ? "llabs(" : "abs(") + c(0) + ")";
        break;
      case OpKind::Sqrt: e = (dbl ? "sqrt(" : "sqrtf(") + c(0) + ")"; break;
      case OpKind::Rsqrt: e = (dbl ? "rsqrt(" : "rsqrtf(") + c(0) + ")"; break;
      case OpKind::Exp: e = (dbl ? "exp(" : "expf(") + c(0) + ")"; break;
      case OpKind::Log: e = (dbl ? "log(" : "logf(") + c(0) + ")"; break;
      case OpKind::Add: e = "(" + c(0) + " + " + c(1) + ")"; break;
      case OpKind::Sub: e = "(" + c(0) + " - " + c(1) + ")"; break;
      case OpKind::Mul: e = "(" + c(0) + " * " + c(1) + ")"; break;
      case OpKind::Div:
        e = f ? "(" + c(0) + " / " + c(1) + ")" : "kerf_dev::idiv<" + ct + ">(" + c(0) + ", " + c(1) + ")";
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
      case OpKind::And: e = "(" + ct + ")(" + c(0) + " & " + c(1) + ")"; break;
      case OpKind::Or: e = "(" + ct + ")(" + c(0) + " | " + c(1) + ")"; break;
      case OpKind::Xor: e = "(" + ct + ")(" + c(0) + " ^ " + c(1) + ")"; break;
      case OpKind::Shl: e = "(" + ct + ")(" + c(0) + " << " + c(1) + ")"; break;
      case OpKind::Shr: e = "(" + ct + ")(" + c(0) + " >> " + c(1) + ")"; break;
      case OpKind::Lt: return "(" + c(0) + " < " + c(1) + ")";
      case OpKind::Le: return "(" + c(0) + " <= " + c(1) + ")";
      case OpKind::Gt: return "(" + c(0) + " > " + c(1) + ")";
      case OpKind::Ge: return "(" + c(0) + " >= " + c(1) + ")";
      case OpKind::Eq: return "(" + c(0) + " == " + c(1) + ")";
      case OpKind::Ne: return "(" + c(0) + " != " + c(1) + ")";
      default: throw InternalError(std::string("CUDA codegen: no expression for op ") + ir::op_name(op.kind));
    }
    return from_compute(rt, e);
  }

  // ------------------------------------------------------------ tiles

  Tile get(ValueId v, int l) {
    if (type(v).is_scalar()) return Tile{scalar(v), true, {}, true};
    const int lv = level_of_[size_t(v)];
    const auto key = std::make_pair(v, l);
    if (const Tile* t = find_memo(key)) return *t;
    if (layouts_[size_t(l)].shape != type(v).shape)
      throw InternalError("CUDA codegen: layout " + layouts_[size_t(l)].key() + " requested for %" +
                          S(v) + " of type " + ir::to_string(type(v)));
    Tile t = compute(v, l);
    frame(lv).memo[key] = t;
    return t;
  }

  Tile compute(ValueId v, int l) {
    const Operation* op = def_op_[size_t(v)];
    const int lv = level_of_[size_t(v)];
    if (!op || op->kind == OpKind::For) return from_home(v, l);  // carried value or loop result
    switch (op->kind) {
      case OpKind::Splat: return Tile{scalar(op->operands[0]), true, {}, true};
      case OpKind::ExpandDims: {
        const Derived d = squeeze_layout(layouts_[size_t(l)], int(op->attrs.axis));
        return compose(get(op->operands[0], intern(d.layout)), d, l);
      }
      case OpKind::Broadcast: {
        const Derived d = unbroadcast_layout(layouts_[size_t(l)], type(op->operands[0]).shape);
        return compose(get(op->operands[0], intern(d.layout)), d, l);
      }
      case OpKind::Transpose: {
        const Derived d = transpose_layout(layouts_[size_t(l)]);
        return compose(get(op->operands[0], intern(d.layout)), d, l);
      }
      case OpKind::Arange: {
        const std::string name = "v" + S(v) + "_" + S(l);
        const int n = layouts_[size_t(l)].num_regs();
        line(lv, "int " + name + "[" + S(n) + "];  // arange in " + layouts_[size_t(l)].key());
        line(lv, "#pragma unroll");
        line(lv, "for (int r = 0; r < " + S(n) + "; ++r) " + name + "[r] = " + S(op->attrs.start) +
                     " + " + coord(l, 0, "r") + ";");
        return Tile{name, false, {}, true};
      }
      case OpKind::Load:
        if (async_.count(v)) return from_async(v, l);
        return from_home(v, l);
      case OpKind::AtomicAdd: {
        const int h = home_.at(v);  // set when the atomic was emitted, in program order
        return convert_tile(v, *find_memo(std::make_pair(v, h)), h, l);
      }
      case OpKind::Dot:
      case OpKind::ReduceSum:
      case OpKind::ReduceMax:
      case OpKind::ReduceMin: return from_home(v, l);
      default: break;
    }
    // Elementwise: compute in `l` from operands in `l`.
    std::vector<Tile> xs;
    for (ValueId o : op->operands) xs.push_back(get(o, l));
    const DType rt = type(v).dtype;
    const std::string name = "v" + S(v) + "_" + S(l);
    const int n = layouts_[size_t(l)].num_regs();
    std::vector<std::string> es;
    for (const Tile& t : xs) es.push_back(elem(t, "r"));
    const std::string e =
        elementwise_expr(*op, es, [&](size_t i) { return type(op->operands[i]).dtype; });
    line(lv, storage_type(rt) + " " + name + "[" + S(n) + "];  // " + ir::op_name(op->kind));
    line(lv, "#pragma unroll");
    line(lv, "for (int r = 0; r < " + S(n) + "; ++r) " + name + "[r] = " + e + ";");
    return Tile{name, false, {}, true};
  }

  // An expensive value in its home layout, converted to `l` if that differs.
  Tile from_home(ValueId v, int l) {
    const int h = home_layout(v);
    Tile home = home_tile(v, h);
    if (h == l) return home;
    return convert_tile(v, home, h, l);
  }

  int home_layout(ValueId v) {
    auto it = home_.find(v);
    if (it != home_.end()) return it->second;
    int h = pref_[size_t(v)];
    if (h < 0) h = blocked(type(v).shape);
    home_[v] = h;
    return h;
  }

  Tile home_tile(ValueId v, int h) {
    const auto key = std::make_pair(v, h);
    if (const Tile* t = find_memo(key)) return *t;
    const Operation* op = def_op_[size_t(v)];
    Tile t;
    if (op && op->kind == OpKind::Load) {
      t = emit_load(*op, h);
    } else if (op && op->kind == OpKind::Dot) {
      t = emit_dot(*op, h);
    } else if (op && ir::is_reduction(op->kind)) {
      t = Tile{emit_reduce(*op), false, {}, true};
    } else {
      throw InternalError("CUDA codegen: %" + S(v) + " has no home tile");
    }
    frame(level_of_[size_t(v)]).memo[key] = t;
    return t;
  }

  // Register-only remapping when the threads already hold what `to` needs.
  bool register_subset(int from, int to, std::vector<int>* kept) const {
    const Layout& F = layouts_[size_t(from)];
    const Layout& T = layouts_[size_t(to)];
    if (F.lane != T.lane || F.warp != T.warp) return false;
    kept->clear();
    for (const Basis& b : T.reg) {
      auto it = std::find(F.reg.begin(), F.reg.end(), b);
      if (it == F.reg.end()) return false;
      kept->push_back(int(it - F.reg.begin()));
    }
    return true;
  }

  // Row-major offsets of a tile in shared memory; rows padded by 16 bytes
  // so that column accesses of successive rows fall in different banks.
  std::vector<int64_t> smem_pitches(const Shape& shape, int elem_bytes) const {
    std::vector<int64_t> p(shape.size(), 1);
    if (shape.empty()) return p;
    const int64_t pad = shape.size() >= 2 ? std::max(1, 16 / elem_bytes) : 0;
    int64_t stride = shape.back() + pad;
    for (size_t i = shape.size() - 1; i-- > 0;) {
      p[i] = stride;
      stride *= shape[i];
    }
    return p;
  }

  int64_t smem_bytes_for(const Shape& shape, int elem_bytes) const {
    if (shape.empty()) return elem_bytes;
    const auto p = smem_pitches(shape, elem_bytes);
    return p[0] * shape[0] * elem_bytes;
  }

  std::string smem_offset(int l, const std::vector<int64_t>& pitch, const std::string& r) {
    std::string e;
    for (int d = 0; d < layouts_[size_t(l)].rank(); ++d) {
      const std::string c = coord(l, d, r);
      if (c == "0") continue;
      e += (e.empty() ? "" : " + ") + (pitch[size_t(d)] == 1 ? c : c + " * " + S(pitch[size_t(d)]));
    }
    return e.empty() ? "0" : e;
  }

  // Room in shared memory for one tile of `v` (row-major, rows padded).
  struct SmemTile {
    DType dtype;
    std::vector<int64_t> pitch;
    int offset;
  };
  SmemTile alloc_smem_tile(ValueId v) {
    const DType dt = type(v).dtype;
    const int eb = dtype_size_bytes(dt);
    return SmemTile{dt, smem_pitches(type(v).shape, eb), alloc_smem(smem_bytes_for(type(v).shape, eb))};
  }

  // Writes a tile into shared memory (row-major, padded). Emitted at `lv`.
  void write_smem(int lv, const Tile& t, int l, DType dt, const std::string& buf,
                  const std::vector<int64_t>& pitch) {
    const Layout& L = layouts_[size_t(l)];
    const int eb = dtype_size_bytes(dt);
    const int rank = L.rank();
    int w = rank ? std::min(L.contiguous_regs(rank - 1), 16 / eb) : 1;
    if (rank && pitch.size() >= 2 && pitch[pitch.size() - 2] % w) w = 1;
    const int n = L.num_regs();
    const std::string st = storage_type(dt);
    const std::string own = owner_predicate(l);
    line(lv, "if (" + (own.empty() ? std::string("true") : own) + ") {");
    line(lv, "  #pragma unroll");
    line(lv, "  for (int q = 0; q < " + S(n / w) + "; ++q) {");
    line(lv, "    const int r = q * " + S(w) + ";");
    if (w == 1) {
      line(lv, "    " + buf + "[" + smem_offset(l, pitch, "r") + "] = " + elem(t, "r") + ";");
    } else {
      line(lv, "    kerf_dev::Pack<" + st + ", " + S(w) + "> pk;");
      line(lv, "    #pragma unroll");
      line(lv, "    for (int j = 0; j < " + S(w) + "; ++j) pk.v[j] = " + elem(t, "r + j") + ";");
      line(lv, "    kerf_dev::st<" + st + ", " + S(w) + ">(" + buf + " + " +
                   smem_offset(l, pitch, "r") + ", pk);");
    }
    line(lv, "  }");
    line(lv, "}");
  }

  Tile convert_tile(ValueId v, const Tile& src, int from, int to) {
    std::vector<int> kept;
    if (register_subset(from, to, &kept)) {
      Derived d;
      d.layout = layouts_[size_t(to)];
      d.kept = kept;
      return compose(src, d, to);
    }
    const int lv = level_of_[size_t(v)];
    const auto [dt, pitch, off] = alloc_smem_tile(v);
    const std::string st = storage_type(dt);
    const std::string buf = fresh("cvt");
    line(lv, "// %" + S(v) + ": " + layouts_[size_t(from)].key() + " -> " + layouts_[size_t(to)].key());
    line(lv, st + "* " + buf + " = reinterpret_cast<" + st + "*>(kerf_smem + " + S(off) + ");");
    line(lv, "__syncthreads();");
    write_smem(lv, src, from, dt, buf, pitch);
    line(lv, "__syncthreads();");
    return read_smem(lv, v, "reinterpret_cast<const " + st + "*>(kerf_smem + " + S(off) + ")", to, dt, pitch);
  }

  // Reads a row-major padded tile from shared memory into registers of layout `to`.
  Tile read_smem(int lv, ValueId v, const std::string& buf, int to, DType dt,
                 const std::vector<int64_t>& pitch) {
    const std::string st = storage_type(dt);
    const int eb = dtype_size_bytes(dt);
    const std::string name = "v" + S(v) + "_" + S(to);
    const Layout& T = layouts_[size_t(to)];
    const int rank = T.rank();
    int w = rank ? std::min(T.contiguous_regs(rank - 1), 16 / eb) : 1;
    if (rank >= 2 && pitch[size_t(rank - 2)] % w) w = 1;
    const int n = T.num_regs();
    line(lv, st + " " + name + "[" + S(n) + "];");
    line(lv, "#pragma unroll");
    line(lv, "for (int q = 0; q < " + S(n / w) + "; ++q) {");
    line(lv, "  const int r = q * " + S(w) + ";");
    if (w == 1) {
      line(lv, "  " + name + "[r] = (" + buf + ")[" + smem_offset(to, pitch, "r") + "];");
    } else {
      line(lv, "  const kerf_dev::Pack<" + st + ", " + S(w) + "> pk = kerf_dev::ld<" + st + ", " +
                   S(w) + ">(" + buf + " + " + smem_offset(to, pitch, "r") + ");");
      line(lv, "  #pragma unroll");
      line(lv, "  for (int j = 0; j < " + S(w) + "; ++j) " + name + "[r + j] = pk.v[j];");
    }
    line(lv, "}");
    return Tile{name, false, {}, true};
  }

  // ------------------------------------------------------------ pipelined loads

  std::string async_slot_offset(const AsyncLoad& a) const {
    return S(a.ring_offset) + " + (" + a.stage + ") * " + S(a.stage_bytes);
  }

  Tile from_async(ValueId v, int l) {
    const AsyncLoad& a = async_.at(v);
    const DType dt = type(v).dtype;
    const std::string st = storage_type(dt);
    return read_smem(level_of_[size_t(v)], v,
                     "reinterpret_cast<const " + st + "*>(kerf_smem + " + async_slot_offset(a) + ")", l, dt,
                     a.pitch);
  }

  // Whether `v` (inside the loop body at `inner`) depends on the loop only
  // through its induction variable, with no memory reads.
  bool iv_only(ValueId v, ValueId iv, int inner, std::set<ValueId>& seen) const {
    if (v == iv || level_of_[size_t(v)] < inner) return true;
    if (!seen.insert(v).second) return true;
    const Operation* op = def_op_[size_t(v)];
    if (!op || !is_pure(op->kind) || op->kind == OpKind::Dot || ir::is_reduction(op->kind)) return false;
    for (ValueId o : op->operands)
      if (!iv_only(o, iv, inner, seen)) return false;
    return true;
  }

  // The value under broadcasts and expand_dims.
  ValueId strip_shape_ops(ValueId v) const {
    for (;;) {
      const Operation* d = def_op_[size_t(v)];
      if (!d || (d->kind != OpKind::Broadcast && d->kind != OpKind::ExpandDims)) return v;
      v = d->operands[0];
    }
  }

  // Whether `idx` is iv + arange(0, n) (in any broadcast form); sets n.
  bool iv_plus_range(ValueId idx, ValueId iv, int64_t* n) const {
    const Operation* add = def_op_[size_t(strip_shape_ops(idx))];
    if (!add || add->kind != OpKind::Add) return false;
    for (int side = 0; side < 2; ++side) {
      const Operation* sp = def_op_[size_t(strip_shape_ops(add->operands[size_t(side)]))];
      const Operation* ar = def_op_[size_t(strip_shape_ops(add->operands[size_t(1 - side)]))];
      if (sp && sp->kind == OpKind::Splat && sp->operands[0] == iv && ar && ar->kind == OpKind::Arange &&
          ar->attrs.start == 0) {
        *n = ar->attrs.end;
        return true;
      }
    }
    return false;
  }

  // A load from a tensor the kernel also writes may still run ahead when every
  // write to that tensor is in this loop at the same indices, and one index is
  // iv + arange(n) with a constant step >= n: each iteration then reads and
  // writes its own tile, disjoint from every other iteration's (in-place
  // updates such as W += s*B@A).
  bool disjoint_in_place(const Operation& load, const Operation& loop) const {
    const ir::Block& body = *loop.body;
    const ValueId iv = body.args[0];
    const size_t rank = size_t(tensor_of(load).rank);
    size_t writes_here = 0;
    for (const Operation& op : body.ops) {
      if ((op.kind != OpKind::Store && op.kind != OpKind::AtomicAdd) || op.attrs.param != load.attrs.param) continue;
      for (size_t d = 0; d < rank; ++d)
        if (op.operands[d] != load.operands[d]) return false;
      ++writes_here;
    }
    std::map<int64_t, int> all;
    count_writes(f_.body, all);
    if (size_t(all[load.attrs.param]) != writes_here) return false;
    const Operation* step = def_op_[size_t(loop.operands[2])];
    if (!step || step->kind != OpKind::Constant) return false;
    for (size_t d = 0; d < rank; ++d) {
      int64_t n = 0;
      if (iv_plus_range(load.operands[d], iv, &n) && step->attrs.ivalue >= n) return true;
    }
    return false;
  }

  static void count_writes(const ir::Block& b, std::map<int64_t, int>& out) {
    for (const Operation& op : b.ops) {
      if (op.kind == OpKind::Store || op.kind == OpKind::AtomicAdd) out[op.attrs.param]++;
      if (op.body) count_writes(*op.body, out);
    }
  }

  // Loads of a loop body that can be issued iterations ahead as cp.async copies.
  std::vector<const Operation*> pipelinable_loads(const Operation& loop, int inner) {
    const ir::Block& body = *loop.body;
    std::vector<const Operation*> out;
    if (num_stages_ < 2 || sm_ < 80) return out;
    std::set<int64_t> written;
    collect_written(f_.body, written);
    for (const Operation& op : body.ops) {
      if (op.kind != OpKind::Load || op.attrs.has_other || type(op.results[0]).is_scalar()) continue;
      // A prefetch must not overtake a store to what it reads.
      if (written.count(op.attrs.param) && !disjoint_in_place(op, loop)) continue;
      std::set<ValueId> seen;
      bool ok = true;
      for (ValueId o : op.operands) ok = ok && iv_only(o, body.args[0], inner, seen);
      if (!ok) continue;
      const int l = blocked(type(op.results[0]).shape);
      const int bytes = vector_width(op, l) * dtype_size_bytes(type(op.results[0]).dtype);
      if (bytes < 4) continue;  // cp.async moves 4, 8 or 16 bytes
      out.push_back(&op);
    }
    return out;
  }

  static void collect_written(const ir::Block& b, std::set<int64_t>& out) {
    for (const Operation& op : b.ops) {
      if (op.kind == OpKind::Store || op.kind == OpKind::AtomicAdd) out.insert(op.attrs.param);
      if (op.body) collect_written(*op.body, out);
    }
  }

  // Emits, into `target` level, a block that issues the cp.async copies of
  // `op` for the iteration whose induction variable is `iv_value` into ring
  // slot `slot`; `valid` says whether that iteration exists.
  void emit_prefetch(const Operation& op, int target, int inner, ValueId iv, const std::string& iv_value,
                     const std::string& slot, const std::string& valid) {
    const AsyncLoad& a = async_.at(op.results[0]);
    const ir::Param& p = tensor_of(op);
    const DType dt = p.dtype;
    const std::string st = storage_type(dt);
    const int eb = dtype_size_bytes(dt);
    // Values of the current iteration are hidden while the block recomputes them.
    const auto saved_scalars = scalars_;
    const auto saved_levels = scalar_level_;
    for (const auto& [v, lvl] : saved_levels)
      if (lvl >= inner) scalars_.erase(v);
    scalars_[iv] = "v" + S(iv);
    const int replaced = open_frame(inner);
    const int l = blocked(type(op.results[0]).shape);
    std::vector<Tile> idx;
    for (int d = 0; d < p.rank; ++d) idx.push_back(get(op.operands[size_t(d)], l));
    Tile mask;
    if (op.attrs.has_mask) mask = get(op.operands[size_t(p.rank)], l);
    const int w = vector_width(op, l);
    const int n = layouts_[size_t(l)].num_regs();
    const std::string ptr = pointer_expr(op);
    line(inner, st + "* ring = reinterpret_cast<" + st + "*>(kerf_smem + " + S(a.ring_offset) + " + (" + slot +
                    ") * " + S(a.stage_bytes) + ");");
    line(inner, "#pragma unroll");
    line(inner, "for (int q = 0; q < " + S(n / w) + "; ++q) {");
    line(inner, "  const int r = q * " + S(w) + ";");
    line(inner, "  const long long off = " + offset_expr(op, idx, "r") + ";");
    const std::string pred = "(" + valid + ")" + (op.attrs.has_mask ? " && " + elem(mask, "r") : "");
    line(inner, "  const bool ok = " + pred + ";");
    line(inner, "  kerf_dev::cp_async<" + S(w * eb) + ">(ring + " + smem_offset(l, a.pitch, "r") + ", ok ? " +
                    ptr + " + off : " + ptr + ", ok);");
    line(inner, "}");
    const std::string code = close_frame(inner, replaced);
    // Scalars the block computed for its iteration go; outer ones it emitted stay.
    for (auto it = scalar_level_.begin(); it != scalar_level_.end();) {
      if (it->second >= inner) {
        scalars_.erase(it->first);
        it = scalar_level_.erase(it);
      } else {
        ++it;
      }
    }
    for (const auto& [v, lvl] : saved_levels)
      if (lvl >= inner) {
        scalars_[v] = saved_scalars.at(v);
        scalar_level_[v] = lvl;
      }
    scalars_[iv] = saved_scalars.count(iv) ? saved_scalars.at(iv) : "v" + S(iv);
    line(target, "{  // prefetch @" + p.name + " for iteration " + iv_value);
    line(target, "  const int v" + S(iv) + " = " + iv_value + ";");
    frame(target).code += code;
    line(target, "}");
  }

  // ------------------------------------------------------------ memory

  const ir::Param& tensor_of(const Operation& op) const { return f_.params[size_t(op.attrs.param)]; }

  std::string pointer_expr(const Operation& op) {
    const ir::Param& p = tensor_of(op);
    const size_t slot = slot_offsets(f_.params)[size_t(op.attrs.param)];
    const std::string key = "p" + S(op.attrs.param);
    if (!pointers_.count(key)) {
      pointers_.insert(key);
      pointer_lines_ += "  " + storage_type(p.dtype) + "* const " + key + " = reinterpret_cast<" +
                        storage_type(p.dtype) + "*>(args.s[" + S(int64_t(slot)) + "]);\n";
    }
    return key;
  }

  std::string stride_expr(const Operation& op, int d) {
    const ir::Param& p = tensor_of(op);
    if (p.facts.contiguous_last && d == p.rank - 1) return "";
    const size_t slot = slot_offsets(f_.params)[size_t(op.attrs.param)] + 1 + size_t(p.rank) + size_t(d);
    const std::string key = "st" + S(op.attrs.param) + "_" + S(d);
    if (!pointers_.count(key)) {
      pointers_.insert(key);
      pointer_lines_ += "  const long long " + key + " = (long long)args.s[" + S(int64_t(slot)) + "];\n";
    }
    return key;
  }

  std::string offset_expr(const Operation& op, const std::vector<Tile>& idx, const std::string& r) {
    std::string e;
    for (size_t d = 0; d < idx.size(); ++d) {
      const std::string s = stride_expr(op, int(d));
      const std::string i = "(long long)" + elem(idx[d], r);
      e += (e.empty() ? "" : " + ") + (s.empty() ? i : i + " * " + s);
    }
    return e.empty() ? "0" : e;
  }

  // Elements per vector access for a load/store of `op` in layout `l`.
  int vector_width(const Operation& op, int l) const {
    const ir::Param& p = tensor_of(op);
    const Layout& L = layouts_[size_t(l)];
    const int rank = L.rank();
    if (rank == 0 || !p.facts.contiguous_last) return 1;
    const int D = rank - 1;
    const int eb = dtype_size_bytes(p.dtype);
    int64_t w = std::min<int64_t>(L.contiguous_regs(D), 16 / eb);
    const ir::AxisInfo& last = axis_[size_t(op.operands[size_t(p.rank - 1)])];
    w = std::min(w, last.contiguity[size_t(D)]);
    int64_t div = last.divisibility[size_t(D)];
    for (int k = 0; k + 1 < p.rank; ++k) {
      const ir::AxisInfo& a = axis_[size_t(op.operands[size_t(k)])];
      w = std::min(w, a.constancy[size_t(D)]);
      const int64_t sd = (p.facts.strides_div16 >> k) & 1 ? 16 : 1;
      div = std::min(div, std::min(ir::kMaxDivisibility, a.element_divisibility() * sd));
    }
    div = std::min<int64_t>(div, p.facts.aligned16 ? 16 / eb : 1);
    w = std::min(w, div);
    if (op.attrs.has_mask) {
      const size_t mi = size_t(p.rank) + (op.kind == OpKind::Load ? 0 : 1);
      w = std::min(w, axis_[size_t(op.operands[mi])].constancy[size_t(D)]);
    }
    int64_t out = 1;
    while (out * 2 <= w) out *= 2;
    return int(out);
  }

  std::string scalar_load(const Operation& op) {
    const ir::Param& p = tensor_of(op);
    std::vector<Tile> idx;
    for (int d = 0; d < p.rank; ++d) idx.push_back(Tile{scalar(op.operands[size_t(d)]), true, {}, true});
    const std::string ptr = pointer_expr(op);
    const std::string off = offset_expr(op, idx, "0");
    const std::string val = ptr + "[" + off + "]";
    if (!op.attrs.has_mask) return val;
    const std::string m = scalar(op.operands[size_t(p.rank)]);
    const std::string other = op.attrs.has_other ? scalar(op.operands[size_t(p.rank) + 1])
                                                 : "(" + storage_type(p.dtype) + ")0";
    return "(" + m + " ? " + val + " : " + other + ")";
  }

  Tile emit_load(const Operation& op, int l) {
    const ir::Param& p = tensor_of(op);
    const ValueId v = op.results[0];
    const int lv = level_of_[size_t(v)];
    const Layout& L = layouts_[size_t(l)];
    std::vector<Tile> idx;
    for (int d = 0; d < p.rank; ++d) idx.push_back(get(op.operands[size_t(d)], l));
    Tile mask, other;
    if (op.attrs.has_mask) mask = get(op.operands[size_t(p.rank)], l);
    if (op.attrs.has_other) other = get(op.operands[size_t(p.rank) + 1], l);
    const int w = vector_width(op, l);
    const int n = L.num_regs();
    const std::string st = storage_type(p.dtype);
    const std::string name = "v" + S(v) + "_" + S(l);
    const std::string ptr = pointer_expr(op);
    line(lv, st + " " + name + "[" + S(n) + "];  // load @" + p.name + " in " + L.key() + ", " +
                 S(w) + "-wide");
    line(lv, "#pragma unroll");
    line(lv, "for (int q = 0; q < " + S(n / w) + "; ++q) {");
    line(lv, "  const int r = q * " + S(w) + ";");
    line(lv, "  const long long off = " + offset_expr(op, idx, "r") + ";");
    std::string load;
    if (w == 1) {
      load = name + "[r] = " + ptr + "[off];";
    } else {
      load = "{ const kerf_dev::Pack<" + st + ", " + S(w) + "> pk = kerf_dev::ld<" + st + ", " + S(w) +
             ">(" + ptr + " + off); for (int j = 0; j < " + S(w) + "; ++j) " + name +
             "[r + j] = pk.v[j]; }";
    }
    if (op.attrs.has_mask) {
      const std::string fill = op.attrs.has_other ? elem(other, "r + j") : "(" + st + ")0";
      line(lv, "  if (" + elem(mask, "r") + ") " + load);
      line(lv, "  else for (int j = 0; j < " + S(w) + "; ++j) " + name + "[r + j] = " + fill + ";");
    } else {
      line(lv, "  " + load);
    }
    line(lv, "}");
    return Tile{name, false, {}, true};
  }

  // Store and atomic_add: the layout they write from.
  int store_layout(ValueId value) {
    const Shape& shape = type(value).shape;
    const int p = pref_[size_t(value)];
    if (p >= 0 && shape.size() == 1) return p;  // reduction results: write in place
    return blocked(shape);
  }

  void emit_store(const Operation& op, int level) {
    const ir::Param& p = tensor_of(op);
    const ValueId value = op.operands[size_t(p.rank)];
    const std::string ptr = pointer_expr(op);
    const std::string st = storage_type(p.dtype);
    const bool atomic = op.kind == OpKind::AtomicAdd;
    // An atomic whose old values are used, or that orders memory, needs more than a fire-and-forget add.
    const ValueId old = atomic && !op.results.empty() && uses_[size_t(op.results[0])] > 0 ? op.results[0] : -1;
    if (atomic && op.attrs.acq_rel) {
      line(level, "__threadfence();  // release: this program's earlier writes come first");
      line(level, "__syncthreads();");
    }
    if (type(value).is_scalar()) {
      std::vector<Tile> idx;
      for (int d = 0; d < p.rank; ++d) idx.push_back(Tile{scalar(op.operands[size_t(d)]), true, {}, true});
      const std::string off = offset_expr(op, idx, "0");
      std::string cond = "threadIdx.x == 0";
      const std::string mask = op.attrs.has_mask ? scalar(op.operands[size_t(p.rank) + 1]) : "true";
      const std::string val = scalar(value);
      if (old < 0) {
        line(level, "if (" + cond + " && " + mask + ") " + store_stmt(p.dtype, atomic, ptr + " + (" + off + ")", val) + ";");
        if (atomic && op.attrs.acq_rel) {
          line(level, "__threadfence();  // acquire: later reads come after the atomic");
          line(level, "__syncthreads();");
        }
        return;
      }
      // One thread adds; every thread of the program gets the old value.
      const int slot = alloc_smem(16);
      const std::string name = "v" + S(old);
      line(level, "if (" + cond + ") {");
      line(level, "  " + st + " prev = (" + st + ")0;");
      line(level, "  if (" + mask + ") prev = " + store_stmt(p.dtype, true, ptr + " + (" + off + ")", val) + ";");
      if (op.attrs.acq_rel) line(level, "  __threadfence();  // acquire");
      line(level, "  *reinterpret_cast<" + st + "*>(kerf_smem + " + S(slot) + ") = prev;");
      line(level, "}");
      line(level, "__syncthreads();");
      line(level, "const " + st + " " + name + " = *reinterpret_cast<const " + st + "*>(kerf_smem + " + S(slot) + ");");
      scalars_[old] = name;
      scalar_level_[old] = level_of_[size_t(old)];
      return;
    }
    const int l = store_layout(value);
    const Layout& L = layouts_[size_t(l)];
    std::vector<Tile> idx;
    for (int d = 0; d < p.rank; ++d) idx.push_back(get(op.operands[size_t(d)], l));
    // A value whose math lives in another layout (a dot's accumulator) is
    // finished there, and only the stored elements move through shared memory.
    const int pv = pref_[size_t(value)];
    const Tile val = (pv >= 0 && pv != l && acc_layouts_.count(pv))
                         ? convert_tile(value, get(value, pv), pv, l)
                         : get(value, l);
    Tile mask;
    if (op.attrs.has_mask) mask = get(op.operands[size_t(p.rank) + 1], l);
    const int w = atomic ? 1 : vector_width(op, l);
    const int n = L.num_regs();
    const std::string own = owner_predicate(l);
    const std::string old_name = old >= 0 ? "atom" + S(old) + "_" + S(l) : "";
    if (old >= 0) {
      line(level, st + " " + old_name + "[" + S(n) + "];  // old values of the atomic");
      line(level, "#pragma unroll");
      line(level, "for (int r = 0; r < " + S(n) + "; ++r) " + old_name + "[r] = (" + st + ")0;");
    }
    line(level, "// " + std::string(atomic ? "atomic_add" : "store") + " @" + p.name + " from " + L.key() +
                    ", " + S(w) + "-wide");
    line(level, "if (" + (own.empty() ? std::string("true") : own) + ") {");
    line(level, "#pragma unroll");
    line(level, "for (int q = 0; q < " + S(n / w) + "; ++q) {");
    line(level, "  const int r = q * " + S(w) + ";");
    line(level, "  const long long off = " + offset_expr(op, idx, "r") + ";");
    const std::string guard = op.attrs.has_mask ? "if (" + elem(mask, "r") + ") " : "";
    if (old >= 0) {
      line(level, "  " + guard + old_name + "[r] = " + store_stmt(p.dtype, true, ptr + " + off", elem(val, "r")) + ";");
    } else if (w == 1) {
      line(level, "  " + guard + store_stmt(p.dtype, atomic, ptr + " + off", elem(val, "r")) + ";");
    } else {
      line(level, "  " + guard + "{ kerf_dev::Pack<" + st + ", " + S(w) + "> pk; for (int j = 0; j < " +
                      S(w) + "; ++j) pk.v[j] = " + elem(val, "r + j") + "; kerf_dev::st<" + st + ", " +
                      S(w) + ">(" + ptr + " + off, pk); }");
    }
    line(level, "}");
    line(level, "}");
    if (atomic && op.attrs.acq_rel) {
      line(level, "__threadfence();  // acquire: later reads come after the atomics");
      line(level, "__syncthreads();");
    }
    if (old < 0) return;
    Tile result{old_name, false, {}, true};
    if (!own.empty()) {
      // Copies of an element live in several threads; the one that added tells the others.
      const DType dt = p.dtype;
      const auto pitch = smem_pitches(L.shape, dtype_size_bytes(dt));
      const int off = alloc_smem(smem_bytes_for(L.shape, dtype_size_bytes(dt)));
      const std::string buf = fresh("old");
      line(level, st + "* " + buf + " = reinterpret_cast<" + st + "*>(kerf_smem + " + S(off) + ");");
      write_smem(level, result, l, dt, buf, pitch);
      line(level, "__syncthreads();");
      result = read_smem(level, old, buf, l, dt, pitch);  // now complete in every thread
    }
    home_[old] = l;
    frame(level_of_[size_t(old)]).memo[std::make_pair(old, l)] = result;
  }

  std::string store_stmt(DType t, bool atomic, const std::string& addr, const std::string& val) {
    if (!atomic) return "*(" + addr + ") = " + val;
    if (t == DType::bf16) return "kerf_dev::atomic_add_16<true>(" + addr + ", " + val + ")";
    if (t == DType::f16) return "kerf_dev::atomic_add_16<false>(" + addr + ", " + val + ")";
    return "kerf_dev::atomic_add(" + addr + ", " + val + ")";
  }

  // ------------------------------------------------------------ dot

  Staged stage(ValueId v) {
    auto it = staged_.find(v);
    if (it != staged_.end()) return it->second;
    if (auto a = async_.find(v); a != async_.end())
      return Staged{async_slot_offset(a->second), a->second.pitch[0]};
    const int lv = level_of_[size_t(v)];
    const auto [dt, pitch, off] = alloc_smem_tile(v);
    int l = pref_[size_t(v)];
    if (l < 0) l = blocked(type(v).shape);
    const Tile t = get(v, l);
    const std::string st = storage_type(dt);
    const std::string buf = fresh("stage");
    line(lv, "// stage %" + S(v) + " in shared memory for a dot");
    line(lv, "__syncthreads();");
    line(lv, "{");
    line(lv, st + "* " + buf + " = reinterpret_cast<" + st + "*>(kerf_smem + " + S(off) + ");");
    write_smem(lv, t, l, dt, buf, pitch);
    line(lv, "}");
    line(lv, "__syncthreads();");
    Staged s{S(off), pitch[0]};
    staged_[v] = s;
    return s;
  }

  Tile emit_dot(const Operation& op, int h) {
    const ValueId v = op.results[0];
    const int lv = level_of_[size_t(v)];
    const ValueId a = op.operands[0], b = op.operands[1];
    const ir::Type& ta = type(a);
    const ir::Type& tb = type(b);
    const int64_t M = ta.shape[0], K = ta.shape[1], N = tb.shape[1];
    const Layout& H = layouts_[size_t(h)];
    const int n = H.num_regs();
    const std::string name = "v" + S(v) + "_" + S(h);
    // The accumulator first (it may be a loop-carried value).
    std::string init = "0.0f";
    Tile acc;
    if (op.operands.size() == 3) {
      acc = get(op.operands[2], h);
      init = elem(acc, "r");
    }
    const Staged sa = stage(a), sb = stage(b);
    const std::string at = storage_type(ta.dtype);
    line(lv, "float " + name + "[" + S(n) + "];  // dot " + ir::to_string(ta) + " @ " + ir::to_string(tb));
    line(lv, "#pragma unroll");
    line(lv, "for (int r = 0; r < " + S(n) + "; ++r) " + name + "[r] = " + init + ";");
    line(lv, "{");
    line(lv, "const " + at + "* sa = reinterpret_cast<const " + at + "*>(kerf_smem + (" + sa.offset + "));");
    line(lv, "const " + at + "* sb = reinterpret_cast<const " + at + "*>(kerf_smem + (" + sb.offset + "));");
    if (mma_eligible(op)) {
      int wm, wn;
      mma_warp_split(Shape{M, N}, num_warps_, &wm, &wn);
      const int64_t MT = M / (16 * wm), NT = N / (8 * wn);
      const std::string mma = ta.dtype == DType::bf16 ? "kerf_dev::mma_bf16_16816" : "kerf_dev::mma_f16_16816";
      line(lv, "const int wm = warp & " + S(wm - 1) + ", wn = (warp >> " + S(log2i(wm)) + ") & " + S(wn - 1) + ";");
      // A's fragments: loaded once where A is defined when the dot sits in a
      // loop that A does not depend on (e.g. B's rows in DoRA).
      const int la = level_of_[size_t(a)];
      const auto frag_key = std::make_pair(a, int64_t(wm) << 32 | int64_t(wn));
      std::string af = afrags_.count(frag_key) ? afrags_[frag_key] : "";
      if (af.empty()) {
        af = fresh("afrag");
        const std::string base = la < lv ? "reinterpret_cast<const " + at + "*>(kerf_smem + (" + sa.offset + "))" : "sa";
        const std::string wmx = "(warp & " + S(wm - 1) + ")";
        line(la, "unsigned " + af + "[" + S(K / 16) + "][" + S(MT) + "][4];  // A fragments of %" + S(a));
        line(la, "#pragma unroll");
        line(la, "for (int ki = 0; ki < " + S(K / 16) + "; ++ki)");
        line(la, "  #pragma unroll");
        line(la, "  for (int mi = 0; mi < " + S(MT) + "; ++mi)");
        line(la, "    kerf_dev::ldmatrix_x4(" + af + "[ki][mi], " + base + " + (" + wmx + " * 16 + mi * " + S(16 * wm) +
                     " + (lane & 15)) * " + S(sa.pitch) + " + ki * 16 + (lane >> 4) * 8);");
        if (la < lv) afrags_[frag_key] = af;
      }
      line(lv, "#pragma unroll");
      line(lv, "for (int ki = 0; ki < " + S(K / 16) + "; ++ki) {");
      line(lv, "  #pragma unroll");
      // B fragments for two n-tiles per ldmatrix.x4 (lanes 16-31 address the second).
      const int64_t per = NT >= 2 ? 2 : 1;
      line(lv, "  for (int ni = 0; ni < " + S(NT) + "; ni += " + S(per) + ") {");
      line(lv, "    unsigned bf[" + S(2 * per) + "];");
      if (per == 2)
        line(lv, "    kerf_dev::ldmatrix_x4_trans(bf, sb + (ki * 16 + (lane & 15)) * " + S(sb.pitch) +
                     " + wn * 8 + (ni + (lane >> 4)) * " + S(8 * wn) + ");");
      else
        line(lv, "    kerf_dev::ldmatrix_x2_trans(bf, sb + (ki * 16 + (lane & 15)) * " + S(sb.pitch) +
                     " + wn * 8 + ni * " + S(8 * wn) + ");");
      line(lv, "    #pragma unroll");
      line(lv, "    for (int h = 0; h < " + S(per) + "; ++h)");
      line(lv, "      #pragma unroll");
      line(lv, "      for (int mi = 0; mi < " + S(MT) + "; ++mi) " + mma + "(&" + name + "[((ni + h) << 2) | (mi << " +
                   S(2 + log2i(NT)) + ")], " + af + "[ki][mi], bf + 2 * h);");
      line(lv, "  }");
      line(lv, "}");
    } else {
      // fp32 FMA: each thread walks K for the rows and columns it owns.
      const Derived rows = unbroadcast_layout(H, Shape{M, 1});
      const Derived cols = unbroadcast_layout(H, Shape{1, N});
      const int lr = intern(rows.layout), lc = intern(cols.layout);
      const int nr = layouts_[size_t(lr)].num_regs(), nc = layouts_[size_t(lc)].num_regs();
      const std::string unroll = K <= 64 ? "#pragma unroll" : "#pragma unroll 8";
      line(lv, unroll);
      line(lv, "for (int k = 0; k < " + S(K) + "; ++k) {");
      line(lv, "  float ar[" + S(nr) + "], bc[" + S(nc) + "];");
      line(lv, "  #pragma unroll");
      line(lv, "  for (int i = 0; i < " + S(nr) + "; ++i) ar[i] = " +
                   to_compute_float(ta.dtype, "sa[" + coord(lr, 0, "i") + " * " + S(sa.pitch) + " + k]") + ";");
      line(lv, "  #pragma unroll");
      line(lv, "  for (int i = 0; i < " + S(nc) + "; ++i) bc[i] = " +
                   to_compute_float(tb.dtype, "sb[k * " + S(sb.pitch) + " + " + coord(lc, 1, "i") + "]") + ";");
      line(lv, "  #pragma unroll");
      line(lv, "  for (int r = 0; r < " + S(n) + "; ++r) " + name + "[r] = fmaf(ar[" +
                   reg_map_expr(rows.kept, "r") + "], bc[" + reg_map_expr(cols.kept, "r") + "], " + name +
                   "[r]);");
      line(lv, "}");
    }
    line(lv, "}");
    return Tile{name, false, {}, true};
  }

  static std::string to_compute_float(DType t, const std::string& x) {
    if (t == DType::f32) return x;
    if (t == DType::f64) return "(float)" + x;
    return to_compute(t, x);
  }

  // ------------------------------------------------------------ reductions

  std::string emit_reduce(const Operation& op) {
    const ValueId v = op.results[0];
    auto done = reduced_.find(v);
    if (done != reduced_.end()) return done->second;
    const int lv = level_of_[size_t(v)];
    const ValueId x = op.operands[0];
    const int axis = int(op.attrs.axis);
    int p = -1;
    if (auto it = reduce_input_.find(v); it != reduce_input_.end()) p = it->second;
    if (p < 0) p = blocked(type(x).shape);
    const Derived s = slice_layout(layouts_[size_t(p)], axis);
    const int sl = intern(s.layout);
    home_[v] = sl;
    const Tile tx = get(x, p);
    const DType dt = type(x).dtype;
    const DType ct = compute_dtype(dt);
    const std::string cts = storage_type(ct);
    const Layout& P = layouts_[size_t(p)];
    const int n = layouts_[size_t(sl)].num_regs();
    std::string ident, comb_a, comb_b;
    auto combine = [&](const std::string& a, const std::string& b) {
      switch (op.kind) {
        case OpKind::ReduceSum: return "(" + a + " + " + b + ")";
        case OpKind::ReduceMax:
          return is_float(ct) ? std::string(ct == DType::f64 ? "fmax(" : "fmaxf(") + a + ", " + b + ")"
                              : "(" + a + " > " + b + " ? " + a + " : " + b + ")";
        default:
          return is_float(ct) ? std::string(ct == DType::f64 ? "fmin(" : "fminf(") + a + ", " + b + ")"
                              : "(" + a + " < " + b + " ? " + a + " : " + b + ")";
      }
    };
    if (op.kind == OpKind::ReduceSum) {
      ident = is_float(ct) ? float_literal(0.0, ct) : int_literal(0, ct);
    } else {
      const bool mx = op.kind == OpKind::ReduceMax;
      if (is_float(ct)) ident = float_literal(mx ? -1.0 / 0.0 : 1.0 / 0.0, ct);
      else if (ct == DType::i64) ident = mx ? "(-9223372036854775807LL - 1)" : "9223372036854775807LL";
      else ident = mx ? "(-2147483647 - 1)" : "2147483647";
    }
    const std::string acc = "red" + S(v);
    line(lv, cts + " " + acc + "[" + S(n) + "];  // " + ir::op_name(op.kind) + " axis " + S(axis) + " of " +
                 P.key());
    line(lv, "#pragma unroll");
    line(lv, "for (int j = 0; j < " + S(n) + "; ++j) " + acc + "[j] = " + ident + ";");
    line(lv, "#pragma unroll");
    line(lv, "for (int r = 0; r < " + S(P.num_regs()) + "; ++r) {");
    line(lv, "  const int j = " + reg_map_expr(s.kept, "r") + ";");
    line(lv, "  " + acc + "[j] = " + combine(acc + "[j]", to_compute(dt, elem(tx, "r"))) + ";");
    line(lv, "}");
    for (size_t i = 0; i < P.lane.size(); ++i) {
      if (P.lane[i].dim != axis) continue;
      line(lv, "#pragma unroll");
      line(lv, "for (int j = 0; j < " + S(n) + "; ++j) " + acc + "[j] = " +
                   combine(acc + "[j]", "__shfl_xor_sync(0xffffffffu, " + acc + "[j], " + S(1 << i) + ")") + ";");
    }
    uint32_t wmask = 0;
    for (size_t i = 0; i < P.warp.size(); ++i)
      if (P.warp[i].dim == axis) wmask |= 1u << i;
    if (wmask) {
      const int eb = dtype_size_bytes(ct);
      const int off = alloc_smem(int64_t(32) * num_warps_ * n * eb);
      const std::string buf = fresh("red");
      line(lv, "{  // across warps");
      line(lv, cts + "* " + buf + " = reinterpret_cast<" + cts + "*>(kerf_smem + " + S(off) + ");");
      line(lv, "__syncthreads();");
      line(lv, "#pragma unroll");
      line(lv, "for (int j = 0; j < " + S(n) + "; ++j) " + buf + "[(warp * 32 + lane) * " + S(n) + " + j] = " +
                   acc + "[j];");
      line(lv, "__syncthreads();");
      for (uint32_t m = 1; m <= wmask; ++m) {
        if ((m & ~wmask) != 0) continue;
        line(lv, "#pragma unroll");
        line(lv, "for (int j = 0; j < " + S(n) + "; ++j) " + acc + "[j] = " +
                     combine(acc + "[j]", buf + "[((warp ^ " + S(m) + ") * 32 + lane) * " + S(n) + " + j]") + ";");
      }
      line(lv, "}");
    }
    std::string out = acc;
    if (ct != dt) {
      out = "v" + S(v) + "_" + S(sl);
      line(lv, storage_type(dt) + " " + out + "[" + S(n) + "];");
      line(lv, "#pragma unroll");
      line(lv, "for (int j = 0; j < " + S(n) + "; ++j) " + out + "[j] = " + from_compute(dt, acc + "[j]") + ";");
    }
    reduced_[v] = out;
    return out;
  }

  // ------------------------------------------------------------ statements

  void emit_block(const ir::Block& b) {
    for (const Operation& op : b.ops) {
      const int lv = depth() - 1;
      switch (op.kind) {
        case OpKind::Load:
          // Loads keep their place relative to stores (pipelined ones were issued ahead).
          if (type(op.results[0]).is_scalar()) scalar(op.results[0]);
          else if (!async_.count(op.results[0])) get(op.results[0], home_layout(op.results[0]));
          break;
        case OpKind::Store:
        case OpKind::AtomicAdd: emit_store(op, lv); break;
        case OpKind::For: emit_for(op, lv); break;
        case OpKind::Yield: break;  // handled by emit_for
        default: break;             // pure values are emitted where they are used
      }
    }
  }

  void emit_for(const Operation& op, int lv) {
    const ir::Block& body = *op.body;
    const size_t n = op.results.size();
    const int inner = lv + 1;
    const ValueId ivid = body.args[0];
    const std::string lo = scalar(op.operands[0]), hi = scalar(op.operands[1]), step = scalar(op.operands[2]);
    std::vector<std::string> carried(n);
    std::vector<int> homes(n, -1);
    for (size_t i = 0; i < n; ++i) {
      const ValueId arg = body.args[i + 1];
      const ir::Type& t = type(arg);
      const std::string st = storage_type(t.dtype);
      carried[i] = "c" + S(arg);
      if (t.is_scalar()) {
        line(lv, st + " " + carried[i] + " = " + scalar(op.operands[i + 3]) + ";");
        scalars_[arg] = carried[i];
        scalars_[op.results[i]] = carried[i];
        continue;
      }
      homes[i] = home_layout(arg);
      home_[op.results[i]] = homes[i];
      const Tile init = get(op.operands[i + 3], homes[i]);
      const int nr = layouts_[size_t(homes[i])].num_regs();
      line(lv, st + " " + carried[i] + "[" + S(nr) + "];  // carried in " + layouts_[size_t(homes[i])].key());
      line(lv, "#pragma unroll");
      line(lv, "for (int r = 0; r < " + S(nr) + "; ++r) " + carried[i] + "[r] = " + elem(init, "r") + ";");
      frame(lv).memo[std::make_pair(op.results[i], homes[i])] = Tile{carried[i], false, {}, true};
    }
    const std::string iv = "v" + S(ivid);
    scalars_[ivid] = iv;

    // Software pipelining: loads that depend only on the induction variable are
    // copied into shared memory num_stages - 1 iterations ahead.
    const std::vector<const Operation*> pipelined = pipelinable_loads(op, inner);
    const int S_ = num_stages_;
    const std::string it = "it" + S(ivid);
    if (!pipelined.empty()) {
      line(lv, "int " + it + " = 0;  // iteration count, selects the ring slot");
      for (const Operation* ld : pipelined) {
        const ir::Type& t = type(ld->results[0]);
        AsyncLoad a;
        a.pitch = smem_pitches(t.shape, dtype_size_bytes(t.dtype));
        a.stage_bytes = (smem_bytes_for(t.shape, dtype_size_bytes(t.dtype)) + 15) & ~int64_t(15);
        a.ring_offset = alloc_smem(a.stage_bytes * S_);
        a.stage = it + " % " + S(S_);
        async_[ld->results[0]] = a;
      }
      for (int k = 0; k + 1 < S_; ++k) {
        const std::string ivk = fresh("pf_iv");
        line(lv, "const int " + ivk + " = " + lo + " + " + S(k) + " * " + step + ";");
        for (const Operation* ld : pipelined)
          emit_prefetch(*ld, lv, inner, ivid, ivk, S(k), ivk + " < " + hi + " && " + step + " > 0");
        line(lv, "kerf_dev::cp_async_commit();");
      }
    }

    open_frame(inner);
    for (size_t i = 0; i < n; ++i)
      if (homes[i] >= 0) frame(inner).memo[std::make_pair(body.args[i + 1], homes[i])] = Tile{carried[i], false, {}, true};
    if (!pipelined.empty()) {
      line(inner, "kerf_dev::cp_async_wait<" + S(S_ - 2) + ">();  // this iteration's copies have landed");
      line(inner, "__syncthreads();");
      const std::string ivn = fresh("pf_iv");
      line(inner, "const int " + ivn + " = " + iv + " + " + S(S_ - 1) + " * " + step + ";");
      for (const Operation* ld : pipelined)
        emit_prefetch(*ld, inner, inner, ivid, ivn, "(" + it + " + " + S(S_ - 1) + ") % " + S(S_), ivn + " < " + hi);
      line(inner, "kerf_dev::cp_async_commit();");
    }
    emit_block(body);
    // The next carried values, all computed before any is overwritten.
    const Operation& y = body.ops.back();
    struct Assign {
      std::string dst, src;
      int regs;  // 0: scalar
    };
    std::vector<Assign> assigns;
    for (size_t i = 0; i < n; ++i) {
      const ValueId next = y.operands[i];
      if (next == body.args[i + 1]) continue;
      const ir::Type& t = type(next);
      const std::string tmp = fresh("next");
      if (t.is_scalar()) {
        line(inner, "const " + storage_type(t.dtype) + " " + tmp + " = " + scalar(next) + ";");
        assigns.push_back({carried[i], tmp, 0});
        continue;
      }
      const Tile tn = get(next, homes[i]);
      const int nr = layouts_[size_t(homes[i])].num_regs();
      line(inner, storage_type(t.dtype) + " " + tmp + "[" + S(nr) + "];");
      line(inner, "#pragma unroll");
      line(inner, "for (int r = 0; r < " + S(nr) + "; ++r) " + tmp + "[r] = " + elem(tn, "r") + ";");
      assigns.push_back({carried[i], tmp, nr});
    }
    for (const Assign& a : assigns) {
      if (a.regs == 0) {
        line(inner, a.dst + " = " + a.src + ";");
        continue;
      }
      line(inner, "#pragma unroll");
      line(inner, "for (int r = 0; r < " + S(a.regs) + "; ++r) " + a.dst + "[r] = " + a.src + "[r];");
    }
    if (!pipelined.empty()) line(inner, "++" + it + ";");
    std::string body_code = close_frame(inner, -1);
    // Values first computed inside the body are gone with it.
    for (auto it2 = scalar_level_.begin(); it2 != scalar_level_.end();) {
      if (it2->second > lv) {
        scalars_.erase(it2->first);
        it2 = scalar_level_.erase(it2);
      } else {
        ++it2;
      }
    }
    for (auto it2 = staged_.begin(); it2 != staged_.end();)
      it2 = level_of_[size_t(it2->first)] > lv ? staged_.erase(it2) : std::next(it2);
    for (auto it2 = reduced_.begin(); it2 != reduced_.end();)
      it2 = level_of_[size_t(it2->first)] > lv ? reduced_.erase(it2) : std::next(it2);
    for (auto it2 = afrags_.begin(); it2 != afrags_.end();)
      it2 = level_of_[size_t(it2->first.first)] > lv ? afrags_.erase(it2) : std::next(it2);
    line(lv, "if (" + step + " > 0)");
    line(lv, "for (int " + iv + " = " + lo + "; " + iv + " < " + hi + "; " + iv + " += " + step + ") {");
    frame(lv).code += body_code;
    line(lv, "}");
    if (!pipelined.empty()) {
      line(lv, "kerf_dev::cp_async_wait<0>();  // nothing in flight once the loop is done");
      line(lv, "__syncthreads();");
    }
  }

  // ------------------------------------------------------------ state

  const ir::Function& f_;
  std::string arch_;
  int sm_ = 80;
  int num_warps_ = 4;
  int num_stages_ = 1;
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
  std::map<ValueId, std::string> reduced_;
  std::map<std::pair<ValueId, int64_t>, std::string> afrags_;  // (A, warp split) -> fragments
  std::set<std::string> pointers_;
  std::string pointer_lines_;
  int counter_ = 0;
  int smem_top_ = 0;

 public:
  const std::string& pointer_lines() const { return pointer_lines_; }
};

}  // namespace

KernelCode generate(const ir::Function& f, const std::string& arch) {
  Codegen g(f, arch);
  KernelCode k = g.run();
  // Pointers and strides are declared once, at the top of the kernel.
  const std::string marker = "  (void)lane; (void)warp;\n";
  const auto pos = k.source.find(marker);
  if (pos != std::string::npos) k.source.insert(pos + marker.size(), g.pointer_lines());
  return k;
}

}  // namespace kerf::jit::cuda
