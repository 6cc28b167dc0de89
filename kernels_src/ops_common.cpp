#include "ops_common.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <exception>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "kerf/jit/cpu_backend.h"
#include "kerf/kernels/kernels.h"
#include "kerf/runtime/cuda.h"
#include "ops_accumulate.h"
#include "ops_checks.h"

namespace kerf::ops::detail {

std::string shape_str(const TensorView& t) {
  if (t.rank < 0 || t.rank > kMaxRank) return "a view of invalid rank " + std::to_string(t.rank);
  std::string s = "[";
  for (int d = 0; d < t.rank; ++d) s += (d ? ", " : "") + std::to_string(t.shape[size_t(d)]);
  return s + "]";
}

void expect_shape(const char* op, const char* name, const TensorView& t, const int64_t* want,
                  size_t rank) {
  bool ok = t.rank == int(rank);
  for (size_t d = 0; ok && d < rank; ++d) ok = want[d] < 0 || t.shape[d] == want[d];
  if (ok) return;
  std::string w = "[";
  for (size_t d = 0; d < rank; ++d)
    w += (d ? ", " : "") + (want[d] < 0 ? std::string("*") : std::to_string(want[d]));
  throw InvalidArgument(std::string(op) + ": " + name + " must have shape " + w + "], got " +
                        shape_str(t));
}

void expect_dtype(const char* op, const char* name, const TensorView& t, const DType* allowed,
                  size_t count) {
  for (size_t i = 0; i < count; ++i)
    if (t.dtype == allowed[i]) return;
  std::string a;
  for (size_t i = 0; i < count; ++i) a += (i ? ", " : "") + std::string(dtype_name(allowed[i]));
  throw TypeError(std::string(op) + ": " + name + " must be one of {" + a + "}, got " +
                  dtype_name(t.dtype));
}

namespace {
std::string number_text(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}
}  // namespace

// The kernels compute in fp32: a double beyond float's range is inf there, and the
// sums NaN (written in place by the merges).
void expect_finite_scale(const char* op, double s) {
  if (!std::isfinite(s))
    throw InvalidArgument(std::string(op) + ": s must be finite, got " + number_text(s));
  if (std::fabs(s) > double(FLT_MAX))
    throw InvalidArgument(std::string(op) + ": s must be within float32's range (|s| <= " +
                          number_text(double(FLT_MAX)) + "), got " + number_text(s));
}

// Also a positive eps that float32, which the kernels compute in, would hold as 0.
bool refused_eps(double eps) {
  return !(eps >= 0 && eps <= double(FLT_MAX)) || (eps > 0 && float(eps) == 0.0f);
}

void expect_eps(const char* op, double eps) {
  if (!(eps >= 0)) throw InvalidArgument(std::string(op) + ": eps must be >= 0, got " + number_text(eps));
  if (eps > double(FLT_MAX))
    throw InvalidArgument(std::string(op) + ": eps must be within float32's range (<= " +
                          number_text(double(FLT_MAX)) + "), got " + number_text(eps));
  if (refused_eps(eps))
    throw InvalidArgument(std::string(op) + ": eps " + number_text(eps) +
                          " is below float32's smallest positive value (1.4e-45), which the kernels would "
                          "hold as 0; pass 0 for no eps, or an eps float32 holds");
}

void expect_device(const char* op, const NamedTensor* ts, size_t count) {
  for (size_t i = 1; i < count; ++i)
    if (ts[i].second->device != ts[0].second->device)
      throw InvalidArgument(std::string(op) + ": " + ts[i].first + " is on " + ts[i].second->device.str() +
                            " but " + ts[0].first + " is on " + ts[0].second->device.str());
}

namespace {

// A stream's buffer `slot` (0: the zeroed workspace, 1: scratch) on a device, and the
// mutex held from asking for it until the last launch using it is queued. The buffer
// only changes (grows) under the mutex.
struct StreamBuffer {
  std::mutex mu;
  cuda::DeviceBuffer buf;
};

// The entry of (slot, device, stream). Entries are never removed (a node map: each
// stays put), so each thread keeps the last one it found per slot and a repeated
// call takes no global lock and does no lookup.
StreamBuffer& stream_entry(int slot, const Device& dev, void* stream) {
  struct Seen {
    int device = -1;
    void* stream = nullptr;
    StreamBuffer* entry = nullptr;
  };
  thread_local Seen seen[2];
  Seen& s = seen[slot];
  if (s.entry && s.device == dev.index && s.stream == stream) return *s.entry;
  static std::mutex mu;
  static std::map<std::tuple<int, int, void*>, StreamBuffer> entries;
  {
    std::lock_guard<std::mutex> guard(mu);
    s.entry = &entries[{slot, dev.index, stream}];
  }
  s.device = dev.index;
  s.stream = stream;
  return *s.entry;
}

// Buffer `slot` of `stream` on `dev`, at least `bytes`; on a GPU the caller holds its
// stream_lock.
void* stream_buffer(int slot, const Device& dev, void* stream, size_t bytes) {
  if (!dev.is_cuda()) {
    // CPU calls are synchronous, so one buffer per thread is never shared.
    thread_local std::vector<uint64_t> host[2];
    if (host[slot].size() * 8 < bytes) host[slot].assign((bytes + 7) / 8, 0);
    return host[slot].data();
  }
  cuda::DeviceBuffer& buf = stream_entry(slot, dev, stream).buf;
  if (buf.bytes() < bytes) {
    // Kernels queued on this stream may still use the old buffer.
    if (buf.bytes()) cuda::stream_synchronize(stream, dev.index);
    buf = cuda::DeviceBuffer(std::max<size_t>(bytes, 1 << 16), dev.index);
    buf.fill_bytes(0);
  }
  return buf.data();
}

// Held from asking for a stream's buffer `slot` until the last launch using it is
// queued. None on the CPU, whose calls are synchronous and whose buffers are per thread.
std::unique_lock<std::mutex> stream_lock(int slot, const Device& dev, void* stream) {
  if (!dev.is_cuda()) return {};
  return std::unique_lock<std::mutex>(stream_entry(slot, dev, stream).mu);
}

}  // namespace

bool capturing(const Device& dev, void* stream) { return dev.is_cuda() && cuda::stream_capturing(stream); }

WorkspaceLease lease_workspace(const Device& dev, void* stream, size_t bytes) {
  WorkspaceLease lease;
  if (bytes && capturing(dev, stream)) {
    lease.graph_owned = cuda::StreamOrderedBuffer(bytes, stream);
    cuda::memset_device_async(lease.graph_owned.data(), 0, bytes, stream);
    lease.data = static_cast<char*>(lease.graph_owned.data());
    return lease;
  }
  lease.lock = stream_lock(0, dev, stream);  // before the buffer: it may be regrown for this call
  if (bytes) lease.data = static_cast<char*>(stream_buffer(0, dev, stream, bytes));
  return lease;
}

void* unused_memory() { return reinterpret_cast<void*>(uintptr_t(1) << 16); }

DType cast_a_dtype(const Config& config, DType product) {
  return meta_or(config, "CAST_A", 0) && is_half(product) ? product : DType::f32;
}

namespace {

// Scratch memory for a copy one launch writes and the next reads: no zero
// promise, private to `stream` (to the calling thread on the CPU).
void* scratch(const Device& dev, void* stream, size_t bytes) {
  return stream_buffer(1, dev, stream, bytes);
}

// Held from asking for a stream's scratch until the last launch reading it is queued.
std::unique_lock<std::mutex> scratch_lock(const Device& dev, void* stream) {
  return stream_lock(1, dev, stream);
}

// A (rank 2 or 3) as rank 3, and a rank-3 copy of it seen in A's rank.
TensorView rank3_of(const TensorView& A) {
  return A.rank == 3 ? A
                     : restride(A, {1, A.shape[0], A.shape[1]}, {A.shape[0] * A.strides[0], A.strides[0], A.strides[1]});
}
TensorView in_rank_of(const TensorView& A, const TensorView& copy3) {
  return A.rank == 3 ? copy3 : TensorView::contiguous(copy3.data, copy3.dtype, {A.shape[0], A.shape[1]}, A.device);
}

bool casts(const TensorView& A, DType to) { return to != DType::f32 && A.dtype == DType::f32; }

}  // namespace

TensorView compiled_a(const TensorView& A, DType to, std::vector<autotune::KernelCall>& calls,
                      bool release) {
  if (!casts(A, to)) return A;
  const RunCopies c = run_copies({{rank3_of(A), to}}, nullptr, release);
  calls.push_back(c.calls[0]);
  return in_rank_of(A, c.copies[0]);
}

RunA run_a(const TensorView& A, DType to, const LaunchOptions& options, bool release) {
  if (!casts(A, to)) return {A, {}};
  RunCopies c = run_copies({{rank3_of(A), to}}, &options, release);
  RunA r;
  r.a = in_rank_of(A, c.copies[0]);
  r.lock = std::move(c.lock);
  r.graph_owned = std::move(c.graph_owned);
  return r;
}

RunCopies run_copies(const std::vector<std::pair<TensorView, DType>>& xs,
                     const LaunchOptions* options, bool release) {
  RunCopies r;
  if (xs.empty()) return r;
  const Device dev = xs[0].first.device;
  const auto bytes_of = [](const TensorView& x, DType to) {
    return (size_t(x.numel()) * size_t(dtype_size_bytes(to)) + 15) / 16 * 16;
  };
  size_t bytes = 0;
  for (const auto& [x, to] : xs) bytes += bytes_of(x, to);
  char* at = static_cast<char*>(unused_memory());
  if (options && bytes) {
    if (capturing(dev, options->stream)) {
      r.graph_owned = cuda::StreamOrderedBuffer(bytes, options->stream);
      at = static_cast<char*>(r.graph_owned.data());
    } else {
      r.lock = scratch_lock(dev, options->stream);
      at = static_cast<char*>(scratch(dev, options->stream, bytes));
    }
  }
  for (const auto& [x, to] : xs) {
    const TensorView copy = TensorView::contiguous(at, to, {x.shape[0], x.shape[1], x.shape[2]}, dev);
    at += bytes_of(x, to);
    CopyLaunch c = plan_copy_3d(x, copy, false);
    if (release) c.call.meta["RELEASE"] = 1;
    if (options && copy.numel()) launch(*c.call.kernel, c.call.args, c.grid, c.call.meta, *options);
    r.copies.push_back(copy);
    r.calls.push_back(c.call);
  }
  return r;
}

CopiedAdapters copied_adapters(const TensorView& A, std::optional<DType> a_to, const TensorView& B,
                               std::optional<DType> b_to, const LaunchOptions* options) {
  std::vector<std::pair<TensorView, DType>> xs;
  if (a_to) xs.push_back({A, *a_to});
  if (b_to) xs.push_back({B, *b_to});
  CopiedAdapters m{A, B, run_copies(xs, options)};
  if (a_to) m.A = m.copies.copies[0];
  if (b_to) m.B = m.copies.copies.back();
  return m;
}

void run_cast_3d(const TensorView& x, const TensorView& out, const LaunchOptions& options) {
  const CopyLaunch c = plan_copy_3d(x, out, false);
  launch(*c.call.kernel, c.call.args, c.grid, c.call.meta, options);
}

CallKey& CallKey::add(const TensorView& t) {
  add(int64_t(t.dtype) << 8 | int64_t(t.rank) | unit_stride_dims(t) << 16);
  for (int d = 0; d < t.rank; ++d) add(t.shape[size_t(d)]);
  return *this;
}

CallKey& CallKey::add(const Config& c) {
  add(c.block_m).add(c.block_k).add(c.split_k).add(c.num_warps).add(c.num_stages);
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the meta names and values
  for (const auto& [name, value] : c.meta) {
    for (const char ch : name) h = (h ^ uint8_t(ch)) * 1099511628211ull;
    for (int b = 0; b < 8; ++b) h = (h ^ uint8_t(uint64_t(value) >> (8 * b))) * 1099511628211ull;
  }
  return add(int64_t(h));
}

void expect_meta(const char* op, const Config& config, std::initializer_list<MetaRange> allowed) {
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"block_m", config.block_m},
                                    {"block_k", config.block_k},
                                    {"split_k", config.split_k},
                                    {"num_warps", config.num_warps},
                                    {"num_stages", config.num_stages}})
    if (value < 0)
      throw InvalidArgument(std::string(op) + ": Config." + name + " must be >= 0 (0 lets kerf choose), got " +
                            std::to_string(value));
  if (config.num_stages > 8)
    throw InvalidArgument(std::string(op) + ": Config.num_stages must be at most 8 (0 lets kerf choose), got " +
                          std::to_string(config.num_stages));
  if (config.split_k > 65535)
    throw InvalidArgument(std::string(op) + ": Config.split_k must be at most 65535 (programs on grid axis 1), got " +
                          std::to_string(config.split_k));
  // Tiles are powers of two (kernels pad nothing: they mask the tail of the last one).
  for (const auto& [name, value, most] : {std::tuple<const char*, int64_t, int64_t>{"block_m", config.block_m, 1024},
                                          {"block_k", config.block_k, 1024},
                                          {"num_warps", config.num_warps, 32}})
    if (value && (value > most || (value & (value - 1))))
      throw InvalidArgument(std::string(op) + ": Config." + name + " must be a power of two up to " +
                            std::to_string(most) + " (0 lets kerf choose), got " + std::to_string(value));
  for (const auto& [name, value] : config.meta) {
    const MetaRange* range = nullptr;
    for (const MetaRange& a : allowed)
      if (name == a.name) range = &a;
    if (!range) {
      std::string takes;
      for (const MetaRange& a : allowed) takes += (takes.empty() ? "" : ", ") + std::string(a.name);
      throw InvalidArgument(std::string(op) + ": Config.meta names '" + name + "', which this op does not take (" +
                            (takes.empty() ? std::string("it takes none") : "it takes " + takes) + ")");
    }
    if (value < range->lo || value > range->hi)
      throw InvalidArgument(std::string(op) + ": Config.meta " + name + " must be in [" + std::to_string(range->lo) +
                            ", " + std::to_string(range->hi) + "], got " + std::to_string(value));
    if (range->takes && !range->takes(value))
      throw InvalidArgument(std::string(op) + ": Config.meta " + name + " must be " + range->takes_text + ", got " +
                            std::to_string(value));
  }
}

Config with_own_tile(const Config& given, int64_t block_m, int64_t block_k, int64_t warps, int64_t stages,
                     const std::map<std::string, int64_t>& meta) {
  Config c = given;
  c.block_m = block_m;
  c.block_k = block_k;
  if (!c.num_warps) c.num_warps = warps;
  if (!c.num_stages) c.num_stages = stages;
  for (const auto& [name, value] : meta) c.meta.emplace(name, value);
  return c;
}

Config with_ring_tile(const Config& given) {
  return with_own_tile(given, 64, 128, 4, 3, {{"WGMMA", 1}, {"STORE_IN_RING", 1}, {"L2_PREFETCH", 128}});
}

bool one_tile_own_allowed(const Config& given, const TensorView& W) {
  return W.rank > 0 && W.strides[size_t(W.rank - 1)] == 1 && !given.meta.count("STREAM") &&
         meta_or(given, "ONE_TILE", 1) && !given.meta.count("WALK_ROWS");
}

Config with_one_tile(const Config& given, int64_t block_m, int64_t block_k, int64_t warps) {
  return with_own_tile(given, block_m, block_k, warps, 1, {{"STREAM", 1}, {"ONE_TILE", 1}});
}

void add_codegen_hints(const Config& config, dsl::MetaMap& meta, int64_t wgmma_ss_default) {
  if (const int64_t bytes = meta_or(config, "L2_PREFETCH", 0)) meta["l2_prefetch"] = bytes;
  if (meta_or(config, "WGMMA", 0)) meta["wgmma"] = 1;
  if (meta_or(config, "WGMMA", 0) && meta_or(config, "WGMMA_SS", wgmma_ss_default)) meta["wgmma_ss"] = 1;
  if (meta_or(config, "STAGED_ADDS", 0)) meta["staged_adds"] = 1;
  if (meta_or(config, "ACC_STORE", 0)) meta["acc_store"] = 1;
  if (meta_or(config, "STORE_IN_RING", 0)) meta["store_in_ring"] = 1;
}

Config stream_plan(const Config& config, DType w, int64_t steps, dsl::MetaMap& meta, int64_t* split) {
  Config order = config;
  if (!meta_or(config, "STREAM", 0)) return order;
  *split = std::clamp<int64_t>(steps, 1, 65535);
  meta["num_stages"] = 1;
  meta["acc_col_run"] = 16 / int64_t(dtype_size_bytes(w));
  meta.erase("l2_prefetch");  // a hint of pipelined copies: there are none
  meta.erase("store_in_ring");  // nor a ring to stage in (the same kernel, compiled once)
  // ONE_TILE: the kernel's one-tile form, W's tile asked for before the adapters' (a program
  // for every column block).
  if (meta_or(config, "ONE_TILE", 0) && *split == steps) meta["ONE_TILE"] = 1;
  order.meta["COLS_FIRST"] = 1;
  return order;
}

Grid row_slice_grid(int64_t row_blocks, int64_t slices, int64_t batch, const Config& config, dsl::MetaMap& meta) {
  if (meta_or(config, "COLS_FIRST", 0) && row_blocks <= 65535) {
    meta["COLS_FIRST"] = 1;
    return Grid{uint32_t(slices), uint32_t(row_blocks), uint32_t(batch)};
  }
  meta.erase("COLS_FIRST");
  return Grid{uint32_t(row_blocks), uint32_t(slices), uint32_t(batch)};
}

void pass_meta(const Config& config, dsl::MetaMap& meta, std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (const int64_t v = meta_or(config, name, 0)) meta[name] = v;
}

size_t CallKeyHash::operator()(const CallKey& k) const {
  uint64_t h = k.n;
  for (size_t i = 0; i < k.n; ++i) h = (h ^ uint64_t(k.words[i])) * 0x100000001b3ull + (h >> 29);
  return size_t(h);
}

int64_t split_for(int64_t blocks, int64_t programs, int64_t steps) {
  return std::clamp<int64_t>(cdiv(3 * programs, std::max<int64_t>(blocks, 1)), 1,
                             std::max<int64_t>(1, steps));
}

int64_t split_for_waves(int64_t blocks, int64_t programs, int64_t steps, int64_t waves) {
  return std::clamp<int64_t>(waves * programs / std::max<int64_t>(blocks, 1), 1, std::max<int64_t>(1, steps));
}

// On an H100 at r=64, the ring tile (64x128), slices 2 / 4 / 8 / 16 / 32: 4096x4096 47.2 /
// 30.8 / 30.7 / 31.2 / 33.7 us, 8192x8192 103.3 / 102.2 / 101.7 / 101.0 / 101.3, 14336x4096
// 141.7 / 90.2 / 92.0 / 90.4 / 90.7 (r=32: 40.9 / 30.4 / 29.6 / 29.9 / 31.4, 102.9 / 101.2 /
// 100.9 / 100.4 / 99.7, 121.2 / 90.3 / 90.2 / 89.1 / 88.8); this gives 8, 8 and 16. On two
// stages (three programs a multiprocessor), r=64, slices 4 / 8 / 16: 4096x4096 33.9 / 30.2 /
// 31.5, 8192x8192 100.3 / 100.3 / 102.6, 14336x4096 100.4 / 88.8 / 90.7; this gives 4, 8, 8.
int64_t walk_rows_split(int64_t col_blocks, int64_t programs, int64_t row_steps, int64_t stages) {
  return split_for_waves(col_blocks, programs, std::max<int64_t>(1, row_steps / 8), stages <= 2 ? 2 : 4);
}

int parallelism(const Device& dev) {
  if (!dev.is_cuda()) return jit::cpu::thread_count();
  static std::mutex mu;
  static std::map<int, int> sms;
  std::lock_guard<std::mutex> lock(mu);
  auto it = sms.find(dev.index);
  if (it != sms.end()) return it->second;
  const int n = cuda::device_info(dev.index).sm_count;
  sms[dev.index] = n;
  return n;
}

namespace {
thread_local std::string planning_arch;  // PlanningArch's ("": ask the device)
}  // namespace

PlanningArch::PlanningArch(std::string arch) : previous_(std::exchange(planning_arch, std::move(arch))) {}

PlanningArch::~PlanningArch() { planning_arch = std::move(previous_); }

bool wgmma_target(const Device& dev) {
  if (!dev.is_cuda()) return false;
  if (!planning_arch.empty()) return planning_arch == "sm_90a";
  try {
    return device_arch(dev.index) == "sm_90a";
  } catch (const std::exception&) {
    return false;
  }
}

namespace {
thread_local bool t_checks_only = false;
}  // namespace

bool checks_only() { return t_checks_only; }
ChecksOnly::ChecksOnly() : before_(t_checks_only) { t_checks_only = true; }
ChecksOnly::~ChecksOnly() { t_checks_only = before_; }

}  // namespace kerf::ops::detail
