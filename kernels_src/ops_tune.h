// How an op asks the autotuner for its configuration: the problem, the
// candidates, the kernels a configuration compiles to and how to run the op
// with one. The shared part (pruning by tile size and shared memory, parallel
// compiles, timing) lives here once.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kerf/jit/autotune.h"
#include "ops_common.h"
#include "kerf/ops/ops.h"
#include "kerf/runtime/cuda.h"

namespace kerf::ops::detail {

struct TuneRequest {
  autotune::Problem problem;
  // The meta-parameter names that ops::Config::block_m and block_k stand for in
  // this op's kernels ("BLOCK_M", "BLOCK_N", "BLOCK_T"; "BLOCK_K", "BLOCK_D").
  std::string block_m_name, block_k_name;
  // The GPU's candidates (the CPU back end tries a few tile sizes of its own).
  std::vector<autotune::Config> gpu_candidates;
  // The problem's extent along each: tiles far beyond it only waste work.
  int64_t extent_m = 0, extent_k = 0;
  // For with_wave_splits' candidates: their row blocks are split_batch x cdiv(extent_m,
  // the tile's rows), on split_programs multiprocessors. A choice stored for another
  // shape of the same bucket then gets the split that fills this shape's waves as it
  // filled that one's (not that shape's split count). 0: the stored split_k as it is.
  int64_t split_batch = 1, split_programs = 0;
  // The kernels `config` compiles to (arguments may hold stand-in workspace pointers).
  std::function<std::vector<autotune::KernelCall>(const Config& config)> kernels;
  // Runs the op once with `config`, queued on `stream`.
  std::function<void(const Config& config)> run;
  // Puts back what the op writes in place, before each timed run; empty when nothing needs it.
  std::function<void()> restore;
  // Meta overrides tried on the first round's finalists (autotune::Options::finalist_variants).
  std::vector<autotune::Config> finalist_variants;
  // The form a candidate runs as, after stream_canonical (Hooks::canonical); empty: that alone.
  std::function<autotune::Config(autotune::Config)> canonical;
  void* stream = nullptr;
};

// The elements of a view an op writes in place, saved when made and put back by
// restore() (queued on `stream` on a GPU): timed runs of an in-place op each
// start from the caller's data. A view without gaps is saved as its bytes; one
// with gaps (W[:, :128]) element by element, so that the memory between its
// elements, which may be another tensor's, is never written. Saves nothing when
// `written` does not overlap `input` (then restore() does nothing).
class SavedBytes {
 public:
  SavedBytes(const TensorView& input, const TensorView& written, void* stream);
  ~SavedBytes();  // waits for queued copies before the device copy is freed
  SavedBytes(const SavedBytes&) = delete;
  SavedBytes& operator=(const SavedBytes&) = delete;
  bool active() const { return bytes_ != 0; }
  void restore() const;

 private:
  void* first_ = nullptr;  // a view without gaps: its first byte
  TensorView view_, packed_;  // a view with gaps (as rank 3), and its elements' contiguous copy
  Device device_;
  void* stream_ = nullptr;
  size_t bytes_ = 0;
  cuda::DeviceBuffer device_copy_;
  std::vector<char> host_copy_;
};

// The ops::Config a candidate stands for, its tile meta-parameters named as given
// (ops::Config::block_m carries BLOCK_N for the MoE ops, BLOCK_T for the embedding).
Config config_from(const autotune::Config& candidate, const std::string& block_m_name,
                   const std::string& block_k_name);
// The inverse: the candidate an ops::Config stands for, in the names the op's registered
// kernels read (fields left 0 are left out, as the op's defaults).
autotune::Config candidate_from(const Config& config, const std::string& block_m_name,
                                const std::string& block_k_name);
// The ops::Config of a candidate of `request`.
Config config_of(const TuneRequest& request, const autotune::Config& candidate);

// `base`, each also with split_k set so that its programs fill each of `waves`
// full waves of `programs` multiprocessors (one program per SM), for ops whose
// programs share a row block's columns (grid axis 1). A candidate's row blocks
// are `batch` x cdiv(rows, its `block_m_name`), its column steps cdiv(cols, its
// `block_k_name`); a split equal to the op's default (split_for, or with
// `default_waves` the split for that many waves) is not repeated. A wave count of 0 stands for one column step per program (as many
// programs as tiles, the shape a one-tile-per-program kernel launches). Splits
// change only the grid, so they compile nothing new. Each added candidate also
// keeps its wave count ("split_waves"), from which config_of recomputes the
// split for the shape at hand (TuneRequest::split_programs).
std::vector<autotune::Config> with_wave_splits(const std::vector<autotune::Config>& base,
                                               const std::string& block_m_name, int64_t rows,
                                               const std::string& block_k_name, int64_t cols, int64_t batch,
                                               int64_t programs, const std::vector<int64_t>& waves,
                                               int64_t default_waves = 0);

// The L2 hint variants the streaming ops try on their finalists (EVICT 1 and 2).
const std::vector<autotune::Config>& evict_variants();
// evict_variants, and CAST_A when A is f32, the product bf16/f16 and `A` on a GPU.
std::vector<autotune::Config> evict_and_cast_variants(const TensorView& A, DType product);

// `variants` and, when the op's product runs on tensor cores (`product` bf16, f16 or
// TF32), WARPS_N 2 and 4: warps sharing the dot's columns, so that each reads
// fewer of A's columns from shared memory (dsl::dot's warps_n).
std::vector<autotune::Config> with_warps_n_variants(std::vector<autotune::Config> variants, Product product);

// `variants` and L2_PREFETCH 128 (on an H100 the MoE forward, merge and DoRA norm
// gained up to 1% with it at fixed configs). Not 256: it took the DoRA norm at r=16
// and 8192x8192 from 56.2 to 53.6 us but made r=64 5% slower, and when the tuner
// was offered it, it chose it for r=64 at 4096x4096 and 4096x14336 and those calls
// ran 21.7 -> 23.1 and 54.7 -> 57.1 us in the benchmark.
std::vector<autotune::Config> with_l2_prefetch_variants(std::vector<autotune::Config> variants);

// `variants` and WGMMA 1 (Hopper's warpgroup dots, kernel meta wgmma) when the
// op's product runs on tensor cores and `device` is an sm_90a GPU. At fixed
// configs on an H100 it took the DoRA norm at r=64 from 74.1 to 61.6 us
// (8192x8192, 64x128 tiles) and the MoE backward at r=64 from 516.4 to 461.4 us.
std::vector<autotune::Config> with_wgmma_variant(std::vector<autotune::Config> variants, DType product,
                                                 const Device& device);

// `variants` and COLS_FIRST 1 (the column slices of a row block on grid axis 0,
// so that the programs running together cover a few whole rows), alone and with
// each variant that sets WGMMA. At fixed configs on an H100 it took the merge at
// 14336x4096 from 95.6 to 94.3 us (64x128 tiles, default split) and 95.8 to 94.1
// us (split 4), and 4096x4096 31.0 to 30.4 us; the DoRA norm at r=16 (64x128
// tiles, default split) 53.8 to 52.5 us at 14336x4096 and 57.6 to 56.8 us at
// 8192x8192 (at r=64 within 1% either way).
std::vector<autotune::Config> with_cols_first_variants(std::vector<autotune::Config> variants);

// `candidates` and, when `product` runs on tensor cores and `device` is an sm_90a
// GPU, each of `tiles` with WGMMA 1: first-round candidates of their own, since
// the tiles that suit warpgroup dots are not the ones that win with mma.sync (the
// finalists' WGMMA variant alone missed them: DoRA r=64 at 14336x4096 tuned to
// 54.1 us while 128x128 tiles, 8 warps, one wave and WGMMA ran 51.6 us).
std::vector<autotune::Config> with_wgmma_tiles(std::vector<autotune::Config> candidates,
                                               const std::vector<autotune::Config>& tiles, DType product,
                                               const Device& device);

// `candidates` and, when `product` runs on tensor cores, STREAM tiles of their own
// (one tile per program; split and stages fixed by the plan): 32x64, 32x128,
// 32x256, 64x64, 64x128 and 128x64 with 4 warps (up to 64 accumulator registers per thread).
std::vector<autotune::Config> with_stream_tiles(std::vector<autotune::Config> candidates,
                                                const std::string& block_m_name, const std::string& block_k_name,
                                                DType product);

// `variants` and, when `product` runs on tensor cores (where with_stream_tiles adds STREAM
// tiles), ONE_TILE=1: the finalists that are STREAM configs also in their one-tile form
// (stream_canonical takes it out of the others, which are then not timed again).
std::vector<autotune::Config> with_one_tile_variant(std::vector<autotune::Config> variants, DType product);

// `c` as it runs: with STREAM, without the entries stream_plan overrides or drops
// (split_k, num_stages, L2_PREFETCH, COLS_FIRST) and without ONE_TILE=0; without STREAM,
// without ONE_TILE. The tuner's Hooks::canonical, so a finalist variant that only sets one
// of them is not compiled and timed again.
autotune::Config stream_canonical(autotune::Config c);

// The autotuner's choice for `request`; when tuning is off for the device, a call
// inside a graph capture finds no stored choice, or no candidate could run (then for
// every later call of the problem too), untuned_config's for the device (the op's own,
// all zero, wherever its tiles fit). On the CPU back end only two tile sizes
// of each are tried.
Config tuned_config(const TuneRequest& request);

// The most shared memory a block of `config`'s kernels (request.kernels) takes on `arch`.
int config_shared_memory(const TuneRequest& request, const Config& config, const std::string& arch);
// What untuned_config found: the bytes of the op's own tiles, of the config it returns,
// and the tuner's candidate it took ("" when none: the op's own).
struct UntunedFit {
  int own_bytes = 0, bytes = 0;
  std::string candidate;
  autotune::Config chosen;  // the candidate itself (empty: the op's own)
};
// The config an untuned call runs (KERF_AUTOTUNE=0, or a capture with no stored
// choice, or a tuning pass none of whose candidates could run) on a GPU of `arch` whose
// blocks hold `limit` bytes of shared memory: the op's own (empty) where its tiles fit,
// else the candidate of request.gpu_candidates that fits with the most shared memory
// (deeper pipelines, larger tiles; the first such), else the same among small tiles
// (16 to 64 each way, 4 warps, two stages); tiles far beyond the problem left out; the
// op's own when nothing fits (its launch then names the bytes needed and allowed).
// tuned_config asks it for the device at hand.
Config untuned_config(const TuneRequest& request, const std::string& arch, int limit, UntunedFit* fit = nullptr);
// The same for a registered op on `views` (they may be fake) with `sm_count`
// multiprocessors, as kerf-cache warm compiles for a target: the candidate in the names
// the op's kernels read, empty where the op's own tiles fit or nothing does.
autotune::Config untuned_candidate(const autotune::TunableOp& op, const std::vector<TensorView>& views,
                                   const std::string& arch, int limit, int sm_count, UntunedFit* fit = nullptr);

}  // namespace kerf::ops::detail
