// kerf: the whole public API in one include.
#pragma once

#include "kerf/cache/store.h"      // the kernel cache: settings, bundles (mount_bundle), stats
#include "kerf/dsl/dsl.h"          // the tile DSL: Kernel, Builder, tiles and ops
#include "kerf/dtype.h"
#include "kerf/error.h"            // kerf::Error and its kinds
#include "kerf/jit/cpu_backend.h"  // the CPU back end (available() says whether it was built)
#include "kerf/jit/autotune.h"     // the autotuner (set_interrupt_check, forget_choices)
#include "kerf/jit/launch.h"       // kerf::launch: compile on first call, then run
#include "kerf/kernels/kernels.h"  // the kernel library, as DSL kernels
#include "kerf/ops/ops.h"          // validated operations (dora_norm, ...)
#include "kerf/runtime/cuda.h"     // devices, memory, streams, events
#include "kerf/runtime/tensor.h"   // TensorView, Scalar, Grid
