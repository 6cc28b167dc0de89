// dot: operands staged in shared memory; mma.sync with ldmatrix fragments for
// bf16/f16 tiles of suitable shape, fp32 FMA otherwise.
#include "codegen_impl.h"

namespace kerf::jit::cuda::detail {

Staged Codegen::stage(ValueId v) {
  auto it = staged_.find(v);
  if (it != staged_.end()) return it->second;
  if (auto a = async_.find(v); a != async_.end())
    return Staged{async_slot_offset(a->second), a->second.pitch[0]};
  // trans(x): x's tile in shared memory, read transposed (no second copy).
  if (const Operation* op = def_op_[size_t(v)];
      op && op->kind == OpKind::Transpose && type(op->operands[0]).dtype == type(v).dtype) {
    Staged s = stage(op->operands[0]);
    s.transposed = !s.transposed;
    staged_[v] = s;
    return s;
  }
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

Tile Codegen::emit_dot(const Operation& op, int h) {
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
  line(lv, "float " + name + "[" + S(n) + "];  // dot " + ir::to_string(ta) + " @ " +
               ir::to_string(tb));
  line(lv, "#pragma unroll");
  line(lv, "for (int r = 0; r < " + S(n) + "; ++r) " + name + "[r] = " + init + ";");
  line(lv, "{");
  line(lv, "const " + at + "* sa = reinterpret_cast<const " + at + "*>(kerf_smem + (" + sa.offset +
               "));");
  line(lv, "const " + at + "* sb = reinterpret_cast<const " + at + "*>(kerf_smem + (" + sb.offset +
               "));");
  if (mma_eligible(op)) {
    int wm, wn;
    mma_warp_split(Shape{M, N}, num_warps_, int(op.attrs.axis), &wm, &wn);
    const int64_t MT = M / (16 * wm), NT = N / (8 * wn);
    const std::string mma =
        ta.dtype == DType::bf16 ? "kerf_dev::mma_bf16_16816" : "kerf_dev::mma_f16_16816";
    line(lv, "const int wm = warp & " + S(wm - 1) + ", wn = (warp >> " + S(log2i(wm)) + ") & " +
                 S(wn - 1) + ";");
    // A's fragments: loaded once where A is defined when the dot sits in a
    // loop that A does not depend on (e.g. B's rows in DoRA).
    const int la = level_of_[size_t(a)];
    const auto frag_key = std::make_pair(a, int64_t(wm) << 32 | int64_t(wn));
    std::string af = afrags_.count(frag_key) ? afrags_[frag_key] : "";
    if (af.empty()) {
      af = fresh("afrag");
      const std::string base =
          la < lv ? "reinterpret_cast<const " + at + "*>(kerf_smem + (" + sa.offset + "))" : "sa";
      const std::string wmx = "(warp & " + S(wm - 1) + ")";
      line(la,
           "unsigned " + af + "[" + S(K / 16) + "][" + S(MT) + "][4];  // A fragments of %" + S(a));
      line(la, "#pragma unroll");
      line(la, "for (int ki = 0; ki < " + S(K / 16) + "; ++ki)");
      line(la, "  #pragma unroll");
      line(la, "  for (int mi = 0; mi < " + S(MT) + "; ++mi)");
      if (!sa.transposed)
        line(la, "    kerf_dev::ldmatrix_x4(" + af + "[ki][mi], " + base + " + (" + wmx +
                     " * 16 + mi * " + S(16 * wm) + " + (lane & 15)) * " + S(sa.pitch) +
                     " + ki * 16 + (lane >> 4) * 8);");
      else  // shared memory holds A^T [K, M]: rows k, 8 m's per row, transposed by ldmatrix
        line(la, "    kerf_dev::ldmatrix_x4_trans(" + af + "[ki][mi], " + base +
                     " + (ki * 16 + (lane & 7) + ((lane >> 4) & 1) * 8) * " + S(sa.pitch) + " + " +
                     wmx + " * 16 + mi * " + S(16 * wm) + " + ((lane >> 3) & 1) * 8);");
      if (la < lv) afrags_[frag_key] = af;
    }
    line(lv, "#pragma unroll");
    line(lv, "for (int ki = 0; ki < " + S(K / 16) + "; ++ki) {");
    line(lv, "  #pragma unroll");
    // B fragments for two n-tiles per ldmatrix.x4 (lanes 16-31 address the second).
    const int64_t per = NT >= 2 ? 2 : 1;
    line(lv, "  for (int ni = 0; ni < " + S(NT) + "; ni += " + S(per) + ") {");
    line(lv, "    unsigned bf[" + S(2 * per) + "];");
    if (sb.transposed) {
      // Shared memory holds B^T [N, K]: each n's k's are contiguous, the layout
      // mma wants for B, so ldmatrix needs no transpose.
      const std::string n_of = per == 2 ? "(ni + (lane >> 4))" : "ni";
      line(lv, std::string("    kerf_dev::") + (per == 2 ? "ldmatrix_x4" : "ldmatrix_x2") +
                   "(bf, sb + (wn * 8 + " + n_of + " * " + S(8 * wn) + " + (lane & 7)) * " +
                   S(sb.pitch) + " + ki * 16 + ((lane >> 3) & 1) * 8);");
    } else if (per == 2) {
      line(lv, "    kerf_dev::ldmatrix_x4_trans(bf, sb + (ki * 16 + (lane & 15)) * " + S(sb.pitch) +
                   " + wn * 8 + (ni + (lane >> 4)) * " + S(8 * wn) + ");");
    } else {
      line(lv, "    kerf_dev::ldmatrix_x2_trans(bf, sb + (ki * 16 + (lane & 15)) * " + S(sb.pitch) +
                   " + wn * 8 + ni * " + S(8 * wn) + ");");
    }
    line(lv, "    #pragma unroll");
    line(lv, "    for (int h = 0; h < " + S(per) + "; ++h)");
    line(lv, "      #pragma unroll");
    line(lv, "      for (int mi = 0; mi < " + S(MT) + "; ++mi) " + mma + "(&" + name +
                 "[((ni + h) << 2) | (mi << " + S(2 + log2i(NT)) + ")], " + af +
                 "[ki][mi], bf + 2 * h);");
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
    line(lv,
         "  for (int i = 0; i < " + S(nr) + "; ++i) ar[i] = " +
             to_compute_float(ta.dtype, sa.transposed
                                            ? "sa[k * " + S(sa.pitch) + " + " + coord(lr, 0, "i") + "]"
                                            : "sa[" + coord(lr, 0, "i") + " * " + S(sa.pitch) + " + k]") +
             ";");
    line(lv, "  #pragma unroll");
    line(lv,
         "  for (int i = 0; i < " + S(nc) + "; ++i) bc[i] = " +
             to_compute_float(tb.dtype, sb.transposed
                                            ? "sb[" + coord(lc, 1, "i") + " * " + S(sb.pitch) + " + k]"
                                            : "sb[k * " + S(sb.pitch) + " + " + coord(lc, 1, "i") + "]") +
             ";");
    line(lv, "  #pragma unroll");
    line(lv, "  for (int r = 0; r < " + S(n) + "; ++r) " + name + "[r] = fmaf(ar[" +
                 reg_map_expr(rows.kept, "r") + "], bc[" + reg_map_expr(cols.kept, "r") + "], " +
                 name + "[r]);");
    line(lv, "}");
  }
  line(lv, "}");
  return Tile{name, false, {}, true};
}

std::string Codegen::to_compute_float(DType t, const std::string& x) {
  if (t == DType::f32) return x;
  if (t == DType::f64) return "(float)" + x;
  return to_compute(t, x);
}

}  // namespace kerf::jit::cuda::detail
