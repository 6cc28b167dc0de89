// What is known about the integer values of a kernel, per tile dimension:
// runs of consecutive values (contiguity), the power of two that divides the
// first value of each run (divisibility), and runs of equal values
// (constancy). Code generation uses it to turn element accesses into
// 16-byte vector accesses when addresses, masks and layouts allow.
#pragma once

#include <cstdint>
#include <vector>

#include "kerf/jit/ir.h"

namespace kerf::ir {

struct AxisInfo {
  // One entry per tile dimension; a scalar has rank 0 and uses `scalar_div`.
  std::vector<int64_t> contiguity;
  std::vector<int64_t> divisibility;
  std::vector<int64_t> constancy;
  int64_t scalar_div = 1;

  // The largest power of two that divides every element.
  int64_t element_divisibility() const;
};

inline constexpr int64_t kMaxDivisibility = int64_t(1) << 30;

// Indexed by ValueId. Non-integer values get the conservative answer.
std::vector<AxisInfo> analyze_axis_info(const Function& f);

}  // namespace kerf::ir
