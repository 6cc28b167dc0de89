// Reductions over one axis: registers, then lanes (warp shuffles), then warps
// (shared memory).
#include "codegen_impl.h"

namespace kerf::jit::cuda::detail {

std::string Codegen::emit_reduce(const Operation& op) {
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
      case OpKind::ReduceSum:
        return "(" + a + " + " + b + ")";
      case OpKind::ReduceMax:
        return is_float(ct)
                   ? std::string(ct == DType::f64 ? "fmax(" : "fmaxf(") + a + ", " + b + ")"
                   : "(" + a + " > " + b + " ? " + a + " : " + b + ")";
      default:
        return is_float(ct)
                   ? std::string(ct == DType::f64 ? "fmin(" : "fminf(") + a + ", " + b + ")"
                   : "(" + a + " < " + b + " ? " + a + " : " + b + ")";
    }
  };
  if (op.kind == OpKind::ReduceSum) {
    ident = is_float(ct) ? float_literal(0.0, ct) : int_literal(0, ct);
  } else {
    const bool mx = op.kind == OpKind::ReduceMax;
    // NaN: fmax/fmin take the other operand of a NaN, so a NaN start changes nothing unless
    // every element is NaN, which then gives NaN (as on the CPU; -inf would have come out).
    if (is_float(ct))
      ident = ct == DType::f64 ? "__longlong_as_double(0x7ff8000000000000LL)" : "__int_as_float(0x7fc00000)";
    else if (ct == DType::i64)
      ident = mx ? "(-9223372036854775807LL - 1)" : "9223372036854775807LL";
    else
      ident = mx ? "(-2147483647 - 1)" : "2147483647";
  }
  const std::string acc = "red" + S(v);
  line(lv, cts + " " + acc + "[" + S(n) + "];  // " + ir::op_name(op.kind) + " axis " + S(axis) +
               " of " + P.key());
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
                 combine(acc + "[j]",
                         "__shfl_xor_sync(0xffffffffu, " + acc + "[j], " + S(1 << i) + ")") +
                 ";");
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
    line(lv, "for (int j = 0; j < " + S(n) + "; ++j) " + buf + "[(warp * 32 + lane) * " + S(n) +
                 " + j] = " + acc + "[j];");
    line(lv, "__syncthreads();");
    for (uint32_t m = 1; m <= wmask; ++m) {
      if ((m & ~wmask) != 0) continue;
      line(lv, "#pragma unroll");
      line(lv, "for (int j = 0; j < " + S(n) + "; ++j) " + acc + "[j] = " +
                   combine(acc + "[j]",
                           buf + "[((warp ^ " + S(m) + ") * 32 + lane) * " + S(n) + " + j]") +
                   ";");
    }
    line(lv, "}");
  }
  std::string out = acc;
  if (ct != dt) {
    out = "v" + S(v) + "_" + S(sl);
    line(lv, storage_type(dt) + " " + out + "[" + S(n) + "];");
    line(lv, "#pragma unroll");
    line(lv, "for (int j = 0; j < " + S(n) + "; ++j) " + out +
                 "[j] = " + from_compute(dt, acc + "[j]") + ";");
  }
  reduced_[v] = out;
  return out;
}

}  // namespace kerf::jit::cuda::detail
