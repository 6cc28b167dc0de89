// The parts of the kerf._kerf module, each bound by the file named for it.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <stdexcept>

namespace kerf::python {

namespace py = pybind11;

// Host memory that could not be had, with the size asked for: raised as MemoryError
// (thrown where the GIL may be released, so not set as a Python error there).
struct HostOutOfMemory : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void register_errors(
    py::module_& m);  // errors.cpp: kerf::Error -> ValueError / TypeError / RuntimeError
// Sets the Python error of a kerf::Error (or HostOutOfMemory) in flight; rethrows
// anything else (pybind11's exception translator, and def_fast's entries).
void translate_error(std::exception_ptr p);
void bind_buffer(py::module_& m);  // buffer.cpp: kerf.Buffer
void bind_ops(py::module_& m);     // ops_bindings.cpp: kerf.ops and kerf.Config

}  // namespace kerf::python
