// Loads, stores and atomics: addresses, vector widths from the axis analysis,
// masks, and the threads that own each element.
#include "codegen_impl.h"

namespace kerf::jit::cuda::detail {

const ir::Param& Codegen::tensor_of(const Operation& op) const {
  return f_.params[size_t(op.attrs.param)];
}

std::string Codegen::pointer_expr(const Operation& op) {
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

std::string Codegen::l2_policy(const Operation& op) {
  if (op.attrs.evict == 0 || sm_ < 80) return "";
  const bool first = op.attrs.evict == 1;
  const std::string key = first ? "kerf_pol_first" : "kerf_pol_last";
  if (!pointers_.count(key)) {
    pointers_.insert(key);
    pointer_lines_ += "  const unsigned long long " + key + " = kerf_dev::l2_policy_evict_" +
                      (first ? "first" : "last") + "();\n";
  }
  return key;
}

std::string Codegen::stride_expr(const Operation& op, int d) {
  const ir::Param& p = tensor_of(op);
  if (p.facts.contiguous_last && d == p.rank - 1) return "";
  const size_t slot =
      slot_offsets(f_.params)[size_t(op.attrs.param)] + 1 + size_t(p.rank) + size_t(d);
  const std::string key = "st" + S(op.attrs.param) + "_" + S(d);
  if (!pointers_.count(key)) {
    pointers_.insert(key);
    pointer_lines_ +=
        "  const long long " + key + " = (long long)args.s[" + S(int64_t(slot)) + "];\n";
  }
  return key;
}

std::string Codegen::dim_arg(int64_t param, int d) const {
  return "args.s[" + S(int64_t(slot_offsets(f_.params)[size_t(param)] + 1 + size_t(d))) + "]";
}

std::string Codegen::offset_expr(const Operation& op, const std::vector<Tile>& idx,
                                 const std::string& r) {
  std::string e;
  for (size_t d = 0; d < idx.size(); ++d) {
    const std::string s = stride_expr(op, int(d));
    const std::string i = "(long long)" + elem(idx[d], r);
    e += (e.empty() ? "" : " + ") + (s.empty() ? i : i + " * " + s);
  }
  return e.empty() ? "0" : e;
}

// Elements per vector access for a load/store of `op` in layout `l`.
int Codegen::vector_width(const Operation& op, int l) const {
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
    const int64_t sd = p.facts.stride_divisor(k);
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

std::vector<Tile> Codegen::index_tiles(const Operation& op, int l) {
  std::vector<Tile> idx;
  for (int d = 0; d < tensor_of(op).rank; ++d) idx.push_back(get(op.operands[size_t(d)], l));
  return idx;
}

std::string Codegen::scalar_load(const Operation& op) {
  const ir::Param& p = tensor_of(op);
  std::vector<Tile> idx;
  for (int d = 0; d < p.rank; ++d)
    idx.push_back(Tile{scalar(op.operands[size_t(d)]), true, {}, true});
  const std::string ptr = pointer_expr(op);
  const std::string off = offset_expr(op, idx, "0");
  const std::string val = ptr + "[" + off + "]";
  if (!op.attrs.has_mask) return val;
  const std::string m = scalar(op.operands[size_t(p.rank)]);
  const std::string other = op.attrs.has_other ? scalar(op.operands[size_t(p.rank) + 1])
                                               : "(" + storage_type(p.dtype) + ")0";
  return "(" + m + " ? " + val + " : " + other + ")";
}

Tile Codegen::emit_load(const Operation& op, int l) {
  const ir::Param& p = tensor_of(op);
  const ValueId v = op.results[0];
  const int lv = level_of_[size_t(v)];
  const Layout& L = layouts_[size_t(l)];
  const std::vector<Tile> idx = index_tiles(op, l);
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
  const std::string pol = l2_policy(op);
  if (!pol.empty()) {
    load = "{ const kerf_dev::Pack<" + st + ", " + S(w) + "> pk = kerf_dev::ld_hint<" + st + ", " + S(w) + ">(" +
           ptr + " + off, " + pol + "); for (int j = 0; j < " + S(w) + "; ++j) " + name + "[r + j] = pk.v[j]; }";
  } else if (w == 1) {
    load = name + "[r] = " + ptr + "[off];";
  } else {
    load = "{ const kerf_dev::Pack<" + st + ", " + S(w) + "> pk = kerf_dev::ld<" + st + ", " +
           S(w) + ">(" + ptr + " + off); for (int j = 0; j < " + S(w) + "; ++j) " + name +
           "[r + j] = pk.v[j]; }";
  }
  // A cluster_share load read plainly (no clusters): its elements whose (scalar) last
  // index lies outside the last dimension read zero, as where clusters share it.
  std::string cond = op.attrs.has_mask ? elem(mask, "r") : "";
  if (op.attrs.cluster_share) {
    const std::string last = "(long long)" + elem(idx.back(), "r");
    const std::string dim = "(long long)" + dim_arg(op.attrs.param, p.rank - 1);
    cond = (cond.empty() ? "" : "(" + cond + ") && ") + last + " >= 0 && " + last + " < " + dim;
  }
  if (!cond.empty()) {
    const std::string fill = op.attrs.has_other ? elem(other, "r + j") : "(" + st + ")0";
    line(lv, "  if (" + cond + ") " + load);
    line(lv, "  else for (int j = 0; j < " + S(w) + "; ++j) " + name + "[r + j] = " + fill + ";");
  } else {
    line(lv, "  " + load);
  }
  line(lv, "}");
  return Tile{name, false, {}, true};
}

// cluster_load with clusters (cluster_ = C programs, the same code and layouts): the
// program of rank q reads t[..., j + q]. Each program takes the register groups r with
// r % C == its rank and reads, for each, the C neighbours t[..., j .. j + C) of its own
// element (one vector where they are aligned: the last dimension is contiguous), with its
// own mask (the cluster's masks agree); it writes the value for rank q to its shared
// memory at (q, thread, r / C). After a cluster barrier every program reads, from each
// program of the cluster, its own thread's values there (r / C contiguous: one vector per
// program), and a second barrier ends the exchange (a program's buffer is read by the
// others until then; its arrival is a full release, so those reads are done before any
// program passes its wait, where the restricted release of the first covers only the
// program's own shared-memory writes). A buffer at the kernel's top level is free for the regions allocated
// after it (alloc_smem, alloc_smem_1024): what they hold is written after the exchange.
Tile Codegen::emit_cluster_load(const Operation& op, int l) {
  const ir::Param& p = tensor_of(op);
  const ValueId v = op.results[0];
  const int lv = level_of_[size_t(v)];
  const Layout& L = layouts_[size_t(l)];
  const std::vector<Tile> idx = index_tiles(op, l);
  Tile mask;
  if (op.attrs.has_mask) mask = get(op.operands[size_t(p.rank)], l);
  const int n = L.num_regs(), threads = 32 * num_warps_, C = cluster_;
  const int J = (n + C - 1) / C;  // register groups each program reads for the others
  const int eb = dtype_size_bytes(p.dtype);
  const std::string st = storage_type(p.dtype);
  // The neighbours of an element in one vector where their address allows it (the last
  // dimension contiguous, the tensor 16-byte aligned): up to 16 bytes a load.
  int vw = 1;
  if (p.facts.contiguous_last && p.facts.aligned16)
    while (vw * 2 <= 16 / eb && C % (vw * 2) == 0) vw *= 2;
  const int64_t bytes = int64_t(C) * threads * J * eb;
  const int off = alloc_smem(bytes);
  cluster_rank_used_ = true;
  const std::string name = "v" + S(v) + "_" + S(l);
  const std::string ptr = pointer_expr(op);
  const std::string stride = stride_expr(op, p.rank - 1);
  const std::string buf = fresh("cld");
  line(lv, st + " " + name + "[" + S(n) + "];  // cluster_load @" + p.name + " in " + L.key() +
               ", shared over clusters of " + S(C) + " programs");
  line(lv, "{");
  line(lv, "  " + st + "* " + buf + " = reinterpret_cast<" + st + "*>(kerf_smem + " + S(off) + ");");
  line(lv, "  #pragma unroll");
  line(lv, "  for (int r = 0; r < " + S(n) + "; ++r) {");
  line(lv, "    if (r % " + S(C) + " != int(kerf_crank)) continue;");
  line(lv, "    " + st + " nb[" + S(C) + "];");
  const std::string on = op.attrs.has_mask ? elem(mask, "r") : "true";
  line(lv, "    if (" + on + ") {");
  line(lv, "      const long long off = " + offset_expr(op, idx, "r") + ";");
  // Rank 0's element: the rank's steps back along the last dimension. Neighbours outside
  // that dimension (the programs of the last cluster past its end) are not read.
  const std::string dim = "(long long)" + dim_arg(op.attrs.param, p.rank - 1);
  line(lv, "      const long long j0 = (long long)" + elem(idx.back(), "r") + " - (long long)kerf_crank;");
  line(lv, "      const " + st + "* b0 = " + ptr + " + off - (long long)kerf_crank" +
               (stride.empty() ? "" : " * " + stride) + ";");
  const std::string one_by_one = "for (int c = 0; c < " + S(C) + "; ++c) nb[c] = j0 + c >= 0 && j0 + c < " + dim +
                                 " ? b0[c" + (stride.empty() ? "" : " * " + stride) + "] : (" + st + ")0;";
  if (vw > 1) {
    line(lv, "      if (j0 >= 0 && j0 + " + S(C) + " <= " + dim + " && (reinterpret_cast<unsigned long long>(b0) & " +
                 S(vw * eb - 1) + "ull) == 0) {");
    line(lv, "        #pragma unroll");
    line(lv, "        for (int c = 0; c < " + S(C) + "; c += " + S(vw) + ") { const kerf_dev::Pack<" + st + ", " +
                 S(vw) + "> pk = kerf_dev::ld<" + st + ", " + S(vw) + ">(b0 + c); for (int j = 0; j < " + S(vw) +
                 "; ++j) nb[c + j] = pk.v[j]; }");
    line(lv, "      } else {");
    line(lv, "        " + one_by_one);
    line(lv, "      }");
  } else {
    line(lv, "      #pragma unroll");
    line(lv, "      " + one_by_one);
  }
  line(lv, "    } else {");
  line(lv, "      for (int c = 0; c < " + S(C) + "; ++c) nb[c] = (" + st + ")0;");
  line(lv, "    }");
  line(lv, "    #pragma unroll");
  line(lv, "    for (int c = 0; c < " + S(C) + "; ++c) " + buf + "[(c * " + S(threads) + " + threadIdx.x) * " + S(J) +
               " + r / " + S(C) + "] = nb[c];");
  line(lv, "  }");
  line(lv, "  kerf_dev::cluster_arrive();");
  line(lv, "  kerf_dev::cluster_wait();");
  // Each program's values for this one: J contiguous elements (a vector when J*eb is 2, 4,
  // 8 or a multiple of 16 bytes).
  const int jb = J * eb;
  const bool vec = jb == 2 || jb == 4 || jb == 8 || jb % 16 == 0;
  line(lv, "  #pragma unroll");
  line(lv, "  for (int o = 0; o < " + S(C) + "; ++o) {");
  const std::string at = buf + " + (int(kerf_crank) * " + S(threads) + " + threadIdx.x) * " + S(J);
  if (vec) {
    line(lv, "    const kerf_dev::Pack<" + st + ", " + S(J) + "> pk = kerf_dev::ld_cluster_pack<" + st + ", " + S(J) +
                 ">(" + at + ", unsigned(o));");
    line(lv, "    #pragma unroll");
    line(lv, "    for (int j = 0; j < " + S(J) + "; ++j) if (j * " + S(C) + " + o < " + S(n) + ") " + name + "[j * " +
                 S(C) + " + o] = pk.v[j];");
  } else {
    line(lv, "    #pragma unroll");
    line(lv, "    for (int j = 0; j < " + S(J) + "; ++j) if (j * " + S(C) + " + o < " + S(n) + ") " + name + "[j * " +
                 S(C) + " + o] = kerf_dev::ld_cluster_pack<" + st + ", 1>(" + at + " + j, unsigned(o)).v[0];");
  }
  line(lv, "  }");
  line(lv, "  kerf_dev::cluster_arrive_release();  // the reads above done before any program goes on");
  line(lv, "  kerf_dev::cluster_wait();");
  line(lv, "}");
  if (lv == 0) spent_smem_.push_back({off, bytes});
  return Tile{name, false, {}, true};
}

// Store and atomic_add: the layout they write from.
int Codegen::store_layout(ValueId value) {
  const Shape& shape = type(value).shape;
  const int p = pref_[size_t(value)];
  if (p >= 0 && shape.size() == 1) return p;  // reduction results: write in place
  // A dot's accumulator in runs of columns: written from its registers.
  if (p >= 0 && run_kept_.count(p)) return p;
  // acc_store: any dot's accumulator, from its registers (pairs of adjacent columns).
  if (acc_store_ && p >= 0 && shape.size() == 2 && acc_layouts_.count(p)) return p;
  return blocked(shape);
}

void Codegen::emit_store(const Operation& op, int level) {
  const ir::Param& p = tensor_of(op);
  const ValueId value = op.operands[size_t(p.rank)];
  const std::string ptr = pointer_expr(op);
  const std::string st = storage_type(p.dtype);
  const bool atomic = op.kind == OpKind::AtomicAdd;
  // An atomic whose old values are used, or that orders memory, needs more than a fire-and-forget
  // add.
  const ValueId old =
      atomic && !op.results.empty() && uses_[size_t(op.results[0])] > 0 ? op.results[0] : -1;
  if (atomic && op.attrs.acq_rel) {
    line(level, "__threadfence();  // release: this program's earlier writes come first");
    line(level, "__syncthreads();");
  }
  if (type(value).is_scalar()) {
    std::vector<Tile> idx;
    for (int d = 0; d < p.rank; ++d)
      idx.push_back(Tile{scalar(op.operands[size_t(d)]), true, {}, true});
    const std::string off = offset_expr(op, idx, "0");
    std::string cond = "threadIdx.x == 0";
    const std::string mask = op.attrs.has_mask ? scalar(op.operands[size_t(p.rank) + 1]) : "true";
    const std::string val = scalar(value);
    if (old < 0) {
      line(level, "if (" + cond + " && " + mask + ") " +
                      store_stmt(p.dtype, atomic, ptr + " + (" + off + ")", val) + ";");
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
    line(level, "  if (" + mask +
                    ") prev = " + store_stmt(p.dtype, true, ptr + " + (" + off + ")", val) + ";");
    if (op.attrs.acq_rel) line(level, "  __threadfence();  // acquire");
    line(level, "  *reinterpret_cast<" + st + "*>(kerf_smem + " + S(slot) + ") = prev;");
    line(level, "}");
    line(level, "__syncthreads();");
    line(level, "const " + st + " " + name + " = *reinterpret_cast<const " + st +
                    "*>(kerf_smem + " + S(slot) + ");");
    scalars_[old] = name;
    scalar_level_[old] = level_of_[size_t(old)];
    return;
  }
  // Plain f32 atomics (no old values, no ordering) go out as vector reductions, at most 4 wide.
  const bool vector_red = atomic && old < 0 && !op.attrs.acq_rel && p.dtype == DType::f32;
  // A value whose math lives in another layout (a dot's accumulator) is
  // finished there, and only the stored elements move through shared memory;
  // reductions of an accumulator go out from it directly (its pairs of adjacent
  // columns, 2 wide) when its layout allows, with no shared-memory round trip.
  const int pv = pref_[size_t(value)];
  const bool from_acc = pv >= 0 && acc_layouts_.count(pv);
  // With staged_adds they go out in a blocked layout of 4-wide vectors, a warp's
  // threads covering whole rows: whole 128-byte lines per instruction.
  const bool staged = vector_red && from_acc && staged_adds_ && type(value).shape.size() == 2;
  const int l = staged ? intern(blocked_layout(type(value).shape, num_warps_, 4))
                : vector_red && from_acc && vector_width(op, pv) >= 2 ? pv
                                                                      : store_layout(value);
  const Layout& L = layouts_[size_t(l)];
  const std::vector<Tile> idx = index_tiles(op, l);
  Tile val;
  if (from_acc && pv != l) {
    const Tile src = get(value, pv);  // its reads of any ring slot come first
    val = convert_tile(value, src, pv, l, in_place_slot(op, value, pv, level));
  } else {
    val = get(value, l);
  }
  Tile mask;
  if (op.attrs.has_mask) mask = get(op.operands[size_t(p.rank) + 1], l);
  const int w = !atomic ? vector_width(op, l) : vector_red ? std::min(4, vector_width(op, l)) : 1;
  const int n = L.num_regs();
  if (atomic && op.attrs.cluster_sum && cluster_ > 1) {
    emit_cluster_add(op, level, l, idx, val, mask, w);
    return;
  }
  const std::string own = owner_predicate(l);
  const std::string old_name = old >= 0 ? "atom" + S(old) + "_" + S(l) : "";
  if (old >= 0) {
    line(level, st + " " + old_name + "[" + S(n) + "];  // old values of the atomic");
    line(level, "#pragma unroll");
    line(level, "for (int r = 0; r < " + S(n) + "; ++r) " + old_name + "[r] = (" + st + ")0;");
  }
  line(level, "// " + std::string(atomic ? "atomic_add" : "store") + " @" + p.name + " from " +
                  L.key() + ", " + S(w) + "-wide");
  line(level, "if (" + (own.empty() ? std::string("true") : own) + ") {");
  line(level, "#pragma unroll");
  line(level, "for (int q = 0; q < " + S(n / w) + "; ++q) {");
  line(level, "  const int r = q * " + S(w) + ";");
  line(level, "  const long long off = " + offset_expr(op, idx, "r") + ";");
  const std::string guard = op.attrs.has_mask ? "if (" + elem(mask, "r") + ") " : "";
  if (old >= 0) {
    line(level, "  " + guard + old_name +
                    "[r] = " + store_stmt(p.dtype, true, ptr + " + off", elem(val, "r")) + ";");
  } else if (!atomic && !l2_policy(op).empty()) {
    line(level, "  " + guard + "{ kerf_dev::Pack<" + st + ", " + S(w) + "> pk; for (int j = 0; j < " + S(w) +
                    "; ++j) pk.v[j] = " + elem(val, "r + j") + "; kerf_dev::st_hint<" + st + ", " + S(w) + ">(" +
                    ptr + " + off, pk, " + l2_policy(op) + "); }");
  } else if (w == 1) {
    line(level, "  " + guard + store_stmt(p.dtype, atomic, ptr + " + off", elem(val, "r")) + ";");
  } else if (atomic) {
    line(level, "  " + guard + "{ kerf_dev::Pack<float, " + S(w) + "> pk; for (int j = 0; j < " + S(w) +
                    "; ++j) pk.v[j] = " + elem(val, "r + j") + "; kerf_dev::red_add<" + S(w) + ">(" + ptr +
                    " + off, pk); }");
  } else {
    line(level, "  " + guard + "{ kerf_dev::Pack<" + st + ", " + S(w) +
                    "> pk; for (int j = 0; j < " + S(w) + "; ++j) pk.v[j] = " + elem(val, "r + j") +
                    "; kerf_dev::st<" + st + ", " + S(w) + ">(" + ptr + " + off, pk); }");
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

// One applypriority per element held (the kernel picks one element per line);
// before sm_80 there is no such hint and nothing is emitted.
void Codegen::emit_l2_evict_normal(const Operation& op, int level) {
  if (sm_ < 80) return;
  const ir::Param& p = tensor_of(op);
  const int l = blocked(type(op.operands[0]).shape);
  const Layout& L = layouts_[size_t(l)];
  const std::vector<Tile> idx = index_tiles(op, l);
  Tile mask;
  if (op.attrs.has_mask) mask = get(op.operands[size_t(p.rank)], l);
  const std::string ptr = pointer_expr(op);
  const std::string own = owner_predicate(l);
  line(level, "// l2_evict_normal @" + p.name + " in " + L.key());
  line(level, "if (" + (own.empty() ? std::string("true") : own) + ") {");
  line(level, "#pragma unroll");
  line(level, "for (int r = 0; r < " + S(L.num_regs()) + "; ++r) {");
  line(level, "  const long long off = " + offset_expr(op, idx, "r") + ";");
  const std::string guard = op.attrs.has_mask ? "if (" + elem(mask, "r") + ") " : "";
  line(level, "  " + guard + "asm volatile(\"applypriority.global.L2::evict_normal [%0], 128;\" :: \"l\"(" + ptr +
                  " + off) : \"memory\");");
  line(level, "}");
  line(level, "}");
}

// The programs of a cluster (cluster_ of them, the same code and layouts) each
// write their registers of the value to a shared-memory buffer, indexed by
// (register group, thread) so that every thread finds its own elements at the
// same place in each program, and arrive at a cluster barrier. The rest waits
// until the end of the enclosing block (a loop body: after the work that
// follows the add in it), or the next cluster sum, whichever comes first: there
// the program waits for its cluster, and the program of rank q adds register
// groups q, q + C, ... : its own values plus the other programs' (distributed
// shared memory), with one vector reduction per group.
// With a mask, a program's masked-off values count as zero and its mask bytes
// go beside the values: an element is added where any program's mask is on (at
// the adding program's indices, which must agree with the others' there).
// The buffer is double: a program writes the other half the next time, after
// a wait that every program of its cluster arrived at after its reads of this
// one (their values are used by the reductions issued before the arrival).
void Codegen::emit_cluster_add(const Operation& op, int level, int l, const std::vector<Tile>& idx,
                               const Tile& val, const Tile& mask, int w) {
  flush_cluster(level);  // a program arrives at most once before it waits
  const ir::Param& p = tensor_of(op);
  const Layout& L = layouts_[size_t(l)];
  const int n = L.num_regs(), threads = 32 * num_warps_, groups = n / w;
  const bool masked = op.attrs.has_mask;
  const std::string ptr = pointer_expr(op);
  const std::string own = owner_predicate(l);
  const int64_t half = int64_t(n) * threads;  // floats in one half of the buffer
  const int off = alloc_smem(2 * half * 4);
  const int moff = masked ? alloc_smem(2 * int64_t(groups) * threads) : 0;
  const std::string phase = "kerf_cphase" + S(int64_t(cluster_phases_.size()));
  cluster_phases_.push_back(phase);
  cluster_rank_used_ = true;
  const std::string at = "(q * " + S(threads) + " + threadIdx.x)";
  const std::string slot = "cbuf + " + at + " * " + S(w);
  const std::string pack = "kerf_dev::Pack<float, " + S(w) + ">";
  const std::string on = masked ? elem(mask, "r") : "true";
  const std::string value = masked ? "(" + on + ") ? " + elem(val, "r + j") + " : 0.0f" : elem(val, "r + j");
  const std::string cbuf =
      "  float* cbuf = reinterpret_cast<float*>(kerf_smem + " + S(off) + ") + " + phase + " * " + S(half) + ";";
  const std::string mbuf = "  unsigned char* mbuf = kerf_smem + " + S(moff) + " + " + phase + " * " +
                           S(int64_t(groups) * threads) + ";";
  line(level, "// atomic_add @" + p.name + " from " + L.key() + ", " + S(w) + "-wide, summed over clusters of " +
                  S(cluster_) + " programs first (the sums at the end of the block)");
  line(level, "{");
  line(level, cbuf);
  if (masked) line(level, mbuf);
  line(level, "  #pragma unroll");
  line(level, "  for (int q = 0; q < " + S(groups) + "; ++q) {");
  line(level, "    const int r = q * " + S(w) + ";");
  line(level, "    " + pack + " pk; for (int j = 0; j < " + S(w) + "; ++j) pk.v[j] = " + value +
                  "; kerf_dev::st<float, " + S(w) + ">(" + slot + ", pk);");
  if (masked) line(level, "    mbuf[" + at + "] = (" + on + ") ? 1 : 0;");
  line(level, "  }");
  line(level, "  kerf_dev::cluster_arrive();");
  line(level, "}");

  std::vector<std::string>& rest = cluster_pending_[level];
  rest.push_back("// the cluster's sums of the atomic_add @" + p.name + " above");
  rest.push_back("{");
  rest.push_back("  kerf_dev::cluster_wait();");
  rest.push_back(cbuf);
  if (masked) rest.push_back(mbuf);
  rest.push_back("  if (" + (own.empty() ? std::string("true") : own) + ") {");
  rest.push_back("  #pragma unroll");
  rest.push_back("  for (int q = 0; q < " + S(groups) + "; ++q) {");
  rest.push_back("    if (q % " + S(cluster_) + " != int(kerf_crank)) continue;");
  rest.push_back("    const int r = q * " + S(w) + ";");
  rest.push_back("    " + pack + " pk; for (int j = 0; j < " + S(w) + "; ++j) pk.v[j] = " + value + ";");
  rest.push_back("    bool any = " + on + ";");
  rest.push_back("    for (unsigned c = 1; c < " + S(cluster_) + "; ++c) {");
  rest.push_back("      const unsigned from = (kerf_crank + c) % " + S(cluster_) + "u;");
  rest.push_back("      const " + pack + " o = kerf_dev::ld_cluster_pack<float, " + S(w) + ">(" + slot + ", from);");
  rest.push_back("      for (int j = 0; j < " + S(w) + "; ++j) pk.v[j] += o.v[j];");
  if (masked) rest.push_back("      any |= kerf_dev::ld_cluster_u8(mbuf + " + at + ", from) != 0;");
  rest.push_back("    }");
  rest.push_back("    if (any) {");
  rest.push_back("      const long long off = " + offset_expr(op, idx, "r") + ";");
  rest.push_back("      kerf_dev::red_add<" + S(w) + ">(" + ptr + " + off, pk);");
  rest.push_back("    }");
  rest.push_back("  }");
  rest.push_back("  }");
  rest.push_back("  " + phase + " ^= 1u;");
  rest.push_back("}");
}

void Codegen::flush_cluster(int level) {
  auto it = cluster_pending_.find(level);
  if (it == cluster_pending_.end()) return;
  for (const std::string& s : it->second) line(level, s);
  cluster_pending_.erase(it);
}

std::string Codegen::store_stmt(DType t, bool atomic, const std::string& addr,
                                const std::string& val) {
  if (!atomic) return "*(" + addr + ") = " + val;
  if (t == DType::bf16) return "kerf_dev::atomic_add_16<true>(" + addr + ", " + val + ")";
  if (t == DType::f16) return "kerf_dev::atomic_add_16<false>(" + addr + ", " + val + ")";
  return "kerf_dev::atomic_add(" + addr + ", " + val + ")";
}

}  // namespace kerf::jit::cuda::detail
