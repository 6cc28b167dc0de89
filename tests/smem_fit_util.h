// Checks, on any machine, that the kernels a GPU test case would launch fit an H100's
// shared memory: a config over it is refused at launch, which only a GPU run would show.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "catch.h"
#include "kerf/jit/autotune.h"
#include "kerf/jit/cuda_codegen.h"
#include "kerf/jit/launch.h"
#include "kerf/ops/ops.h"
#include "kernels_src/ops_tune.h"

namespace kerf::test {

// A device address for planning only (never dereferenced).
inline void* planning_address() { return reinterpret_cast<void*>(uintptr_t(1) << 16); }

// The registered tunable op named `name` (jit/autotune.h); the test stops where there is none.
inline autotune::TunableOp registered_op(const std::string& name) {
  const std::vector<autotune::TunableOp> all = autotune::tunable_ops();
  const auto op = std::find_if(all.begin(), all.end(), [&](const autotune::TunableOp& o) { return o.name == name; });
  REQUIRE(op != all.end());
  return *op;
}

// The shared memory a planned kernel call takes, generated for sm_90a.
inline int sm90a_smem_bytes(const autotune::KernelCall& k) {
  return jit::cuda::generate(k.kernel->trace(arg_specs(k.args), k.meta), "sm_90a").smem_bytes;
}

// Every kernel the registered op `name` plans for `views` (fake GPU tensors) and `config` on an
// H100 (132 multiprocessors), generated for sm_90a, fits its shared memory.
inline void check_fits_h100(const std::string& name, const std::vector<TensorView>& views,
                            const ops::Config& config) {
  const autotune::TunableOp op = registered_op(name);
  const ops::detail::PlanningArch h100("sm_90a");  // the op's own tiles there, on any machine
  const std::vector<autotune::KernelCall> calls =
      op.kernels(views, ops::detail::candidate_from(config, op.block_m_name, op.block_k_name), 132);
  REQUIRE(!calls.empty());
  for (const autotune::KernelCall& k : calls) {
    const int bytes = sm90a_smem_bytes(k);
    CAPTURE(k.kernel->name(), bytes);
    CHECK(bytes <= autotune::typical_max_shared_memory("sm_90a"));
  }
}

// Whether planned kernel metas `m` are the ring tile (ops_common.h with_ring_tile) with its
// rows in meta `rows` (BLOCK_M, BLOCK_N): 64x128, 4 warps, `stages` stages (3 unless an op
// says otherwise), warpgroup dots, the store through the ring, 128-byte L2 prefetches.
inline bool is_ring_tile(const autotune::Config& m, const std::string& rows, int64_t stages = 3) {
  return m.at(rows) == 64 && m.at("BLOCK_K") == 128 && m.at("num_warps") == 4 && m.at("num_stages") == stages &&
         m.count("wgmma") && m.count("store_in_ring") && m.count("l2_prefetch") && m.at("l2_prefetch") == 128;
}

// Whether planned kernel metas `m` are a one-tile own tile (ops_common.h with_one_tile; the
// merge's and the MoE forward's) with its rows in meta `rows_meta` (BLOCK_M, BLOCK_N): `rows`
// by `cols` on `warps` warps, one stage, a program for every tile (ONE_TILE), the column blocks
// of a row block launched together (COLS_FIRST).
inline bool is_one_tile(const autotune::Config& m, const std::string& rows_meta, int64_t rows, int64_t cols,
                        int64_t warps = 4) {
  return m.at(rows_meta) == rows && m.at("BLOCK_K") == cols && m.at("num_warps") == warps && m.at("num_stages") == 1 &&
         m.count("ONE_TILE") && m.at("ONE_TILE") == 1 && m.count("COLS_FIRST") && !m.count("wgmma") &&
         !m.count("WALK_ROWS");
}

}  // namespace kerf::test
