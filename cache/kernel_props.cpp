// Facts about a kernel entry for people and manifests (see kernel_props.h).
#include "cache/kernel_props.h"

namespace kerf::cache {
namespace {

// "bf16[2] c a16 d16=11 s16=01 d8=11 s8=01": dtype, rank and the specialization facts.
std::string arg_text(const dsl::ArgSpec& a) {
  if (a.kind == ir::ParamKind::Scalar) return "scalar";
  std::string s = std::string(dtype_name(a.dtype)) + "[" + std::to_string(a.rank) + "]";
  if (a.facts.contiguous_last) s += " c";
  if (a.facts.aligned16) s += " a16";
  const auto bits = [&](uint32_t mask) {
    std::string b;
    for (int d = 0; d < a.rank; ++d) b += (mask >> d) & 1 ? '1' : '0';
    return b;
  };
  return s + " d16=" + bits(a.facts.dims_div16) + " s16=" + bits(a.facts.strides_div16) +
         " d8=" + bits(a.facts.dims_div8) + " s8=" + bits(a.facts.strides_div8);
}

}  // namespace

std::string meta_text(const std::vector<ir::MetaValue>& meta) {
  std::string s;
  for (const ir::MetaValue& m : meta)
    s += (s.empty() ? "" : ",") + m.name + "=" + std::to_string(m.value);
  return s;
}

std::map<std::string, std::string> kernel_props(const KernelKeyFields& f) {
  std::string args;
  for (const dsl::ArgSpec& a : f.args) args += (args.empty() ? "" : "; ") + arg_text(a);
  std::map<std::string, std::string> p = {
      {"kernel", f.kernel},
      {"ir_hash", f.ir_hash.hex()},
      {"code_hash", f.code_hash.hex()},
      {"meta", meta_text(f.meta)},
      {"args", args},
      {"layout", f.layout},
      {"backend", f.target.backend},
      {"arch", f.target.arch},
      {"compiler", f.target.compiler},
      {"kerf_version", f.kerf_version},
  };
  return p;
}

}  // namespace kerf::cache
