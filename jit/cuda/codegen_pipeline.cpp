// Software pipelining: loads that depend only on a loop's induction variable
// are issued as cp.async copies into a ring of shared-memory buffers, ahead of
// the iteration that reads them.
#include "codegen_impl.h"

namespace kerf::jit::cuda::detail {

std::string Codegen::async_slot_offset(const AsyncLoad& a) const {
  return a.base + " + (" + a.stage + ") * " + S(a.stage_bytes);
}

Tile Codegen::from_async(ValueId v, int l) {
  const AsyncLoad& a = async_.at(v);
  const DType dt = type(v).dtype;
  const std::string st = storage_type(dt);
  if (a.sw_rows || a.sw32) throw InternalError("CUDA codegen: a swizzled tile read outside a dot");
  async_reads_[v].insert(l);
  return read_smem(level_of_[size_t(v)], v,
                   "reinterpret_cast<const " + st + "*>(kerf_smem + " + async_slot_offset(a) + ")",
                   l, dt, a.pitch);
}

// Whether `v` is `u` or computed from it, through values of loop level `level` and deeper.
bool Codegen::depends_on(ValueId v, ValueId u, int level, std::set<ValueId>& seen) const {
  if (v == u) return true;
  if (level_of_[size_t(v)] < level || !seen.insert(v).second) return false;
  const Operation* op = def_op_[size_t(v)];
  if (!op) return false;
  for (ValueId o : op->operands)
    if (depends_on(o, u, level, seen)) return true;
  return false;
}

std::string Codegen::in_place_slot(const Operation& store, ValueId value, int from, int level) {
  if (!store_in_ring_ || !cur_block_ || !owner_predicate(from).empty()) return "";
  const ir::Type& t = type(value);
  const int eb = dtype_size_bytes(t.dtype);
  const std::vector<int64_t> pitch = smem_pitches(t.shape, eb);
  for (const auto& [u, a] : async_) {
    // Once an iteration: a second conversion there would overwrite the first's values
    // while other threads may still read them.
    if (level_of_[size_t(u)] != level || a.sw_rows || a.sw32 || ring_staged_.count(u)) continue;
    // A load of this loop's body (a loop before it at the same level had its own rings).
    if (std::none_of(cur_block_->ops.begin(), cur_block_->ops.end(),
                     [&](const Operation& o) { return &o == def_op_[size_t(u)]; }))
      continue;
    const ir::Type& ut = type(u);
    if (ut.shape != t.shape || dtype_size_bytes(ut.dtype) != eb || a.pitch != pitch ||
        a.stage_bytes < smem_bytes_for(t.shape, eb))
      continue;
    // Read from its slot in the conversion's source layout only, and by no dot (which
    // may read a ring in place).
    const auto reads = async_reads_.find(u);
    if (reads == async_reads_.end() || reads->second != std::set<int>{from}) continue;
    bool ok = true;
    if (const auto us = users_.find(u); us != users_.end())
      for (const auto& [user, index] : us->second) ok = ok && user->kind != OpKind::Dot;
    // Nothing the store still needs (its mask), and nothing after it in the iteration,
    // comes from the slot's values.
    std::set<ValueId> seen;
    for (size_t k = 0; ok && k < store.operands.size(); ++k)
      if (store.operands[k] != value) ok = !depends_on(store.operands[k], u, level, seen);
    for (size_t i = cur_index_ + 1; ok && i < cur_block_->ops.size(); ++i) {
      const Operation& later = cur_block_->ops[i];
      if (later.body) ok = false;  // a nested loop: not looked into
      for (ValueId o : later.operands) ok = ok && !depends_on(o, u, level, seen);
    }
    if (ok) {
      ring_staged_.insert(u);
      return async_slot_offset(a);
    }
  }
  return "";
}

// Whether `v` (inside the loop body at `inner`) depends on the loop only
// through its induction variable, with no memory reads.
bool Codegen::iv_only(ValueId v, ValueId iv, int inner, std::set<ValueId>& seen) const {
  if (v == iv || level_of_[size_t(v)] < inner) return true;
  if (!seen.insert(v).second) return true;
  const Operation* op = def_op_[size_t(v)];
  if (!op || !is_pure(op->kind) || op->kind == OpKind::Dot || ir::is_reduction(op->kind))
    return false;
  for (ValueId o : op->operands)
    if (!iv_only(o, iv, inner, seen)) return false;
  return true;
}

// The value under broadcasts and expand_dims.
ValueId Codegen::strip_shape_ops(ValueId v) const {
  for (;;) {
    const Operation* d = def_op_[size_t(v)];
    if (!d || (d->kind != OpKind::Broadcast && d->kind != OpKind::ExpandDims)) return v;
    v = d->operands[0];
  }
}

// Whether `idx` is iv + arange(0, n) (in any broadcast form); sets n.
bool Codegen::iv_plus_range(ValueId idx, ValueId iv, int64_t* n) const {
  const Operation* add = def_op_[size_t(strip_shape_ops(idx))];
  if (!add || add->kind != OpKind::Add) return false;
  for (int side = 0; side < 2; ++side) {
    const Operation* sp = def_op_[size_t(strip_shape_ops(add->operands[size_t(side)]))];
    const Operation* ar = def_op_[size_t(strip_shape_ops(add->operands[size_t(1 - side)]))];
    if (sp && sp->kind == OpKind::Splat && sp->operands[0] == iv && ar &&
        ar->kind == OpKind::Arange && ar->attrs.start == 0) {
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
bool Codegen::disjoint_in_place(const Operation& load, const Operation& loop) const {
  const ir::Block& body = *loop.body;
  const ValueId iv = body.args[0];
  const size_t rank = size_t(tensor_of(load).rank);
  size_t writes_here = 0;
  for (const Operation& op : body.ops) {
    if ((op.kind != OpKind::Store && op.kind != OpKind::AtomicAdd) ||
        op.attrs.param != load.attrs.param)
      continue;
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

void Codegen::count_writes(const ir::Block& b, std::map<int64_t, int>& out) {
  for (const Operation& op : b.ops) {
    if (op.kind == OpKind::Store || op.kind == OpKind::AtomicAdd) out[op.attrs.param]++;
    if (op.body) count_writes(*op.body, out);
  }
}

// Loads of a loop body that can be issued iterations ahead as cp.async copies.
std::vector<const Operation*> Codegen::pipelinable_loads(const Operation& loop, int inner) {
  const ir::Block& body = *loop.body;
  std::vector<const Operation*> out;
  if (num_stages_ < 2 || sm_ < 80) return out;
  std::set<int64_t> written;
  collect_written(f_.body, written);
  bool after_wait = false;
  for (const Operation& op : body.ops) {
    // Nothing after a wait for the prior grid is issued ahead of it.
    after_wait = after_wait || op.kind == OpKind::GridWait ||
                 (op.body && ir::contains(*op.body, OpKind::GridWait));
    if (after_wait) break;
    if (op.kind != OpKind::Load || op.attrs.has_other || op.attrs.cluster_share || type(op.results[0]).is_scalar())
      continue;
    // A B operand staged in the column order of a runs accumulator is written by the threads.
    if (staged_cols_.count(op.results[0])) continue;
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

void Codegen::collect_written(const ir::Block& b, std::set<int64_t>& out) {
  for (const Operation& op : b.ops) {
    if (op.kind == OpKind::Store || op.kind == OpKind::AtomicAdd) out.insert(op.attrs.param);
    if (op.body) collect_written(*op.body, out);
  }
}

// Emits, into `target` level, a block that issues the cp.async copies of
// `op` for the iteration whose induction variable is `iv_value` into ring
// slot `slot`; `valid` says whether that iteration exists.
void Codegen::emit_prefetch(const Operation& op, int target, int inner, ValueId iv,
                            const std::string& iv_value, const std::string& slot,
                            const std::string& valid) {
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
  const std::vector<Tile> idx = index_tiles(op, l);
  Tile mask;
  if (op.attrs.has_mask) mask = get(op.operands[size_t(p.rank)], l);
  const int w = vector_width(op, l);
  const int n = layouts_[size_t(l)].num_regs();
  const std::string ptr = pointer_expr(op);
  line(inner, st + "* ring = reinterpret_cast<" + st + "*>(kerf_smem + " + a.base +
                  " + (" + slot + ") * " + S(a.stage_bytes) + ");");
  // Where threads hold copies of the same elements (a tile smaller than the
  // block, or a [BM,1] column), the first of them copies: one write per slot
  // element, none racing another (every thread still commits and waits).
  const std::string own = owner_predicate(l);
  if (!own.empty()) line(inner, "if (" + own + ") {");
  line(inner, "#pragma unroll");
  line(inner, "for (int q = 0; q < " + S(n / w) + "; ++q) {");
  line(inner, "  const int r = q * " + S(w) + ";");
  line(inner, "  const long long off = " + offset_expr(op, idx, "r") + ";");
  const std::string pred = "(" + valid + ")" + (op.attrs.has_mask ? " && " + elem(mask, "r") : "");
  line(inner, "  const bool ok = " + pred + ";");
  const std::string pol = l2_policy(op);
  const std::string size = S(w * eb) + (l2_prefetch_ ? ", " + S(l2_prefetch_) : "");
  if (pol.empty())
    line(inner, "  kerf_dev::cp_async<" + size + ">(ring + " + smem_offset(l, a.pitch, "r", a.sw_rows, a.sw32) +
                    ", ok ? " + ptr + " + off : " + ptr + ", ok);");
  else
    line(inner, "  kerf_dev::cp_async_hint<" + size + ">(ring + " + smem_offset(l, a.pitch, "r", a.sw_rows, a.sw32) +
                    ", ok ? " + ptr + " + off : " + ptr + ", ok, " + pol + ");");
  line(inner, "}");
  if (!own.empty()) line(inner, "}");
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
  // The loop counter's own type: an i64 counter cut to int would prefetch from wrapped indices.
  line(target, "  const " + storage_type(type(iv).dtype) + " v" + S(iv) + " = " + iv_value + ";");
  frame(target).code += code;
  line(target, "}");
}

}  // namespace kerf::jit::cuda::detail
