// The parts of the kerf._kerf module, each bound by the file named for it.
#pragma once

#include <pybind11/pybind11.h>

namespace kerf::python {

namespace py = pybind11;

void register_errors(
    py::module_& m);  // errors.cpp: kerf::Error -> ValueError / TypeError / RuntimeError
void bind_buffer(py::module_& m);  // buffer.cpp: kerf.Buffer
void bind_ops(py::module_& m);     // ops_bindings.cpp: kerf.ops and kerf.Config

}  // namespace kerf::python
