// CPU back-end kernels through the cache tiers (see cpu_kernel.h).
#include "kerf/cache/cpu_kernel.h"

#include "cache/kernel_props.h"
#include "kerf/cache/log.h"
#include "kerf/cache/store.h"
#include "kerf/error.h"

#if defined(KERF_HAVE_LLVM)
#include "jit/cpu/object_code.h"
#endif

namespace kerf::cache {

Target cpu_target() {
  Target t;
  t.backend = "cpu";
  t.arch = jit::cpu::host_cpu();
  t.compiler = "llvm " + jit::cpu::llvm_version();
  t.features = jit::cpu::host_features();
  return t;
}

#if defined(KERF_HAVE_LLVM)

CpuLoaded cpu_kernel(const ir::Function& fn, std::string_view layout) {
  // The LLVM IR kerf generates stands for the code: a change to the CPU code
  // generator changes the key even when the kernel's IR does not.
  static const Target target = cpu_target();
  const std::string llvm_ir = jit::cpu::emit_llvm_ir(fn);
  const KernelKeyFields fields = kernel_fields(fn, ir::hash_bytes(llvm_ir.data(), llvm_ir.size()),
                                               std::string(layout), target);
  CpuLoaded out;
  out.key = kernel_key(fields);

  if (std::optional<Found> found = lookup(out.key)) {
    jit::cpu::ObjectCode object;
    object.bytes = std::move(found->entry.blob);
    object.entry = found->entry.prop("entry");
    try {
      object.stack_bytes = std::stoll(found->entry.prop("stack_bytes"));
      out.kernel = jit::cpu::load_object(object);
      out.source = found->tier == Tier::bundle ? KernelSource::bundle : KernelSource::disk;
      return out;
    } catch (const std::exception& e) {
      // Checksums held but LLVM cannot link it (another LLVM build?): compile instead.
      log::once(
          log::Level::warn, "cpu-object:" + out.key.stem(),
          "cannot load cached CPU object for '" + fn.name + "' (" + e.what() + "); recompiling");
    }
  }

  const jit::cpu::ObjectCode object = counted_compile([&] { return jit::cpu::emit_object(fn); });
  Entry e;
  e.kind = EntryKind::cpu_kernel;
  e.props = kernel_props(fields);
  e.props["entry"] = object.entry;
  e.props["stack_bytes"] = std::to_string(object.stack_bytes);
  e.props["compile_ms"] = std::to_string(object.compile_ms);
  e.blob = object.bytes;
  remember(out.key, e);
  out.kernel = jit::cpu::load_object(object);
  out.kernel->compile_ms = object.compile_ms;
  out.source = KernelSource::compiled;
  return out;
}

#else

CpuLoaded cpu_kernel(const ir::Function& fn, std::string_view) {
  CpuLoaded out;
  out.kernel = jit::cpu::compile(fn);  // throws NotAvailable: no back end in this build
  return out;
}

#endif

}  // namespace kerf::cache
