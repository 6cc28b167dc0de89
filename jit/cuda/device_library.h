// The device-side helper code that generated CUDA kernels include.
#pragma once

#include <string>

namespace kerf::jit::cuda {

const char* device_library_source();

// The helpers every wgmma dot uses (descriptor, fence, commit, wait), and the
// wgmma.m64n<n>k16 wrappers (bf16 and f16, A from registers, B by descriptor),
// for the kernels that use them.
const char* wgmma_helpers_source();
std::string wgmma_wrapper_source(int n);

// Cluster rank, cluster barrier and distributed shared-memory loads (sm_90+),
// for the kernels whose cluster_atomic_add sums over clusters.
const char* cluster_helpers_source();

}  // namespace kerf::jit::cuda
