// The JIT's entry point: specialization key -> compiled kernel -> launch.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "kerf/error.h"
#include "kerf/jit/abi.h"
#include "kerf/jit/cpu_backend.h"
#include "kerf/jit/cuda_codegen.h"
#include "kerf/jit/launch.h"
#include "kerf/jit/nvrtc.h"
#include "kerf/runtime/cuda.h"

namespace kerf {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A loaded specialization, ready to launch.
struct Compiled {
  std::vector<ir::Param> params;
  size_t num_slots = 0;
  // CPU
  std::unique_ptr<jit::cpu::CpuKernel> cpu;
  // CUDA
  cuda::Module module;
  void* function = nullptr;
  int threads = 0;
  int smem_bytes = 0;
  std::string backend;
};

// The in-process key: everything that selects generated code, as 64-bit words.
struct Key {
  std::vector<uint64_t> words;
  bool operator==(const Key& o) const { return words == o.words; }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    for (uint64_t w : k.words) {
      h ^= w;
      h *= 1099511628211ull;
      h ^= h >> 29;
    }
    return size_t(h);
  }
};

uint64_t string_word(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) {
    h ^= uint8_t(c);
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t spec_word(const dsl::ArgSpec& a) {
  return uint64_t(a.kind) | uint64_t(a.dtype) << 4 | uint64_t(a.rank) << 12 |
         uint64_t(a.facts.contiguous_last) << 20 | uint64_t(a.facts.aligned16) << 21 |
         uint64_t(a.facts.dims_div16 & 0xFF) << 24 | uint64_t(a.facts.strides_div16 & 0xFF) << 32;
}

class KernelCache {
 public:
  static KernelCache& instance() {
    static KernelCache c;
    return c;
  }

  // Returns the compiled kernel for `key`, building it once (other callers wait).
  std::shared_ptr<Compiled> get(const Key& key, const std::function<std::shared_ptr<Compiled>()>& build,
                                bool* built) {
    std::shared_future<std::shared_ptr<Compiled>> fut;
    std::promise<std::shared_ptr<Compiled>> promise;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(key);
      if (it != map_.end()) {
        fut = it->second;
      } else {
        fut = promise.get_future().share();
        map_.emplace(key, fut);
        *built = true;
      }
    }
    if (*built) {
      try {
        promise.set_value(build());
      } catch (...) {
        // A failed build is not cached: the next call tries again.
        {
          std::lock_guard<std::mutex> lock(mu_);
          map_.erase(key);
        }
        promise.set_exception(std::current_exception());
      }
    }
    return fut.get();
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    map_.clear();
  }

 private:
  std::mutex mu_;
  std::unordered_map<Key, std::shared_future<std::shared_ptr<Compiled>>, KeyHash> map_;
};

bool pow2_16_multiple(int64_t v) { return v % 16 == 0; }

Device common_device(const std::vector<Arg>& args, const std::string& kernel_name) {
  bool seen = false;
  Device dev;
  for (size_t i = 0; i < args.size(); ++i) {
    const TensorView* t = std::get_if<TensorView>(&args[i]);
    if (!t) continue;
    if (!seen) {
      dev = t->device;
      seen = true;
    } else if (t->device != dev) {
      throw InvalidArgument("kernel '" + kernel_name + "': argument " + std::to_string(i) + " is on " +
                            t->device.str() + " but an earlier tensor is on " + dev.str() +
                            "; all tensors of one launch must share a device");
    }
  }
  return dev;
}

void check_tensor(const TensorView& t, size_t index, const std::string& kernel_name) {
  const std::string where = "kernel '" + kernel_name + "': argument " + std::to_string(index);
  if (t.rank < 1 || t.rank > kMaxRank)
    throw InvalidArgument(where + " has rank " + std::to_string(t.rank) + " (supported: 1.." +
                          std::to_string(kMaxRank) + ")");
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[size_t(d)] < 0) throw InvalidArgument(where + " has a negative size");
    if (t.shape[size_t(d)] > INT32_MAX)
      throw InvalidArgument(where + " has size " + std::to_string(t.shape[size_t(d)]) + " along dimension " +
                            std::to_string(d) + "; kerf kernels index dimensions with 32-bit integers");
  }
  if (t.data == nullptr && t.numel() > 0) throw InvalidArgument(where + " has a null data pointer");
}

std::string dump_dir() {
  const char* d = std::getenv("KERF_DUMP_DIR");
  return d && *d ? d : "";
}

void dump(const std::string& name, const std::string& text) {
  const std::string dir = dump_dir();
  if (dir.empty()) return;
  std::ofstream(dir + "/" + name) << text;
}

std::shared_ptr<Compiled> build_cpu(const ir::Function& fn) {
  auto c = std::make_shared<Compiled>();
  c->params = fn.params;
  c->num_slots = jit::slot_count(fn.params);
  c->cpu = jit::cpu::compile(fn);
  c->backend = "cpu";
  return c;
}

std::string device_arch(int device) {
  static std::mutex mu;
  static std::unordered_map<int, std::string> archs;
  std::lock_guard<std::mutex> lock(mu);
  auto it = archs.find(device);
  if (it != archs.end()) return it->second;
  const cuda::DeviceInfo info = cuda::device_info(device);
  const std::string arch = cuda::arch_name(info.cc_major, info.cc_minor);
  archs[device] = arch;
  return arch;
}

std::shared_ptr<Compiled> build_cuda(const ir::Function& fn, int device) {
  const std::string arch = device_arch(device);
  const jit::cuda::KernelCode code = jit::cuda::generate(fn, arch);
  dump(code.entry + ".ir", ir::print(fn));
  dump(code.entry + ".cu", code.source);
  const nvrtc::Output out = nvrtc::compile(code.source, code.entry + ".cu", arch);
  auto c = std::make_shared<Compiled>();
  c->params = fn.params;
  c->num_slots = jit::slot_count(fn.params);
  c->module = cuda::Module(out.image.data(), device);
  c->function = c->module.function(code.entry);
  c->threads = code.threads;
  c->smem_bytes = code.smem_bytes;
  if (code.smem_bytes > 48 * 1024) cuda::set_max_dynamic_smem(c->function, code.smem_bytes);
  c->backend = arch;
  return c;
}

}  // namespace

std::vector<dsl::ArgSpec> arg_specs(const std::vector<Arg>& args) {
  std::vector<dsl::ArgSpec> specs;
  specs.reserve(args.size());
  for (const Arg& a : args) {
    const TensorView* t = std::get_if<TensorView>(&a);
    if (!t) {
      specs.push_back(dsl::ArgSpec::scalar());
      continue;
    }
    ir::TensorFacts f;
    const int eb = dtype_size_bytes(t->dtype);
    f.contiguous_last = t->rank > 0 && t->strides[size_t(t->rank - 1)] == 1;
    f.aligned16 = (reinterpret_cast<uintptr_t>(t->data) % 16) == 0;
    for (int d = 0; d < t->rank; ++d) {
      if (pow2_16_multiple(t->shape[size_t(d)])) f.dims_div16 |= 1u << d;
      if (pow2_16_multiple(t->strides[size_t(d)]) && (t->strides[size_t(d)] * eb) % 16 == 0)
        f.strides_div16 |= 1u << d;
    }
    specs.push_back(dsl::ArgSpec::tensor(t->dtype, t->rank, f));
  }
  return specs;
}

LaunchInfo launch(const dsl::Kernel& kernel, const std::vector<Arg>& args, Grid grid,
                  const dsl::MetaMap& meta, void* stream) {
  for (size_t i = 0; i < args.size(); ++i)
    if (const TensorView* t = std::get_if<TensorView>(&args[i])) check_tensor(*t, i, kernel.name());
  const Device dev = common_device(args, kernel.name());
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return LaunchInfo{false, 0.0, ""};  // nothing to run
  const std::vector<dsl::ArgSpec> specs = arg_specs(args);

  Key key;
  key.words.reserve(4 + 2 * meta.size() + specs.size());
  key.words.push_back(kernel.id());
  key.words.push_back(uint64_t(dev.kind) << 32 | uint64_t(uint32_t(dev.index)));
  for (const auto& [name, value] : meta) {
    key.words.push_back(string_word(name));
    key.words.push_back(uint64_t(value));
  }
  for (const dsl::ArgSpec& s : specs) key.words.push_back(spec_word(s));

  LaunchInfo info;
  const auto t0 = Clock::now();
  std::shared_ptr<Compiled> c = KernelCache::instance().get(
      key,
      [&]() -> std::shared_ptr<Compiled> {
        const ir::Function fn = kernel.trace(specs, meta);
        if (dev.is_cuda()) {
          cuda::require_device(dev.index);
          return build_cuda(fn, dev.index);
        }
        return build_cpu(fn);
      },
      &info.compiled);
  if (info.compiled) info.compile_ms = ms_since(t0);
  info.backend = c->backend;

  constexpr size_t kInlineSlots = 64;
  jit::Slot inline_slots[kInlineSlots];
  std::vector<jit::Slot> heap_slots;
  jit::Slot* slots = inline_slots;
  if (c->num_slots > kInlineSlots) {
    heap_slots.resize(c->num_slots);
    slots = heap_slots.data();
  }
  jit::pack_args(c->params, args, slots);
  if (dev.is_cuda()) {
    if (grid.y > 65535 || grid.z > 65535)
      throw InvalidArgument("kernel '" + kernel.name() + "': grid y and z must be at most 65535, got (" +
                            std::to_string(grid.x) + ", " + std::to_string(grid.y) + ", " +
                            std::to_string(grid.z) + ")");
    void* params[] = {slots};
    cuda::launch(c->function, grid, c->threads, c->smem_bytes, stream, params);
  } else {
    jit::cpu::run_grid(*c->cpu, grid, slots);
  }
  return info;
}

std::string cuda_source(const dsl::Kernel& kernel, const std::vector<Arg>& args, const dsl::MetaMap& meta,
                        const std::string& arch) {
  const ir::Function fn = kernel.trace(arg_specs(args), meta);
  return jit::cuda::generate(fn, arch).source;
}

void clear_kernel_cache() { KernelCache::instance().clear(); }

}  // namespace kerf
