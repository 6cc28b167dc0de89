// kerf._kerf: the compiled half of the `kerf` Python package (kerf/__init__.py
// is the other half and the one users import).
#include "module.h"

#include "fast_call.h"

#include <string>

#include "kerf/jit/autotune.h"
#include "kerf/jit/cpu_backend.h"
#include "kerf/jit/launch.h"
#include "kerf/runtime/cuda.h"
#include "tensor_bridge.h"

#ifndef KERF_VERSION
#define KERF_VERSION "0.0.0"
#endif

PYBIND11_MODULE(_kerf, m) {
  namespace py = pybind11;
  using namespace kerf;
  m.doc() =
      "kerf's compiled core: ops on DLPack tensors, kerf.Buffer, errors. Import `kerf`, not this.";
  m.attr("__version__") = KERF_VERSION;

  python::init_bridge();
  python::register_errors(m);
  python::bind_buffer(m);
  python::bind_ops(m);
  python::fast_call::bind_with_signature(m);
  // A Ctrl-C stops a long autotuning pass: the tuner asks between candidates,
  // and Python's signal handlers run then (their exception is what the call
  // raises, KeyboardInterrupt by default).
  autotune::set_interrupt_check([] {
    if (!Py_IsInitialized()) return false;
    py::gil_scoped_acquire gil;
    return PyErr_CheckSignals() != 0;
  });

  m.def("cpu_available", &jit::cpu::available,
        "Whether kerf was built with its CPU back end (LLVM).");
  m.def("llvm_version", &jit::cpu::llvm_version, "The LLVM version of the CPU back end, or ''.");
  m.def(
      "cuda_available", [] { return cuda::driver_available() && cuda::device_count() > 0; },
      "Whether a CUDA driver and at least one device are there.");
  m.def("cuda_unavailable_reason", &cuda::driver_unavailable_reason,
        "Why CUDA cannot be used ('' when it can).");
  m.def("device_count", &cuda::device_count, "CUDA devices (0 without a driver).");
  m.def(
      "clear_kernel_cache", [] { clear_kernel_cache(); },
      "Drops every kernel compiled in this process (the on-disk cache is kept).");
}
