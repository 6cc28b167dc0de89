// def_fast's entry point (fast_call.h): argument parsing and error translation.
#include "fast_call.h"

#include <cstring>

namespace kerf::python::fast_call {

namespace {

constexpr const char* kCapsule = "kerf._kerf.fast_function";
constexpr size_t kMaxParams = 24;

// Sets the pending Python error for the exception in flight.
void set_error_from_current_exception() {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (...) {
    try {
      translate_error(std::current_exception());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(PyExc_MemoryError, "out of host memory");
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (...) {
      PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
    }
  }
}

// "name(a, b, c=None)\n--\n\n" + doc: CPython's __text_signature__ convention,
// so that inspect.signature() and help() show the parameters.
std::string doc_with_signature(const Function& fn) {
  std::string s = fn.name + "(";
  for (size_t i = 0; i < fn.params.size(); ++i) {
    s += (i ? ", " : "") + fn.params[i];
    if (fn.defaults[i]) s += "=" + std::string(py::repr(fn.defaults[i]));
  }
  return s + ")\n--\n\n" + fn.doc;
}

}  // namespace

PyObject* entry(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  const auto* fn = static_cast<const Function*>(PyCapsule_GetPointer(self, kCapsule));
  if (!fn) return nullptr;
  const size_t n = fn->params.size();
  PyObject* slots[kMaxParams] = {};
  if (size_t(nargs) > n) {
    PyErr_Format(PyExc_TypeError, "%s() takes at most %zu arguments (%zd given)", fn->name.c_str(), n, nargs);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) slots[i] = args[i];
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    const char* name = PyUnicode_AsUTF8(key);
    if (!name) return nullptr;
    size_t i = 0;
    while (i < n && fn->params[i] != name) ++i;
    if (i == n) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%s'", fn->name.c_str(), name);
      return nullptr;
    }
    if (slots[i]) {
      PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn->name.c_str(), name);
      return nullptr;
    }
    slots[i] = args[nargs + k];
  }
  for (size_t i = 0; i < n; ++i) {
    if (slots[i]) continue;
    if (!fn->defaults[i]) {
      PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %zu)", fn->name.c_str(),
                   fn->params[i].c_str(), i + 1);
      return nullptr;
    }
    slots[i] = fn->defaults[i].ptr();
  }
  try {
    return fn->call(slots);
  } catch (...) {
    set_error_from_current_exception();
    return nullptr;
  }
}

void add_to_module(py::module_& m, Function* fn) {
  if (fn->params.size() > kMaxParams)
    throw InternalError("def_fast(" + fn->name + "): more than " + std::to_string(kMaxParams) + " parameters");
  fn->doc = doc_with_signature(*fn);
  fn->def.ml_name = fn->name.c_str();
  fn->def.ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&entry));
  fn->def.ml_flags = METH_FASTCALL | METH_KEYWORDS;
  fn->def.ml_doc = fn->doc.c_str();
  const py::object capsule = py::reinterpret_steal<py::object>(PyCapsule_New(fn, kCapsule, nullptr));
  if (!capsule) throw py::error_already_set();
  const py::object module_name = m.attr("__name__");
  const py::object f =
      py::reinterpret_steal<py::object>(PyCFunction_NewEx(&fn->def, capsule.ptr(), module_name.ptr()));
  if (!f) throw py::error_already_set();
  m.add_object(fn->name.c_str(), f, /*overwrite=*/true);
}

}  // namespace kerf::python::fast_call
