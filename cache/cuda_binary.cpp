// CUDA binaries through the cache tiers (see cuda_binary.h).
#include "kerf/cache/cuda_binary.h"

#include <chrono>
#include <cstdlib>
#include <fstream>

#include "cache/kernel_props.h"
#include "kerf/cache/log.h"
#include "kerf/cache/store.h"
#include "kerf/error.h"
#include "kerf/jit/cuda_codegen.h"

namespace kerf::cache {
namespace {

// KERF_DUMP_DIR: every generated kernel's IR and CUDA C++, for people debugging codegen.
void dump(const std::string& name, const std::string& text) {
  const char* dir = std::getenv("KERF_DUMP_DIR");
  if (!dir || !*dir) return;
  const std::string path = std::string(dir) + "/" + name;
  std::ofstream out(path);
  out << text;
  out.close();
  if (!out)
    log::once(log::Level::warn, std::string("dump-dir:") + dir,
              "KERF_DUMP_DIR=" + std::string(dir) + ": cannot write " + path +
                  " (the directory must exist and be writable); kernels are not dumped");
}

// The launch facts the generated code decides, from the props of a stored entry.
bool launch_facts_match(const Entry& e, const jit::cuda::KernelCode& code) {
  return e.kind == EntryKind::cuda_kernel && !e.blob.empty() && e.prop("entry") == code.entry &&
         e.prop("threads") == std::to_string(code.threads) &&
         e.prop("smem_bytes") == std::to_string(code.smem_bytes);
}

}  // namespace

Target cuda_target(const std::string& arch) {
  Target t;
  t.backend = "cuda";
  t.arch = arch;
  const auto [major, minor] = nvrtc::version();
  // Without NVRTC the version is unknown: only family lookups (any version) can answer.
  t.compiler =
      major ? "nvrtc " + std::to_string(major) + "." + std::to_string(minor) : "nvrtc unavailable";
  return t;
}

CudaBinary cuda_binary(const ir::Function& fn, const std::string& arch, std::string_view layout,
                       const CudaCompiler& compile) {
  const jit::cuda::KernelCode code = jit::cuda::generate(fn, arch);
  dump(code.entry + ".ir", ir::print(fn));
  dump(code.entry + ".cu", code.source);

  // Without NVRTC the key cannot name its version: any version's build of this kernel will do.
  const bool have_nvrtc = nvrtc::available();
  const KernelKeyFields fields =
      kernel_fields(fn, ir::hash_bytes(code.source.data(), code.source.size()), std::string(layout),
                    cuda_target(arch));
  CudaBinary bin;
  bin.key = kernel_key(fields);
  bin.entry = code.entry;
  bin.threads = code.threads;
  bin.smem_bytes = code.smem_bytes;

  if (std::optional<Found> found = lookup(bin.key, !have_nvrtc)) {
    if (launch_facts_match(found->entry, code)) {
      bin.image = std::move(found->entry.blob);
      bin.is_cubin = found->entry.prop("image") != "ptx";
      bin.source = found->tier == Tier::bundle ? KernelSource::bundle : KernelSource::disk;
      log::write(log::Level::debug, "kernel " + code.entry + " for " + arch + " from " +
                                        kernel_source_name(bin.source) + " (" + found->where + ")");
      return bin;
    }
    // The key matched but the launch facts do not: never launch it; rebuild.
    log::once(log::Level::warn, "cache-facts:" + bin.key.stem(),
              "cache entry " + bin.key.stem() + " for " + code.entry +
                  " does not agree with the generated code (entry, threads or shared memory); "
                  "rebuilding");
  }

  if (!have_nvrtc && !compile)
    throw NotAvailable("kernel '" + fn.name + "' for " + arch + " (" + meta_text(fn.meta) +
                       ") is in no mounted bundle and not in the kernel cache (" +
                       current_settings().dir +
                       "), and it cannot be compiled here: " + nvrtc::unavailable_reason());
  nvrtc::Output out = counted_compile([&] {
    return compile ? compile(code.source, code.entry + ".cu", arch)
                   : nvrtc::compile(code.source, code.entry + ".cu", arch);
  });

  Entry e;
  e.kind = EntryKind::cuda_kernel;
  e.props = kernel_props(fields);
  e.props["entry"] = code.entry;
  e.props["threads"] = std::to_string(code.threads);
  e.props["smem_bytes"] = std::to_string(code.smem_bytes);
  e.props["image"] = out.is_cubin ? "cubin" : "ptx";
  e.props["compile_ms"] = std::to_string(out.compile_ms);
  e.blob = out.image;
  remember(bin.key, e);
  bin.image = std::move(out.image);
  bin.is_cubin = out.is_cubin;
  bin.source = KernelSource::compiled;
  return bin;
}

}  // namespace kerf::cache
