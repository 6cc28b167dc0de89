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
#include "codegen_impl.h"

#include <algorithm>
#include <functional>

namespace kerf::jit::cuda {
namespace detail {

Codegen::Codegen(const ir::Function& f, const std::string& arch) : f_(f), arch_(arch) {
  num_warps_ = int(f.meta_value("num_warps", 4));
  num_stages_ = int(f.meta_value("num_stages", 1));
  l2_prefetch_ = int(f.meta_value("l2_prefetch", 0));  // 0, 64, 128 or 256: checked when traced
  sm_ = arch_number(arch);
  // wgmma needs the architecture-specific target (sm_90a); elsewhere the meta is ignored.
  wgmma_ = f.meta_value("wgmma", 0) != 0 && sm_ == 90 && !arch.empty() && arch.back() == 'a';
  wgmma_ss_ = wgmma_ && f.meta_value("wgmma_ss", 0) != 0;
  acc_col_run_ = int(f.meta_value("acc_col_run", 0));
  staged_adds_ = f.meta_value("staged_adds", 0) != 0;
  acc_store_ = f.meta_value("acc_store", 0) != 0;
  store_in_ring_ = f.meta_value("store_in_ring", 0) != 0;
  early_prologue_ = f.meta_value("early_prologue", 0) != 0;
  // Thread-block clusters exist from sm_90; before it a cluster sum is a plain atomic.
  cluster_ = sm_ >= 90 ? int(f.meta_value("cluster_size", 1)) : 1;
}

KernelCode Codegen::run() {
  axis_ = ir::analyze_axis_info(f_);
  uses_ = ir::count_uses(f_);
  def_op_.assign(f_.types.size(), nullptr);
  level_of_.assign(f_.types.size(), 0);
  pref_.assign(f_.types.size(), -1);
  scan_block(f_.body, 0);
  choose_blocked_vectors(f_.body);
  compute_prefs(f_.body);
  prefer_runs_for_acc_inputs();

  frames_.assign(1, Frame{});
  active_.assign(1, 0);
  // Grid barriers stand at the top level (the verifier's rule).
  for (const Operation& op : f_.body.ops)
    if (op.kind == OpKind::GridSync) last_grid_barrier_ = &op;
  emit_block(f_.body);
  flush_cluster(0);
  // The program whose exit (counted after its last barrier) came last sets the barriers'
  // counter back to zero.
  if (grid_arrivals_ > 0)
    line(0, "kerf_dev::grid_exit_finish(" + grid_sync_ptr_ + ", kerf_grid_exit, " + S(grid_arrivals_ + 1) + ");");

  KernelCode out;
  out.threads = 32 * num_warps_;
  // With 1024-aligned regions the dynamic shared memory has one pad of up to
  // 1024 bytes before kerf_smem (the window's base is only 16-byte aligned).
  out.smem_bytes = smem_top_ + (smem_1024_ ? 1024 : 0);
  out.num_slots = int(slot_count(f_.params));
  const ir::Hash128 h = ir::hash(f_);
  out.entry = "kerf_" + f_.name + "_" + h.hex().substr(0, 12);
  std::ostringstream src;
  src << "// kerf: generated for " << arch_ << " from kernel '" << f_.name << "'\n";
  src << "// IR hash " << h.hex() << "; " << out.threads << " threads, " << out.smem_bytes
      << " bytes of shared memory\n";
  src << "#include <cuda/std/cstdint>\n";
  src << device_library_source();
  if (!wgmma_sizes_.empty()) src << wgmma_helpers_source();
  for (int n : wgmma_sizes_) src << wgmma_wrapper_source(n);
  if (cluster_rank_used_) src << cluster_helpers_source();
  // The compile may ask ptxas to keep room for KERF_MIN_PROGRAMS programs a multiprocessor
  // (cache::compile_kernel's retry of a kernel that spilled registers it could have had).
  src << "\n#ifdef KERF_MIN_PROGRAMS\n#define KERF_LAUNCH_BOUNDS __launch_bounds__(" << out.threads
      << ", KERF_MIN_PROGRAMS)\n#else\n#define KERF_LAUNCH_BOUNDS __launch_bounds__(" << out.threads
      << ")\n#endif\n";
  src << "extern \"C\" __global__ void KERF_LAUNCH_BOUNDS " << out.entry
      << "(const __grid_constant__ kerf_dev::Args<" << std::max(1, out.num_slots) << "> args) {\n";
  if (smem_1024_) {
    src << "  extern __shared__ __align__(16) unsigned char kerf_smem_window[];\n";
    src << "  unsigned char* const kerf_smem = kerf_smem_window + ((1024u - ((unsigned)__cvta_generic_to_shared("
           "kerf_smem_window) & 1023u)) & 1023u);  // 1024-aligned\n";
  } else {
    src << "  extern __shared__ __align__(16) unsigned char kerf_smem[];\n";
  }
  src << "  const int lane = threadIdx.x & 31;\n";
  src << "  const int warp = threadIdx.x >> 5;\n";
  src << "  (void)lane; (void)warp;\n";
  if (grid_arrivals_ > 0) src << "  int kerf_grid_exit = 0;  // thread 0: the barriers' count before its exit\n";
  src << prologue();
  if (cluster_rank_used_) {
    src << "  const unsigned kerf_crank = kerf_dev::cluster_rank();\n";
    for (const std::string& phase : cluster_phases_) src << "  unsigned " << phase << " = 0;\n";
  }
  src << frames_[0].code;
  // No program leaves while another of its cluster may still read its shared memory.
  if (!cluster_phases_.empty()) src << "  kerf_dev::cluster_arrive();\n  kerf_dev::cluster_wait();\n";
  src << "}\n";
  out.source = src.str();
  return out;
}

bool Codegen::is_pure(OpKind k) const {
  return k != OpKind::Load && k != OpKind::Store && k != OpKind::AtomicAdd && k != OpKind::For &&
         k != OpKind::Yield && k != OpKind::GridWait && k != OpKind::GridRelease && k != OpKind::GridSync &&
         k != OpKind::L2EvictNormal;
}

// Records each value's defining op and placement level.
void Codegen::scan_block(const ir::Block& b, int level) {
  for (const Operation& op : b.ops) {
    for (ValueId r : op.results) def_op_[size_t(r)] = &op;
    for (size_t i = 0; i < op.operands.size(); ++i) users_[op.operands[i]].push_back({&op, int(i)});
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

const ir::Type& Codegen::type(ValueId v) const {
  return f_.type(v);
}

void Codegen::choose_blocked_vectors(const ir::Block& b) {
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

int Codegen::blocked(const Shape& shape) {
  auto it = blocked_vec_.find(shape);
  const int vec = it == blocked_vec_.end() ? 4 : it->second;
  return intern(blocked_layout(shape, num_warps_, vec));
}

bool Codegen::mma_eligible(const Operation& op) const {
  const ir::Type& a = type(op.operands[0]);
  const ir::Type& b = type(op.operands[1]);
  // bf16/f16 tiles, and f32 tiles taken as TF32 (mma.sync only: wgmma_dot asks for half tiles).
  if (sm_ < 80 || !(is_half(a.dtype) || (a.dtype == DType::f32 && op.attrs.tf32))) return false;
  const int64_t M = a.shape[0], K = a.shape[1], N = b.shape[1];
  return M % 16 == 0 && N % 8 == 0 && K % 16 == 0;
}

ValueId Codegen::dot_source(ValueId v, bool* transposed) const {
  *transposed = false;
  const Operation* op = def_op_[size_t(v)];
  if (op && op->kind == OpKind::Transpose && type(op->operands[0]).dtype == type(v).dtype) {
    *transposed = true;
    return op->operands[0];
  }
  return v;
}

bool Codegen::sw128_candidate(ValueId v) const {
  if (!wgmma_) return false;
  const ir::Type& t = type(v);
  if (t.shape.size() != 2 || !is_half(t.dtype) || t.shape[0] % 8 || t.shape[1] % 64) return false;
  // Every use an operand of a tensor-core dot, directly or (once) through a trans().
  const auto only_dot_operand = [&](ValueId x, bool through_trans, const auto& self) -> bool {
    const auto it = users_.find(x);
    if (it == users_.end()) return false;
    for (const auto& [op, i] : it->second) {
      if (op->kind == OpKind::Dot && i < 2 && mma_eligible(*op)) continue;
      if (through_trans && op->kind == OpKind::Transpose && type(op->results[0]).dtype == t.dtype &&
          self(op->results[0], false, self))
        continue;
      return false;
    }
    return true;
  };
  return only_dot_operand(v, true, only_dot_operand);
}

int64_t Codegen::smem_pad(ValueId v) const {
  const ir::Type& t = type(v);
  if (t.shape.size() != 2 || t.dtype != DType::f32) return -1;
  const auto it = users_.find(v);
  if (it == users_.end() || it->second.empty()) return -1;
  for (const auto& [op, i] : it->second) {
    // B [K, N] read by column (bfrag_tf32), or A^T [K, M] once trans() makes it A (afrag_tf32_trans).
    if (op->kind == OpKind::Dot && i == 1 && mma_eligible(*op) && op->attrs.tf32) continue;
    if (op->kind == OpKind::Transpose) {
      const auto u = users_.find(op->results[0]);
      if (u != users_.end() && !u->second.empty() &&
          std::all_of(u->second.begin(), u->second.end(), [&](const auto& use) {
            return use.first->kind == OpKind::Dot && use.second == 0 && mma_eligible(*use.first) &&
                   use.first->attrs.tf32;
          }))
        continue;
    }
    return -1;
  }
  return 8;
}

bool Codegen::wgmma_split(const Operation& op, int64_t* cols_per_warpgroup) const {
  if (!wgmma_ || !mma_eligible(op) || num_warps_ % 4) return false;
  const Shape& shape = type(op.results[0]).shape;
  int wm, wn;
  mma_warp_split(shape, num_warps_, int(op.attrs.axis), &wm, &wn);
  if (wm % 4 || shape[0] % (16 * wm)) return false;
  *cols_per_warpgroup = shape[1] / wn;
  return true;
}

bool Codegen::sw32_candidate(ValueId v) const {
  if (!wgmma_ss_) return false;
  const ir::Type& t = type(v);
  if (t.shape.size() != 2 || !is_half(t.dtype) || t.shape[0] % 8 || t.shape[1] != 16) return false;
  const auto it = users_.find(v);
  if (it == users_.end() || it->second.empty()) return false;
  for (const auto& [op, i] : it->second) {
    int64_t nw = 0;
    if (op->kind != OpKind::Dot || i != 1 || !wgmma_split(*op, &nw) || nw != 16) return false;
  }
  return true;
}

bool Codegen::wgmma_dot(const Operation& op) const {
  int64_t nw = 0;  // columns of one warpgroup
  if (!wgmma_split(op, &nw)) return false;
  bool transposed;
  const ValueId b = dot_source(op.operands[1], &transposed);
  if (!transposed && nw == 16 && sw32_candidate(b)) return true;
  if (!sw128_candidate(b)) return false;
  // K-major (smem holds B^T [N, K]): one instruction of N = nw <= 256.
  // MN-major ([K, N]): instructions of 64 columns, or one of 16 or 32.
  return transposed ? nw % 8 == 0 && nw <= 256 : (nw % 64 == 0 || nw == 32 || nw == 16);
}

int Codegen::acc_layout(const Operation& op) {
  const Shape& shape = type(op.results[0]).shape;
  int l;
  if (wgmma_dot(op)) {
    int wm, wn;
    mma_warp_split(shape, num_warps_, int(op.attrs.axis), &wm, &wn);
    l = intern(wgmma_acc_layout(shape, num_warps_, wm, wn));
  } else if (mma_eligible(op)) {
    int wm, wn;
    mma_warp_split(shape, num_warps_, int(op.attrs.axis), &wm, &wn);
    if (runs_eligible(op)) {
      const RunAcc ra = mma_acc_layout_runs(shape, num_warps_, wm, wn, acc_col_run_);
      l = intern(ra.layout);
      run_kept_[l] = ra.kept;
      std::vector<int> to_hw(ra.hw_to_logical.size());
      for (size_t i = 0; i < to_hw.size(); ++i) to_hw[size_t(ra.hw_to_logical[i])] = int(i);
      staged_cols_[op.operands[1]] = to_hw;
      if (std::find(run_dots_.begin(), run_dots_.end(), &op) == run_dots_.end()) run_dots_.push_back(&op);
    } else {
      l = intern(mma_acc_layout(shape, num_warps_, wm, wn));
    }
  } else {
    l = intern(blocked_layout(shape, num_warps_, 4));
  }
  acc_layouts_.insert(l);
  return l;
}

bool Codegen::runs_eligible(const Operation& op) const {
  if (acc_col_run_ < 2) return false;
  const ValueId b = op.operands[1];
  bool transposed = false;
  dot_source(b, &transposed);
  if (transposed) return false;
  auto it = users_.find(b);
  if (it == users_.end()) return false;
  for (const auto& [user, index] : it->second)
    if (user != &op || index != 1) return false;
  return true;
}

void Codegen::prefer_runs_for_acc_inputs() {
  if (run_dots_.empty()) return;
  // v (used once) and the values it is computed from elementwise take layout l;
  // the loads among them are then read straight into it.
  std::function<void(ValueId, int)> pull = [&](ValueId v, int l) {
    const Operation* d = def_op_[size_t(v)];
    if (!d || type(v).is_scalar() || pref_[size_t(v)] == l || uses_[size_t(v)] != 1) return;
    if (d->kind == OpKind::Load) {
      pref_[size_t(v)] = l;
    } else if (ir::is_elementwise_unary(d->kind) || ir::is_elementwise_binary(d->kind) ||
               d->kind == OpKind::Select || d->kind == OpKind::Cast) {
      if (type(d->operands[0]).shape != type(v).shape) return;
      pref_[size_t(v)] = l;
      for (ValueId o : d->operands) pull(o, l);
    }
  };
  for (const Operation* op : run_dots_)
    if (op->operands.size() == 3) pull(op->operands[2], pref_[size_t(op->results[0])]);
  // Values combined elementwise with such a dot's result (W + s * B@A).
  std::function<void(const ir::Block&)> walk = [&](const ir::Block& b) {
    for (const Operation& op : b.ops) {
      if (op.body) walk(*op.body);
      if (op.results.size() != 1) continue;
      const int l = pref_[size_t(op.results[0])];
      if (l < 0 || !run_kept_.count(l)) continue;
      if (ir::is_elementwise_binary(op.kind) || op.kind == OpKind::Select)
        for (ValueId o : op.operands) pull(o, l);
    }
  };
  walk(f_.body);
}

int Codegen::merge_prefs(const std::vector<int>& ls) const {
  for (int l : ls)
    if (acc_layouts_.count(l)) return l;
  for (int l : ls)
    if (l >= 0) return l;
  return -1;
}

// A layout each expensive value would like to live in.
void Codegen::compute_prefs(const ir::Block& b) {
  for (const Operation& op : b.ops) {
    if (op.kind == OpKind::For) {
      const ir::Block& body = *op.body;
      const size_t n = op.results.size();
      for (size_t i = 0; i < n; ++i)
        pref_[size_t(body.args[i + 1])] = pref_[size_t(op.operands[i + 3])];
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
      case OpKind::Load:
        pref_[size_t(r)] = blocked(type(r).shape);
        break;
      case OpKind::Dot:
        pref_[size_t(r)] = acc_layout(op);
        break;
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

int Codegen::intern(const Layout& l) {
  for (size_t i = 0; i < layouts_.size(); ++i)
    if (layouts_[i] == l) return int(i);
  layouts_.push_back(l);
  return int(layouts_.size() - 1);
}

bool Codegen::thread_part_nonzero(int l, int d) const {
  const Layout& L = layouts_[size_t(l)];
  for (const Basis& b : L.lane)
    if (b.dim == d) return true;
  for (const Basis& b : L.warp)
    if (b.dim == d) return true;
  return false;
}

// Coordinate along `d` of register `r` (a C++ expression) of layout `l`.
std::string Codegen::coord(int l, int d, const std::string& r) {
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

std::string Codegen::prologue() {
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
std::string Codegen::owner_predicate(int l) const {
  const Layout& L = layouts_[size_t(l)];
  const uint32_t lm = L.replicated_lane_mask(), wm = L.replicated_warp_mask();
  std::string p;
  if (lm) p += "(lane & " + S(lm) + ") == 0";
  if (wm) p += std::string(p.empty() ? "" : " && ") + "(warp & " + S(wm) + ") == 0";
  return p;
}

Frame& Codegen::frame(int level) {
  return frames_[size_t(active_.at(size_t(level)))];
}

int Codegen::depth() const {
  return int(active_.size());
}

void Codegen::line(int level, const std::string& s) {
  std::string& code = frame(level).code;
  code.append(size_t(2 * (level + 1)), ' ');
  code += s;
  code += '\n';
}

const Tile* Codegen::find_memo(const std::pair<ValueId, int>& key) {
  for (int lv = depth() - 1; lv >= 0; --lv) {
    auto& memo = frame(lv).memo;
    auto it = memo.find(key);
    if (it != memo.end()) return &it->second;
  }
  return nullptr;
}

// Opens a fresh frame for `level` (a loop body, or a prefetch block that
// stands in for one); returns the frame it replaced, or -1 for a new level.
int Codegen::open_frame(int level) {
  frames_.emplace_back();
  const int idx = int(frames_.size()) - 1;
  if (level < depth()) {
    const int prev = active_[size_t(level)];
    active_[size_t(level)] = idx;
    return prev;
  }
  active_.push_back(idx);
  if (level == 0) frames_.back().fenced = true;  // the kernel's frame runs once
  return -1;
}

// Closes the frame of `level` and returns its code.
std::string Codegen::close_frame(int level, int replaced) {
  std::string code = std::move(frame(level).code);
  if (replaced >= 0) {
    active_[size_t(level)] = replaced;
  } else {
    active_.pop_back();
  }
  return code;
}

std::string Codegen::fresh(const std::string& base) {
  return base + "_" + S(counter_++);
}

// A region at a multiple of 1024 bytes into kerf_smem, which the kernel then
// places at a 1024-byte boundary once (one pad for all such regions).
std::string Codegen::alloc_smem_1024(int lv, int64_t bytes, int* offset) {
  smem_1024_ = true;
  *offset = take_smem(bytes, 1024);
  const std::string name = fresh("sw_base");
  line(lv, "const int " + name + " = " + S(*offset) + ";  // 1024-aligned, for wgmma's swizzle");
  return name;
}

int Codegen::alloc_smem(int64_t bytes) { return take_smem(bytes, 16); }

// `bytes` at a multiple of `align` into kerf_smem: an aligned stretch of a top-level
// cluster_load's buffer (spent before anything emitted after it runs) where one is large
// enough, else new memory at the top.
int Codegen::take_smem(int64_t bytes, int align) {
  for (auto s = spent_smem_.begin(); s != spent_smem_.end(); ++s) {
    const int at = (s->first + align - 1) & ~(align - 1);
    if (at + bytes <= s->first + s->second) {
      spent_smem_.erase(s);
      return at;
    }
  }
  const int off = (smem_top_ + align - 1) & ~(align - 1);
  smem_top_ = off + int(bytes);
  return off;
}

std::string Codegen::elem(const Tile& t, const std::string& r) const {
  if (t.scalar) return t.name;
  if (t.identity) return t.name + "[" + r + "]";
  return t.name + "[" + reg_map_expr(t.kept, r) + "]";
}

// A Tile of a value requested in layout `l`, given the tile of that value in
// a layout derived from `l` by dropping register bits.
Tile Codegen::compose(Tile inner, const Derived& d, int l) const {
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

void Codegen::emit_block(const ir::Block& b) {
  std::map<size_t, std::vector<const Operation*>> prologues_before;
  if (early_prologue_)
    for (const auto& [loop, at] : early_prologues(b, depth() - 1)) prologues_before[at].push_back(loop);
  const ir::Block* const outer_block = cur_block_;
  const size_t outer_index = cur_index_;
  for (size_t i = 0; i < b.ops.size(); ++i) {
    const Operation& op = b.ops[i];
    const int lv = depth() - 1;
    cur_block_ = &b;
    cur_index_ = i;
    if (const auto early = prologues_before.find(i); early != prologues_before.end())
      for (const Operation* loop : early->second) emit_prologue(*loop, lv);
    switch (op.kind) {
      case OpKind::Load:
        // Loads keep their place relative to stores (pipelined ones were issued ahead).
        if (type(op.results[0]).is_scalar())
          scalar(op.results[0]);
        else if (!async_.count(op.results[0]))
          get(op.results[0], home_layout(op.results[0]));
        break;
      case OpKind::Store:
      case OpKind::AtomicAdd:
        emit_store(op, lv);
        break;
      case OpKind::For:
        emit_for(op, lv);
        break;
      case OpKind::Yield:
        break;  // handled by emit_for
      case OpKind::GridWait:
        // Programmatic dependent launch (sm_90+): wait for the grid launched before this one
        // and see its writes. Without such a launch there is nothing to wait for.
        if (sm_ >= 90) line(lv, "asm volatile(\"griddepcontrol.wait;\" ::: \"memory\");");
        break;
      case OpKind::L2EvictNormal:
        emit_l2_evict_normal(op, lv);
        break;
      case OpKind::GridRelease:
        if (sm_ >= 90) line(lv, "asm volatile(\"griddepcontrol.launch_dependents;\" ::: \"memory\");");
        break;
      case OpKind::GridSync:
        // A wait after k arrivals waits for k arrivals of every program (the launch is
        // cooperative); an arrival alone passes no count.
        grid_sync_ptr_ = pointer_expr(op);
        if (op.attrs.axis != ir::kGridAwait) ++grid_arrivals_;
        line(lv, std::string("// ") + ir::grid_barrier_name(op) + " " + S(grid_arrivals_) + " @" + tensor_of(op).name);
        line(lv, std::string("kerf_dev::") + ir::grid_barrier_name(op) + "(" + grid_sync_ptr_ +
                     (op.attrs.axis == ir::kGridArrive ? "" : ", " + S(grid_arrivals_)) + ");");
        // After the kernel's last barrier: this program's exit.
        if (&op == last_grid_barrier_)
          line(lv, "kerf_grid_exit = kerf_dev::grid_exit_count(" + grid_sync_ptr_ + ");");
        break;
      default:
        break;  // pure values are emitted where they are used
    }
  }
  cur_block_ = outer_block;
  cur_index_ = outer_index;
}

// The pipelined loads' rings and the copies of the loop's first num_stages - 1
// iterations, at level lv: where the loop is, or earlier (emit_block with
// early_prologue), once the values they need exist.
void Codegen::emit_prologue(const Operation& op, int lv) {
  prologue_done_.insert(&op);
  const ir::Block& body = *op.body;
  const int inner = lv + 1;
  const ValueId ivid = body.args[0];
  const std::vector<const Operation*> pipelined = pipelinable_loads(op, inner);
  if (pipelined.empty()) return;
  const std::string lo = scalar(op.operands[0]), hi = scalar(op.operands[1]), step = scalar(op.operands[2]);
  const int S_ = num_stages_;
  const std::string it = "it" + S(ivid);
  line(lv, "int " + it + " = 0;  // iteration count, selects the ring slot");
  for (const Operation* ld : pipelined) {
    const ir::Type& t = type(ld->results[0]);
    AsyncLoad a;
    a.pitch = smem_pitches(t.shape, dtype_size_bytes(t.dtype), smem_pad(ld->results[0]));
    const bool sw32 = sw32_candidate(ld->results[0]);
    if (sw128_candidate(ld->results[0]) || sw32) {
      a.sw_rows = sw32 ? 0 : t.shape[0];
      a.sw32 = sw32;
      if (sw32) a.pitch = {16, 1};
      a.stage_bytes = t.shape[0] * t.shape[1] * dtype_size_bytes(t.dtype);
      a.region_bytes = a.stage_bytes * S_;
      a.base = alloc_smem_1024(lv, a.region_bytes, &a.ring_offset);
    } else {
      a.stage_bytes =
          (smem_bytes_for(t.shape, dtype_size_bytes(t.dtype), smem_pad(ld->results[0])) + 15) & ~int64_t(15);
      a.region_bytes = a.stage_bytes * S_;
      a.ring_offset = alloc_smem(a.region_bytes);
      a.base = S(a.ring_offset);
    }
    a.stage = it + " % " + S(S_);
    async_[ld->results[0]] = a;
  }
  for (int k = 0; k + 1 < S_; ++k) {
    const std::string ivk = fresh("pf_iv");
    line(lv, "const " + storage_type(type(ivid).dtype) + " " + ivk + " = " + lo + " + " + S(k) + " * " + step + ";");
    for (const Operation* ld : pipelined)
      emit_prefetch(*ld, lv, inner, ivid, ivk, S(k), ivk + " < " + hi + " && " + step + " > 0");
    line(lv, "kerf_dev::cp_async_commit();");
  }
}

// Where in block `b` the prologue of each pipelined loop may go at the earliest
// (early_prologue): after the last op with effects that the copies depend on
// (a load or an atomic's old values among their indices, masks and bounds), and
// after the last op they must not pass (another loop, a grid wait or barrier, a
// write to a tensor they read). Pure values are emitted where first used, so they
// move with the prologue. Index of the op before which it goes, by loop.
std::map<const Operation*, size_t> Codegen::early_prologues(const ir::Block& b, int lv) {
  std::map<const Operation*, size_t> out;
  std::map<ValueId, size_t> defined_at;
  for (size_t i = 0; i < b.ops.size(); ++i)
    for (const ValueId r : b.ops[i].results) defined_at[r] = i;
  for (size_t f = 0; f < b.ops.size(); ++f) {
    const Operation& loop = b.ops[f];
    if (loop.kind != OpKind::For) continue;
    const int inner = lv + 1;
    const std::vector<const Operation*> pipelined = pipelinable_loads(loop, inner);
    if (pipelined.empty()) continue;
    std::set<int64_t> read;
    for (const Operation* ld : pipelined) read.insert(ld->attrs.param);
    size_t earliest = 0;
    for (size_t i = 0; i < f; ++i) {
      const Operation& o = b.ops[i];
      const bool fence = o.kind == OpKind::For || o.body || o.kind == OpKind::GridWait ||
                         o.kind == OpKind::GridSync || o.kind == OpKind::GridRelease ||
                         ((o.kind == OpKind::Store || o.kind == OpKind::AtomicAdd) && read.count(o.attrs.param));
      if (fence) earliest = i + 1;
    }
    // The values the copies and the loop bounds depend on, through pure ops (those the
    // loop's body defines included: invariant ones are emitted outside it, where used).
    std::set<ValueId> in_body;
    std::vector<const ir::Block*> blocks{loop.body.get()};
    while (!blocks.empty()) {
      const ir::Block* blk = blocks.back();
      blocks.pop_back();
      for (const ValueId a : blk->args) in_body.insert(a);
      for (const Operation& o : blk->ops) {
        for (const ValueId r : o.results) in_body.insert(r);
        if (o.body) blocks.push_back(o.body.get());
      }
    }
    std::vector<ValueId> work(loop.operands.begin(), loop.operands.begin() + 3);
    for (const Operation* ld : pipelined) work.insert(work.end(), ld->operands.begin(), ld->operands.end());
    std::set<ValueId> seen;
    while (!work.empty()) {
      const ValueId v = work.back();
      work.pop_back();
      if (!seen.insert(v).second) continue;
      const Operation* d = def_op_[size_t(v)];
      if (!d) continue;  // a block argument (the loop's own) or a parameter
      const auto at = defined_at.find(v);
      const bool here = at != defined_at.end();
      if (here && !is_pure(d->kind)) {
        earliest = std::max(earliest, at->second + 1);
        continue;
      }
      if (!here && !in_body.count(v)) continue;  // from an enclosing block: exists already
      for (const ValueId o : d->operands) work.push_back(o);
    }
    if (earliest < f) out[&loop] = earliest;
  }
  return out;
}

void Codegen::emit_for(const Operation& op, int lv) {
  const ir::Block& body = *op.body;
  const size_t n = op.results.size();
  const int inner = lv + 1;
  const ValueId ivid = body.args[0];
  const std::string lo = scalar(op.operands[0]), hi = scalar(op.operands[1]),
                    step = scalar(op.operands[2]);
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
    line(lv, st + " " + carried[i] + "[" + S(nr) + "];  // carried in " +
                 layouts_[size_t(homes[i])].key());
    line(lv, "#pragma unroll");
    line(lv, "for (int r = 0; r < " + S(nr) + "; ++r) " + carried[i] + "[r] = " + elem(init, "r") +
                 ";");
    frame(lv).memo[std::make_pair(op.results[i], homes[i])] = Tile{carried[i], false, {}, true};
  }
  const std::string iv = "v" + S(ivid);
  const std::string iv_type = storage_type(type(ivid).dtype);  // int, or long long for an i64 counter
  scalars_[ivid] = iv;

  // Software pipelining: loads that depend only on the induction variable are
  // copied into shared memory num_stages - 1 iterations ahead (the first ones here,
  // or earlier in the block: emit_prologue).
  if (!prologue_done_.count(&op)) emit_prologue(op, lv);
  const std::vector<const Operation*> pipelined = pipelinable_loads(op, inner);
  const int S_ = num_stages_;
  const std::string it = "it" + S(ivid);
  bool swizzled_rings = false;
  for (const Operation* ld : pipelined) {
    const AsyncLoad& a = async_.at(ld->results[0]);
    swizzled_rings = swizzled_rings || a.sw_rows != 0 || a.sw32;
  }

  open_frame(inner);
  for (size_t i = 0; i < n; ++i)
    if (homes[i] >= 0)
      frame(inner).memo[std::make_pair(body.args[i + 1], homes[i])] =
          Tile{carried[i], false, {}, true};
  if (!pipelined.empty()) {
    line(inner,
         "kerf_dev::cp_async_wait<" + S(S_ - 2) + ">();  // this iteration's copies have landed");
    if (swizzled_rings)  // wgmma reads them through the async proxy
      line(inner, "asm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\");");
    line(inner, "__syncthreads();");
    frame(inner).fenced = true;
    const std::string ivn = fresh("pf_iv");
    line(inner, "const " + iv_type + " " + ivn + " = " + iv + " + " + S(S_ - 1) + " * " + step + ";");
    for (const Operation* ld : pipelined)
      emit_prefetch(*ld, inner, inner, ivid, ivn, "(" + it + " + " + S(S_ - 1) + ") % " + S(S_),
                    ivn + " < " + hi);
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
  flush_cluster(inner);  // cluster sums complete after the body's work, the carried values included
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
  for (auto it2 = bfrags_.begin(); it2 != bfrags_.end();)
    it2 = level_of_[size_t(it2->first.first)] > lv ? bfrags_.erase(it2) : std::next(it2);
  line(lv, "if (" + step + " > 0)");
  line(lv,
       "for (" + iv_type + " " + iv + " = " + lo + "; " + iv + " < " + hi + "; " + iv + " += " + step + ") {");
  frame(lv).code += body_code;
  line(lv, "}");
  if (!pipelined.empty()) {
    line(lv, "kerf_dev::cp_async_wait<0>();  // nothing in flight once the loop is done");
    line(lv, "__syncthreads();");
    // A loop at the kernel's top level never runs again: its rings are free
    // for the transient buffers of layout conversions emitted after it.
    if (lv == 0) {
      int lo_off = INT32_MAX, hi_off = 0;
      for (const Operation* ld : pipelined) {
        const AsyncLoad& a = async_.at(ld->results[0]);
        lo_off = std::min(lo_off, a.ring_offset);
        hi_off = std::max(hi_off, a.ring_offset + int(a.region_bytes));
      }
      free_smem_.push_back({lo_off, hi_off - lo_off});
    }
  }
}

const std::string& Codegen::pointer_lines() const {
  return pointer_lines_;
}

}  // namespace detail

bool is_gpu_arch(const std::string& arch) {
  if (arch.rfind("sm_", 0) != 0) return false;
  size_t end = arch.find_first_not_of("0123456789", 3);
  if (end == std::string::npos) end = arch.size();
  return end >= 5 && (end == arch.size() || (end + 1 == arch.size() && (arch.back() == 'a' || arch.back() == 'f')));
}

int arch_number(const std::string& arch) {
  int v = 0;
  for (char c : arch)
    if (c >= '0' && c <= '9') v = v * 10 + (c - '0');
  return v;
}

KernelCode generate(const ir::Function& f, const std::string& arch) {
  if (!is_gpu_arch(arch))
    throw InvalidArgument("kernel '" + f.name + "': '" + arch + "' is not a GPU architecture (like sm_90a or sm_80)");
  // Each thread holds its share of every tile in registers; far beyond what a thread
  // has (255 registers), NVRTC spends minutes unrolling the arrays (2^20 elements on 4
  // warps ran for more than ten minutes). Such tiles are refused here, as the CPU back
  // end refuses tiles beyond its stack.
  constexpr int64_t kMaxElementsPerThread = 1024;
  const int64_t threads = 32 * std::max<int64_t>(1, f.meta_value("num_warps", 4));
  for (const ir::Type& t : f.types)
    if (!t.is_scalar() && t.numel() / threads > kMaxElementsPerThread)
      throw DefinitionError("kernel '" + f.name + "': a tile " + ir::to_string(t) + " over " +
                            std::to_string(threads) + " GPU threads needs " + std::to_string(t.numel() / threads) +
                            " registers per thread; at most " + std::to_string(kMaxElementsPerThread) +
                            " are compiled (a thread has 255): use smaller block sizes or more warps");
  detail::Codegen g(f, arch);
  KernelCode k = g.run();
  // Pointers and strides are declared once, at the top of the kernel.
  const std::string marker = "  (void)lane; (void)warp;\n";
  const auto pos = k.source.find(marker);
  if (pos != std::string::npos) k.source.insert(pos + marker.size(), g.pointer_lines());
  return k;
}

}  // namespace kerf::jit::cuda
