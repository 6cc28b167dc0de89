// kerf::Error in Python: one exception class per ErrorKind, each deriving from
// kerf.Error and from the built-in exception its kind maps to, so that
//   except ValueError / TypeError / RuntimeError   and   except kerf.Error
// both work. The message is the C++ message.
#include <array>
#include <string>

#include "kerf/error.h"
#include "module.h"

namespace kerf::python {

namespace {

struct ErrorTypes {
  PyObject* base = nullptr;            // kerf.Error
  std::array<PyObject*, 9> by_kind{};  // indexed by ErrorKind
};

ErrorTypes& error_types() {
  static ErrorTypes t;  // made once at import (with the GIL); kept for the process's life
  return t;
}

PyObject* new_error(py::module_& m, const char* name, PyObject* builtin, const char* doc) {
  PyObject* bases = PyTuple_Pack(2, error_types().base, builtin);
  if (!bases) throw py::error_already_set();
  const std::string qualified = std::string("kerf.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  Py_DECREF(bases);
  if (!type) throw py::error_already_set();
  m.add_object(name, py::reinterpret_borrow<py::object>(type));
  return type;
}

// Raises `type(message)` with extra attributes; never throws (it runs inside a translator).
void raise(PyObject* type, const std::string& message,
           std::initializer_list<std::pair<const char*, PyObject*>> attributes = {}) {
  if (PyErr_Occurred()) PyErr_Clear();  // an attribute that failed to convert is dropped
  PyObject* exc = PyObject_CallFunction(type, "s", message.c_str());
  if (!exc) return;  // the failure to build it is the pending error
  for (const auto& [name, value] : attributes) {
    if (value && PyObject_SetAttrString(exc, name, value) != 0) PyErr_Clear();
    Py_XDECREF(value);
  }
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
}

}  // namespace

void register_errors(py::module_& m) {
  ErrorTypes& t = error_types();
  t.base = PyErr_NewExceptionWithDoc(
      "kerf.Error", "Every error kerf raises derives from kerf.Error.", PyExc_Exception, nullptr);
  if (!t.base) throw py::error_already_set();
  m.add_object("Error", py::reinterpret_borrow<py::object>(t.base));
  auto kind = [](ErrorKind k) { return size_t(k); };
  t.by_kind[kind(ErrorKind::InvalidArgument)] = new_error(
      m, "InvalidArgumentError", PyExc_ValueError, "A bad shape, value, stride, device or layout.");
  t.by_kind[kind(ErrorKind::Type)] = new_error(
      m, "DTypeError", PyExc_TypeError, "A wrong dtype, or an argument that is not a tensor.");
  t.by_kind[kind(ErrorKind::Definition)] =
      new_error(m, "DefinitionError", PyExc_ValueError, "A mistake in a DSL kernel definition.");
  t.by_kind[kind(ErrorKind::Compile)] =
      new_error(m, "CompileError", PyExc_RuntimeError,
                "NVRTC or LLVM rejected generated code; .log holds the compiler's log and .source "
                "the generated source.");
  t.by_kind[kind(ErrorKind::Cuda)] =
      new_error(m, "CudaError", PyExc_RuntimeError,
                "The CUDA driver reported an error; .code is its CUresult.");
  t.by_kind[kind(ErrorKind::NotAvailable)] =
      new_error(m, "NotAvailableError", PyExc_RuntimeError,
                "No CUDA driver or device, or a back end kerf was built without.");
  t.by_kind[kind(ErrorKind::Cache)] =
      new_error(m, "CacheError", PyExc_RuntimeError, "A kernel cache or bundle could not be used.");
  t.by_kind[kind(ErrorKind::Internal)] =
      new_error(m, "InternalError", PyExc_RuntimeError, "A bug in kerf itself: please report it.");
  t.by_kind[kind(ErrorKind::Interrupted)] =
      new_error(m, "WorkInterruptedError", PyExc_RuntimeError,
                "Work stopped on request (an autotuning pass); a Ctrl-C raises the signal handler's "
                "own exception instead, KeyboardInterrupt by default.");

  py::register_exception_translator(&translate_error);
}

void translate_error(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const CompileError& e) {
    raise(error_types().by_kind[size_t(e.kind())], e.what(),
          {{"log", PyUnicode_DecodeUTF8(e.log().data(), Py_ssize_t(e.log().size()), "replace")},
           {"source",
            PyUnicode_DecodeUTF8(e.source().data(), Py_ssize_t(e.source().size()), "replace")}});
  } catch (const Interrupted& e) {
    // Stopped by a signal handler that raised: its exception is already pending.
    if (!PyErr_Occurred()) raise(error_types().by_kind[size_t(e.kind())], e.what());
  } catch (const CudaError& e) {
    raise(error_types().by_kind[size_t(e.kind())], e.what(),
          {{"code", PyLong_FromLong(e.code())}});
  } catch (const HostOutOfMemory& e) {
    PyErr_SetString(PyExc_MemoryError, e.what());
  } catch (const Error& e) {
    const size_t k = size_t(e.kind());
    PyObject* type = k < error_types().by_kind.size() ? error_types().by_kind[k] : nullptr;
    raise(type ? type : PyExc_RuntimeError, e.what());
  }
}

}  // namespace kerf::python
