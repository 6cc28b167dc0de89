// Cache keys: XXH3-128 over a versioned, canonical byte encoding of everything
// that selects a compiled kernel (or an autotune choice).
//
// Encoding (version kKeyEncodingVersion): the 8 bytes "kerf-key", a u32
// version, a u8 kind (1 kernel, 2 tune choice), then the fields in a fixed
// order, each as [u8 tag][u32 byte count][bytes]; integers little endian,
// strings as their bytes, lists as a u32 count then their items. Changing what
// a field means, or adding one, bumps the version, so old entries simply stop
// matching.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kerf/dsl/dsl.h"
#include "kerf/jit/ir.h"

namespace kerf::cache {

inline constexpr uint32_t kKeyEncodingVersion = 2;  // 2: tensor facts gained div8 masks

// Where code runs and what produced it.
struct Target {
  std::string backend;   // "cuda" or "cpu"
  std::string arch;      // exact architecture: "sm_90a"; the host CPU's LLVM name for "cpu"
  std::string compiler;  // "nvrtc 13.0" or "llvm 14.0.6" (kernel keys only)
  std::string features;  // CPU features, canonical (cpu only)
  std::string device;    // device name, e.g. "NVIDIA H100 80GB HBM3" (tune keys only)
};

// A compiled kernel: its IR, the code generated from it, how it was specialized, where it runs.
struct KernelKeyFields {
  std::string kernel;               // the DSL kernel's name
  ir::Hash128 ir_hash;              // ir::hash of the traced Function
  ir::Hash128 code_hash;            // XXH3-128 of the generated CUDA C++ / LLVM IR text
  std::vector<ir::MetaValue> meta;  // every meta-parameter the trace read (warps, stages ...)
  std::vector<dsl::ArgSpec> args;   // dtypes, ranks, alignment/divisibility/contiguity facts
  std::string layout;               // canonical sharding layout text ("" unsharded)
  Target target;
  std::string kerf_version;
};

// An autotune choice: keyed by the problem, not by the candidates tried.
struct TuneKeyFields {
  std::string op;                     // "dora_norm"
  std::vector<int64_t> shape_bucket;  // the op's shape, bucketed
  std::vector<DType> dtypes;
  std::string layout;
  Target target;  // backend, arch, device (or CPU features); no compiler
  std::string kerf_version;
};

struct CacheKey {
  ir::Hash128 id;        // the key
  ir::Hash128 family;    // the key with the compiler left out (found when no compiler is there)
  std::string encoding;  // the bytes `id` hashes: entries compare them in full

  // "<family hex>-<id hex>", the name of the entry on disk.
  std::string stem() const;
  bool operator==(const CacheKey& o) const { return id == o.id && encoding == o.encoding; }
};

CacheKey kernel_key(const KernelKeyFields& f);
// The fields of a traced Function's key: name, IR hash, meta, argument specs (from
// its parameters), with the given generated-code hash, layout and target.
KernelKeyFields kernel_fields(const ir::Function& fn, const ir::Hash128& code_hash,
                              const std::string& layout, const Target& target);
CacheKey tune_key(const TuneKeyFields& f);

// kerf's own version, as built ("0.1.0").
std::string kerf_version();

}  // namespace kerf::cache
