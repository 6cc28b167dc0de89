// dot: operands staged in shared memory; mma.sync with ldmatrix fragments for
// bf16/f16 tiles of suitable shape (and f32 tiles taken as TF32), fp32 FMA otherwise.
#include "codegen_impl.h"

namespace kerf::jit::cuda::detail {

bool Codegen::invariant_choice(ValueId v, int lv) const {
  const Operation* d = def_op_[size_t(v)];
  if (!d || d->kind != OpKind::Select || level_of_[size_t(v)] != lv) return false;
  const Operation* c = def_op_[size_t(d->operands[0])];
  if (!c || c->kind != OpKind::Splat) return false;
  for (const ValueId arm : {d->operands[1], d->operands[2]})
    if (type(arm) != type(v) || (level_of_[size_t(arm)] >= lv && !invariant_choice(arm, lv))) return false;
  return true;
}

Staged Codegen::stage(ValueId v) {
  auto it = staged_.find(v);
  if (it != staged_.end()) return it->second;
  const auto cols = staged_cols_.find(v);
  if (auto a = async_.find(v); a != async_.end()) {
    if (cols != staged_cols_.end()) throw InternalError("CUDA codegen: a pipelined B operand in runs order");
    return Staged{async_slot_offset(a->second), a->second.pitch[0], false, a->second.sw_rows, a->second.sw32};
  }
  // cond ? x : y for a condition the same in every thread (a splat scalar) and tiles
  // defined before the loop that holds the choice (or such choices among them): each
  // staged once, where it is defined, and the dot reads the one chosen (not a copy of
  // it staged every iteration).
  if (cols == staged_cols_.end() && invariant_choice(v, level_of_[size_t(v)])) {
    const Operation* d = def_op_[size_t(v)];
    const Staged sx = stage(d->operands[1]), sy = stage(d->operands[2]);
    if (sx.pitch == sy.pitch && sx.sw_rows == sy.sw_rows && sx.sw32 == sy.sw32 && sx.transposed == sy.transposed) {
      Staged s = sx;
      s.offset = "(" + scalar(def_op_[size_t(d->operands[0])]->operands[0]) + " ? (" + sx.offset + ") : (" +
                 sy.offset + "))";
      staged_[v] = s;
      return s;
    }
  }
  // trans(x): x's tile in shared memory, read transposed (no second copy).
  bool transposed = false;
  if (const ValueId src = dot_source(v, &transposed); transposed) {
    Staged s = stage(src);
    s.transposed = !s.transposed;
    staged_[v] = s;
    return s;
  }
  const int lv = level_of_[size_t(v)];
  const int64_t sw_rows = sw128_candidate(v) ? type(v).shape[0] : 0;
  const bool sw32 = !sw_rows && sw32_candidate(v);
  const DType dt = type(v).dtype;
  const std::vector<int64_t> pitch =
      sw32 ? std::vector<int64_t>{16, 1} : smem_pitches(type(v).shape, dtype_size_bytes(dt), smem_pad(v));
  std::string where;
  if (sw_rows || sw32) {
    int unused = 0;
    where = alloc_smem_1024(lv, type(v).shape[0] * type(v).shape[1] * dtype_size_bytes(dt), &unused);
  } else {
    where = S(alloc_smem_tile(v).offset);
  }
  int l = pref_[size_t(v)];
  if (l < 0) l = blocked(type(v).shape);
  const Tile t = get(v, l);
  const std::string st = storage_type(dt);
  const std::string buf = fresh("stage");
  line(lv, "// stage %" + S(v) + " in shared memory for a dot");
  line(lv, "__syncthreads();");
  line(lv, "{");
  line(lv, st + "* " + buf + " = reinterpret_cast<" + st + "*>(kerf_smem + " + where + ");");
  // The B operand of a dot whose accumulator is in runs of columns: each column
  // where the mma instructions read the column that the runs layout puts there.
  const int lw = cols == staged_cols_.end() ? l : intern(map_dim_bits(layouts_[size_t(l)], 1, cols->second));
  write_smem(lv, t, lw, dt, buf, pitch, sw_rows, sw32);
  line(lv, "}");
  if (sw_rows || sw32) line(lv, "asm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\");");
  line(lv, "__syncthreads();");
  Staged s{where, pitch[0], false, sw_rows, sw32};
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
  // In a runs layout the instructions still write mma's register order: the
  // tile's storage is that order and `kept` maps the layout's registers to it.
  const auto runs = run_kept_.find(h);
  const Tile out = runs == run_kept_.end() ? Tile{name, false, {}, true} : Tile{name, false, runs->second, false};
  const Staged sa = stage(a), sb = stage(b);
  const std::string at = storage_type(ta.dtype);
  line(lv, "float " + name + "[" + S(n) + "];  // dot " + ir::to_string(ta) + " @ " +
               ir::to_string(tb));
  line(lv, "#pragma unroll");
  line(lv, "for (int r = 0; r < " + S(n) + "; ++r) " + elem(out, "r") + " = " + init + ";");
  line(lv, "{");
  line(lv, "const " + at + "* sa = reinterpret_cast<const " + at + "*>(kerf_smem + (" + sa.offset +
               "));");
  line(lv, "const " + at + "* sb = reinterpret_cast<const " + at + "*>(kerf_smem + (" + sb.offset +
               "));");
  if (mma_eligible(op)) {
    int wm, wn;
    mma_warp_split(Shape{M, N}, num_warps_, int(op.attrs.axis), &wm, &wn);
    const int64_t MT = M / (16 * wm), NT = N / (8 * wn);
    const bool wg = wgmma_dot(op);
    // TF32 (f32 tiles): instructions of k=8, so each of A's and B's fragments covers 8 k's
    // and f32 rows of 16 bytes hold 4 of them; fragments are rounded to TF32 once loaded.
    const bool tf32 = ta.dtype == DType::f32;
    const int64_t KS = tf32 ? 8 : 16;  // k per instruction
    if (tf32 && (wg || sa.sw_rows || sb.sw_rows || sb.sw32))
      throw InternalError("CUDA codegen: a TF32 dot on wgmma tiles");
    if (sb.sw32 && !wg) throw InternalError("CUDA codegen: a 32-byte-swizzled B operand of a dot not on wgmma");
    const std::string mma = tf32                       ? "kerf_dev::mma_tf32_1688"
                            : ta.dtype == DType::bf16 ? "kerf_dev::mma_bf16_16816"
                                                      : "kerf_dev::mma_f16_16816";
    // Element offset of (row, col) of a staged tile: row-major with its pitch, or swizzled.
    const auto at_rc = [](const Staged& st, const std::string& row, const std::string& col) {
      if (st.sw_rows) return "kerf_dev::sw128(" + row + ", " + col + ", " + S(st.sw_rows) + ")";
      return "(" + row + ") * " + S(st.pitch) + " + " + col;
    };
    line(lv, "const int wm = warp & " + S(wm - 1) + ", wn = (warp >> " + S(log2i(wm)) + ") & " +
                 S(wn - 1) + ";  (void)wm; (void)wn;  // a warpgroup dot may use neither");
    // A's fragments: loaded once where A is defined when the dot sits in a
    // loop that A does not depend on (e.g. B's rows in DoRA).
    // wgmma with A from shared memory too (meta wgmma_ss, A's tile swizzled): no
    // fragments; each warpgroup's instructions read A through descriptors.
    const bool ss = wg && wgmma_ss_ && sa.sw_rows;
    const int la = level_of_[size_t(a)];
    const auto frag_key = std::make_pair(a, int64_t(wm) << 32 | int64_t(wn));
    std::string af = afrags_.count(frag_key) ? afrags_[frag_key] : "";
    if (af.empty() && !ss) {
      af = fresh("afrag");
      const std::string base =
          la < lv ? "reinterpret_cast<const " + at + "*>(kerf_smem + (" + sa.offset + "))" : "sa";
      const std::string wmx = "(warp & " + S(wm - 1) + ")";
      line(la,
           "unsigned " + af + "[" + S(K / KS) + "][" + S(MT) + "][4];  // A fragments of %" + S(a));
      line(la, "#pragma unroll");
      line(la, "for (int ki = 0; ki < " + S(K / KS) + "; ++ki)");
      line(la, "  #pragma unroll");
      line(la, "  for (int mi = 0; mi < " + S(MT) + "; ++mi) {");
      const std::string m0 = wmx + " * 16 + mi * " + S(16 * wm);
      if (!sa.transposed)  // lanes 16-31 address the step's second half of k's (8 halves, or 4 f32)
        line(la, "    kerf_dev::ldmatrix_x4(" + af + "[ki][mi], " + base + " + " +
                     at_rc(sa, m0 + " + (lane & 15)", "ki * " + S(KS) + " + (lane >> 4) * " + S(KS / 2)) + ");");
      else if (tf32)  // shared memory holds A^T [K, M]: each register read alone
        line(la, "    kerf_dev::afrag_tf32_trans(" + af + "[ki][mi], " + base + ", " + S(sa.pitch) + ", ki * 8, " +
                     m0 + ", lane);");
      else  // shared memory holds A^T [K, M]: rows k, 8 m's per row, transposed by ldmatrix
        line(la, "    kerf_dev::ldmatrix_x4_trans(" + af + "[ki][mi], " + base + " + " +
                     at_rc(sa, "ki * 16 + (lane & 7) + ((lane >> 4) & 1) * 8",
                           wmx + " * 16 + mi * " + S(16 * wm) + " + ((lane >> 3) & 1) * 8") +
                     ");");
      if (tf32) line(la, "    kerf_dev::round_tf32(" + af + "[ki][mi], 4);");
      line(la, "  }");
      if (la < lv) afrags_[frag_key] = af;
    }
    if (wg) {
      // wgmma: each warpgroup multiplies its 64-row m tiles by its N / wn
      // columns of B, read from shared memory through a descriptor.
      const int64_t nw = N / wn;
      const int64_t chunk = sb.transposed ? nw : std::min<int64_t>(nw, 64);
      wgmma_sizes_.insert(int(chunk));
      const std::string fn = std::string("kerf_dev::wgmma_") + (ss ? "ss_" : "") +
                             (ta.dtype == DType::bf16 ? "bf16" : "f16") + "_n" + S(chunk) + "<" +
                             (ss ? (sa.transposed ? "1, " : "0, ") : "") + (sb.transposed ? "0" : "1") + ">";
      const int64_t rows = sb.sw_rows;
      // A 32-byte-swizzled B [K, 16] (MN-major): rows of 32 bytes, one instruction of 16 columns.
      const std::string b_desc = sb.sw32 ? "kerf_dev::wgmma_desc32" : "kerf_dev::wgmma_desc";
      line(lv, "const unsigned sb_addr = (unsigned)__cvta_generic_to_shared(sb);");
      line(lv, "const int n0 = wn * " + S(nw) + ";");
      std::string a_arg = af + "[ki][mi]";
      if (ss) {
        // The warpgroup's m tile mi: rows mi * 16 * wm + 64 * (its index among the wm / 4
        // warpgroups along M), as the warps' fragments of the register form would be.
        line(lv, "const unsigned sa_addr = (unsigned)__cvta_generic_to_shared(sa);");
        line(lv, "const int wg_m = ((warp & " + S(wm - 1) + ") >> 2) * 64;");
        const std::string m0 = "(mi * " + S(16 * wm) + " + wg_m)";
        const std::string a_off =
            sa.transposed  // A^T [K, M] in shared memory: MN-major, 64 m's a block
                ? "(" + m0 + " >> 6) * " + S(sa.sw_rows * 128) + " + ki * 16 * 128"
                : "((ki * 16) >> 6) * " + S(sa.sw_rows * 128) + " + " + m0 + " * 128 + ((ki * 16) & 63) * 2";
        a_arg = "kerf_dev::wgmma_desc(sa_addr + " + a_off + ")";
      }
      line(lv, "kerf_dev::wgmma_fence();");
      line(lv, "#pragma unroll");
      line(lv, "for (int ki = 0; ki < " + S(K / 16) + "; ++ki) {");
      line(lv, "  #pragma unroll");
      line(lv, "  for (int mi = 0; mi < " + S(MT) + "; ++mi) {");
      line(lv, "    #pragma unroll");
      line(lv, "    for (int c = 0; c < " + S(nw / chunk) + "; ++c) {");
      if (sb.sw32)
        line(lv, "      const unsigned off = ki * 16 * 32;");
      else if (sb.transposed)  // B^T [N, K] in shared memory: K-major
        line(lv, "      const unsigned off = ((ki * 16) >> 6) * " + S(rows * 128) +
                     " + (n0 + c * " + S(chunk) + ") * 128 + ((ki * 16) & 63) * 2;");
      else  // B [K, N]: MN-major
        line(lv, "      const unsigned off = ((n0 + c * " + S(chunk) + ") >> 6) * " + S(rows * 128) +
                     " + ki * 16 * 128 + ((n0 + c * " + S(chunk) + ") & 63) * 2;");
      line(lv, "      " + fn + "(&" + name + "[((c * " + S(chunk / 8) + ") << 2) | (mi << " +
                   S(2 + log2i(int(NT))) + ")], " + a_arg + ", " + b_desc + "(sb_addr + off));");
      line(lv, "    }");
      line(lv, "  }");
      line(lv, "}");
      line(lv, "kerf_dev::wgmma_commit();");
      line(lv, "kerf_dev::wgmma_wait();");
    } else {
      // B fragments for two n-tiles per ldmatrix.x4 (lanes 16-31 address the second).
      const int64_t per = NT >= 2 ? 2 : 1;
      // The ldmatrix of B's fragments for k step `ki` and n tile `ni` into `dst` from `base`.
      // `wnx` is the warp's n index (the name `wn` exists only inside the dot's block).
      const auto load_b = [&](int level, const std::string& dst, const std::string& base, const std::string& wnx) {
        if (sb.transposed) {
          // Shared memory holds B^T [N, K]: each n's k's are contiguous, the layout
          // mma wants for B, so ldmatrix needs no transpose (lanes 8-15 and 24-31
          // address the step's second half of k's: 8 halves, or 4 f32 for TF32).
          const std::string n_of = per == 2 ? "(ni + (lane >> 4))" : "ni";
          line(level, std::string("    kerf_dev::") + (per == 2 ? "ldmatrix_x4" : "ldmatrix_x2") + "(" + dst +
                          ", " + base + " + " +
                          at_rc(sb, wnx + " * 8 + " + n_of + " * " + S(8 * wn) + " + (lane & 7)",
                                "ki * " + S(KS) + " + ((lane >> 3) & 1) * " + S(KS / 2)) +
                          ");");
          if (tf32) line(level, "    kerf_dev::round_tf32(" + dst + ", " + S(2 * per) + ");");
        } else if (tf32) {
          // B [K, N]: each register read alone, two per n tile.
          for (int64_t h = 0; h < per; ++h)
            line(level, "    kerf_dev::bfrag_tf32(" + dst + " + " + S(2 * h) + ", " + base + ", " + S(sb.pitch) +
                            ", ki * 8, " + wnx + " * 8 + (ni + " + S(h) + ") * " + S(8 * wn) + ", lane);");
          line(level, "    kerf_dev::round_tf32(" + dst + ", " + S(2 * per) + ");");
        } else if (per == 2) {
          line(level, "    kerf_dev::ldmatrix_x4_trans(" + dst + ", " + base + " + " +
                          at_rc(sb, "ki * 16 + (lane & 15)", wnx + " * 8 + (ni + (lane >> 4)) * " + S(8 * wn)) +
                          ");");
        } else {
          line(level, "    kerf_dev::ldmatrix_x2_trans(" + dst + ", " + base + " + " +
                          at_rc(sb, "ki * 16 + (lane & 15)", wnx + " * 8 + ni * " + S(8 * wn)) + ");");
        }
      };
      // B's fragments, like A's, loaded once where B is defined when the dot sits in a
      // loop that B does not depend on (e.g. the embedding backward's activations),
      // where they take few registers: the loop then reads no B from shared memory.
      const int lb = level_of_[size_t(b)];
      const int64_t b_regs = (K / KS) * NT * 2;
      const auto bkey = std::make_pair(b, int64_t(wm) << 32 | int64_t(wn));
      std::string bfr = bfrags_.count(bkey) ? bfrags_[bkey] : "";
      if (bfr.empty() && lb < lv && b_regs <= kMaxHoistedBRegs) {
        bfr = fresh("bfrag");
        line(lb, "unsigned " + bfr + "[" + S(K / KS) + "][" + S(NT / per) + "][" + S(2 * per) +
                     "];  // B fragments of %" + S(b));
        line(lb, "#pragma unroll");
        line(lb, "for (int ki = 0; ki < " + S(K / KS) + "; ++ki)");
        line(lb, "  #pragma unroll");
        line(lb, "  for (int ni = 0; ni < " + S(NT) + "; ni += " + S(per) + ") {");
        load_b(lb, bfr + "[ki][ni / " + S(per) + "]",
               "reinterpret_cast<const " + at + "*>(kerf_smem + (" + sb.offset + "))",
               "((warp >> " + S(log2i(wm)) + ") & " + S(wn - 1) + ")");
        line(lb, "  }");
        bfrags_[bkey] = bfr;
      }
      if (!bfr.empty()) line(lv, "(void)sb;  // B's fragments are in registers");
      line(lv, "#pragma unroll");
      line(lv, "for (int ki = 0; ki < " + S(K / KS) + "; ++ki) {");
      line(lv, "  #pragma unroll");
      line(lv, "  for (int ni = 0; ni < " + S(NT) + "; ni += " + S(per) + ") {");
      if (bfr.empty()) {
        line(lv, "    unsigned bf[" + S(2 * per) + "];");
        load_b(lv, "bf", "sb", "wn");
      } else {
        line(lv, "    const unsigned* bf = " + bfr + "[ki][ni / " + S(per) + "];");
      }
      line(lv, "    #pragma unroll");
      line(lv, "    for (int h = 0; h < " + S(per) + "; ++h)");
      line(lv, "      #pragma unroll");
      line(lv, "      for (int mi = 0; mi < " + S(MT) + "; ++mi) " + mma + "(&" + name +
                   "[((ni + h) << 2) | (mi << " + S(2 + log2i(NT)) + ")], " + af +
                   "[ki][mi], bf + 2 * h);");
      line(lv, "  }");
      line(lv, "}");
    }
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
  return out;
}

std::string Codegen::to_compute_float(DType t, const std::string& x) {
  if (t == DType::f32) return x;
  if (t == DType::f64) return "(float)" + x;
  return to_compute(t, x);
}

}  // namespace kerf::jit::cuda::detail
