// Scalars and tiles: values computed in the layout a consumer asks for, and
// conversions between layouts through shared memory.
#include "codegen_impl.h"

namespace kerf::jit::cuda::detail {

std::string Codegen::scalar(ValueId v) {
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
    case OpKind::ProgramId:
      expr = std::string("(int)blockIdx.") + "xyz"[a.axis];
      break;
    case OpKind::NumPrograms:
      expr = std::string("(int)gridDim.") + "xyz"[a.axis];
      break;
    case OpKind::TensorDim:
      expr = "(int)" + dim_arg(a.param, int(a.axis));
      break;
    case OpKind::TensorStride: {
      const ir::Param& p = f_.params[size_t(a.param)];
      if (p.facts.contiguous_last && a.axis == p.rank - 1) {
        expr = "1LL";
      } else {
        const size_t slot =
            slot_offsets(f_.params)[size_t(a.param)] + 1 + size_t(p.rank) + size_t(a.axis);
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

Tile Codegen::get(ValueId v, int l) {
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

Tile Codegen::compute(ValueId v, int l) {
  const Operation* op = def_op_[size_t(v)];
  const int lv = level_of_[size_t(v)];
  if (!op || op->kind == OpKind::For) return from_home(v, l);  // carried value or loop result
  switch (op->kind) {
    case OpKind::Splat:
      return Tile{scalar(op->operands[0]), true, {}, true};
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
    case OpKind::ReduceMin:
      return from_home(v, l);
    case OpKind::Interleave: {
      // The operands in `l` less its parity basis (bit 0 of the last dimension):
      // a register bit is dropped (both operands sit in this thread's registers),
      // a lane or warp bit becomes a copy (each thread picks its half).
      const Layout& L = layouts_[size_t(l)];
      const int d = L.rank() - 1;
      Derived half;
      half.layout.shape = type(op->operands[0]).shape;
      std::string parity;
      for (size_t i = 0; i < L.reg.size(); ++i) {
        Basis b = L.reg[i];
        if (b.dim == d && b.value == 1) {
          parity = "(((r) >> " + S(int64_t(i)) + ") & 1)";
          continue;
        }
        if (b.dim == d) b.value /= 2;
        half.layout.reg.push_back(b);
        half.kept.push_back(int(i));
      }
      auto halve = [&](std::vector<Basis>& out, const std::vector<Basis>& in, const char* who) {
        for (size_t i = 0; i < in.size(); ++i) {
          Basis b = in[i];
          if (b.dim == d && b.value == 1) {
            parity = "((" + std::string(who) + " >> " + S(int64_t(i)) + ") & 1)";
            b = Basis{};
          } else if (b.dim == d) {
            b.value /= 2;
          }
          out.push_back(b);
        }
      };
      halve(half.layout.lane, L.lane, "lane");
      halve(half.layout.warp, L.warp, "warp");
      half.layout.check();
      const int h = intern(half.layout);
      const Tile a = compose(get(op->operands[0], h), half, l);
      const Tile b = compose(get(op->operands[1], h), half, l);
      const std::string name = "v" + S(v) + "_" + S(l);
      const int n = L.num_regs();
      line(lv, storage_type(type(v).dtype) + " " + name + "[" + S(n) + "];  // interleave in " + L.key());
      line(lv, "#pragma unroll");
      line(lv, "for (int r = 0; r < " + S(n) + "; ++r) " + name + "[r] = " + parity + " ? " + elem(b, "r") +
                   " : " + elem(a, "r") + ";");
      return Tile{name, false, {}, true};
    }
    case OpKind::Gather: {
      // Lane t of every warp holds src[t mod n] (n <= 32); a lookup is a shuffle
      // from the lane its index names (shfl takes the index's low five bits).
      const ValueId src = op->operands[0];
      const int table_layout = intern(blocked_layout(type(src).shape, num_warps_, 1));
      const Tile table = get(src, table_layout);
      const Tile index = get(op->operands[1], l);
      const std::string name = "v" + S(v) + "_" + S(l);
      const int n = layouts_[size_t(l)].num_regs();
      line(lv, storage_type(type(v).dtype) + " " + name + "[" + S(n) + "];  // gather in " +
                   layouts_[size_t(l)].key());
      line(lv, "#pragma unroll");
      line(lv, "for (int r = 0; r < " + S(n) + "; ++r) " + name + "[r] = kerf_dev::shfl_idx(" +
                   elem(table, "0") + ", (int)(" + elem(index, "r") + "));");
      return Tile{name, false, {}, true};
    }
    default:
      break;
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
Tile Codegen::from_home(ValueId v, int l) {
  const int h = home_layout(v);
  Tile home = home_tile(v, h);
  if (h == l) return home;
  return convert_tile(v, home, h, l);
}

int Codegen::home_layout(ValueId v) {
  auto it = home_.find(v);
  if (it != home_.end()) return it->second;
  int h = pref_[size_t(v)];
  if (h < 0) h = blocked(type(v).shape);
  home_[v] = h;
  return h;
}

Tile Codegen::home_tile(ValueId v, int h) {
  const auto key = std::make_pair(v, h);
  if (const Tile* t = find_memo(key)) return *t;
  const Operation* op = def_op_[size_t(v)];
  Tile t;
  if (op && op->kind == OpKind::Load) {
    t = op->attrs.cluster_share && cluster_ > 1 ? emit_cluster_load(*op, h) : emit_load(*op, h);
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
bool Codegen::register_subset(int from, int to, std::vector<int>* kept) const {
  const Layout& F = layouts_[size_t(from)];
  const Layout& T = layouts_[size_t(to)];
  if (F.lane != T.lane || F.warp != T.warp) return false;
  // Only when T's registers are the first ones of F's, in order: `kept` maps storage
  // bit j to requested bit kept[j], which a reordering of bits would invert.
  if (T.reg.size() > F.reg.size()) return false;
  kept->clear();
  for (size_t j = 0; j < T.reg.size(); ++j) {
    if (!(T.reg[j] == F.reg[j])) return false;
    kept->push_back(int(j));
  }
  return true;
}

// Row-major offsets of a tile in shared memory; rows padded by 16 bytes
// so that column accesses of successive rows fall in different banks.
std::vector<int64_t> Codegen::smem_pitches(const Shape& shape, int elem_bytes, int64_t pad) const {
  std::vector<int64_t> p(shape.size(), 1);
  if (shape.empty()) return p;
  if (pad < 0) pad = shape.size() >= 2 ? std::max(1, 16 / elem_bytes) : 0;
  int64_t stride = shape.back() + pad;
  for (size_t i = shape.size() - 1; i-- > 0;) {
    p[i] = stride;
    stride *= shape[i];
  }
  return p;
}

int64_t Codegen::smem_bytes_for(const Shape& shape, int elem_bytes, int64_t pad) const {
  if (shape.empty()) return elem_bytes;
  const auto p = smem_pitches(shape, elem_bytes, pad);
  return p[0] * shape[0] * elem_bytes;
}

std::string Codegen::smem_offset(int l, const std::vector<int64_t>& pitch, const std::string& r,
                                 int64_t sw_rows, bool sw32) {
  if (sw_rows) return "kerf_dev::sw128(" + coord(l, 0, r) + ", " + coord(l, 1, r) + ", " + S(sw_rows) + ")";
  if (sw32) return "kerf_dev::sw32(" + coord(l, 0, r) + ", " + coord(l, 1, r) + ")";
  std::string e;
  for (int d = 0; d < layouts_[size_t(l)].rank(); ++d) {
    const std::string c = coord(l, d, r);
    if (c == "0") continue;
    e += (e.empty() ? "" : " + ") + (pitch[size_t(d)] == 1 ? c : c + " * " + S(pitch[size_t(d)]));
  }
  return e.empty() ? "0" : e;
}

int Codegen::transient_smem(int64_t bytes, bool* reused) {
  if (reused) *reused = true;
  for (const auto& [off, size] : free_smem_)
    if (size >= bytes) return off;
  if (reused) *reused = false;
  return alloc_smem(bytes);
}

Codegen::SmemTile Codegen::alloc_smem_tile(ValueId v) {
  const DType dt = type(v).dtype;
  const int eb = dtype_size_bytes(dt);
  return SmemTile{dt, smem_pitches(type(v).shape, eb, smem_pad(v)),
                  alloc_smem(smem_bytes_for(type(v).shape, eb, smem_pad(v)))};
}

// Writes a tile into shared memory (row-major, padded). Emitted at `lv`.
void Codegen::write_smem(int lv, const Tile& t, int l, DType dt, const std::string& buf,
                         const std::vector<int64_t>& pitch, int64_t sw_rows, bool sw32) {
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
    line(lv, "    " + buf + "[" + smem_offset(l, pitch, "r", sw_rows, sw32) + "] = " + elem(t, "r") + ";");
  } else {
    line(lv, "    kerf_dev::Pack<" + st + ", " + S(w) + "> pk;");
    line(lv, "    #pragma unroll");
    line(lv, "    for (int j = 0; j < " + S(w) + "; ++j) pk.v[j] = " + elem(t, "r + j") + ";");
    line(lv, "    kerf_dev::st<" + st + ", " + S(w) + ">(" + buf + " + " +
                 smem_offset(l, pitch, "r", sw_rows, sw32) + ", pk);");
  }
  line(lv, "  }");
  line(lv, "}");
}

Tile Codegen::convert_tile(ValueId v, const Tile& src, int from, int to, const std::string& slot) {
  std::vector<int> kept;
  if (register_subset(from, to, &kept)) {
    Derived d;
    d.layout = layouts_[size_t(to)];
    d.kept = kept;
    return compose(src, d, to);
  }
  const int lv = level_of_[size_t(v)];
  const DType dt = type(v).dtype;
  const std::vector<int64_t> pitch = smem_pitches(type(v).shape, dtype_size_bytes(dt));
  const std::string st = storage_type(dt);
  // The buffer: a spent ring slot that held the tile's source in layout `from` (each
  // thread overwrites only the elements it read there, so no barrier comes first), or a
  // transient region whose only reader is this conversion (when a barrier already
  // separates its previous run from this one, a pipelined loop's, or none ran, writing
  // needs no other).
  std::string base = slot;
  bool barrier_first = false;
  if (slot.empty()) {
    bool reused = false;
    base = S(transient_smem(smem_bytes_for(type(v).shape, dtype_size_bytes(dt)), &reused));
    barrier_first = reused || !frame(lv).fenced;
  }
  const std::string buf = fresh("cvt");
  line(lv, "// %" + S(v) + ": " + layouts_[size_t(from)].key() + " -> " + layouts_[size_t(to)].key() +
               (slot.empty() ? "" : ", through this iteration's ring slot"));
  line(lv, st + "* " + buf + " = reinterpret_cast<" + st + "*>(kerf_smem + " + base + ");");
  if (barrier_first) line(lv, "__syncthreads();");
  write_smem(lv, src, from, dt, buf, pitch);
  line(lv, "__syncthreads();");
  return read_smem(lv, v, "reinterpret_cast<const " + st + "*>(kerf_smem + " + base + ")", to, dt, pitch);
}

// Reads a row-major padded tile from shared memory into registers of layout `to`.
Tile Codegen::read_smem(int lv, ValueId v, const std::string& buf, int to, DType dt,
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

}  // namespace kerf::jit::cuda::detail
