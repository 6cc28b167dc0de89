// Guards for tests that need a GPU or NVRTC. Where the need is not met, the test
// prints one "KERF-SKIPPED: <why>" line and returns; CTest reports such a test as
// skipped (SKIP_REGULAR_EXPRESSION in tests/CMakeLists.txt).
#pragma once

#include <iostream>

#include "kerf/jit/nvrtc.h"
#include "kerf/runtime/cuda.h"

// Use as the first statement of a TEST_CASE (it returns from the test case).
#define KERF_REQUIRE_GPU()                                                                     \
  do {                                                                                         \
    if (kerf::cuda::device_count() == 0) {                                                     \
      std::cout << "KERF-SKIPPED: no CUDA device: " << kerf::cuda::driver_unavailable_reason() \
                << std::endl;                                                                  \
      return;                                                                                  \
    }                                                                                          \
  } while (false)

// For tests of several GPUs at once (one GPU is not enough: they say so and return).
#define KERF_REQUIRE_TWO_GPUS()                                                \
  do {                                                                         \
    KERF_REQUIRE_GPU();                                                        \
    if (kerf::cuda::device_count() < 2) {                                      \
      std::cout << "KERF-SKIPPED: needs two CUDA devices, the driver reports " \
                << kerf::cuda::device_count() << std::endl;                    \
      return;                                                                  \
    }                                                                          \
  } while (false)

#define KERF_REQUIRE_NVRTC()                                                                  \
  do {                                                                                        \
    if (!kerf::nvrtc::available()) {                                                          \
      std::cout << "KERF-SKIPPED: NVRTC not available: " << kerf::nvrtc::unavailable_reason() \
                << std::endl;                                                                 \
      return;                                                                                 \
    }                                                                                         \
  } while (false)
