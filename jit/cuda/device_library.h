// The device-side helper code that generated CUDA kernels include.
#pragma once

#include <string>

namespace kerf::jit::cuda {

const char* device_library_source();

// wgmma.m64n<n>k16 wrappers (bf16 and f16, A from registers, B by descriptor)
// for the kernels that use them; n = 0 gives the shared helpers.
std::string wgmma_wrapper_source(int n);

}  // namespace kerf::jit::cuda
