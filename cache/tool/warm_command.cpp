// kerf-cache warm: fill the cache for ops x shapes x dtypes x layouts x architectures.
// On a GPU of the target architecture (or on the CPU) the op itself runs once on
// zero-filled tensors, so it is compiled and tuned exactly as an application
// would; for an architecture with no device here, the kernels the op would
// launch are compiled (by NVRTC) without running anything.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "cache/tool/tool.h"
#include "common/env_switch.h"
#include "kerf/cache/cuda_binary.h"
#include "kerf/cache/store.h"
#include "kerf/error.h"
#include "kerf/jit/autotune.h"
#include "kerf/jit/cuda_codegen.h"
#include "kerf/jit/launch.h"
#include "kerf/runtime/cuda.h"
#include "kernels_src/ops_tune.h"

namespace kerf::cache_tool {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, sep);) out.push_back(item);
  if (!text.empty() && text.back() == sep) out.emplace_back();
  return out;
}

std::vector<int64_t> parse_shape(const std::string& text) {
  std::vector<int64_t> dims;
  for (const std::string& d : split(text, 'x')) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(d.c_str(), &end, 10);
    if (d.empty() || *end != '\0' || v <= 0 || errno == ERANGE)
      throw InvalidArgument(
          "--shape wants positive sizes joined by 'x' (e.g. 4096x4096x16), got '" + text + "'");
    dims.push_back(v);
  }
  return dims;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t;
  for (int64_t d : s) t += (t.empty() ? "" : "x") + std::to_string(d);
  return t;
}

// One line per step on a pipe or file; a bar redrawn in place on a terminal.
class Progress {
 public:
  explicit Progress(size_t total) : total_(total), tty_(::isatty(::fileno(stderr)) != 0) {}
  void step(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    ++done_;
    if (!tty_) {
      std::fprintf(stderr, "[%zu/%zu] %s\n", done_, total_, what.c_str());
      return;
    }
    constexpr int kWidth = 30;
    const int filled = total_ ? int(kWidth * done_ / total_) : kWidth;
    std::fprintf(stderr, "\r[%s%s] %zu/%zu %-60.60s", std::string(size_t(filled), '#').c_str(),
                 std::string(size_t(kWidth - filled), '-').c_str(), done_, total_, what.c_str());
    if (done_ == total_) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

 private:
  std::mutex mu_;
  size_t total_, done_ = 0;
  bool tty_;
};

struct Item {
  const autotune::TunableOp* op;
  std::vector<int64_t> shape;
  DType dtype;
  std::string layout, arch;
  std::string text() const {
    return op->name + " " + shape_text(shape) + " " + dtype_name(dtype) +
           (layout.empty() ? "" : " [" + layout + "]") + " " + arch;
  }
};

// Operand memory for an op run: device buffers on a GPU, host words on the CPU, zeroed.
struct Operands {
  std::vector<cuda::DeviceBuffer> device;
  std::vector<std::vector<uint64_t>> host;
  std::vector<TensorView> views;
};

Operands make_operands(const Item& item, bool gpu) {
  Operands o;
  for (const autotune::Operand& spec : item.op->operands(item.shape, item.dtype)) {
    size_t n = 1;
    for (int64_t d : spec.shape) n *= size_t(d);
    const size_t bytes = n * size_t(dtype_size_bytes(spec.dtype));
    void* data;
    if (gpu) {
      o.device.emplace_back(std::max<size_t>(bytes, 16), 0);
      o.device.back().fill_bytes(0);
      data = o.device.back().data();
    } else {
      o.host.emplace_back((bytes + 7) / 8 + 2, 0);
      data = o.host.back().data();
    }
    o.views.push_back(TensorView::contiguous(data, spec.dtype, spec.shape,
                                             gpu ? Device::cuda(0) : Device::cpu()));
  }
  return o;
}

// Views of the op's operands that are never dereferenced (compile-only warming):
// 256-byte aligned, contiguous, like fresh framework tensors.
std::vector<TensorView> fake_operands(const Item& item) {
  std::vector<TensorView> views;
  uintptr_t next = uintptr_t(1) << 20;
  for (const autotune::Operand& spec : item.op->operands(item.shape, item.dtype)) {
    views.push_back(TensorView::contiguous(reinterpret_cast<void*>(next), spec.dtype, spec.shape,
                                           Device::cuda(0)));
    // Apart, as real tensors are (the op's checks refuse outputs overlapping inputs).
    size_t bytes = size_t(dtype_size_bytes(spec.dtype));
    for (int64_t d : spec.shape) bytes *= size_t(d);
    next += (bytes / (uintptr_t(1) << 20) + 1) << 20;
  }
  return views;
}

struct CompileJob {
  std::string what;
  ir::Function fn;
  std::string arch, layout;
};

struct Totals {
  std::atomic<int> compiled{0}, cached{0}, skipped{0}, failed{0}, runs{0};
};

}  // namespace

int warm(Args& args) {
  std::vector<std::string> op_names, shapes, archs;
  std::vector<std::string> layouts;
  std::vector<DType> dtypes;
  bool all_candidates = false, tune = true;
  int sm_count = 0;
  int jobs = int(std::max(1u, std::thread::hardware_concurrency()));
  while (!args.empty()) {
    const std::string a = args.next();
    if (a == "--op") {
      for (const std::string& n : split(args.value_of(a), ',')) op_names.push_back(n);
    } else if (a == "--shape") {
      shapes.push_back(args.value_of(a));
    } else if (a == "--dtype") {
      for (const std::string& t : split(args.value_of(a), ',')) {
        const auto d = parse_dtype(t);
        if (!d) throw InvalidArgument("unknown dtype '" + t + "'");
        dtypes.push_back(*d);
      }
    } else if (a == "--layout") {
      // As the ops key their kernels: the canonical text of what it stands for (the
      // same for "mesh(tp=4,dp=2) W[,tp]" and "mesh(tp=4) W[,tp,]").
      const std::string text = args.value_of(a);
      try {
        layouts.push_back(ops::Layout::parse(text).canonical());
      } catch (const InvalidArgument& e) {
        throw InvalidArgument(std::string("warm: --layout: ") + e.what());
      }
    } else if (a == "--arch") {
      for (const std::string& x : split(args.value_of(a), ',')) archs.push_back(x);
    } else if (a == "--all-candidates") {
      all_candidates = true;
    } else if (a == "--no-tune") {
      tune = false;
    } else if (a == "--sm-count") {
      sm_count = int(whole_number("warm: --sm-count", args.value_of(a), 1, 100000));
    } else if (a == "-j") {
      jobs = int(whole_number("warm: -j", args.value_of(a), 1, 1024));
    } else {
      throw InvalidArgument("warm: unknown option '" + a + "'");
    }
  }
  if (shapes.empty()) throw InvalidArgument("warm: give at least one --shape");
  if (all_candidates && !tune)
    throw InvalidArgument(
        "warm: --all-candidates (every autotune candidate, for tuning on the target) does not "
        "go with --no-tune (the default configurations only)");
  if (dtypes.empty()) dtypes = {DType::bf16};
  if (layouts.empty()) layouts = {""};
  const bool have_gpu = cuda::device_count() > 0;
  const std::string native = have_gpu ? device_arch(0) : "cpu";
  if (archs.empty()) archs = {native};
  for (std::string& a : archs) {
    if (a == "native") a = native;
    if (a != "cpu" && !jit::cuda::is_gpu_arch(a))
      throw InvalidArgument("warm: --arch '" + a + "' is neither cpu, native nor a GPU architecture (like sm_90a "
                            "or sm_80)");
  }
  const char* autotune_env = std::getenv("KERF_AUTOTUNE");
  if (!tune)
    ::setenv("KERF_AUTOTUNE", "0", 1);
  else if (!autotune_env || detail::switch_word(autotune_env).empty())  // unset, or blank (the library reads it so)
    ::setenv("KERF_AUTOTUNE", "1", 1);      // warm means tune, CPU too
  cache::reload_settings();
  (void)cache_dir();  // refuses a directory the library refuses
  if (cache::current_settings().disk != cache::DiskMode::on)
    throw InvalidArgument(std::string("warm: the disk cache is ") +
                          cache::disk_mode_name(cache::current_settings().disk) +
                          " (KERF_CACHE): nothing warm compiles or tunes would be stored");
  // Kernels and choices a mounted bundle holds would be found there and never written to
  // the directory, so a `warm && pack` of it would ship without them.
  if (!cache::mounted_bundles().empty())
    throw InvalidArgument("warm: bundles are mounted (KERF_CACHE_BUNDLES): what they hold would be served from "
                          "them and not stored in " + cache::current_settings().dir +
                          "; unset KERF_CACHE_BUNDLES to warm the directory");
  const uint64_t stores_before = cache::stats().stores;
  const uint64_t failures_before = cache::stats().store_failures;

  const std::vector<autotune::TunableOp> ops = autotune::tunable_ops();
  std::vector<const autotune::TunableOp*> chosen;
  for (const autotune::TunableOp& op : ops)
    if (op_names.empty() || std::find(op_names.begin(), op_names.end(), op.name) != op_names.end())
      chosen.push_back(&op);
  for (const std::string& n : op_names) {
    bool known = false;
    for (const autotune::TunableOp& op : ops) known |= op.name == n;
    if (!known) {
      std::string names;
      for (const autotune::TunableOp& op : ops) names += (names.empty() ? "" : ", ") + op.name;
      throw InvalidArgument("warm: unknown op '" + n + "' (known: " + names + ")");
    }
  }

  std::vector<Item> items;
  for (const autotune::TunableOp* op : chosen)
    for (const std::string& s : shapes) {
      const std::vector<int64_t> shape = parse_shape(s);
      if (shape.size() != op->shape_names.size()) {
        if (chosen.size() == 1) {
          std::string names;
          for (const std::string& n : op->shape_names) names += (names.empty() ? "" : "x") + n;
          throw InvalidArgument("warm: " + op->name + " takes a shape " + names + ", got '" + s +
                                "'");
        }
        continue;  // a shape for another of the ops
      }
      for (DType t : dtypes)
        for (const std::string& layout : layouts) {
          if (!layout.empty() && !op->takes_layout)
            throw InvalidArgument("warm: " + op->name + " takes no sharding layout (got '" + layout + "')");
          for (const std::string& arch : archs) items.push_back(Item{op, shape, t, layout, arch});
        }
    }
  if (items.empty()) throw InvalidArgument("warm: no --shape fits the chosen ops");

  // Runs first (one at a time: they share the device), then the compile-only jobs in parallel.
  Totals totals;
  std::vector<CompileJob> compile_jobs;
  std::vector<const Item*> run_items;
  for (const Item& item : items) {
    const bool runs_here = item.arch == "cpu" || (have_gpu && item.arch == native);
    if (runs_here) {
      run_items.push_back(&item);
      continue;
    }
    const std::vector<TensorView> views = fake_operands(item);
    try {
      // What the op itself would refuse (a dtype it does not take, a rank above 256,
      // too many experts) is refused here too: entries no call could use are not stored.
      const ops::detail::ChecksOnly checks_only;
      item.op->call(views, nullptr, item.layout);
    } catch (const Error& e) {
      throw InvalidArgument("warm: " + item.text() + ": " + e.what());
    }
    // Planned for the target, not for this machine's GPU (if any): an op's own tiles
    // differ by architecture (warpgroup tiles on sm_90a).
    const ops::detail::PlanningArch target(item.arch);
    const int sms = sm_count > 0 ? sm_count : autotune::typical_sm_count(item.arch);
    const int smem_limit = autotune::typical_max_shared_memory(item.arch);
    // The op's own config, or where its tiles would not fit the target's shared memory
    // what an untuned call there runs instead (README, "Untuned calls").
    std::vector<autotune::Config> configs = {
        ops::detail::untuned_candidate(*item.op, views, item.arch, smem_limit, sms)};
    if (all_candidates) {
      const std::vector<autotune::Config> c = item.op->gpu_candidates();
      configs.insert(configs.end(), c.begin(), c.end());
    }
    std::set<std::string> seen;  // candidates that plan to the same kernel compile once
    for (const autotune::Config& config : configs)
      for (const autotune::KernelCall& call : item.op->kernels(views, config, sms)) {
        ir::Function fn = call.kernel->trace(arg_specs(call.args), call.meta);
        const std::string id = ir::hash(fn).hex();
        if (!seen.insert(id).second) continue;
        if (&config != &configs.front() && jit::cuda::generate(fn, item.arch).smem_bytes > smem_limit) {
          ++totals.skipped;  // the tuner on the target would prune it too
          continue;
        }
        compile_jobs.push_back(CompileJob{item.text() + " " + autotune::config_text(call.meta),
                                          std::move(fn), item.arch, item.layout});
      }
  }

  Progress progress(run_items.size() + compile_jobs.size());
  const auto t0 = Clock::now();
  for (const Item* item : run_items) {
    const auto t = Clock::now();
    const bool gpu = item->arch != "cpu";
    Operands o = make_operands(*item, gpu);
    const cache::Stats before = cache::stats();
    item->op->call(o.views, nullptr, item->layout);
    if (gpu) cuda::device_synchronize(0);
    const cache::Stats after = cache::stats();
    totals.compiled += int(after.compiles - before.compiles);
    ++totals.runs;
    char line[64];
    std::snprintf(line, sizeof line, ": ran (%d compiled, %.1f s)",
                  int(after.compiles - before.compiles), seconds_since(t));
    progress.step(item->text() + line);
  }

  std::atomic<size_t> next{0};
  const auto worker = [&] {
    for (size_t i; (i = next++) < compile_jobs.size();) {
      const CompileJob& job = compile_jobs[i];
      const auto t = Clock::now();
      std::string result;
      try {
        const cache::CudaBinary bin = cache::cuda_binary(job.fn, job.arch, job.layout);
        (bin.source == KernelSource::compiled ? totals.compiled : totals.cached)++;
        char line[64];
        std::snprintf(line, sizeof line, ": %s (%.1f s)", kernel_source_name(bin.source),
                      seconds_since(t));
        result = line;
      } catch (const Error& e) {
        ++totals.failed;
        result = std::string(": FAILED: ") + e.what();
      }
      progress.step(job.what + result);
    }
  };
  std::vector<std::thread> pool;
  const int n = std::max(1, std::min<int>(jobs, int(compile_jobs.size())));
  for (int t = 1; t < n; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();

  // The op runs happened on this machine's device (its GPU, else the CPU): tuned if tuning is on there.
  const bool tuning = autotune::enabled_for(have_gpu ? Device::cuda(0) : Device::cpu());
  std::printf(
      "warmed %zu item(s) in %.1f s: %d kernel(s) compiled, %d already cached, %d op run(s) "
      "here%s, "
      "%d candidate(s) skipped for shared memory, %d failed; cache %s\n",
      items.size(), seconds_since(t0), totals.compiled.load(), totals.cached.load(),
      totals.runs.load(), totals.runs && tuning ? " (tuned)" : "", totals.skipped.load(),
      totals.failed.load(), cache::current_settings().dir.c_str());
  // Compiled but not stored (an unwritable directory, a full disk part-way): a
  // warm-then-pack step must not pass with what is missing.
  if (totals.compiled > 0 && cache::stats().stores == stores_before) {
    std::fprintf(stderr, "kerf-cache: warm: nothing was stored in %s (the log above says why)\n",
                 cache::current_settings().dir.c_str());
    return 1;
  }
  if (const uint64_t lost = cache::stats().store_failures - failures_before) {
    std::fprintf(stderr, "kerf-cache: warm: %llu entr%s could not be stored in %s (the log above says why)\n",
                 static_cast<unsigned long long>(lost), lost == 1 ? "y" : "ies",
                 cache::current_settings().dir.c_str());
    return 1;
  }
  return totals.failed ? 1 : 0;
}

}  // namespace kerf::cache_tool
