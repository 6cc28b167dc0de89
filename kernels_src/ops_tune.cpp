#include "ops_tune.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>

#include "kerf/cache/log.h"
#include "kerf/error.h"
#include "kerf/jit/launch.h"
#include "ops_checks.h"
#include "ops_common.h"

namespace kerf::ops::detail {

namespace {

// `t` (rank <= 3) as a rank-3 view: leading dims of size 1.
TensorView as_rank3(const TensorView& t) {
  if (t.rank > 3) throw InternalError("SavedBytes: views of rank > 3 are not saved element by element");
  std::vector<int64_t> shape(size_t(3 - t.rank), 1), strides(size_t(3 - t.rank), 0);
  for (int d = 0; d < t.rank; ++d) {
    shape.push_back(t.shape[size_t(d)]);
    strides.push_back(t.strides[size_t(d)]);
  }
  return restride(t, shape, strides);
}

// to = from, element by element (same dtype and shape, rank 3), queued on `stream` on a GPU.
void copy_elements(const TensorView& from, const TensorView& to, void* stream) {
  if (from.device.is_cuda()) {
    LaunchOptions options;
    options.stream = stream;
    run_cast_3d(from, to, options);
    return;
  }
  const size_t elem = size_t(dtype_size_bytes(from.dtype));
  for (int64_t i = 0; i < to.shape[0]; ++i)
    for (int64_t j = 0; j < to.shape[1]; ++j)
      for (int64_t k = 0; k < to.shape[2]; ++k) {
        const auto at = [&](const TensorView& t) {
          return static_cast<char*>(t.data) + (i * t.strides[0] + j * t.strides[1] + k * t.strides[2]) * int64_t(elem);
        };
        std::memcpy(at(to), at(from), elem);
      }
}

}  // namespace

SavedBytes::SavedBytes(const TensorView& input, const TensorView& written, void* stream)
    : device_(input.device), stream_(stream) {
  if (!may_overlap(input, written) || input.numel() == 0) return;
  const auto [lo, hi] = byte_span(input);
  const size_t dense = size_t(input.numel()) * size_t(dtype_size_bytes(input.dtype));
  if (size_t(hi - lo) == dense) {
    // No gaps (contiguous, or a permutation of it): the span is the view's own bytes.
    first_ = reinterpret_cast<void*>(lo);
    bytes_ = dense;
    if (device_.is_cuda()) {
      device_copy_ = cuda::DeviceBuffer(bytes_, device_.index);
      cuda::memcpy_device_to_device(device_copy_.data(), first_, bytes_, stream_, device_.index);
    } else {
      const char* p = static_cast<const char*>(first_);
      host_copy_.assign(p, p + bytes_);
    }
    return;
  }
  // Gaps between the view's elements may be other tensors' memory, written meanwhile (by
  // another thread's op on the neighbouring columns): only the view's own elements are
  // saved and put back.
  view_ = as_rank3(input);
  bytes_ = dense;
  void* copy = nullptr;
  if (device_.is_cuda()) {
    device_copy_ = cuda::DeviceBuffer(bytes_, device_.index);
    copy = device_copy_.data();
  } else {
    host_copy_.resize(bytes_);
    copy = host_copy_.data();
  }
  packed_ = TensorView::contiguous(copy, view_.dtype, {view_.shape[0], view_.shape[1], view_.shape[2]}, device_);
  copy_elements(view_, packed_, stream_);
}

SavedBytes::~SavedBytes() {
  if (!bytes_ || !device_.is_cuda()) return;
  try {
    cuda::stream_synchronize(stream_, device_.index);
  } catch (...) {
    // A failing stream fails the op's own launches too; nothing more to do here.
  }
}

void SavedBytes::restore() const {
  if (!bytes_) return;
  if (packed_.data) {
    copy_elements(packed_, view_, stream_);
  } else if (device_.is_cuda()) {
    cuda::memcpy_device_to_device(first_, device_copy_.data(), bytes_, stream_, device_.index);
  } else {
    std::memcpy(first_, host_copy_.data(), bytes_);
  }
}

Config config_from(const autotune::Config& c, const std::string& block_m_name, const std::string& block_k_name) {
  Config cfg;
  cfg.block_m = autotune::value_or_zero(c, block_m_name);
  cfg.block_k = autotune::value_or_zero(c, block_k_name);
  cfg.num_warps = autotune::value_or_zero(c, "num_warps");
  cfg.num_stages = autotune::value_or_zero(c, "num_stages");
  cfg.split_k = autotune::value_or_zero(c, "split_k");  // ops whose programs share columns tune it
  for (const auto& [name, value] : c)
    if (name != block_m_name && name != block_k_name && name != "num_warps" && name != "num_stages" &&
        name != "split_k" && name != "split_waves" && name != "defaults")
      cfg.meta[name] = value;
  return cfg;
}

autotune::Config candidate_from(const Config& c, const std::string& block_m_name, const std::string& block_k_name) {
  autotune::Config a;
  if (c.block_m) a[block_m_name] = c.block_m;
  if (c.block_k) a[block_k_name] = c.block_k;
  if (c.split_k) a["split_k"] = c.split_k;
  if (c.num_warps) a["num_warps"] = c.num_warps;
  if (c.num_stages) a["num_stages"] = c.num_stages;
  for (const auto& [name, value] : c.meta) a[name] = value;
  return a;
}

std::vector<autotune::Config> with_wave_splits(const std::vector<autotune::Config>& base,
                                               const std::string& block_m_name, int64_t rows,
                                               const std::string& block_k_name, int64_t cols, int64_t batch,
                                               int64_t programs, const std::vector<int64_t>& waves,
                                               int64_t default_waves) {
  std::vector<autotune::Config> all;
  for (const autotune::Config& c : base) {
    all.push_back(c);
    const int64_t blocks = std::max<int64_t>(1, batch * cdiv(rows, autotune::value_or_zero(c, block_m_name)));
    const int64_t n = std::max<int64_t>(1, cdiv(cols, autotune::value_or_zero(c, block_k_name)));
    std::vector<int64_t> splits = {default_waves ? split_for_waves(blocks, programs, n, default_waves)
                                                 : split_for(blocks, programs, n)};
    for (const int64_t w : waves) {
      const int64_t split = w == 0 ? n : split_for_waves(blocks, programs, n, w);
      if (std::find(splits.begin(), splits.end(), split) != splits.end()) continue;
      splits.push_back(split);
      autotune::Config with = c;
      with["split_k"] = split;
      with["split_waves"] = w;
      all.push_back(std::move(with));
    }
  }
  return all;
}

std::vector<autotune::Config> with_warps_n_variants(std::vector<autotune::Config> variants, Product product) {
  if (is_half(product) || product.tf32)
    for (int64_t wn : {2, 4}) variants.push_back({{"WARPS_N", wn}});
  return variants;
}

std::vector<autotune::Config> with_l2_prefetch_variants(std::vector<autotune::Config> variants) {
  variants.push_back({{"L2_PREFETCH", 128}});
  return variants;
}

namespace {

// Whether an op whose product is `product` can run its dots as wgmma on `device`.
bool wgmma_applies(DType product, const Device& device) {
  return is_half(product) && wgmma_target(device);
}

}  // namespace

std::vector<autotune::Config> with_wgmma_variant(std::vector<autotune::Config> variants, DType product,
                                                 const Device& device) {
  if (wgmma_applies(product, device)) variants.push_back({{"WGMMA", 1}});
  return variants;
}

std::vector<autotune::Config> with_wgmma_tiles(std::vector<autotune::Config> candidates,
                                               const std::vector<autotune::Config>& tiles, DType product,
                                               const Device& device) {
  if (!wgmma_applies(product, device)) return candidates;
  for (autotune::Config tile : tiles) {
    tile["WGMMA"] = 1;
    candidates.push_back(std::move(tile));
  }
  return candidates;
}

std::vector<autotune::Config> with_stream_tiles(std::vector<autotune::Config> candidates,
                                                const std::string& block_m_name, const std::string& block_k_name,
                                                DType product) {
  if (!is_half(product)) return candidates;
  for (auto [bm, bk] : {std::pair<int64_t, int64_t>{32, 64}, {32, 128}, {32, 256}, {64, 64}, {64, 128}, {128, 64}})
    candidates.push_back({{block_m_name, bm}, {block_k_name, bk}, {"num_warps", 4}, {"STREAM", 1}});
  return candidates;
}

std::vector<autotune::Config> with_one_tile_variant(std::vector<autotune::Config> variants, DType product) {
  if (is_half(product)) variants.push_back({{"ONE_TILE", 1}});
  return variants;
}

autotune::Config stream_canonical(autotune::Config c) {
  if (autotune::value_or_zero(c, "STREAM") == 0) {
    c.erase("ONE_TILE");  // the one-tile form of STREAM's programs: nothing without them
    return c;
  }
  if (autotune::value_or_zero(c, "ONE_TILE") == 0) c.erase("ONE_TILE");
  for (const char* name : {"split_k", "split_waves", "num_stages", "L2_PREFETCH", "COLS_FIRST"}) c.erase(name);
  return c;
}

std::vector<autotune::Config> with_cols_first_variants(std::vector<autotune::Config> variants) {
  std::vector<autotune::Config> added = {{{"COLS_FIRST", 1}}};
  for (const autotune::Config& v : variants)
    if (v.count("WGMMA")) {
      autotune::Config both = v;
      both["COLS_FIRST"] = 1;
      added.push_back(std::move(both));
    }
  variants.insert(variants.end(), added.begin(), added.end());
  return variants;
}

Config config_of(const TuneRequest& q, const autotune::Config& c) {
  Config cfg = config_from(c, q.block_m_name, q.block_k_name);
  const auto waves = c.find("split_waves");
  if (waves != c.end() && q.split_programs > 0 && q.extent_m > 0 && q.extent_k > 0 && cfg.block_m > 0 &&
      cfg.block_k > 0) {
    const int64_t blocks = std::max<int64_t>(1, q.split_batch * cdiv(q.extent_m, cfg.block_m));
    const int64_t steps = std::max<int64_t>(1, cdiv(q.extent_k, cfg.block_k));
    cfg.split_k = waves->second == 0 ? steps : split_for_waves(blocks, q.split_programs, steps, waves->second);
  }
  return cfg;
}

const std::vector<autotune::Config>& evict_variants() {
  static const std::vector<autotune::Config> v = {{{"EVICT", 1}}, {{"EVICT", 2}}};
  return v;
}

std::vector<autotune::Config> evict_and_cast_variants(const TensorView& A, DType product) {
  std::vector<autotune::Config> v = evict_variants();
  if (A.device.is_cuda() && A.dtype == DType::f32 && is_half(product)) v.push_back({{"CAST_A", 1}});
  return v;
}

namespace {
thread_local uint64_t provisional_count = 0;
}  // namespace

uint64_t provisional_configs() { return provisional_count; }

int config_shared_memory(const TuneRequest& q, const Config& config, const std::string& arch) {
  int most = 0;
  for (const autotune::KernelCall& k : q.kernels(config))
    most = std::max(most, autotune::shared_memory_bytes(*k.kernel, k.args, k.meta, arch));
  return most;
}

Config untuned_config(const TuneRequest& q, const std::string& arch, int limit, UntunedFit* fit) {
  UntunedFit f;
  f.own_bytes = f.bytes = config_shared_memory(q, {}, arch);
  if (f.own_bytes <= limit) {
    if (fit) *fit = f;
    return {};
  }
  // The tuner's candidates, then (none fitting: GPUs of 99 KiB at ranks of 128 and up)
  // small tiles on two stages.
  const std::vector<autotune::Config> small = autotune::product({{q.block_m_name, {64, 32, 16}},
                                                                 {q.block_k_name, {64, 32, 16}},
                                                                 {"num_warps", {4}},
                                                                 {"num_stages", {2}}});
  for (const std::vector<autotune::Config>* list : {&q.gpu_candidates, &small}) {
    const autotune::Config* best = nullptr;
    int best_bytes = -1;
    for (const autotune::Config& c : *list) {
      if (c.count("split_waves")) continue;  // a tile's splits: the tile itself is in the list
      const Config cfg = config_of(q, c);
      // Tiles far beyond the problem only waste work (the smallest ones stay).
      if (q.extent_m && cfg.block_m > 16 && cfg.block_m > next_pow2(q.extent_m)) continue;
      if (q.extent_k && cfg.block_k > 16 && cfg.block_k > next_pow2(q.extent_k)) continue;
      const int n = config_shared_memory(q, cfg, arch);
      if (n <= limit && n > best_bytes) {
        best = &c;
        best_bytes = n;
      }
    }
    if (best) {
      f.chosen = *best;
      f.bytes = best_bytes;
      f.candidate = (list == &small ? "small tiles " : "the tuner's candidate ") + autotune::config_text(*best);
      break;
    }
  }
  if (fit) *fit = f;
  return f.chosen.empty() ? Config{} : config_of(q, f.chosen);
}

autotune::Config untuned_candidate(const autotune::TunableOp& op, const std::vector<TensorView>& views,
                                   const std::string& arch, int limit, int sm_count, UntunedFit* fit) {
  TuneRequest q;
  q.problem.op = op.name;
  q.block_m_name = op.block_m_name;
  q.block_k_name = op.block_k_name;
  q.gpu_candidates = op.gpu_candidates();
  q.kernels = [&](const Config& c) {
    return op.kernels(views, candidate_from(c, op.block_m_name, op.block_k_name), sm_count);
  };
  UntunedFit f;
  untuned_config(q, arch, limit, &f);
  if (fit) *fit = f;
  return f.chosen;
}

namespace {

// untuned_config on the device of `q` (the op's own config on the CPU), said once per
// op, choice and architecture at KERF_LOG=info when the op's own tiles do not fit.
Config untuned_on_device(const TuneRequest& q) {
  const Device& dev = q.problem.device;
  if (!dev.is_cuda() || q.gpu_candidates.empty()) return {};
  const std::string arch = device_arch(dev.index);
  const int limit = autotune::max_shared_memory(dev.index);
  UntunedFit f;
  const Config chosen = untuned_config(q, arch, limit, &f);
  if (!f.candidate.empty())
    log::once(log::Level::info, "untuned-fit:" + q.problem.op + ":" + f.candidate + ":" + arch,
              q.problem.op + ": its own tiles need " + std::to_string(f.own_bytes) + " bytes of shared memory, " +
                  arch + " device " + std::to_string(dev.index) + " allows " + std::to_string(limit) +
                  "; untuned, it runs " + f.candidate + " (" + std::to_string(f.bytes) +
                  " bytes)");
  return chosen;
}

}  // namespace

Config tuned_config(const TuneRequest& q) {
  const Device& dev = q.problem.device;
  if (!autotune::enabled_for(dev)) return untuned_on_device(q);
  const bool gpu = dev.is_cuda();
  // Each CPU candidate is an LLVM compile: a few tile sizes only.
  std::vector<autotune::Config> candidates =
      gpu ? q.gpu_candidates
          : autotune::product({{q.block_m_name, {16, 32}},
                               {q.block_k_name, {32, 64}},
                               {"num_warps", {4}},
                               {"num_stages", {1}}});
  // Tiles beyond the problem's extent only waste work, but the smallest tile of
  // each list stays even when the problem is smaller still.
  int64_t smallest_m = INT64_MAX, smallest_k = INT64_MAX;
  for (const autotune::Config& c : candidates) {
    const Config cfg = config_of(q, c);
    smallest_m = std::min(smallest_m, cfg.block_m);
    smallest_k = std::min(smallest_k, cfg.block_k);
  }
  // The op's own defaults compete too, so a tuned config is never slower than
  // the untuned one by the tuner's clock (all-zero fields: the op decides).
  candidates.push_back({{"defaults", 1}});
  autotune::Hooks hooks;
  hooks.keep = [&](const autotune::Config& c) {
    const Config cfg = config_of(q, c);
    if (q.extent_m && cfg.block_m > std::max(smallest_m, next_pow2(q.extent_m))) return false;
    if (q.extent_k && cfg.block_k > std::max(smallest_k, next_pow2(q.extent_k))) return false;
    return !gpu || config_shared_memory(q, cfg, device_arch(dev.index)) <= autotune::max_shared_memory(dev.index);
  };
  hooks.canonical = [&q](autotune::Config c) {
    c = stream_canonical(std::move(c));
    return q.canonical ? q.canonical(std::move(c)) : c;
  };
  hooks.compile = [&](const autotune::Config& c) {
    for (const autotune::KernelCall& k : q.kernels(config_of(q, c))) prepare(*k.kernel, k.args, k.meta);
  };
  // A stored choice names only what the candidates and finalist variants name, each value
  // within the range they give it (split_k within the grid's limit: it follows the shape),
  // and passes the checks a caller's Config gets.
  hooks.usable = [&](const autotune::Config& stored) -> std::string {
    std::map<std::string, std::pair<int64_t, int64_t>> range;
    const auto widen = [&](const autotune::Config& c) {
      for (const autotune::Config& form : {c, hooks.canonical(c)})
        for (const auto& [name, value] : form) {
          auto [it, fresh] = range.try_emplace(name, value, value);
          if (!fresh) it->second = {std::min(it->second.first, value), std::max(it->second.second, value)};
        }
    };
    for (const autotune::Config& c : candidates) widen(c);
    if (gpu)
      for (const autotune::Config& v : q.finalist_variants) widen(v);
    for (const auto& [name, value] : stored) {
      const auto it = range.find(name);
      if (it == range.end()) return "it names '" + name + "', which this op's tuner does not choose";
      const auto [lo, hi] = name == "split_k" ? std::pair<int64_t, int64_t>{1, 65535} : it->second;
      if (value < lo || value > hi)
        return name + "=" + std::to_string(value) + " is outside the [" + std::to_string(lo) + ", " +
               std::to_string(hi) + "] the tuner tries";
    }
    Config cfg = config_of(q, stored);
    cfg.meta.clear();  // named and ranged above
    try {
      expect_meta(q.problem.op.c_str(), cfg, {});
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  hooks.run = [&](const autotune::Config& c) { q.run(config_of(q, c)); };
  hooks.restore = q.restore;
  autotune::Options options;
  options.stream = q.stream;
  if (gpu) options.finalist_variants = q.finalist_variants;
  options.incumbent = {{"defaults", 1}};  // replaced only by a config faster beyond the clock's noise
  options.lookup_only = capturing(dev, q.stream);
  const autotune::Choice choice = autotune::choose(q.problem, candidates, {}, hooks, options);
  // A capture with no stored choice, or a pass none of whose candidates could run (on a
  // GPU with less shared memory than they want), then remembered as the empty config for
  // the problem's bucket: the untuned config for the device. (A pass choosing the op's
  // own config names it: {"defaults", 1}.)
  if (choice.from == autotune::Choice::From::defaults || choice.config.empty()) {
    if (options.lookup_only && choice.from == autotune::Choice::From::defaults) ++provisional_count;
    return untuned_on_device(q);
  }
  return config_of(q, choice.config);
}

}  // namespace kerf::ops::detail
