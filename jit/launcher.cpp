// The JIT's entry point: specialization -> kernel in memory (L1) -> launch.
//
// The hot path (the kernel is loaded) builds a small key on the stack from the
// kernel's id, the device, the layout, the meta-parameters and the arguments'
// specialization facts, finds it in the in-process map and launches: no
// tracing, no hashing of source or IR, no disk. A miss traces the kernel and
// asks the cache (cache/cuda_binary.h, cache/cpu_kernel.h): bundles, the disk
// tier, then the compiler.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "common/env_switch.h"
#include "kerf/cache/cpu_kernel.h"
#include "kerf/cache/cuda_binary.h"
#include "kerf/cache/log.h"
#include "kerf/error.h"
#include "kerf/jit/abi.h"
#include "kerf/jit/cpu_backend.h"
#include "kerf/jit/cuda_codegen.h"
#include "kerf/jit/launch.h"
#include "kerf/jit/launch_count.h"
#include "kerf/runtime/cuda.h"

namespace kerf {

// A loaded specialization, ready to launch.
struct CompiledKernel {
  std::string name;  // the kernel's, for messages
  std::vector<ir::Param> params;
  size_t num_slots = 0;
  // CPU
  std::unique_ptr<jit::cpu::CpuKernel> cpu;
  // CUDA
  cuda::Module module;
  void* function = nullptr;
  int threads = 0;
  int smem_bytes = 0;
  bool can_overlap = false;  // waits for the prior grid, on sm_90+: overlap_prior is honoured
  unsigned cluster = 1;        // thread-block cluster size along x the launch asks for (sm_90+)
  bool cooperative = false;    // has grid_sync: every block resident at once
  unsigned grid_multiple = 1;  // meta cluster_size: grid x must be a multiple of it (every backend)
  std::string backend;
  KernelSource source = KernelSource::compiled;
};

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

using Compiled = CompiledKernel;

// ---------------------------------------------------------------- the in-memory key
// Mixing for the L1 hash (not a cache key: entries are compared in full).
inline uint64_t mix(uint64_t h, uint64_t w) {
  h ^= w + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

inline uint64_t mix_bytes(uint64_t h, std::string_view s) {
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = mix(h, w);
  }
  uint64_t tail = s.size();
  for (; i < s.size(); ++i) tail = tail << 8 | uint8_t(s[i]);
  return mix(h, tail);
}

uint32_t device_word(Device dev) { return uint32_t(dev.kind) << 16 | uint32_t(dev.index); }

ir::TensorFacts facts_of(const TensorView& t) {
  ir::TensorFacts f;
  const int eb = dtype_size_bytes(t.dtype);
  f.contiguous_last = t.rank > 0 && t.strides[size_t(t.rank - 1)] == 1;
  f.aligned16 = (reinterpret_cast<uintptr_t>(t.data) % 16) == 0;
  for (int d = 0; d < t.rank; ++d) {
    const int64_t size = t.shape[size_t(d)], stride = t.strides[size_t(d)];
    if (size % 16 == 0) f.dims_div16 |= 1u << d;
    if (size % 8 == 0) f.dims_div8 |= 1u << d;
    if (stride % 16 == 0 && (stride * eb) % 16 == 0) f.strides_div16 |= 1u << d;
    if (stride % 8 == 0) f.strides_div8 |= 1u << d;
  }
  return f;
}

// One argument's specialization as one word: kind, dtype, rank, facts.
uint64_t spec_word(const Arg& a) {
  const TensorView* t = std::get_if<TensorView>(&a);
  if (!t) return uint64_t(ir::ParamKind::Scalar);
  const ir::TensorFacts f = facts_of(*t);
  return uint64_t(ir::ParamKind::Tensor) | uint64_t(t->dtype) << 4 | uint64_t(t->rank) << 12 |
         uint64_t(f.contiguous_last) << 20 | uint64_t(f.aligned16) << 21 |
         uint64_t(f.dims_div16 & 0xFF) << 24 | uint64_t(f.strides_div16 & 0xFF) << 32 |
         uint64_t(f.dims_div8 & 0xFF) << 40 | uint64_t(f.strides_div8 & 0xFF) << 48;
}

// A lookup key, built on the stack for each call; it borrows the caller's data.
struct Probe {
  static constexpr size_t kInlineArgs = 32;
  uint64_t kernel_id = 0;
  uint32_t device = 0;
  std::string_view layout;
  const dsl::MetaMap* meta = nullptr;
  uint64_t inline_specs[kInlineArgs];
  std::vector<uint64_t> heap_specs;  // only for calls with more than kInlineArgs arguments
  const uint64_t* specs = nullptr;
  size_t num_specs = 0;
  uint64_t hash = 0;

  Probe(const dsl::Kernel& k, Device dev, const std::vector<Arg>& args, const dsl::MetaMap& m,
        std::string_view lay)
      : kernel_id(k.id()),
        device(device_word(dev)),
        layout(lay),
        meta(&m) {
    num_specs = args.size();
    uint64_t* out = inline_specs;
    if (num_specs > kInlineArgs) {
      heap_specs.resize(num_specs);
      out = heap_specs.data();
    }
    uint64_t h = mix(mix(0, kernel_id), device);
    for (size_t i = 0; i < num_specs; ++i) h = mix(h, out[i] = spec_word(args[i]));
    for (const auto& [name, value] : m) h = mix(mix_bytes(h, name), uint64_t(value));
    hash = layout.empty() ? h : mix_bytes(h, layout);
    specs = out;
  }
};

// An L1 entry: an owned copy of the key, and the kernel once it is ready.
struct Slot {
  uint64_t kernel_id = 0;
  uint32_t device = 0;
  std::string layout;
  std::vector<std::pair<std::string, int64_t>> meta;
  std::vector<uint64_t> specs;
  std::shared_ptr<Compiled> ready;                        // set once built
  std::shared_future<std::shared_ptr<Compiled>> pending;  // for callers that wait

  Slot(const Probe& p)
      : kernel_id(p.kernel_id),
        device(p.device),
        layout(p.layout),
        meta(p.meta->begin(), p.meta->end()),
        specs(p.specs, p.specs + p.num_specs) {}

  bool matches(const Probe& p) const {
    if (kernel_id != p.kernel_id || device != p.device || layout != p.layout ||
        specs.size() != p.num_specs || meta.size() != p.meta->size())
      return false;
    if (std::memcmp(specs.data(), p.specs, p.num_specs * sizeof(uint64_t)) != 0) return false;
    auto it = p.meta->begin();
    for (const auto& [name, value] : meta) {
      if (name != it->first || value != it->second) return false;
      ++it;
    }
    return true;
  }
};

class KernelCache {
 public:
  static KernelCache& instance() {
    static KernelCache c;
    return c;
  }

  // The kernel for `probe`, built once by `build` (concurrent callers of one key wait for it).
  // A template, not std::function: wrapping the caller's lambda would allocate on every launch.
  template <class Build>
  std::shared_ptr<Compiled> get(const Probe& probe, const Build& build, bool* built) {
    std::shared_ptr<Slot> slot;
    std::promise<std::shared_ptr<Compiled>> promise;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto [lo, hi] = map_.equal_range(probe.hash);
      for (auto it = lo; it != hi; ++it) {
        if (!it->second->matches(probe)) continue;
        if (it->second->ready) return it->second->ready;  // the hot path
        slot = it->second;
        break;
      }
      if (!slot) {
        slot = std::make_shared<Slot>(probe);
        slot->pending = promise.get_future().share();
        map_.emplace(probe.hash, slot);
        *built = true;
      }
    }
    if (!*built) return slot->pending.get();
    try {
      std::shared_ptr<Compiled> c = build();
      {
        std::lock_guard<std::mutex> lock(mu_);
        slot->ready = c;
      }
      promise.set_value(c);
      return c;
    } catch (...) {
      // A failed build is not kept: the next call tries again.
      erase(probe.hash, slot);
      promise.set_exception(std::current_exception());
      throw;
    }
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    map_.clear();
  }

 private:
  void erase(uint64_t hash, const std::shared_ptr<Slot>& slot) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [lo, hi] = map_.equal_range(hash);
    for (auto it = lo; it != hi; ++it)
      if (it->second == slot) {
        map_.erase(it);
        return;
      }
  }

  std::mutex mu_;
  std::unordered_multimap<uint64_t, std::shared_ptr<Slot>> map_;
};

// Bumped by clear_kernel_cache(): LaunchMemo entries of an older epoch are forgotten.
std::atomic<uint64_t> cache_epoch{0};

}  // namespace

// ---------------------------------------------------------------- LaunchMemo
struct LaunchMemo::Impl {
  struct Entry {
    uint64_t kernel_id = 0;
    const dsl::MetaMap* meta = nullptr;
    dsl::MetaMap meta_copy;  // its contents when remembered: a new map at the old address only misses
    uint32_t device = 0;
    std::string layout;
    std::vector<uint64_t> specs;
    std::shared_ptr<Compiled> compiled;
  };
  static constexpr size_t kMaxEntries = 4;

  std::mutex mu;
  uint64_t epoch = 0;
  std::vector<Entry> entries;
  size_t next = 0;  // the entry a new kernel replaces once the memo is full

  std::shared_ptr<Compiled> find(uint64_t kernel_id, const dsl::MetaMap* meta, uint32_t device,
                                 std::string_view layout, const uint64_t* specs, size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    if (epoch != cache_epoch.load(std::memory_order_acquire)) return nullptr;
    for (const Entry& e : entries)
      if (e.kernel_id == kernel_id && e.meta == meta && e.device == device && e.specs.size() == n &&
          std::memcmp(e.specs.data(), specs, n * sizeof(uint64_t)) == 0 && e.layout == layout &&
          e.meta_copy == *meta)
        return e.compiled;
    return nullptr;
  }

  void remember(uint64_t kernel_id, const dsl::MetaMap* meta, uint32_t device, std::string_view layout,
                const uint64_t* specs, size_t n, std::shared_ptr<Compiled> compiled, uint64_t at_epoch) {
    std::lock_guard<std::mutex> lock(mu);
    if (epoch != at_epoch) {
      entries.clear();
      next = 0;
      epoch = at_epoch;
    }
    Entry e{kernel_id, meta, *meta, device, std::string(layout), std::vector<uint64_t>(specs, specs + n),
            std::move(compiled)};
    if (entries.size() < kMaxEntries) {
      entries.push_back(std::move(e));
    } else {
      entries[next] = std::move(e);
      next = (next + 1) % kMaxEntries;
    }
  }
};

LaunchMemo::LaunchMemo() : impl_(new Impl) {}
LaunchMemo::~LaunchMemo() { delete impl_; }
LaunchMemo::LaunchMemo(const LaunchMemo&) : impl_(new Impl) {}
LaunchMemo& LaunchMemo::operator=(const LaunchMemo& o) {
  if (this != &o) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->entries.clear();
    impl_->next = 0;
  }
  return *this;
}

// ---------------------------------------------------------------- ResolvedKernel
struct ResolvedAccess {
  static void set(ResolvedKernel& r, std::shared_ptr<const Compiled> c, uint64_t epoch) {
    r.compiled_ = std::move(c);
    r.epoch_ = epoch;
  }
  static const Compiled& get(const ResolvedKernel& r) {
    if (!r.compiled_) throw InvalidArgument("launch: the ResolvedKernel holds no kernel");
    if (!r.usable())
      throw InvalidArgument("launch: the ResolvedKernel's kernel was dropped by clear_kernel_cache()");
    return *r.compiled_;
  }
};

ResolvedKernel::ResolvedKernel() = default;
ResolvedKernel::~ResolvedKernel() = default;
ResolvedKernel::ResolvedKernel(const ResolvedKernel&) = default;
ResolvedKernel& ResolvedKernel::operator=(const ResolvedKernel&) = default;

bool ResolvedKernel::usable() const {
  return compiled_ && epoch_ == cache_epoch.load(std::memory_order_acquire);
}

void ResolvedKernel::reset() {
  compiled_.reset();
  epoch_ = 0;
}

namespace {

// ---------------------------------------------------------------- checks
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
      throw InvalidArgument("kernel '" + kernel_name + "': argument " + std::to_string(i) +
                            " is on " + t->device.str() + " but an earlier tensor is on " +
                            dev.str() + "; all tensors of one launch must share a device");
    }
  }
  return dev;
}

// A tensor argument's memory: a pointer when it has elements, aligned to its element size
// (a GPU cannot load a misaligned element; the fault would end the CUDA context). For
// launch() and a resolved kernel's relaunch alike; messages built only when wrong.
void check_memory(const TensorView& t, size_t index, const std::string& kernel_name) {
  if (t.numel() == 0) return;
  const auto addr = reinterpret_cast<uintptr_t>(t.data);
  if (addr == 0)
    throw InvalidArgument("kernel '" + kernel_name + "': argument " + std::to_string(index) +
                          " has a null data pointer");
  if (addr % uintptr_t(dtype_size_bytes(t.dtype)) != 0)
    throw InvalidArgument("kernel '" + kernel_name + "': argument " + std::to_string(index) + " starts at address " +
                          std::to_string(addr) + ", not a multiple of its element size (" +
                          std::to_string(dtype_size_bytes(t.dtype)) + " bytes for " + dtype_name(t.dtype) + ")");
}

// The message is built only when something is wrong: this runs on every launch.
void check_tensor(const TensorView& t, size_t index, const std::string& kernel_name) {
  const auto where = [&] {
    return "kernel '" + kernel_name + "': argument " + std::to_string(index);
  };
  if (t.rank < 1 || t.rank > kMaxRank)
    throw InvalidArgument(where() + " has rank " + std::to_string(t.rank) + " (supported: 1.." +
                          std::to_string(kMaxRank) + ")");
  for (int d = 0; d < t.rank; ++d) {
    if (t.shape[size_t(d)] < 0) throw InvalidArgument(where() + " has a negative size");
    if (t.shape[size_t(d)] > INT32_MAX)
      throw InvalidArgument(where() + " has size " + std::to_string(t.shape[size_t(d)]) +
                            " along dimension " + std::to_string(d) +
                            "; kerf kernels index dimensions with 32-bit integers");
  }
  check_memory(t, index, kernel_name);
}

// program_id and num_programs are i32 in every kernel: a grid axis past INT32_MAX would
// hand programs negative ids (the GPU's own limit on x is 2^31 - 1 too).
void check_grid(Grid grid, const std::string& kernel_name) {
  if (grid.x > uint32_t(INT32_MAX) || grid.y > uint32_t(INT32_MAX) || grid.z > uint32_t(INT32_MAX))
    throw InvalidArgument("kernel '" + kernel_name + "': grid (" + std::to_string(grid.x) + ", " +
                          std::to_string(grid.y) + ", " + std::to_string(grid.z) +
                          ") has an axis past 2147483647 programs; program ids are 32-bit integers");
}

// What a kernel specialized for `need` assumes that a tensor with facts `have` lacks
// ("" when `have` gives all of it).
std::string missing_facts(const ir::TensorFacts& need, const ir::TensorFacts& have, int rank) {
  std::string out;
  const auto add = [&](const std::string& what) { out += (out.empty() ? "" : ", ") + what; };
  if (need.contiguous_last && !have.contiguous_last) add("a last dimension of stride 1");
  if (need.aligned16 && !have.aligned16) add("a 16-byte aligned data pointer");
  for (int d = 0; d < rank; ++d) {
    const std::string dim = std::to_string(d);
    if ((need.dims_div16 >> d & 1) && !(have.dims_div16 >> d & 1))
      add("a size of dimension " + dim + " that is a multiple of 16");
    else if ((need.dims_div8 >> d & 1) && !(have.dims_div8 >> d & 1))
      add("a size of dimension " + dim + " that is a multiple of 8");
    if ((need.strides_div16 >> d & 1) && !(have.strides_div16 >> d & 1))
      add("a stride of dimension " + dim + " that is a multiple of 16");
    else if ((need.strides_div8 >> d & 1) && !(have.strides_div8 >> d & 1))
      add("a stride of dimension " + dim + " that is a multiple of 8");
  }
  return out;
}

// An empty grid runs nothing, yet its arguments are checked as a launch's are (count,
// kinds, dtypes, ranks, meta-parameters): the kernel is traced, not compiled, once per
// specialization.
void check_empty_launch(const dsl::Kernel& kernel, const std::vector<Arg>& args, const dsl::MetaMap& meta,
                        Device dev, std::string_view layout) {
  const Probe probe(kernel, dev, args, meta, layout);
  static std::mutex mu;
  static std::unordered_multimap<uint64_t, std::unique_ptr<Slot>> checked;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto [lo, hi] = checked.equal_range(probe.hash);
    for (auto it = lo; it != hi; ++it)
      if (it->second->matches(probe)) return;
  }
  (void)kernel.trace(arg_specs(args), meta);  // throws what a launch of these arguments would
  std::lock_guard<std::mutex> lock(mu);
  if (checked.size() < 4096) checked.emplace(probe.hash, std::make_unique<Slot>(probe));
}

// ---------------------------------------------------------------- building (the L1 miss)
std::shared_ptr<Compiled> build_cpu(const ir::Function& fn, std::string_view layout) {
  cache::CpuLoaded loaded = cache::cpu_kernel(fn, layout);
  auto c = std::make_shared<Compiled>();
  c->name = fn.name;
  c->params = fn.params;
  c->num_slots = jit::slot_count(fn.params);
  c->cpu = std::move(loaded.kernel);
  c->backend = "cpu";
  c->source = loaded.source;
  return c;
}

// Whether the kernel waits for the grid before it (dsl::wait_prior_grid) and the launch
// may overlap that grid: sm_90 and later, unless KERF_OVERLAP_LAUNCHES=0.
bool may_overlap(const ir::Function& fn, int device) {
  static const bool enabled = [] {
    const char* v = std::getenv("KERF_OVERLAP_LAUNCHES");
    const std::string w = v ? detail::switch_word(v) : std::string();
    if (!w.empty() && !detail::is_off_word(w) && !detail::is_on_word(w))
      log::once(log::Level::warn, "settings:KERF_OVERLAP_LAUNCHES",
                       std::string("KERF_OVERLAP_LAUNCHES='") + v + "' is not one of 0 (off), 1 (on); using on");
    return !detail::is_off_word(w);
  }();
  if (!enabled || cuda::device_info(device).cc_major < 9) return false;
  return ir::contains(fn.body, ir::OpKind::GridWait);
}

std::shared_ptr<Compiled> build_cuda(const ir::Function& fn, int device, std::string_view layout) {
  const std::string arch = device_arch(device);
  cache::CudaBinary bin = cache::cuda_binary(fn, arch, layout);
  auto c = std::make_shared<Compiled>();
  c->name = fn.name;
  c->params = fn.params;
  c->num_slots = jit::slot_count(fn.params);
  c->module = cuda::Module(bin.image.data(), device);
  c->function = c->module.function(bin.entry);
  c->threads = bin.threads;
  c->smem_bytes = bin.smem_bytes;
  c->can_overlap = may_overlap(fn, device);
  c->cooperative = ir::contains(fn.body, ir::OpKind::GridSync);
  if (bin.smem_bytes > 48 * 1024) {
    const int limit = cuda::device_info(device).max_smem_per_block_optin;
    if (limit > 0 && bin.smem_bytes > limit)
      throw InvalidArgument("kernel '" + fn.name + "' needs " + std::to_string(bin.smem_bytes) +
                            " bytes of shared memory per block; " + arch + " device " +
                            std::to_string(device) + " allows " + std::to_string(limit) +
                            " (choose smaller blocks or fewer num_stages)");
    cuda::set_max_dynamic_smem(c->function, bin.smem_bytes);
  }
  c->backend = arch;
  c->source = bin.source;
  return c;
}

// Checks the call, finds (or builds) its kernel; fills `info`. Null when the grid is empty.
std::shared_ptr<Compiled> resolve(const dsl::Kernel& kernel, const std::vector<Arg>& args,
                                  Grid grid, const dsl::MetaMap& meta, const LaunchOptions& options,
                                  LaunchInfo& info) {
  if (const char* outer = dsl::tracing_kernel())
    throw DefinitionError("kernel '" + kernel.name() + "' was launched inside the body of kernel '" + outer +
                          "' while that was being traced; a kernel body describes one program and cannot "
                          "launch kernels");
  const std::string_view layout = options.layout;
  LaunchMemo* const memo = options.memo;
  for (size_t i = 0; i < args.size(); ++i)
    if (const TensorView* t = std::get_if<TensorView>(&args[i])) check_tensor(*t, i, kernel.name());
  const Device dev = common_device(args, kernel.name());
  check_grid(grid, kernel.name());
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) {  // nothing to run
    check_empty_launch(kernel, args, meta, dev, layout);
    return nullptr;
  }

  // The caller's memo first: the specialization words alone, no meta hashing, no global lock.
  uint64_t specs[Probe::kInlineArgs];
  const bool use_memo = memo && args.size() <= Probe::kInlineArgs;
  const uint64_t epoch = cache_epoch.load(std::memory_order_acquire);
  if (use_memo) {
    for (size_t i = 0; i < args.size(); ++i) specs[i] = spec_word(args[i]);
    if (std::shared_ptr<Compiled> c =
            memo->impl().find(kernel.id(), &meta, device_word(dev), layout, specs, args.size())) {
      info.backend = c->backend;
      if (options.resolved) ResolvedAccess::set(*options.resolved, c, epoch);
      return c;
    }
  }

  const Probe probe(kernel, dev, args, meta, layout);
  Clock::time_point t0;  // read only when building: the hot path does not look at clocks
  bool built = false;
  std::shared_ptr<Compiled> c = KernelCache::instance().get(
      probe,
      [&]() -> std::shared_ptr<Compiled> {
        t0 = Clock::now();
        const ir::Function fn = kernel.trace(arg_specs(args), meta);
        std::shared_ptr<Compiled> built_c;
        if (dev.is_cuda()) {
          cuda::require_device(dev.index);
          built_c = build_cuda(fn, dev.index, layout);
        } else {
          built_c = build_cpu(fn, layout);
        }
        built_c->grid_multiple = unsigned(fn.meta_value("cluster_size", 1));
        // Clusters from sm_90; before it the kernel's cluster sums are plain atomics (the codegen's choice).
        if (dev.is_cuda() && cuda::device_info(dev.index).cc_major >= 9) built_c->cluster = built_c->grid_multiple;
        return built_c;
      },
      &built);
  if (built) {
    info.compile_ms = ms_since(t0);
    info.source = c->source;
    info.compiled = c->source == KernelSource::compiled;
  }
  info.backend = c->backend;
  if (use_memo)
    memo->impl().remember(kernel.id(), &meta, device_word(dev), layout, specs, args.size(), c, epoch);
  if (options.resolved) ResolvedAccess::set(*options.resolved, c, epoch);
  return c;
}

thread_local uint64_t t_launches = 0;

// Packs `args` and runs `c` over `grid` (not empty) on `options.stream`.
void run(const Compiled& c, const std::vector<Arg>& args, Grid grid, const LaunchOptions& options) {
  ++t_launches;  // counted before it may write anything (launch_count.h)
  constexpr size_t kInlineSlots = 64;
  jit::Slot inline_slots[kInlineSlots];
  std::vector<jit::Slot> heap_slots;
  jit::Slot* slots = inline_slots;
  if (c.num_slots > kInlineSlots) {
    heap_slots.resize(c.num_slots);
    slots = heap_slots.data();
  }
  jit::pack_args(c.params, args, slots, c.name.c_str());
  if (grid.x % c.grid_multiple != 0)
    throw InvalidArgument("kernel '" + c.name + "': grid x (" + std::to_string(grid.x) +
                          ") must be a multiple of its cluster_size " + std::to_string(c.grid_multiple));
  if (c.function) {
    if (grid.y > 65535 || grid.z > 65535)
      throw InvalidArgument("kernel '" + c.name + "': grid y and z must be at most 65535, got (" +
                            std::to_string(grid.x) + ", " + std::to_string(grid.y) + ", " +
                            std::to_string(grid.z) + ")");
    void* params[] = {slots};
    cuda::launch_in(c.module.context(), c.function, grid, c.threads, c.smem_bytes, options.stream, params,
                    options.overlap_prior && c.can_overlap, c.cluster, c.cooperative);
  } else {
    jit::cpu::run_grid(*c.cpu, grid, slots);
  }
}

}  // namespace

const char* kernel_source_name(KernelSource s) {
  switch (s) {
    case KernelSource::memory:
      return "memory";
    case KernelSource::bundle:
      return "bundle";
    case KernelSource::disk:
      return "disk";
    case KernelSource::compiled:
      return "compiled";
  }
  return "?";
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

std::vector<dsl::ArgSpec> arg_specs(const std::vector<Arg>& args) {
  std::vector<dsl::ArgSpec> specs;
  specs.reserve(args.size());
  for (const Arg& a : args) {
    const TensorView* t = std::get_if<TensorView>(&a);
    specs.push_back(t ? dsl::ArgSpec::tensor(t->dtype, t->rank, facts_of(*t))
                      : dsl::ArgSpec::scalar());
  }
  return specs;
}

uint64_t launches_on_this_thread() {
  return t_launches;
}

LaunchInfo launch(const dsl::Kernel& kernel, const std::vector<Arg>& args, Grid grid,
                  const dsl::MetaMap& meta, void* stream) {
  LaunchOptions options;
  options.stream = stream;
  return launch(kernel, args, grid, meta, options);
}

LaunchInfo launch(const dsl::Kernel& kernel, const std::vector<Arg>& args, Grid grid,
                  const dsl::MetaMap& meta, const LaunchOptions& options) {
  LaunchInfo info;
  const std::shared_ptr<Compiled> c = resolve(kernel, args, grid, meta, options, info);
  if (c) run(*c, args, grid, options);
  return info;
}

LaunchInfo launch(const ResolvedKernel& kernel, const std::vector<Arg>& args, Grid grid,
                  const LaunchOptions& options) {
  const Compiled& c = ResolvedAccess::get(kernel);
  if (args.size() != c.params.size())
    throw InvalidArgument("kernel '" + c.name + "' takes " + std::to_string(c.params.size()) +
                          " arguments, got " + std::to_string(args.size()));
  for (size_t i = 0; i < args.size(); ++i) {
    const TensorView* t = std::get_if<TensorView>(&args[i]);
    if ((t != nullptr) != (c.params[i].kind == ir::ParamKind::Tensor))
      throw InvalidArgument("kernel '" + c.name + "': argument " + std::to_string(i) + " must be a " +
                            (t ? "scalar" : "tensor"));
    if (!t) continue;
    // The kernel was built for these dtypes and ranks, on this kind of device: another would
    // read its memory with the wrong element size or past its end.
    if (t->dtype != c.params[i].dtype || t->rank != c.params[i].rank)
      throw InvalidArgument("kernel '" + c.name + "': argument " + std::to_string(i) + " '" + c.params[i].name +
                            "' was resolved as " + dtype_name(c.params[i].dtype) + " of rank " +
                            std::to_string(c.params[i].rank) + ", got " + dtype_name(t->dtype) + " of rank " +
                            std::to_string(t->rank) + " (resolve the kernel for these arguments)");
    if (t->device.is_cuda() != (c.function != nullptr))
      throw InvalidArgument("kernel '" + c.name + "': argument " + std::to_string(i) + " is on " + t->device.str() +
                            ", but the kernel was resolved for " + (c.function ? "a GPU" : "the CPU"));
    // A module is loaded in one device's context: another device's memory would be read
    // through peer access, or fault.
    if (c.function && t->device.index != c.module.device())
      throw InvalidArgument("kernel '" + c.name + "': argument " + std::to_string(i) + " is on " + t->device.str() +
                            ", but the kernel was resolved on cuda:" + std::to_string(c.module.device()));
    check_tensor(*t, i, c.name);  // sizes (32-bit in the kernel) and memory, as launch() checks
    // Its code assumes the alignment, contiguity and divisibility facts of the call that
    // resolved it (masks and vector widths follow from them): a view without one of them
    // would be read as if it had it.
    const ir::TensorFacts& need = c.params[i].facts;
    const ir::TensorFacts have = facts_of(*t);
    if (!(need == have)) {
      const std::string missing = missing_facts(need, have, t->rank);
      if (!missing.empty())
        throw InvalidArgument("kernel '" + c.name + "': argument " + std::to_string(i) + " '" + c.params[i].name +
                              "' lacks what the kernel was resolved for: " + missing +
                              " (resolve the kernel for these arguments)");
    }
  }
  check_grid(grid, c.name);
  LaunchInfo info;
  info.backend = c.backend;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return info;
  run(c, args, grid, options);
  return info;
}

LaunchInfo prepare(const dsl::Kernel& kernel, const std::vector<Arg>& args,
                   const dsl::MetaMap& meta, const LaunchOptions& options) {
  LaunchInfo info;
  resolve(kernel, args, Grid{1, 1, 1}, meta, options, info);
  return info;
}

std::string cuda_source(const dsl::Kernel& kernel, const std::vector<Arg>& args,
                        const dsl::MetaMap& meta, const std::string& arch) {
  const ir::Function fn = kernel.trace(arg_specs(args), meta);
  return jit::cuda::generate(fn, arch).source;
}

void clear_kernel_cache() {
  KernelCache::instance().clear();
  cache_epoch.fetch_add(1, std::memory_order_acq_rel);
}

}  // namespace kerf
