// The kernel argument ABI shared by the CPU and CUDA back ends.
//
// A launch passes one flat array of 8-byte slots, in parameter order:
//   tensor of rank r: [data address] [size 0 .. size r-1] [stride 0 .. stride r-1]   (1 + 2r slots)
//                     sizes and strides as int64, strides in elements
//   scalar:           one slot; the value in the parameter's declared dtype, stored in
//                     the slot's low bytes (little endian), the rest zero
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kerf/jit/ir.h"
#include "kerf/runtime/tensor.h"

namespace kerf::jit {

using Slot = uint64_t;

size_t slot_count(const std::vector<ir::Param>& params);
// First slot of each parameter.
std::vector<size_t> slot_offsets(const std::vector<ir::Param>& params);

// Fills `slots` (slot_count(params) entries) from call arguments that were
// already checked against `params` (kinds and ranks match). A scalar for an integer
// parameter must be a whole number in the parameter's range (2.5 or 3e9 for an i32 is
// an InvalidArgument naming the parameter and `kernel`, never truncated or wrapped);
// float parameters take any number, rounded to their dtype.
void pack_args(const std::vector<ir::Param>& params, const std::vector<Arg>& args, Slot* slots,
               const char* kernel = nullptr);

}  // namespace kerf::jit
