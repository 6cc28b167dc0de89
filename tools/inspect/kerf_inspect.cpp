// kerf-inspect: what kerf makes of a library kernel, without a GPU.
//
//   kerf-inspect list
//   kerf-inspect KERNEL [--dtype bf16] [--meta NAME=VALUE ...]   IR text and hash
//   kerf-inspect KERNEL ... --hash                              the hash alone
//   kerf-inspect KERNEL ... --cuda sm_90a                       the generated CUDA C++
//   kerf-inspect KERNEL ... --compile sm_90a                    NVRTC compile; prints sizes, time, and
//                                                               ptxas' registers, spills and advisories
//   kerf-inspect KERNEL ... --compile sm_90a --save k.cubin     and writes the image (for cuobjdump -sass)
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "kerf/cache/cuda_binary.h"
#include "kerf/cache/disk_cache.h"
#include "kerf/error.h"
#include "kerf/jit/cuda_codegen.h"
#include "kerf/jit/nvrtc.h"
#include "kerf/kernels/library.h"

using namespace kerf;

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fprintf(argc < 2 ? stderr : stdout,
                 "usage: kerf-inspect list | KERNEL [--dtype T] [--meta K=V]... [--hash] [--cuda ARCH] "
                 "[--compile ARCH [--save FILE]]\n"
                 "exit status: 0 done; 1 failed (a kernel that does not trace or compile); 2 bad arguments\n");
    return argc < 2 ? 2 : 0;
  }
  try {
    const std::string name = argv[1];
    if (name == "list") {
      if (argc > 2) throw InvalidArgument(std::string("list takes no arguments, got '") + argv[2] + "'");
      for (const auto& e : kernels::library()) std::printf("%s\n", e.name.c_str());
      return 0;
    }
    const kernels::LibraryEntry* entry = kernels::find_in_library(name);
    if (!entry) throw InvalidArgument("no library kernel named '" + name + "' (kerf-inspect list shows them)");
    DType dtype = DType::bf16;
    bool hash_only = false;
    std::string cuda_arch, compile_arch, save_path;
    dsl::MetaMap overrides;
    for (int i = 2; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw InvalidArgument(a + " needs a value");
        return argv[++i];
      };
      if (a == "--dtype") {
        const std::string v = value();
        const auto d = parse_dtype(v);
        if (!d) throw InvalidArgument("unknown dtype '" + v + "'");
        dtype = *d;
      } else if (a == "--meta") {
        const std::string v = value();
        const auto eq = v.find('=');
        const std::string name = eq == std::string::npos ? "" : v.substr(0, eq), num = v.substr(eq + 1);
        size_t used = 0;
        long long n = 0;
        try {
          if (!name.empty()) n = std::stoll(num, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (name.empty() || num.empty() || used != num.size())
          throw InvalidArgument("--meta wants NAME=INTEGER, got '" + v + "'");
        overrides[name] = n;
      } else if (a == "--hash") {
        hash_only = true;
      } else if (a == "--cuda") {
        cuda_arch = value();
      } else if (a == "--compile") {
        compile_arch = value();
      } else if (a == "--save") {
        save_path = value();
        if (save_path.empty()) throw InvalidArgument("--save needs a file name, got ''");
      } else {
        throw InvalidArgument("unknown option '" + a + "'");
      }
    }
    dsl::MetaMap meta = entry->example_meta(dtype);
    for (const auto& [k, v] : overrides) meta[k] = v;
    const ir::Function fn = entry->kernel().trace(entry->example_args(dtype), meta);
    if (!save_path.empty() && compile_arch.empty()) throw InvalidArgument("--save goes with --compile ARCH");
    for (const std::string* arch : {&cuda_arch, &compile_arch})
      if (!arch->empty() && !jit::cuda::is_gpu_arch(*arch))
        throw InvalidArgument("'" + *arch + "' is not a GPU architecture (like sm_90a or sm_80)");
    if (hash_only) {
      std::printf("%s\n", ir::hash(fn).hex().c_str());
      return 0;
    }
    if (!cuda_arch.empty()) {
      std::fputs(jit::cuda::generate(fn, cuda_arch).source.c_str(), stdout);
      return 0;
    }
    if (!compile_arch.empty()) {
      const jit::cuda::KernelCode code = jit::cuda::generate(fn, compile_arch);
      const cache::CompiledKernel compiled = cache::compile_kernel(code, compile_arch);  // as kerf's launches do
      const nvrtc::Output& out = compiled.out;
      std::printf("%s: %zu bytes of %s for %s in %.1f ms; %d threads, %d bytes of shared memory\n",
                  code.entry.c_str(), out.image.size(), out.is_cubin ? "cubin" : "PTX", compile_arch.c_str(),
                  out.compile_ms, code.threads, code.smem_bytes);
      // What ptxas said of the kernel's resources (a cubin; PTX is assembled later, by the driver).
      const nvrtc::PtxasUsage& usage = compiled.usage;
      if (compiled.min_programs > 0)
        std::printf("ptxas: %d registers a thread spilled %d bytes; compiled again for %d program(s) a "
                    "multiprocessor (KERF_MIN_PROGRAMS, all its shared memory allows)\n",
                    compiled.first.registers, std::max(compiled.first.spill_store_bytes, 0),
                    compiled.min_programs);
      if (usage.registers >= 0)
        std::printf("ptxas: %d registers a thread, %d bytes spilled (stores) / %d (loads), %d bytes of stack\n",
                    usage.registers, std::max(usage.spill_store_bytes, 0), std::max(usage.spill_load_bytes, 0),
                    std::max(usage.stack_frame_bytes, 0));
      for (const std::string& a : usage.advisories) std::printf("ptxas: %s\n", a.c_str());
      if (!save_path.empty()) {
        cache::write_file_atomically(save_path, out.image);
        std::printf("written to %s\n", save_path.c_str());
      }
      return 0;
    }
    std::fputs(ir::print(fn).c_str(), stdout);
    std::printf("// hash %s\n", ir::hash(fn).hex().c_str());
    return 0;
  } catch (const kerf::InvalidArgument& e) {  // the arguments (options, meta values) asked for something it cannot do
    std::fprintf(stderr, "kerf-inspect: %s\n", e.what());
    return 2;
  } catch (const kerf::Error& e) {
    std::fprintf(stderr, "kerf-inspect: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kerf-inspect: %s\n", e.what());
    return 1;
  }
}
