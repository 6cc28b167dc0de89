// CUDA binaries through the cache tiers (see cuda_binary.h).
#include "kerf/cache/cuda_binary.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>

#include "cache/kernel_props.h"
#include "kerf/cache/log.h"
#include "kerf/cache/store.h"
#include "kerf/error.h"
#include "kerf/jit/autotune.h"
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

int spilled_bytes(const nvrtc::PtxasUsage& u) {
  return std::max(u.spill_store_bytes, 0) + std::max(u.spill_load_bytes, 0);
}

}  // namespace

int programs_per_multiprocessor(int threads, int smem_bytes, const std::string& arch) {
  if (threads <= 0) return 0;
  // Each program's shared memory comes with 1 KB the driver reserves; a multiprocessor
  // has 1 KB more than one program may opt in to.
  const int per_sm = autotune::typical_max_shared_memory(arch) + 1024;
  const int by_smem = per_sm / (std::max(smem_bytes, 0) + 1024);
  return std::min(by_smem, autotune::typical_max_threads_per_multiprocessor(arch) / threads);
}

CompiledKernel compile_kernel(const jit::cuda::KernelCode& code, const std::string& arch,
                              const CudaCompiler& compile) {
  const std::string name = code.entry + ".cu";
  const auto run = [&](const std::vector<std::string>& options) {
    return compile ? compile(code.source, name, arch, options) : nvrtc::compile(code.source, name, arch, options);
  };
  CompiledKernel k;
  k.out = run({nvrtc::kPtxasVerbose});
  k.first = k.usage = nvrtc::ptxas_usage(k.out.log);
  // ptxas chooses registers for an occupancy of its own when the launch bounds name
  // none; where it spills for an occupancy the shared memory never allows, the
  // registers it held back are free.
  const int programs = programs_per_multiprocessor(code.threads, code.smem_bytes, arch);
  const int regs = k.usage.registers;
  if (!k.out.is_cubin || spilled_bytes(k.usage) == 0 || programs < 1 || regs <= 0 || regs >= 255) return k;
  const int by_registers = 65536 / (code.threads * ((regs + 7) / 8 * 8));
  if (by_registers <= programs) return k;
  CompiledKernel again;
  again.out = run({nvrtc::kPtxasVerbose, "-DKERF_MIN_PROGRAMS=" + std::to_string(programs)});
  again.usage = nvrtc::ptxas_usage(again.out.log);
  if (spilled_bytes(again.usage) >= spilled_bytes(k.usage)) return k;
  again.min_programs = programs;
  again.first = k.usage;
  again.out.compile_ms += k.out.compile_ms;
  log::write(log::Level::debug, "kernel " + code.entry + " for " + arch + ": recompiled for " +
                                    std::to_string(programs) + " program(s) a multiprocessor (" +
                                    std::to_string(regs) + " registers spilled " +
                                    std::to_string(spilled_bytes(k.usage)) + " bytes; now " +
                                    std::to_string(again.usage.registers) + " registers, " +
                                    std::to_string(spilled_bytes(again.usage)) + " bytes)");
  return again;
}

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
  CompiledKernel compiled = counted_compile([&] { return compile_kernel(code, arch, compile); });
  nvrtc::Output& out = compiled.out;

  Entry e;
  e.kind = EntryKind::cuda_kernel;
  e.props = kernel_props(fields);
  e.props["entry"] = code.entry;
  e.props["threads"] = std::to_string(code.threads);
  e.props["smem_bytes"] = std::to_string(code.smem_bytes);
  e.props["image"] = out.is_cubin ? "cubin" : "ptx";
  e.props["compile_ms"] = std::to_string(out.compile_ms);
  if (compiled.usage.registers > 0) {
    e.props["registers"] = std::to_string(compiled.usage.registers);
    e.props["spill_bytes"] = std::to_string(spilled_bytes(compiled.usage));
  }
  if (compiled.min_programs > 0) e.props["min_programs"] = std::to_string(compiled.min_programs);
  e.blob = out.image;
  remember(bin.key, e);
  bin.image = std::move(out.image);
  bin.is_cubin = out.is_cubin;
  bin.source = KernelSource::compiled;
  return bin;
}

}  // namespace kerf::cache
