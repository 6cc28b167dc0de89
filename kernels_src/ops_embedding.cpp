// ops::lora_embedding and its backward: argument checks, id checking, the
// vocab-parallel layout, launches.
//
// Ids out of range: on the CPU the ids are read and checked before any launch.
// On a GPU the host cannot read them without waiting, so the kernels check
// every id themselves: an id outside [0, vocab) is never used as an address
// (its lanes are masked; the token's output row is zeros) and is recorded in
// a small per-(device, stream) record, which the op reads after the launch
// (IdCheck::sync) or check_embedding_ids() reads later (IdCheck::deferred).
#include <algorithm>
#include <bit>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "kerf/jit/launch.h"
#include "kerf/kernels/kernels.h"
#include "kerf/ops/ops.h"
#include "kerf/runtime/cuda.h"
#include "ops_accumulate.h"
#include "ops_checks.h"
#include "ops_common.h"
#include "ops_layout.h"
#include "ops_tune.h"

namespace kerf::ops {

using namespace detail;

namespace {

constexpr int kRecordSlots = 4;  // count, first position, its id, the vocabulary size

// The bad-id records the kernels write on a GPU: zero until an id is out of range.
// One per (device, stream), and one per device for the launches of captured CUDA
// graphs, which may run on any stream at any later time. Nothing may be allocated
// while a stream captures, so the graph record is made with the device's first
// stream record, before any capture can need it.
struct GraphRecord {
  cuda::DeviceBuffer buf;
  bool used = false;  // a captured call has taken it: checks read it from then on
};
struct Records {
  std::mutex mu;
  std::map<std::pair<int, void*>, cuda::DeviceBuffer> by_stream;  // nodes never move
  std::map<int, GraphRecord> for_graphs;                          // by device
};

Records& records() {
  static Records r;
  return r;
}

cuda::DeviceBuffer new_record(int device) {
  cuda::DeviceBuffer buf(kRecordSlots * 8, device);
  buf.fill_bytes(0);
  return buf;
}

cuda::DeviceBuffer& device_record(const Device& dev, void* stream) {
  Records& r = records();
  std::lock_guard<std::mutex> lock(r.mu);
  cuda::DeviceBuffer& buf = r.by_stream[{dev.index, stream}];
  if (!buf.bytes()) {
    buf = new_record(dev.index);
    GraphRecord& graphs = r.for_graphs[dev.index];
    if (!graphs.buf.bytes()) graphs.buf = new_record(dev.index);
  }
  return buf;
}

// The graph record of `dev` for a call being captured on `op`'s behalf.
cuda::DeviceBuffer& graph_record(const char* op, const Device& dev) {
  Records& r = records();
  std::lock_guard<std::mutex> lock(r.mu);
  const auto it = r.for_graphs.find(dev.index);
  if (it == r.for_graphs.end())
    throw InvalidArgument(std::string(op) + ": the first embedding call on " + dev.str() +
                          " is being captured into a CUDA graph; call it once before the capture (a "
                          "warm-up, as for PyTorch's own ops), so that kerf can set up the record of "
                          "bad token ids, which it cannot allocate during a capture");
  it->second.used = true;
  return it->second.buf;
}

TensorView record_view(const Device& dev, cuda::DeviceBuffer& buf) {
  return TensorView::contiguous(buf.data(), DType::i64, {kRecordSlots}, dev);
}

TensorView error_record(const char* op, const Device& dev, void* stream) {
  if (!dev.is_cuda()) {
    // CPU ids are checked before the launch; the kernels' record is never read.
    thread_local int64_t host[kRecordSlots] = {0, 0, 0, 0};
    return TensorView::contiguous(host, DType::i64, {kRecordSlots}, dev);
  }
  if (capturing(dev, stream)) return record_view(dev, graph_record(op, dev));
  return record_view(dev, device_record(dev, stream));
}

// Where token `pos` (x's elements counted in order) lies in x: "x[1, 1]" for a 2-d x
// when the call's x is known, else "x[pos]".
std::string id_position(int64_t pos, const TensorView* x) {
  if (!x || x->rank <= 1) return "x[" + std::to_string(pos) + "]";
  std::vector<int64_t> index(size_t(x->rank), 0);
  for (int d = x->rank - 1; d >= 0; --d) {
    const int64_t n = x->shape[size_t(d)];
    index[size_t(d)] = n > 0 ? pos % n : 0;
    pos = n > 0 ? pos / n : 0;
  }
  std::string text = "x[";
  for (size_t d = 0; d < index.size(); ++d) text += (d ? ", " : "") + std::to_string(index[d]);
  return text + "]";
}

// `hint`: what the message adds (how the vocabulary's size was reckoned, where a layout did).
std::string bad_id_message(const char* op, int64_t count, int64_t pos, int64_t id, int64_t vocab,
                           const TensorView* x, const std::string& hint = {}) {
  std::string m = std::string(op) + ": token id " + id_position(pos, x) + " = " + std::to_string(id) +
                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")";
  if (count > 1) m += " (" + std::to_string(count) + " ids out of range in all)";
  return m + hint;
}

// Reads `rec` after `stream`'s work (not the whole device's: other streams' work, NCCL's
// say, runs on) and clears it; throws when it holds a bad id.
void throw_if_recorded(const std::string& op, cuda::DeviceBuffer& rec, void* stream, const TensorView* x,
                       const std::string& hint = {}) {
  int64_t host[kRecordSlots] = {0, 0, 0, 0};
  rec.copy_to_host_after(stream, host, sizeof host);
  if (host[0] == 0) return;
  rec.fill_bytes_async(0, stream);
  cuda::stream_synchronize(stream, rec.device());
  throw InvalidArgument(bad_id_message(op.c_str(), host[0], host[1], host[2], host[3], x, hint));
}

// Waits for `stream`, reads its GPU record and clears it; throws when it holds a bad
// id. Then the same for the device's graph record, once a captured call has used it.
// A call being captured checks nothing: its launches run later, from the graph, and
// record into the graph record, which the next check on the device reads.
// `x`: the ids of the call that checks (null for a later check, which cannot tell whose
// ids the record holds).
void throw_recorded_bad_ids(const char* op, const Device& dev, void* stream, const TensorView* x,
                            const std::string& hint = {}) {
  const bool from_op = x != nullptr;
  if (capturing(dev, stream)) {
    if (from_op) return;
    // Before device_record: a stream's first record would be allocated, which a capture refuses.
    throw InvalidArgument(std::string(op) +
                          ": cannot wait for a CUDA stream while it captures a graph; check after the capture");
  }
  cuda::DeviceBuffer& rec = device_record(dev, stream);
  throw_if_recorded(op, rec, stream, x, hint);
  Records& r = records();
  cuda::DeviceBuffer* graphs = nullptr;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    const auto it = r.for_graphs.find(dev.index);
    if (it != r.for_graphs.end() && it->second.used) graphs = &it->second.buf;
  }
  if (graphs) throw_if_recorded(std::string(op) + " (a launch of a captured CUDA graph)", *graphs, stream, nullptr);
}

// Ids on the host: check them all before anything runs.
void check_host_ids(const char* op, const TensorView& x, const TensorView& x1, int64_t vocab,
                    const std::string& hint = {}) {
  const auto* base = static_cast<const uint8_t*>(x1.data);
  const int64_t n = x1.shape[0], stride = x1.strides[0];
  int64_t count = 0, first_pos = -1, first_id = 0;
  for (int64_t t = 0; t < n; ++t) {
    int64_t id;
    if (x1.dtype == DType::i32) {
      int32_t v;
      std::memcpy(&v, base + (t * stride) * 4, 4);
      id = v;
    } else {
      std::memcpy(&id, base + (t * stride) * 8, 8);
    }
    if (id >= 0 && id < vocab) continue;
    if (count++ == 0) {
      first_pos = t;
      first_id = id;
    }
  }
  if (count) throw InvalidArgument(bad_id_message(op, count, first_pos, first_id, vocab, &x, hint));
}

// The kernels count tokens in 32 bits: x's dims may each fit and their product not.
void expect_token_count(const char* op, const TensorView& x) {
  if (x.numel() > INT32_MAX)
    throw InvalidArgument(std::string(op) + ": x (" + x.describe() + ") holds " +
                          std::to_string(x.numel()) +
                          " tokens; at most 2^31 - 1 a call are supported");
}

// x's token dims as one [T]; refused when their strides do not nest (a transposed or
// expanded view of ids).
TensorView flatten_ids(const char* op, const TensorView& x) {
  std::vector<int64_t> sizes, strides;
  for (int d = 0; d < x.rank; ++d) {
    sizes.push_back(x.shape[size_t(d)]);
    strides.push_back(x.strides[size_t(d)]);
  }
  const MergedDims m = merge_dims(sizes, {strides});
  if (m.sizes.size() != 1)
    throw InvalidArgument(std::string(op) + ": the token dims of x (" + x.describe() +
                          ") do not flatten to one dim (their strides do not nest, as in a transposed "
                          "or expanded view); pass a contiguous copy of x");
  const int64_t T = x.numel();
  return restride(x, {T}, {T > 1 ? m.strides[0][0] : 1});
}

// x [...] and a tensor [..., dim] whose leading dims are x's, as [T] and [T, dim].
void flatten_tokens(const char* op, const TensorView& x, const char* yname, const TensorView& y,
                    TensorView* x1, TensorView* y2) {
  std::vector<int64_t> sizes;
  std::vector<std::vector<int64_t>> strides(2);
  for (int d = 0; d < x.rank; ++d) {
    sizes.push_back(x.shape[size_t(d)]);
    strides[0].push_back(x.strides[size_t(d)]);
    strides[1].push_back(y.strides[size_t(d)]);
  }
  const MergedDims m = merge_dims(sizes, strides);
  if (m.sizes.size() != 1) {
    // Which one cannot: x on its own (refused by flatten_ids), or the two together.
    (void)flatten_ids(op, x);
    throw InvalidArgument(std::string(op) + ": the token dims of x (" + x.describe() + ") and " + yname + " (" +
                          y.describe() + ") must flatten alike to one dim (strides that nest in the same order)");
  }
  const int64_t T = x.numel();
  *x1 = restride(x, {T}, {T > 1 ? m.strides[0][0] : 1});
  const int64_t dim = y.shape[size_t(y.rank - 1)];
  *y2 = restride(y, {T, dim}, {T > 1 ? m.strides[1][0] : dim, y.strides[size_t(y.rank - 1)]});
}

std::vector<int64_t> tokens_and(const TensorView& x, int64_t last) {
  std::vector<int64_t> s(x.shape.begin(), x.shape.begin() + x.rank);
  s.push_back(last);
  return s;
}

std::vector<std::string> x_dims(const TensorView& x, bool with_dim) {
  std::vector<std::string> d;
  for (int i = 0; i < x.rank; ++i) {
    d.emplace_back("x");  // "x0", "x1", ... (appended: GCC 12 warns on "x" + std::string)
    d.back() += std::to_string(i);
  }
  if (with_dim) d.push_back("dim");
  return d;
}

// A call's operands for its layout, with after_a (x's dims, then r) when given.
std::vector<OperandDims> with_after_a(const EmbeddingOptions& options, const TensorView& x,
                                      std::vector<OperandDims> operands) {
  if (options.after_a) {
    std::vector<std::string> d = x_dims(x, false);
    d.push_back("r");
    operands.push_back({"after_a", d});
  }
  return operands;
}

// The vocabulary this shard holds: ids [start, start + local) of `total`.
struct VocabRange {
  int64_t start = 0, total = 0;
  // Where the size was reckoned from even shards (a split with no vocab_start): what an
  // out-of-range id's message adds, since uneven shards would show up as such an id.
  std::string hint;
};

VocabRange vocab_range(const char* op, const Layout& layout, const LayoutSplits& splits, int64_t local,
                       const EmbeddingOptions& options) {
  const DimSplit& split = splits.of("vocab");
  const std::string over = split.str();  // "'vp'", "('dp', 'tp')"
  if (options.vocab_start || options.vocab_size) {
    if (!options.vocab_start || !options.vocab_size)
      throw InvalidArgument(std::string(op) + ": vocab_start and vocab_size go together (a shard's first id and "
                            "the whole vocabulary's size), got only " +
                            (options.vocab_start ? "vocab_start" : "vocab_size"));
    const int64_t start = *options.vocab_start, total = *options.vocab_size;
    // The whole vocabulary as the one shard of a vocab split over mesh axes of size 1 (as
    // code sizing its mesh from the world size gives on one device) says nothing wrong.
    const bool one_shard = splits.named.count("vocab") != 0;
    if (split.empty() && !(one_shard && start == 0 && total == local))
      throw InvalidArgument(std::string(op) + ": vocab_start and vocab_size describe a vocabulary shard, but the "
                            "layout does not split 'vocab' (weight's dim 0, A's dim 1)");
    if (start < 0 || total < local || start > total - local)
      throw InvalidArgument(std::string(op) + ": this shard's ids [" + std::to_string(start) + ", " +
                            std::to_string(start) + " + " + std::to_string(local) +
                            ") do not lie in the vocabulary [0, " + std::to_string(total) + ")");
    // With this device's coordinates given too, the two must not contradict each other.
    // Shards lie in coordinate order but may be of any sizes (custom cuts, torch.chunk's
    // empty trailing ones), so one shard tells only this much: the first (c = 0) starts at
    // 0, and the last (c = n - 1) ends at the vocabulary's size.
    if (!layout.coords.empty() && local > 0 && !split.empty()) {
      const int64_t n = layout.shard_count(split), c = layout.shard_index(split);
      const bool first_ok = c != 0 || start == 0, last_ok = c != n - 1 || start + local == total;
      if (!first_ok || !last_ok)
        throw InvalidArgument(std::string(op) + ": vocab_start " + std::to_string(start) + " (ids [" +
                              std::to_string(start) + ", " + std::to_string(start + local) + ") of " +
                              std::to_string(total) + ") disagrees with the layout's " +
                              (split.axes.size() > 1 ? "shard " : "coordinate ") + std::to_string(c) + " of " +
                              std::to_string(n) + " on " + over + " (" +
                              (first_ok ? "the last shard ends at the vocabulary's size"
                                        : "the first shard starts at 0") +
                              ")");
    }
    return {start, total};
  }
  if (split.empty()) return {0, local};
  // check_layout has left out axes of size 1 and checked any coordinates given: they are
  // there or absent.
  const int64_t n = layout.shard_count(split);
  if (layout.coords.empty())
    throw InvalidArgument(std::string(op) + ": layout: the vocabulary is split over " + over +
                          ", so this device's coordinates are needed (Layout::coords, one per mesh axis: " +
                          std::to_string(layout.mesh.size()) + "), got " + std::to_string(layout.coords.size()));
  const int64_t c = layout.shard_index(split);
  VocabRange r;
  if (__builtin_mul_overflow(c, local, &r.start) || __builtin_mul_overflow(n, local, &r.total))
    throw InvalidArgument(std::string(op) + ": layout: " + std::to_string(n) + " vocabulary shards of " +
                          std::to_string(local) + " ids overflow 64 bits");
  r.hint = " (the layout splits the vocabulary over " + over + " into " + std::to_string(n) +
           " even shards of this shard's " + std::to_string(local) + " ids; shards of other sizes need "
           "vocab_start and vocab_size)";
  return r;
}

void expect_ids(const char* op, const TensorView& x) {
  if (x.rank < 1)
    throw InvalidArgument(std::string(op) + ": x must have at least one dimension, got a scalar");
  if (x.rank > kMaxRank)
    throw InvalidArgument(std::string(op) + ": x has rank " + std::to_string(x.rank) + ", more than the " +
                          std::to_string(kMaxRank) + " a tensor view holds");
  expect_dtype(op, "x", x, {DType::i32, DType::i64});
}

int64_t padding_id(const char* op, const EmbeddingOptions& o, int64_t total) {
  if (!o.padding_idx) return -1;
  const int64_t p = *o.padding_idx < 0 ? *o.padding_idx + total : *o.padding_idx;
  if (p < 0 || p >= total)
    throw InvalidArgument(std::string(op) + ": padding_idx " + std::to_string(*o.padding_idx) +
                          " is outside the vocabulary [-" + std::to_string(total) + ", " +
                          std::to_string(total) + ")");
  return p;
}

// The product's dtype for a weight/gradient dtype `t`, the adapter dtypes and the
// output's: half adapters of one dtype multiply as they are (their values exact, the
// scale applied after); fp32 adapters multiply in fp32 where the output keeps fp32
// (as PEFT's fp32 adapters give an fp32 LoRA term), else in a half table's dtype,
// whose rounding the output's own then dominates.
Product embedding_dot(DType t, DType a, DType b, DType out, bool* scale_after) {
  *scale_after = is_half(a) && a == b;
  if (*scale_after) return a;
  if (out == DType::f32) return DType::f32;
  return product_dtype(t, a, b);
}

// One forward call on flattened ids x1 [T] and out2 [T, D].
struct EmbeddingForward {
  TensorView x1, weight, A, B;
  double s;
  TensorView out2;
  VocabRange vr;
  LaunchOptions lo;
  std::optional<TensorView> act;  // EmbeddingOptions::after_a as [T, r], written
};

// The kernels' `act` argument: the activations given as [T, r], or an empty stand-in.
TensorView act_arg(const std::optional<TensorView>& act, const TensorView& A, const Device& dev) {
  return act ? *act : TensorView::contiguous(nullptr, A.dtype, {0, A.shape[0]}, dev);
}

struct EmbeddingLaunch {
  dsl::MetaMap meta;
  Grid grid;
};

// `programs`: multiprocessors (CPU threads) the launch should fill.
EmbeddingLaunch plan_embedding(const EmbeddingForward& c, const Config& config, int64_t programs) {
  const int64_t T = c.x1.shape[0], D = c.weight.shape[1], r = c.A.shape[0];
  const bool gpu = c.x1.device.is_cuda();
  bool scale_after = false;
  const Product dot = embedding_dot(c.weight.dtype, c.A.dtype, c.B.dtype, c.out2.dtype, &scale_after);
  // GPU: 128x128 tiles (64x128 for an fp32 table: three stages of 128x128 fp32
  // rows do not fit in shared memory), D shared by one full wave of programs (the
  // tuner's choice at 8192x128256x4096 in bf16 on an H100: 58.6 us against 67.3
  // us for 32-token blocks split for about three waves). 64-token blocks too where the
  // rank's operands take 4 bytes at rank 64 and up (fp32 adapters or a TF32 product on a
  // half table: 282624 bytes on 128-token blocks at rank 64).
  const int64_t r_pad = rank_pad(r);
  const int64_t bytes = rank_bytes(dot, c.A.dtype, c.B.dtype);
  const int64_t bt = config.block_m ? config.block_m
                     : gpu          ? (dtype_size_bytes(c.weight.dtype) > 2 || (bytes >= 4 && r_pad >= 64) ? 64 : 128)
                                    : 16;
  const int64_t bd = config.block_k ? config.block_k : (gpu ? rank_narrowed(128, r_pad, bytes, 256) : 64);
  const int64_t blocks = cdiv(T, bt), steps = cdiv(D, bd);
  const int64_t split = config.split_k ? config.split_k
                        : gpu          ? split_for_waves(blocks, programs, steps, 1)
                                       : split_for(blocks, programs, steps);
  EmbeddingLaunch l;
  l.meta = {{"BLOCK_T", bt},
            {"BLOCK_D", bd},
            {"R_PAD", r_pad},
            {"SCALE_AFTER", scale_after ? 1 : 0},
            {"num_warps", config.num_warps ? config.num_warps : (gpu && bt >= 128 ? 8 : 4)},
            {"num_stages", config.num_stages ? config.num_stages : (gpu ? 3 : 1)}};
  set_product_meta(l.meta, dot, config);
  pass_meta(config, l.meta, {"WARPS_N"});
  add_codegen_hints(config, l.meta);
  if (c.act) l.meta["STORE_ACT"] = 1;
  l.grid = Grid{uint32_t(blocks), uint32_t(split), 1};
  return l;
}

std::vector<Arg> embedding_args(const EmbeddingForward& c, const TensorView& record) {
  return {c.x1,   c.weight, c.A, c.B, Scalar(c.s), c.out2, record, Scalar(c.vr.start), Scalar(c.vr.total),
          act_arg(c.act, c.A, c.x1.device)};
}

// `record`: where the kernel notes ids out of range (error_record, or a tuning's own).
// `memo`: where the launch remembers its kernel (a plan's own, next to l.meta), or null.
void run_embedding(const EmbeddingForward& c, const EmbeddingLaunch& l, const TensorView& record,
                   LaunchMemo* memo = nullptr) {
  LaunchOptions lo = c.lo;
  lo.memo = memo;
  launch(kernels::lora_embedding(), embedding_args(c, record), l.grid, l.meta, lo);
}

void run_embedding(const EmbeddingForward& c, const Config& config, const TensorView& record) {
  run_embedding(c, plan_embedding(c, config, parallelism(c.x1.device)), record);
}

// Checks EmbeddingOptions::after_a of a call on ids `x` with rank r (x's shape + r) and
// adds it to the call's tensors `all`.
void expect_after_a(const char* op, const EmbeddingOptions& options, const TensorView& x, int64_t r,
                    std::vector<std::pair<const char*, const TensorView*>>& all) {
  if (!options.after_a) return;
  expect_shape(op, "after_a", *options.after_a, tokens_and(x, r));
  all.push_back({"after_a", &*options.after_a});
}

// after_a as [T, r] when given (its token dims flattened as x's).
std::optional<TensorView> flat_after_a(const char* op, const EmbeddingOptions& options, const TensorView& x) {
  if (!options.after_a) return std::nullopt;
  TensorView x1, act;
  flatten_tokens(op, x, "after_a", *options.after_a, &x1, &act);
  return act;
}

// A forward call's launch as repeated calls reuse it: the plan and the kernel it resolved to.
struct EmbeddingPlan {
  EmbeddingLaunch launch;
  mutable LaunchMemo memo;
};

// Stands for the error record where kernels are only compiled (never dereferenced).
TensorView stand_in_record(const Device& dev) {
  return TensorView::contiguous(reinterpret_cast<void*>(uintptr_t(1) << 16), DType::i64, {kRecordSlots}, dev);
}

// The record a tuning's runs write to: bad ids they meet are the call's own, which
// the call itself reports once; the candidates' many runs must not count them again.
class TuningRecord {
 public:
  explicit TuningRecord(const Device& dev) : dev_(dev) {}
  // Made at the first timed run, never before: a call that does not tune (its stream
  // captures a CUDA graph, where nothing may be allocated) never makes it.
  const TensorView& view() {
    if (view_.data) return view_;
    if (!dev_.is_cuda()) {
      view_ = error_record("", dev_, nullptr);  // CPU ids were checked before the launch
      return view_;
    }
    buf_ = cuda::DeviceBuffer(kRecordSlots * 8, dev_.index);
    buf_.fill_bytes(0);
    view_ = TensorView::contiguous(buf_.data(), DType::i64, {kRecordSlots}, dev_);
    return view_;
  }

 private:
  Device dev_;
  cuda::DeviceBuffer buf_;
  TensorView view_;
};

std::vector<autotune::Config> embedding_gpu_candidates() {
  return autotune::product(
      {{"BLOCK_T", {16, 32, 64, 128}}, {"BLOCK_D", {64, 128, 256}}, {"num_warps", {4, 8}}, {"num_stages", {3}}});
}

// The one-kernel backward's tiles. (GATHER is not tried: at 8192 tokens, vocab
// 128256, dim 4096 on an H100 its best configuration took 77.6 us against 54.0.)
std::vector<autotune::Config> embedding_backward_gpu_candidates() {
  return autotune::product({{"BLOCK_T", {32, 64, 128, 256}},
                            {"BLOCK_D", {32, 64, 128}},
                            {"num_warps", {4, 8}},
                            {"num_stages", {3}},
                            {"ROTATE", {0, 1}}});
}

Config tuned_embedding_config(const EmbeddingForward& c) {
  const int64_t T = c.x1.shape[0], V = c.weight.shape[0], D = c.weight.shape[1], r = c.A.shape[0];
  TuneRequest q;
  q.problem = {"lora_embedding",
               {next_pow2(T), next_pow2(V), next_pow2(D), rank_pad(r)},
               {c.weight.dtype, c.A.dtype, c.B.dtype, c.out2.dtype, c.x1.dtype},
               "",
               c.x1.device};
  add_memory_order(q.problem.shape_bucket, c.weight);
  q.block_m_name = "BLOCK_T";
  q.block_k_name = "BLOCK_D";
  // Each tile with D shared by the programs of one full wave (the default), two and three.
  q.gpu_candidates = with_wave_splits(embedding_gpu_candidates(), "BLOCK_T", T, "BLOCK_D", D, 1,
                                      parallelism(c.x1.device), {2, 3}, /*default_waves=*/1);
  bool scale_after = false;
  q.finalist_variants =
      with_l2_prefetch_variants(with_warps_n_variants({}, embedding_dot(c.weight.dtype, c.A.dtype, c.B.dtype, c.out2.dtype, &scale_after)));
  q.extent_m = T;
  q.extent_k = D;
  q.split_programs = parallelism(c.x1.device);
  q.kernels = [&](const Config& config) {
    return std::vector<autotune::KernelCall>{
        {&kernels::lora_embedding(), embedding_args(c, stand_in_record(c.x1.device)),
         plan_embedding(c, config, parallelism(c.x1.device)).meta}};
  };
  TuningRecord record(c.x1.device);
  q.run = [&](const Config& config) { run_embedding(c, config, record.view()); };
  q.stream = c.lo.stream;
  return tuned_config(q);
}

// One backward call on flattened ids x1 [T] and g2 [T, D]; dA3 [1, r, V], dB3 [1, D, r].
struct EmbeddingBackward {
  TensorView x1, A, B, g2;
  double s;
  TensorView dA3, dB3;
  bool by_freq;
  VocabRange vr;
  int64_t padding;
  LaunchOptions lo;
  std::optional<TensorView> act;  // EmbeddingOptions::after_a as [T, r], read
};

struct EmbeddingBackwardPlan {
  dsl::MetaMap meta;
  Grid grid;
  int64_t block_t;
  // Whether the zero-fill of the f32 gradients lets the kernel start as the fill
  // starts (else as the fill ends; the kernel waits for it before its atomics): only
  // for tiles of at least 128x128. On an H100 at 8192x128256x4096 smaller ones, of
  // which several programs fit on one SM, ran 1.5-3x slower started beside the fill
  // (128x64: 46 -> 71-79 us), larger ones gained 1-3 us; started as the fill ends
  // no tile lost.
  bool release_early = false;
  // Whether the fill writes dA and dB evict-last and the kernel puts them back
  // (L2_KEEP): the atomics then add into zeros still in L2 instead of fetching
  // them back after the kernel's stream of g has pushed them out. On an H100 at
  // 8192x128256x4096 (128x128 tiles, gradients rotating between calls) 44.8 -> 42.5 us.
  bool keep_in_l2 = false;
  // GROUP_BY_ID: the tokens of an id add into one row of a [T, r] workspace, and a kernel
  // of its own writes each column of dA once (no zero-fill of dA, no scattered atomics).
  bool grouped = false;
  // FUSED (GPU; grouped, or dA f32): the call as one cooperative kernel whose programs
  // wait for each other (lora_embedding_backward_fused), where the grid fits on the GPU
  // at once; ungrouped (dA f32) the tokens add into dA itself (its meta DIRECT_A). On an
  // H100 at 8192x128256x4096, r=16 (128x128, 4 warps) DIRECT_A took 47.2 us against 42.2
  // for the ungrouped launches, and 48.2-48.3 against 46.3 grouped with scale_grad_by_freq.
  bool fused = false;
  bool direct_a = false;
};

// Whether a call without GROUP_BY_ID in its Config is grouped (see below).
bool groups_by_default(const EmbeddingBackward& c) {
  return c.x1.device.is_cuda() && (c.dA3.dtype != DType::f32 || c.by_freq) && c.x1.shape[0] <= c.A.shape[1];
}

// The dtype of the activations the backward multiplies grad_out by (after_a's, else A's).
DType activation_dtype(const EmbeddingBackward& c) { return c.act ? c.act->dtype : c.A.dtype; }

// grad_out's products with the activations and with B.
Product backward_product(const EmbeddingBackward& c) {
  return product_dtype(c.g2.dtype, activation_dtype(c), c.B.dtype);
}

// The backward's own config on a GPU (a call whose Config names no tile: untuned, or a
// first call inside a graph capture), `given` with what it leaves unsaid filled in: for a
// 16-bit product up to rank 16, the tuner's usual choice on an H100, 128x128 tiles on 4
// warps and 3 stages with ROTATE, STAGED_ADDS and WGMMA (targets other than sm_90a ignore
// it), and FUSED where the call groups by id (`grouped`). Otherwise `given` as it is (the
// plan's own tiles). On an H100 at 8192 tokens, vocab 128256, dim 4096, r=16 the plan's
// own 128x128 on 8 warps (mma.sync, three launches) took about 44-45 us with bf16
// gradients, these 39.7-39.9 (fused; 41.1-41.4 with fp32 gradients fused, 39.2 tuned
// without FUSED, which fp32 gradients do not group). Before WGMMA the tuner chose the same
// tile, FUSED, ROTATE and STAGED_ADDS on mma.sync (42.4-43.0 us).
Config own_config(const Config& given, Product product, int64_t r_pad, bool grouped, bool gpu) {
  if (!gpu || given.block_m || given.block_k || given.meta.count("GATHER") || !is_half(product) || product.tf32 ||
      r_pad > 16)
    return given;
  Config c = with_own_tile(given, 128, 128, 4, 3, {{"ROTATE", 1}, {"STAGED_ADDS", 1}, {"WGMMA", 1}});
  if (grouped) c.meta.emplace("FUSED", 1);
  return c;
}

EmbeddingBackwardPlan plan_embedding_backward(const EmbeddingBackward& c, const Config& given, int64_t programs) {
  const int64_t T = c.x1.shape[0], D = c.B.shape[0], r = c.A.shape[0];
  const bool gpu = c.x1.device.is_cuda();
  const Product dot = backward_product(c);
  const int64_t r_pad = rank_pad(r);
  // Grouped by default (on a GPU) where dA is not f32: dA is then written once in its
  // dtype, where the scattered atomics need an f32 workspace flushed into dA after the
  // kernel; and with scale_grad_by_freq, whose counts the grouping makes, where the
  // scattered form counts in a launch before the fill and clears in one after. On an
  // H100 at 8192x128256x4096, r=16: bf16 dA and dB 52.2-52.6 -> 45.4-45.5 us, f32 with
  // scale_grad_by_freq 49.2-49.9 -> 47.6-47.8 us; plain f32 dA, whose atomics add into dA
  // itself, 42.3-42.7 against 47.1-47.4 us. Only with no more tokens than ids: its
  // [T, r] workspace is then no larger than the f32 copy of dA it replaces.
  // own_config never names GROUP_BY_ID, so this is the plan's config's choice too.
  const bool grouped = meta_or(given, "GROUP_BY_ID", groups_by_default(c) ? 1 : 0) != 0;
  const Config config = own_config(given, dot, r_pad, grouped, gpu);
  const int64_t bytes = rank_bytes(dot, activation_dtype(c), c.B.dtype);
  // Tall token blocks: dB's atomics per element of grad_out are R_PAD / BLOCK_T. Half as
  // tall at rank 256 with 4-byte operands beside half grad_out (fp32 adapters with bf16
  // grad_out: 279552 bytes on 128-token blocks; an fp32 grad_out fits them).
  const int64_t bt = config.block_m ? config.block_m
                     : gpu ? (r_pad * bytes >= 1024 && dtype_size_bytes(c.g2.dtype) < bytes ? 64 : 128)
                           : 16;
  // 128 columns per step on a GPU where three stages of such tiles fit (2-byte
  // grad_out, r up to 64): such tiles may start beside the zero-fill (release_early),
  // 44-45 us at 8192x128256x4096 on an H100 against 46-48 us for 128x64. Not at rank 64
  // with 4-byte adapters or products (fp32 adapters: 247808 bytes in bf16, 321536 in TF32).
  const bool wide = gpu && dtype_size_bytes(c.g2.dtype) <= 2 && r <= 64 && (r_pad < 64 || bytes <= 2);
  const int64_t bd = config.block_k ? config.block_k : gpu ? rank_narrowed(wide ? 128 : 64, r_pad, bytes, 512) : 64;
  // On a GPU the token blocks' programs share D as one full wave: long programs,
  // whose dB partial sums and activation gathers are paid once per more columns
  // (on an H100 at 8192x128256x4096: 47.3 us against 76 us at about three waves).
  const int64_t blocks = cdiv(T, bt), steps = cdiv(D, bd);
  const int64_t split = config.split_k ? config.split_k
                        : gpu          ? split_for_waves(blocks, programs, steps, 1)
                                       : split_for(blocks, programs, steps);
  EmbeddingBackwardPlan p;
  p.grouped = grouped;
  p.meta = {{"BLOCK_T", bt},
            {"BLOCK_D", bd},
            {"R_PAD", r_pad},
            {"BY_FREQ", c.by_freq ? 1 : 0},
            {"ROTATE", meta_or(config, "ROTATE", 0)},
            {"num_warps", config.num_warps ? config.num_warps : (gpu && bt >= 128 ? 8 : 4)},
            {"num_stages", config.num_stages ? config.num_stages : (gpu ? 3 : 1)}};
  set_product_meta(p.meta, dot, config);
  // WGMMA: both products of a step as warpgroup dots reading both tiles from shared memory
  // (g's tile, through its transpose for g^T @ act; B's step tile; the activations kept
  // by rank), unless WGMMA_SS=0 (A's fragments in registers, B's step tile on mma.sync).
  add_codegen_hints(config, p.meta, /*wgmma_ss_default=*/1);
  // On a GPU the kernel waits for the grid before it, the fill, before its first atomics,
  // so that its launch may overlap the fill (LaunchOptions::overlap_prior).
  if (gpu) p.meta["WAIT_PRIOR"] = 1;
  p.grid = Grid{uint32_t(blocks), uint32_t(split), 1};
  p.block_t = bt;
  p.release_early = gpu && bt * bd >= 128 * 128;
  // The kernel finds the lines of its share along dA's and dB's last dimension, stride 1
  // (PEFT's layout; the workspace accumulators of other dtypes always are).
  // Grouped, dA is written by a kernel of its own and only dB is filled.
  const bool fills_a = !p.grouped && c.dA3.dtype == DType::f32, fills_b = c.dB3.dtype == DType::f32;
  const bool unit = (!fills_a || c.dA3.strides[2] == 1) && (!fills_b || c.dB3.strides[2] == 1);
  p.keep_in_l2 = gpu && unit && (fills_a || fills_b) && meta_or(config, "L2_KEEP", 1) != 0;
  if (p.keep_in_l2) p.meta["L2_KEEP"] = 1;
  if (p.grouped) p.meta["GROUP_BY_ID"] = 1;
  if (c.act) p.meta["SAVED_ACT"] = 1;
  // A vocab shard reads the activations of its own ids only (zeros elsewhere, whether the
  // caller passes this shard's forward activations or every shard's sum).
  if (c.act && (c.vr.start != 0 || c.vr.total != c.A.shape[1])) p.meta["ACT_IN_SHARD"] = 1;
  // The pass's first copies go out before the ids' load (and, with after_a, with the
  // activations'), not after the gather that waits for the ids. On an H100 at
  // 8192x128256x4096, r=16, gathering: bf16 gradients 42.9-43.0 -> 42.6-42.9 us,
  // scale_grad_by_freq 45.4-45.7 -> 45.1-45.3 us (with after_a it saved about 0.4 us).
  if (gpu && meta_or(config, "EARLY_PROLOGUE", 1)) p.meta["early_prologue"] = 1;
  p.direct_a = !p.grouped && c.dA3.dtype == DType::f32;
  p.fused = (p.grouped || p.direct_a) && gpu && meta_or(config, "FUSED", 0) != 0 && blocks * split <= programs;
  return p;
}

TensorView as_2d(const TensorView& t3) {
  return restride(t3, {t3.shape[1], t3.shape[2]}, {t3.strides[1], t3.strides[2]});
}

// The i32 [V] counts (or firsts) tensor of a call without one, and one carved from a workspace.
TensorView no_ids(const Device& dev) { return TensorView::contiguous(nullptr, DType::i32, {0}, dev); }
TensorView carve_ids(char** cursor, int64_t V, const Device& dev) {
  return TensorView::contiguous(carve_f32(cursor, 1, 1, V, dev).data, DType::i32, {V}, dev);
}

// `da` is dA [1, r, V] f32, or with GROUP_BY_ID the sums [1, T, r].
std::vector<Arg> embedding_backward_args(const EmbeddingBackward& c, const TensorView& da,
                                         const TensorView& db_acc, const TensorView& counts,
                                         const TensorView& first, const TensorView& record) {
  return {c.x1,     c.A,   c.B,    c.g2, Scalar(c.s), as_2d(da), as_2d(db_acc), counts, first, record,
          Scalar(c.vr.start), Scalar(c.vr.total), Scalar(c.padding), act_arg(c.act, c.A, c.x1.device)};
}

// The GROUP_BY_ID launches' workspace views: counts and first [V] i32, sums [1, T, r]
// f32, and dB's f32 accumulator when dB is not f32 itself (zero on entry, left zero).
// FUSED: counts, sums [1, V, r] by id (DIRECT_A: [1, 1, r], not used), dB's
// accumulator (always the workspace's) and `sync`, the barriers' i32 counter.
struct GroupedViews {
  TensorView counts, first, sums, db_acc, sync;
};

size_t grouped_workspace_bytes(const EmbeddingBackward& c, const EmbeddingBackwardPlan& p) {
  const int64_t T = c.x1.shape[0], D = c.B.shape[0], r = c.A.shape[0], V = c.A.shape[1];
  if (p.fused)
    return carved_bytes(1, 1, V) + carved_bytes(1, p.direct_a ? 1 : V, r) + carved_bytes(1, D, r) +
           carved_bytes(1, 1, 1);
  return 2 * carved_bytes(1, 1, V) + carved_bytes(1, T, r) + (c.dB3.dtype == DType::f32 ? 0 : carved_bytes(1, D, r));
}

GroupedViews grouped_views(const EmbeddingBackward& c, char* ws, const EmbeddingBackwardPlan& p) {
  const int64_t T = c.x1.shape[0], D = c.B.shape[0], r = c.A.shape[0], V = c.A.shape[1];
  const Device& dev = c.x1.device;
  GroupedViews g;
  char* cursor = ws;
  g.counts = carve_ids(&cursor, V, dev);
  if (p.fused) {
    g.sums = carve_f32(&cursor, 1, p.direct_a ? 1 : V, r, dev);  // DIRECT_A: not used
    g.db_acc = carve_f32(&cursor, 1, D, r, dev);
    g.sync = carve_ids(&cursor, 1, dev);
    return g;
  }
  g.first = carve_ids(&cursor, V, dev);
  g.sums = carve_f32(&cursor, 1, T, r, dev);
  g.db_acc = c.dB3.dtype == DType::f32 ? c.dB3 : carve_f32(&cursor, 1, D, r, dev);
  return g;
}

// The fused kernel's metas: the main kernel's tile, dA's columns and dB's rows a step.
dsl::MetaMap fused_meta(const EmbeddingBackward& c, const EmbeddingBackwardPlan& p) {
  dsl::MetaMap m = p.meta;
  for (const char* launch_only : {"WAIT_PRIOR", "L2_KEEP", "GROUP_BY_ID"}) m.erase(launch_only);
  m["BLOCK_V"] = std::max<int64_t>(16, 1024 / p.meta.at("R_PAD"));
  if (p.direct_a) m["DIRECT_A"] = 1;
  const int64_t programs = int64_t(p.grid.x) * p.grid.y * p.grid.z;
  m["BLOCK_M"] = int64_t(std::bit_ceil(uint64_t(std::max<int64_t>(1, cdiv(c.B.shape[0], programs)))));
  return m;
}

std::vector<Arg> fused_args(const EmbeddingBackward& c, const GroupedViews& v, const TensorView& record) {
  return {c.x1,   c.A,    c.B,      c.g2,          Scalar(c.s),        as_2d(v.sums),      as_2d(v.db_acc),
          v.counts, record, Scalar(c.vr.start), Scalar(c.vr.total), Scalar(c.padding), as_2d(c.dA3), as_2d(c.dB3),
          v.sync,   act_arg(c.act, c.A, c.x1.device)};
}

// The grouped calls around the main kernel: its grid (tokens, then dB's tiles when
// dB is zeroed there), the dense write's grid, and their metas.
struct GroupedLaunches {
  Grid group_grid, dense_grid;
  dsl::MetaMap group_meta, dense_meta;
};

GroupedLaunches plan_grouped(const EmbeddingBackward& c, const EmbeddingBackwardPlan& p) {
  const int64_t T = c.x1.shape[0], D = c.B.shape[0], V = c.A.shape[1];
  const int64_t r_pad = p.meta.at("R_PAD");
  const bool gpu = c.x1.device.is_cuda(), fill_b = c.dB3.dtype == DType::f32;
  const int64_t bt = 256, bk = std::clamp<int64_t>(r_pad, 16, 256), bm = std::max<int64_t>(1, 2048 / bk);
  // dB's tiles: zeroed by the first launch when dB is f32, else flushed by the last.
  const int64_t b_tiles = cdiv(D, bm) * cdiv(c.dB3.shape[2], bk);
  GroupedLaunches g;
  g.group_grid = Grid{uint32_t(cdiv(T, bt) + (fill_b ? b_tiles : 0)), 1, 1};
  g.group_meta = {{"BLOCK_T", bt}, {"BLOCK_M", bm}, {"BLOCK_K", bk}, {"FILL_B", fill_b ? 1 : 0}};
  if (p.release_early) g.group_meta["RELEASE"] = 1;
  if (p.keep_in_l2) g.group_meta["EVICT_LAST"] = 1;
  // 1024 elements of dA a program: at 8192x128256x4096, r=16 on an H100 6.3 us against
  // 7.4 us for 4096 (ncu).
  const int64_t bv = std::max<int64_t>(16, 1024 / r_pad);
  g.dense_grid = Grid{uint32_t(cdiv(V, bv) + (fill_b ? 0 : b_tiles)), 1, 1};
  g.dense_meta = {{"BLOCK_V", bv}, {"R_PAD", r_pad}};
  if (!fill_b) g.dense_meta.insert({{"FLUSH_B", 1}, {"BLOCK_M", bm}, {"BLOCK_K", bk}});
  if (gpu) g.dense_meta["WAIT_PRIOR"] = 1;
  return g;
}

std::vector<Arg> group_args(const EmbeddingBackward& c, const GroupedViews& v) {
  return {c.x1, v.counts, v.first, as_2d(v.db_acc), Scalar(c.vr.start)};
}

std::vector<Arg> dense_args(const EmbeddingBackward& c, const GroupedViews& v) {
  return {v.first, v.counts, as_2d(v.sums), as_2d(c.dA3), as_2d(v.db_acc), as_2d(c.dB3)};
}

// The launches of a GROUP_BY_ID call: the ids grouped (and dB zeroed), the main
// kernel adding into the sums, dA written whole (and dB flushed when not f32); or, for
// a FUSED call (grouped or DIRECT_A), the one cooperative kernel on its workspace.
void run_grouped_backward(const EmbeddingBackward& c, const EmbeddingBackwardPlan& p, const TensorView& record) {
  const Device& dev = c.x1.device;
  const WorkspaceLease ws = lease_workspace(dev, c.lo.stream, grouped_workspace_bytes(c, p));
  const GroupedViews v = grouped_views(c, ws.data, p);
  if (p.fused) {
    launch(kernels::lora_embedding_backward_fused(), fused_args(c, v, record), p.grid, fused_meta(c, p), c.lo);
    return;
  }
  const GroupedLaunches g = plan_grouped(c, p);
  const std::vector<Arg> main_args = embedding_backward_args(c, v.sums, v.db_acc, v.counts, v.first, record);
  const std::vector<Arg> last_args = dense_args(c, v);
  // The later kernels made ready first: a compile error (or an interrupt) between the
  // launches would leave the workspace no longer zero.
  prepare(kernels::lora_embedding_backward(), main_args, p.meta, c.lo);
  if (g.dense_grid.x > 0) prepare(kernels::lora_embedding_dense_a(), last_args, g.dense_meta, c.lo);
  launch(kernels::lora_embedding_group(), group_args(c, v), g.group_grid, g.group_meta, c.lo);
  LaunchOptions after = c.lo;
  after.overlap_prior = dev.is_cuda();  // both wait for the grid before them (WAIT_PRIOR)
  launch(kernels::lora_embedding_backward(), main_args, p.grid, p.meta, after);
  if (g.dense_grid.x > 0) launch(kernels::lora_embedding_dense_a(), last_args, g.dense_grid, g.dense_meta, after);
}

// Config.meta GATHER: the backward as gather, the MoE backward's one pass over
// grad_out by column blocks (E = 1: dW = g, its A = B^T, its B = the gathered
// activations, its dA = dB^T, its dB = gB = s * g @ B), and scatter of gB into
// dA by id. Its views of one call; `ws` is the workspace (or stand-in memory).
struct GatheredBackward {
  TensorView da_acc, db_acc, counts, gB, act;  // f32 dA [1, r, V] and dB [1, D, r] targets, ...
  TensorView dW, a_moe, b_moe, da_moe, db_moe;
  Config moe;
  dsl::MetaMap gather_meta, scatter_meta;
  Grid edge_grid;  // the gather's and scatter's
};

// Whether the call runs as gather, product, scatter (Config.meta GATHER): not with the
// activations given (after_a), for there is nothing to gather.
bool runs_gathered(const EmbeddingBackward& c, const Config& config) {
  return meta_or(config, "GATHER", 0) && !c.act;
}

// The dtype of the gathered activations: that of the product they enter.
DType gathered_act_dtype(const EmbeddingBackward& c) { return product_dtype(c.g2.dtype, c.A.dtype, c.B.dtype); }

size_t gathered_workspace_bytes(const EmbeddingBackward& c) {
  const int64_t T = c.x1.shape[0], D = c.B.shape[0], r = c.A.shape[0], V = c.A.shape[1];
  const DType act_t = gathered_act_dtype(c);
  size_t bytes = carved_bytes(1, T, r) + (size_t(T * r) * size_t(dtype_size_bytes(act_t)) + 15) / 16 * 16;
  if (c.dA3.dtype != DType::f32) bytes += carved_bytes(1, r, V);
  if (c.dB3.dtype != DType::f32) bytes += carved_bytes(1, D, r);
  if (c.by_freq) bytes += carved_bytes(1, 1, V);
  return bytes;
}

GatheredBackward plan_gathered(const EmbeddingBackward& c, const Config& config, char* ws) {
  const int64_t T = c.x1.shape[0], D = c.B.shape[0], r = c.A.shape[0], V = c.A.shape[1];
  const Device& dev = c.x1.device;
  const DType act_t = gathered_act_dtype(c);
  GatheredBackward p;
  char* cursor = ws;
  p.da_acc = c.dA3.dtype == DType::f32 ? c.dA3 : carve_f32(&cursor, 1, r, V, dev);
  p.db_acc = c.dB3.dtype == DType::f32 ? c.dB3 : carve_f32(&cursor, 1, D, r, dev);
  p.counts = c.by_freq ? carve_ids(&cursor, V, dev) : no_ids(dev);
  p.gB = carve_f32(&cursor, 1, T, r, dev);
  p.act = TensorView::contiguous(cursor, act_t, {1, T, r}, dev);
  p.dW = as_3d(c.g2);
  p.a_moe = restride(c.B, {1, r, D}, {0, c.B.strides[1], c.B.strides[0]});
  p.b_moe = p.act;
  p.da_moe = restride(p.db_acc, {1, r, D}, {p.db_acc.strides[0], p.db_acc.strides[2], p.db_acc.strides[1]});
  p.db_moe = p.gB;
  p.moe = config;
  // PACK 0: no copies or workspace of its own (this call holds the workspace already).
  p.moe.meta = {{"BY_COLUMNS", 1}, {"ROTATE", meta_or(config, "ROTATE", 0)}, {"PACK", 0}};
  const int64_t r_pad = rank_pad(r);
  const int64_t bt = std::clamp<int64_t>(4096 / r_pad, 16, 128);
  p.gather_meta = {{"BLOCK_T", bt}, {"R_PAD", r_pad}};
  p.scatter_meta = {{"BLOCK_T", bt}, {"R_PAD", r_pad}, {"BY_FREQ", c.by_freq ? 1 : 0}};
  p.edge_grid = Grid{uint32_t(cdiv(T, bt)), 1, 1};
  return p;
}

std::vector<Arg> gather_args(const EmbeddingBackward& c, const GatheredBackward& p, const TensorView& record) {
  return {c.x1, c.A, as_2d(p.act), record, Scalar(c.vr.start), Scalar(c.vr.total)};
}

std::vector<Arg> scatter_args(const EmbeddingBackward& c, const GatheredBackward& p) {
  return {c.x1, as_2d(p.gB), as_2d(p.act), as_2d(p.da_acc), p.counts, Scalar(c.vr.start), Scalar(c.padding)};
}

// The kernels of a GATHER call with `config` (workspace standing in), for compile lists.
std::vector<autotune::KernelCall> gathered_kernels(const EmbeddingBackward& c, const Config& config,
                                                   int64_t programs) {
  const GatheredBackward p = plan_gathered(c, config, static_cast<char*>(unused_memory()));
  return {{&kernels::lora_embedding_gather(), gather_args(c, p, stand_in_record(c.x1.device)), p.gather_meta},
          moe_backward_kernel(p.dW, p.a_moe, p.b_moe, c.s, p.da_moe, p.db_moe, programs, p.moe),
          {&kernels::lora_embedding_scatter(), scatter_args(c, p), p.scatter_meta}};
}

// The launches of a GATHER call. The workspace's regions are zero on entry and
// left zero: the scatter clears gB and the activations, flushes and the
// CLEAR count clear the rest.
void run_gathered_backward(const EmbeddingBackward& c, const Config& config, const TensorView& record) {
  const Device& dev = c.x1.device;
  // Shared by all the launches below: held until the last is queued.
  const WorkspaceLease ws = lease_workspace(dev, c.lo.stream, gathered_workspace_bytes(c));
  const GatheredBackward p = plan_gathered(c, config, ws.data);
  if (c.dA3.dtype == DType::f32) fill_3d(c.dA3, 0.0, c.lo);
  const dsl::MetaMap count_meta = {{"BLOCK_T", p.gather_meta.at("BLOCK_T")}};
  if (c.by_freq) launch(kernels::embedding_count_ids(), {c.x1, p.counts, Scalar(c.vr.start)}, p.edge_grid,
                        count_meta, c.lo);
  launch(kernels::lora_embedding_gather(), gather_args(c, p, record), p.edge_grid, p.gather_meta, c.lo);
  run_moe_backward(p.dW, p.a_moe, p.b_moe, c.s, p.da_moe, p.db_moe, c.lo, p.moe, /*db_is_zero=*/true);
  launch(kernels::lora_embedding_scatter(), scatter_args(c, p), p.edge_grid, p.scatter_meta, c.lo);
  if (c.by_freq) {
    dsl::MetaMap clear = count_meta;
    clear["CLEAR"] = 1;
    launch(kernels::embedding_count_ids(), {c.x1, p.counts, Scalar(c.vr.start)}, p.edge_grid, clear, c.lo);
  }
  if (c.dA3.dtype != DType::f32) flush_accumulator(p.da_acc, c.dA3, c.lo);
  if (c.dB3.dtype != DType::f32) flush_accumulator(p.db_acc, c.dB3, c.lo);
}

// The launches of one backward call: fp32 accumulators (the outputs themselves
// when f32, zeroed; else workspace regions flushed into them), with
// scale_grad_by_freq the id counts (counted first, cleared after), the kernel.
void run_embedding_backward(const EmbeddingBackward& c, const Config& config, const TensorView& record) {
  if (runs_gathered(c, config)) return run_gathered_backward(c, config, record);
  const Device& dev = c.x1.device;
  const EmbeddingBackwardPlan p = plan_embedding_backward(c, config, parallelism(dev));
  if (p.grouped || p.fused) return run_grouped_backward(c, p, record);
  const int64_t D = c.B.shape[0], r = c.A.shape[0], V = c.A.shape[1];
  const bool da_direct = c.dA3.dtype == DType::f32, db_direct = c.dB3.dtype == DType::f32;
  size_t ws_bytes = 0;
  if (!da_direct) ws_bytes += carved_bytes(1, r, V);
  if (!db_direct) ws_bytes += carved_bytes(1, D, r);
  if (c.by_freq) ws_bytes += carved_bytes(1, 1, V);
  const WorkspaceLease ws = ws_bytes ? lease_workspace(dev, c.lo.stream, ws_bytes) : WorkspaceLease{};
  char* cursor = ws.data;
  const TensorView da_acc = da_direct ? c.dA3 : carve_f32(&cursor, 1, r, V, dev);
  const TensorView db_acc = db_direct ? c.dB3 : carve_f32(&cursor, 1, D, r, dev);
  TensorView counts = no_ids(dev);
  if (c.by_freq) counts = carve_ids(&cursor, V, dev);
  const Grid tokens{p.grid.x, 1, 1};
  if (c.by_freq)
    launch(kernels::embedding_count_ids(), {c.x1, counts, Scalar(c.vr.start)}, tokens, {{"BLOCK_T", p.block_t}},
           c.lo);
  // The fill goes last before the kernel, which may then overlap it.
  const bool filled = zero_fills(c.dA3, da_direct, c.dB3, db_direct, c.lo, p.release_early, p.keep_in_l2);
  LaunchOptions main = c.lo;
  main.overlap_prior = filled;  // taken where the kernel waits for the fill (WAIT_PRIOR)
  launch(kernels::lora_embedding_backward(),
         embedding_backward_args(c, da_acc, db_acc, counts, no_ids(dev), record), p.grid, p.meta, main);
  if (c.by_freq)
    launch(kernels::embedding_count_ids(), {c.x1, counts, Scalar(c.vr.start)}, tokens,
           {{"BLOCK_T", p.block_t}, {"CLEAR", 1}}, c.lo);
  if (!da_direct) flush_accumulator(da_acc, c.dA3, c.lo);
  if (!db_direct) flush_accumulator(db_acc, c.dB3, c.lo);
}

// The kernels of a backward call with `config`, as run_embedding_backward launches them,
// its accumulators, counts and workspace standing in (aligned like workspace, never
// dereferenced).
std::vector<autotune::KernelCall> embedding_backward_kernels(const EmbeddingBackward& c, const Config& config,
                                                             int64_t programs) {
  if (runs_gathered(c, config)) return gathered_kernels(c, config, programs);
  const int64_t V = c.A.shape[1], D = c.B.shape[0], r = c.A.shape[0];
  const Device& dev = c.x1.device;
  const EmbeddingBackwardPlan p = plan_embedding_backward(c, config, programs);
  if (p.fused) {
    const GroupedViews v = grouped_views(c, static_cast<char*>(unused_memory()), p);
    return {{&kernels::lora_embedding_backward_fused(), fused_args(c, v, stand_in_record(dev)), fused_meta(c, p)}};
  }
  if (p.grouped) {
    const GroupedViews v = grouped_views(c, static_cast<char*>(unused_memory()), p);
    const GroupedLaunches g = plan_grouped(c, p);
    return {{&kernels::lora_embedding_group(), group_args(c, v), g.group_meta},
            {&kernels::lora_embedding_backward(),
             embedding_backward_args(c, v.sums, v.db_acc, v.counts, v.first, stand_in_record(dev)), p.meta},
            {&kernels::lora_embedding_dense_a(), dense_args(c, v), g.dense_meta}};
  }
  void* const stand_in = unused_memory();
  const TensorView da_acc = TensorView::contiguous(stand_in, DType::f32, {1, r, V}, dev);
  const TensorView db_acc = TensorView::contiguous(stand_in, DType::f32, {1, D, r}, dev);
  const TensorView counts = c.by_freq ? TensorView::contiguous(stand_in, DType::i32, {V}, dev) : no_ids(dev);
  return {{&kernels::lora_embedding_backward(),
           embedding_backward_args(c, da_acc, db_acc, counts, no_ids(dev), stand_in_record(dev)), p.meta}};
}

Config tuned_embedding_backward_config(const EmbeddingBackward& c) {
  const int64_t T = c.x1.shape[0], V = c.A.shape[1], D = c.B.shape[0], r = c.A.shape[0];
  const Device& dev = c.x1.device;
  TuneRequest q;
  q.problem = {std::string(c.by_freq ? "lora_embedding_backward_by_freq" : "lora_embedding_backward") +
                   (c.act ? "_saved_act" : ""),
               {next_pow2(T), next_pow2(V), next_pow2(D), rank_pad(r)},
               {c.A.dtype, c.B.dtype, c.g2.dtype, c.dA3.dtype, c.dB3.dtype, c.x1.dtype},
               "",
               dev};
  add_memory_order(q.problem.shape_bucket, c.g2);
  q.block_m_name = "BLOCK_T";
  q.block_k_name = "BLOCK_D";
  // Each tile with D shared by the programs of one full wave (the default), two and three.
  q.gpu_candidates = with_wave_splits(embedding_backward_gpu_candidates(), "BLOCK_T", T, "BLOCK_D", D, 1,
                                      parallelism(dev), {2, 3}, /*default_waves=*/1);
  // dB's per-step share as whole-row 4-wide reductions (STAGED_ADDS), alone and with rotated
  // steps, on the finalists: at 8192x128256x4096 on an H100, 128x128 (4 warps, ROTATE) went
  // from 43.3 to 42.5 us, 64x128 (ROTATE) from 50.4 to 45.3 us.
  q.finalist_variants = with_l2_prefetch_variants({{{"STAGED_ADDS", 1}}, {{"STAGED_ADDS", 1}, {"ROTATE", 1}}});
  // Grouped calls also try the one-kernel form (FUSED) on the finalists: at 8192x128256x4096,
  // r=16 with bf16 gradients on an H100 44.2-44.3 us against 44.8-44.9 for the three launches.
  if (groups_by_default(c))
    q.finalist_variants.push_back({{"STAGED_ADDS", 1}, {"ROTATE", 1}, {"FUSED", 1}});
  // And with both products as warpgroup dots (WGMMA, 16-bit products on sm_90a): at
  // 8192x128256x4096, r=16 on an H100 (128x128, 4 warps, FUSED) bf16 gradients 41.9-42.2
  // -> 39.7-39.9 us, scale_grad_by_freq 44.3-44.8 -> 41.7-41.9, with after_a 39.5-39.7 ->
  // 38.0 us.
  const Product dot = backward_product(c);
  // Up to rank 64, the ranks whose warpgroup tiles an H100 has run against float64 so far.
  const size_t plain = rank_pad(r) <= 64 ? q.finalist_variants.size() : 0;
  for (size_t i = 0; i < plain; ++i)
    if (q.finalist_variants[i].count("ROTATE"))
      for (autotune::Config v : with_wgmma_variant({}, dot, dev)) {
        v.insert(q.finalist_variants[i].begin(), q.finalist_variants[i].end());
        q.finalist_variants.push_back(std::move(v));
      }
  q.extent_m = T;
  q.extent_k = D;
  q.split_programs = parallelism(dev);
  q.kernels = [&](const Config& config) {
    return embedding_backward_kernels(c, config, parallelism(dev));
  };
  TuningRecord record(dev);
  q.run = [&](const Config& config) { run_embedding_backward(c, config, record.view()); };
  q.stream = c.lo.stream;
  return tuned_config(q);
}

// For kerf-cache warm: ids i64 [T] (all 0: valid), tables and adapters in the dtype given.
std::vector<autotune::Operand> embedding_operands(const std::vector<int64_t>& s, DType t, bool backward) {
  const int64_t T = s[0], V = s[1], D = s[2], r = s[3];
  if (backward)
    return {{{T}, DType::i64}, {{r, V}, t}, {{D, r}, t}, {{T, D}, t}, {{r, V}, t}, {{D, r}, t}};
  return {{{T}, DType::i64}, {{V, D}, t}, {{r, V}, t}, {{D, r}, t}, {{T, D}, t}};
}

const bool embedding_registered = [] {
  for (const bool backward : {false, true}) {
    autotune::TunableOp op;
    op.name = backward ? "lora_embedding_backward" : "lora_embedding";
    op.shape_names = {"T", "vocab", "dim", "r"};
    op.takes_layout = true;
    op.operands = [backward](const std::vector<int64_t>& s, DType t) { return embedding_operands(s, t, backward); };
    if (backward) {
      op.call = [](const std::vector<TensorView>& v, void* stream, const std::string& layout) {
        lora_embedding_backward(v[0], v[1], v[2], v[3], 1.0, v[4], v[5], {}, stream, {}, layout_at_origin(layout));
      };
      op.kernels = [](const std::vector<TensorView>& v, const autotune::Config& c, int sm_count) {
        const EmbeddingBackward call{v[0], v[1], v[2], v[3], 1.0, as_3d(v[4]), as_3d(v[5]),
                                     false, VocabRange{0, v[1].shape[1]}, -1, LaunchOptions{}};
        const Config config = config_from(c, "BLOCK_T", "BLOCK_D");
        return embedding_backward_kernels(call, config, sm_count);
      };
      op.gpu_candidates = embedding_backward_gpu_candidates;
    } else {
      op.call = [](const std::vector<TensorView>& v, void* stream, const std::string& layout) {
        lora_embedding(v[0], v[1], v[2], v[3], 1.0, v[4], {}, stream, {}, layout_at_origin(layout));
      };
      op.kernels = [](const std::vector<TensorView>& v, const autotune::Config& c, int sm_count) {
        const EmbeddingForward call{v[0], v[1], v[2], v[3], 1.0, v[4], VocabRange{0, v[1].shape[0]}, LaunchOptions{}};
        return std::vector<autotune::KernelCall>{{&kernels::lora_embedding(),
                                                  embedding_args(call, stand_in_record(v[0].device)),
                                                  plan_embedding(call, config_from(c, "BLOCK_T", "BLOCK_D"), sm_count).meta}};
      };
      op.gpu_candidates = embedding_gpu_candidates;
    }
    op.block_m_name = "BLOCK_T";
    op.block_k_name = "BLOCK_D";
    autotune::register_op(std::move(op));
  }
  return true;
}();

}  // namespace

namespace {

// The ids of a call with nothing else to compute (dim or rank 0) are still checked, as
// F.embedding does: on the CPU on the host; on the GPU by the gather kernel's pass over
// the tokens, with a rank-0 view of A (nothing gathered, nothing written) and the record.
void check_ids_only(const char* op, const TensorView& x, const TensorView& A, const VocabRange& vr,
                    const EmbeddingOptions& options, void* stream) {
  if (x.numel() == 0) return;
  const TensorView x1 = flatten_ids(op, x);
  if (!x.device.is_cuda()) return check_host_ids(op, x, x1, vr.total, vr.hint);
  TensorView a0 = A;
  a0.shape[0] = 0;
  TensorView act = TensorView::contiguous(unused_memory(), A.dtype, {x1.shape[0], 0}, A.device);
  const int64_t bt = 128;
  LaunchOptions lo;
  lo.stream = stream;
  launch(kernels::lora_embedding_gather(),
         {x1, a0, act, error_record(op, x.device, stream), Scalar(vr.start), Scalar(vr.total)},
         Grid{uint32_t(cdiv(x1.shape[0], bt)), 1, 1}, {{"BLOCK_T", bt}, {"R_PAD", 16}}, lo);
  if (options.id_check == IdCheck::sync) throw_recorded_bad_ids(op, x.device, stream, &x, vr.hint);
}

}  // namespace

void lora_embedding(const TensorView& x, const TensorView& weight, const TensorView& A,
                    const TensorView& B, double s, const TensorView& out,
                    const EmbeddingOptions& options, void* stream, const Config& config,
                    const Layout& layout) {
  const char* op = "lora_embedding";
  expect_finite_scale(op, s);
  expect_meta(op, config, {kWarpsN, kL2Prefetch, kTf32});
  expect_ids(op, x);
  const LayoutSplits splits = check_layout(op, layout, [&] {
    return with_after_a(options, x,
                        {{"x", x_dims(x, false)},
                         {"weight", {"vocab", "dim"}},
                         {"A", {"r", "vocab"}},
                         {"B", {"dim", "r"}},
                         {"out", x_dims(x, true)}});
  });
  expect_unsplit(op, layout, splits, "r", "each token's LoRA term needs every rank of A and B");
  expect_shape(op, "weight", weight, {-1, -1});
  const int64_t V = weight.shape[0], D = weight.shape[1];
  expect_shape(op, "A", A, {-1, V});
  const int64_t r = A.shape[0];
  expect_shape(op, "B", B, {D, r});
  expect_shape(op, "out", out, tokens_and(x, D));
  std::vector<std::pair<const char*, const TensorView*>> all = {
      {"x", &x}, {"weight", &weight}, {"A", &A}, {"B", &B}, {"out", &out}};
  expect_after_a(op, options, x, r, all);
  for (const auto& [n, t] : all) {
    if (t != &x) expect_dtype(op, n, *t, float_dtypes());
    expect_addressable(op, n, *t);
    expect_int32_dims(op, n, *t);
  }
  expect_token_count(op, x);
  expect_device(op, all);
  if (r > 256)
    throw InvalidArgument(std::string(op) + ": rank " + std::to_string(r) +
                          " is above the supported 256");
  // The outputs: out, and after_a when given.
  std::vector<std::pair<const char*, const TensorView*>> outputs = {{"out", &out}};
  if (options.after_a) outputs.push_back({"after_a", &*options.after_a});
  for (const auto& [o_name, o] : outputs) {
    expect_no_self_overlap(op, o_name, *o);
    for (const auto& [n, t] : all)
      if (t != o) expect_disjoint(op, o_name, *o, n, *t);
  }
  const VocabRange vr = vocab_range(op, layout, splits, V, options);
  padding_id(op, options, vr.total);  // only the backward uses it, but F.embedding refuses a bad one here too
  if (checks_only()) return;
  if (D == 0 && !options.after_a) return check_ids_only(op, x, A, vr, options, stream);
  if (x.numel() == 0) return;
  TensorView x1, out2;
  flatten_tokens(op, x, "out", out, &x1, &out2);
  const int64_t T = x1.shape[0];
  if (!x.device.is_cuda()) check_host_ids(op, x, x1, vr.total, vr.hint);

  const std::string text = layout.canonical();
  LaunchOptions lo;
  lo.stream = stream;
  lo.layout = text;
  const EmbeddingForward call{x1, weight, A, B, s, out2, vr, lo, flat_after_a(op, options, x)};
  static PlanMemo<EmbeddingPlan> plans;
  CallKey key;
  key.add(T).add(weight).add(A).add(B.dtype).add(out.dtype).add(x1.dtype).add(x.device);
  key.add(config);
  if (call.act) key.add(*call.act);
  const std::shared_ptr<const EmbeddingPlan> p = plans.get(key, [&] {
    // A caller's Config wins; otherwise the autotuner's choice (its defaults when tuning is off).
    const Config cfg = has_config(config) ? config : tuned_embedding_config(call);
    return EmbeddingPlan{plan_embedding(call, cfg, parallelism(x.device)), {}};
  });
  run_embedding(call, p->launch, error_record(op, x.device, stream), &p->memo);
  if (x.device.is_cuda() && options.id_check == IdCheck::sync) throw_recorded_bad_ids(op, x.device, stream, &x, vr.hint);
}

void lora_embedding_backward(const TensorView& x, const TensorView& A, const TensorView& B,
                             const TensorView& grad_out, double s, const TensorView& grad_A,
                             const TensorView& grad_B, const EmbeddingOptions& options,
                             void* stream, const Config& config, const Layout& layout) {
  const char* op = "lora_embedding_backward";
  expect_finite_scale(op, s);
  expect_meta(op, config, {{"ROTATE", 0, 1}, {"GATHER", 0, 1}, {"GROUP_BY_ID", 0, 1}, {"FUSED", 0, 1}, {"L2_KEEP", 0, 1}, kL2Prefetch, kStagedAdds, kEarlyPrologue, kTf32, kWgmma, kWgmmaSs});
  expect_ids(op, x);
  const LayoutSplits splits = check_layout(op, layout, [&] {
    return with_after_a(options, x,
                        {{"x", x_dims(x, false)},
                         {"A", {"r", "vocab"}},
                         {"B", {"dim", "r"}},
                         {"grad_out", x_dims(x, true)},
                         {"grad_A", {"r", "vocab"}},
                         {"grad_B", {"dim", "r"}}});
  });
  expect_unsplit(op, layout, splits, "r", "each token's LoRA term needs every rank of A and B");
  // scale_grad_by_freq divides by an id's count over every token: a token shard's own
  // counts would give each shard another divisor, and the sum over shards a wrong grad_A.
  if (options.scale_grad_by_freq)
    for (int d = 0; d < x.rank; ++d)
      expect_unsplit(op, layout, splits, "x" + std::to_string(d),
                     "scale_grad_by_freq divides by each id's count over all tokens, which a token shard "
                     "does not see (split the vocabulary or dim instead, or leave scale_grad_by_freq off)");
  expect_shape(op, "A", A, {-1, -1});
  const int64_t r = A.shape[0], V = A.shape[1];
  expect_shape(op, "B", B, {-1, r});
  const int64_t D = B.shape[0];
  expect_shape(op, "grad_out", grad_out, tokens_and(x, D));
  expect_shape(op, "grad_A", grad_A, {r, V});
  expect_shape(op, "grad_B", grad_B, {D, r});
  std::vector<std::pair<const char*, const TensorView*>> all = {
      {"x", &x},           {"A", &A},          {"B", &B}, {"grad_out", &grad_out},
      {"grad_A", &grad_A}, {"grad_B", &grad_B}};
  expect_after_a(op, options, x, r, all);
  for (const auto& [n, t] : all) {
    if (t != &x) expect_dtype(op, n, *t, float_dtypes());
    expect_addressable(op, n, *t);
    expect_int32_dims(op, n, *t);
  }
  expect_token_count(op, x);
  expect_device(op, all);
  if (r > 256)
    throw InvalidArgument(std::string(op) + ": rank " + std::to_string(r) +
                          " is above the supported 256");
  for (const auto& [n, t] : {std::pair{"grad_A", &grad_A}, {"grad_B", &grad_B}}) {
    expect_no_self_overlap(op, n, *t);
    for (const auto& [in_name, in] : all)
      if (in != &grad_A && in != &grad_B) expect_disjoint(op, n, *t, in_name, *in);
  }
  expect_disjoint(op, "grad_B", grad_B, "grad_A", grad_A);
  const VocabRange vr = vocab_range(op, layout, splits, V, options);
  const int64_t padding = padding_id(op, options, vr.total);
  if (checks_only()) return;
  if (r == 0) return check_ids_only(op, x, A, vr, options, stream);

  const std::string text = layout.canonical();
  LaunchOptions lo;
  lo.stream = stream;
  lo.layout = text;
  const TensorView dA3 = as_3d(grad_A), dB3 = as_3d(grad_B);
  if (x.numel() == 0 || D == 0) {  // sums over nothing
    // The CPU reads the ids before anything runs (a bad one leaves the gradients as they
    // were); a GPU checks them in a launch after the fill, as its other forms do.
    if (!x.device.is_cuda()) check_ids_only(op, x, A, vr, options, stream);
    fill_pair_3d(dA3, dB3, 0.0, lo);
    if (x.device.is_cuda()) check_ids_only(op, x, A, vr, options, stream);
    return;
  }
  TensorView x1, g2;
  flatten_tokens(op, x, "grad_out", grad_out, &x1, &g2);
  const int64_t T = x1.shape[0];
  if (!x.device.is_cuda()) check_host_ids(op, x, x1, vr.total, vr.hint);

  const EmbeddingBackward call{x1, A, B, g2, s, dA3, dB3, options.scale_grad_by_freq, vr, padding, lo,
                               flat_after_a(op, options, x)};
  static PlanMemo<Config> tuned;
  CallKey key;
  key.add(T).add(A).add(B).add(g2.dtype).add(grad_A.dtype).add(grad_B.dtype).add(x1.dtype);
  key.add(options.scale_grad_by_freq ? 1 : 0).add(x.device);
  if (call.act) key.add(*call.act);
  run_embedding_backward(
      call, has_config(config) ? config : *tuned.get(key, [&] { return tuned_embedding_backward_config(call); }),
      error_record(op, x.device, stream));
  if (x.device.is_cuda() && options.id_check == IdCheck::sync) throw_recorded_bad_ids(op, x.device, stream, &x, vr.hint);
}

void check_embedding_ids(const Device& device, void* stream) {
  if (!device.is_cuda()) return;
  throw_recorded_bad_ids("lora_embedding", device, stream, nullptr);
}

}  // namespace kerf::ops
