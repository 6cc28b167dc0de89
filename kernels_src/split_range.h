// The slice of a loop that one program of grid axis 1 owns, for kernels whose
// programs share a long dimension (split-K style). The number of slices is the
// grid's, not a meta-parameter, so changing it compiles nothing new.
#pragma once

#include <utility>

#include "kerf/dsl/dsl.h"

namespace kerf::kernels {

// [lo, hi) of [0, n): program_id(1)'s share of num_programs(1) slices, in whole `step`s.
inline std::pair<dsl::Value, dsl::Value> split_range(const dsl::Value& n, int64_t step) {
  using namespace kerf::dsl;
  const Value per_split = cdiv(cdiv(n, literal(step)), num_programs(1)) * step;
  const Value lo = program_id(1) * per_split;
  return {lo, minimum(n, lo + per_split)};
}

}  // namespace kerf::kernels
