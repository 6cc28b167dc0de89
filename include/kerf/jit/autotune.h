// The autotuner: an op declares candidate configurations and a pruning rule;
// the tuner compiles the survivors in parallel threads, times each (CUDA
// events on a GPU, the wall clock on the CPU back end: warm-up runs, then the
// median of repeated runs, inputs restored before each run when the op writes
// in place), keeps the fastest and stores the choice in the kernel cache.
//
// Choices are keyed by op, shape bucket, dtypes, layout and target (arch and
// device name, or CPU and features) and kerf's version, never by the candidate
// list: adding a candidate keeps earlier choices (KERF_AUTOTUNE=force tunes
// again). KERF_AUTOTUNE=0 gives each op's defaults; a line at KERF_LOG=info
// says what was chosen, from how many, in how long.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kerf/cache/key.h"
#include "kerf/dsl/dsl.h"
#include "kerf/runtime/tensor.h"

namespace kerf::autotune {

// A candidate: meta-parameters (BLOCK_M, BLOCK_K, num_warps, num_stages, ...).
using Config = dsl::MetaMap;

// What a choice is for.
struct Problem {
  std::string op;                     // "dora_norm"
  std::vector<int64_t> shape_bucket;  // the op's sizes, bucketed (the op decides how)
  std::vector<DType> dtypes;
  std::string layout;  // canonical sharding layout ("" unsharded)
  Device device;
};

// Measures one candidate.
class Timer {
 public:
  virtual ~Timer() = default;
  // Runs `restore` (if any) then `run`, `warmup` times untimed and `repeats` times
  // timed (restore outside the timing); returns the median run in milliseconds.
  virtual double median_ms(const std::function<void()>& run, const std::function<void()>& restore,
                           int warmup, int repeats) = 0;
};
// Events recorded on `stream` (of `device`); each timed run starts with L2 flushed.
std::unique_ptr<Timer> cuda_event_timer(void* stream, int device = 0);
std::unique_ptr<Timer> wall_clock_timer();  // for the CPU back end (synchronous launches)

struct Hooks {
  std::function<bool(const Config&)> keep;  // the pruning rule; empty keeps every candidate
  // The form a config runs as, where the op ignores or overrides some of its entries
  // (may be empty: every config as it is). Candidates and finalist variants are taken in
  // this form, and one whose form another already has is not compiled or timed again.
  std::function<Config(const Config&)> canonical;
  std::function<void(const Config&)>
      compile;  // readies a candidate (called from several threads); throws to drop it
  std::function<void(const Config&)> run;  // launches a ready candidate once
  std::function<void()> restore;           // puts back what the op writes in place; may be empty
  // Why a stored choice (read back from the cache, perhaps written by another build or
  // damaged with valid checksums) is not one this op's tuner could have made: "" when it
  // is. One that is not is reported and tuned again, as one that fails to compile.
  std::function<std::string(const Config&)> usable;
};

struct Options {
  int warmup = 2;
  int repeats = 10;
  // The `finalists` fastest of the first round are timed again, `final_rounds`
  // times each in turns; the lowest median of those rounds wins.
  int finalists = 3;
  int final_rounds = 3;
  // The op's own config among the candidates (empty: none). When it ran in the first
  // round it joins the final rounds wherever it placed, and another candidate replaces
  // it only with a median lower by more than `incumbent_margin` (a fraction of its
  // time): a gap inside the clock's noise does not make a tuned call slower than an
  // untuned one.
  Config incumbent;
  double incumbent_margin = 0.01;
  // Overrides also tried on each finalist of the first round (e.g. {"EVICT": 1}:
  // a cache hint on the best tiles, without doubling the first round); each
  // variant is compiled, timed once and joins the final rounds.
  std::vector<Config> finalist_variants;
  int compile_threads = 0;  // 0: one per hardware thread (at most one per candidate)
  Timer* timer =
      nullptr;  // nullptr: cuda_event_timer(stream) on a GPU, wall_clock_timer() on the CPU
  void* stream = nullptr;
  bool persist = true;  // look for and store the choice in the kernel cache
  // Use a choice made earlier in this process or stored in the cache, and never
  // tune: `fallback` otherwise, remembered nowhere (e.g. while the op's stream
  // captures a CUDA graph, where nothing can be timed).
  bool lookup_only = false;
};

struct Choice {
  enum class From { defaults, memory, cache, tuned };
  Config config;
  From from = From::defaults;
  double best_ms = 0.0;  // the winner's median (tuned only)
  double tune_ms = 0.0;  // compile + timing (tuned only)
  int candidates = 0, pruned = 0, failed = 0;  // candidates: distinct forms (Hooks::canonical), variants included
};
const char* from_name(Choice::From f);

// Whether KERF_AUTOTUNE asks for tuning on `device` (unset: GPUs only).
bool enabled_for(const Device& device);

// The config to use for `problem`: `fallback` when tuning is off, else the choice
// made earlier in this process, else the one stored in the cache (if the pruning
// rule still accepts it), else a fresh tuning of `candidates`. Tuning runs one at
// a time per process. When no candidate survives, `fallback`.
Choice choose(const Problem& problem, const std::vector<Config>& candidates, const Config& fallback,
              const Hooks& hooks, const Options& options = {});

// Asked between candidates (before each compile the tuning thread starts, and
// before each timed candidate) while a tuning pass runs; returning true
// abandons it: choose() throws kerf::Interrupted and stores nothing. kerf's
// Python module installs one that runs Python's signal handlers, so a Ctrl-C
// stops a long tuning pass within one compile. An empty function removes it.
void set_interrupt_check(std::function<bool()> check);

// The cache key of a problem's choice.
cache::CacheKey choice_key(const Problem& problem);
// Forgets the choices made in this process (tests; a new tuning reads the cache again).
void forget_choices();
// Changes whenever a choice made earlier may no longer be the answer: forget_choices()
// and cache::reload_settings() (KERF_AUTOTUNE may have changed). Ops that remember
// what they derived from a choice start over when it changes.
uint64_t generation();

// Every combination of the given values, e.g. {{"BLOCK_M", {32, 64}}, {"num_warps", {4, 8}}}
// gives 4 candidates; and a candidate's value of `name` (0 when it has none).
std::vector<Config> product(const std::vector<std::pair<std::string, std::vector<int64_t>>>& axes);
int64_t value_or_zero(const Config& c, const std::string& name);

// "BLOCK_K=128,BLOCK_M=64,num_warps=4" and back (empty on malformed text).
std::string config_text(const Config& c);
Config parse_config(const std::string& text);

// ---------------------------------------------------------------- pruning helpers
// Dynamic shared memory a launch's kernel needs on `arch` (traces and generates; no compile).
int shared_memory_bytes(const dsl::Kernel& kernel, const std::vector<Arg>& args, const Config& meta,
                        const std::string& arch);
// What one block may use on a device (after opting in).
int max_shared_memory(int device);
// For an architecture without a device here (kerf-cache warm): the usual opt-in
// shared memory limit and multiprocessor count of that generation's data-center part.
int typical_max_shared_memory(const std::string& arch);
// The threads one multiprocessor of that part holds (2048 on sm_80, 90 and 100; 1024 on
// sm_75; 1536 on sm_86, 89 and 120).
int typical_max_threads_per_multiprocessor(const std::string& arch);
int typical_sm_count(const std::string& arch);

// ---------------------------------------------------------------- tunable ops
// What `kerf-cache warm` needs to know about an op: how to make its operands,
// call it, and which kernels a configuration compiles to.
struct Operand {
  std::vector<int64_t> shape;
  DType dtype = DType::f32;
};
struct KernelCall {
  const dsl::Kernel* kernel = nullptr;
  std::vector<Arg> args;
  Config meta;
};
struct TunableOp {
  std::string name;                      // "dora_norm"
  std::vector<std::string> shape_names;  // the sizes a shape lists: {"out", "in", "r"}
  // Whether the op takes a sharding layout (ops::Layout) with its local shards.
  bool takes_layout = false;
  std::function<std::vector<Operand>(const std::vector<int64_t>& shape, DType dtype)> operands;
  // Runs the op once on `views` (made from `operands`), tuning it where tuning is on,
  // with the layout that `layout` (ops::Layout::canonical() text; "" for none) stands
  // for, this device at coordinate 0 of every mesh axis.
  std::function<void(const std::vector<TensorView>& views, void* stream, const std::string& layout)> call;
  // The kernels the op launches with `config` (empty: its default) on views that
  // may be fake (never dereferenced), for a GPU with `sm_count` multiprocessors.
  std::function<std::vector<KernelCall>(const std::vector<TensorView>& views, const Config& config,
                                        int sm_count)>
      kernels;
  std::function<std::vector<Config>()> gpu_candidates;
  // The meta-parameters its kernels take a row and a column tile from (ops::Config's
  // block_m and block_k).
  std::string block_m_name = "BLOCK_M", block_k_name = "BLOCK_K";
};
// Ops register themselves at load time (kernels_src/ops_*.cpp).
void register_op(TunableOp op);
std::vector<TunableOp> tunable_ops();

}  // namespace kerf::autotune
