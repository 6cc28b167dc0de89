// The device-side helper code that generated CUDA kernels include.
#pragma once

namespace kerf::jit::cuda {

const char* device_library_source();

}  // namespace kerf::jit::cuda
