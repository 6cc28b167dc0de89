// How much stack one program of the CPU back end may use. Tiles live in stack
// arrays, so the compiler refuses kernels whose tiles would not fit the worker
// threads' stacks, and the executor keeps big frames off the caller's thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kerf::jit::cpu {

// Reserved for each worker thread (address space; pages are committed when touched).
inline constexpr size_t kWorkerStackBytes = size_t(64) << 20;
// The most tile bytes one program may keep; the rest of the stack is for everything else.
inline constexpr int64_t kMaxTileStackBytes = int64_t(48) << 20;
// Programs up to this size may also run on the launching thread, whose stack kerf does not know.
inline constexpr int64_t kCallerStackBytes = int64_t(128) << 10;

}  // namespace kerf::jit::cpu
