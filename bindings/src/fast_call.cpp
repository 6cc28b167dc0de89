// def_fast's entry point (fast_call.h): argument parsing and error translation.
#include "fast_call.h"

#include <algorithm>
#include <cstring>
#include <memory>

namespace kerf::python::fast_call {

int64_t int_argument(PyObject* o, const std::string& what) {
  if (PyBool_Check(o) || !PyIndex_Check(o)) throw TypeError(what + " must be an int, got " + type_name(o));
  const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(o));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow)
    throw InvalidArgument(what + " must fit in 64 bits, got " + py::str(index).cast<std::string>());
  return int64_t(v);
}

bool bool_argument(PyObject* o, const std::string& what) {
  if (PyBool_Check(o)) return o == Py_True;
  const std::string type = type_name(o);
  if (type == "numpy.bool_" || type == "numpy.bool") {
    const int v = PyObject_IsTrue(o);
    if (v < 0) throw py::error_already_set();
    return v == 1;
  }
  // An integer (a Python int or a NumPy one) that is 0 or 1, as a flag is often written.
  if (PyIndex_Check(o)) {
    const int64_t v = int_argument(o, what);
    if (v == 0 || v == 1) return v == 1;
    throw InvalidArgument(what + " must be a bool (or 0 or 1), got " + std::to_string(v));
  }
  throw TypeError(what + " must be a bool, got " + type);
}

namespace {

// Each function's `self`: a module object whose state holds its Function, so
// that Python shows and pickles it as a plain function of its module (a
// builtin bound to any other object reads "built-in method ... of ...").
PyModuleDef self_def = {PyModuleDef_HEAD_INIT, "kerf._kerf", nullptr, sizeof(Function*),
                        nullptr, nullptr, nullptr, nullptr, nullptr};

const Function* function_in(PyObject* self) {
  return *static_cast<const Function* const*>(PyModule_GetState(self));
}

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

// "name(a, b, *, c=None)\n--\n\n" + doc: CPython's __text_signature__ convention,
// so that inspect.signature() and help() show the parameters.
std::string doc_with_signature(const Function& fn) {
  std::string s = fn.name + "(";
  for (size_t i = 0; i < fn.params.size(); ++i) {
    if (i) s += ", ";
    if (i == fn.positional) s += "*, ";
    s += fn.params[i];
    if (fn.defaults[i]) s += "=" + std::string(py::repr(fn.defaults[i]));
  }
  return s + ")\n--\n\n" + fn.doc;
}

const Function* function_of(py::handle f) {
  if (!PyCFunction_Check(f.ptr())) return nullptr;
  PyObject* self = PyCFunction_GET_SELF(f.ptr());
  if (!self || !PyModule_Check(self) || PyModule_GetDef(self) != &self_def) return nullptr;
  return function_in(self);
}

}  // namespace

PyObject* entry(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  const Function* fn = function_in(self);
  const size_t n = fn->params.size();
  PyObject* slots[kMaxParams] = {};
  const size_t positional = std::min(n, fn->positional);
  if (size_t(nargs) > positional) {
    PyErr_Format(PyExc_TypeError, "%s() takes at most %zu %sarguments (%zd given)", fn->name.c_str(), positional,
                 positional < n ? "positional " : "", nargs);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) slots[i] = args[i];
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    // Keywords written in the caller's source arrive as interned strings: the
    // same objects as the interned parameter names, found without comparing text.
    size_t i = 0;
    while (i < n && fn->interned[i].ptr() != key) ++i;
    const char* name = nullptr;
    if (i == n) {
      name = PyUnicode_AsUTF8(key);
      if (!name) return nullptr;
      i = 0;
      while (i < n && fn->params[i] != name) ++i;
    }
    if (i == n) {
      PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%s'", fn->name.c_str(), name);
      return nullptr;
    }
    if (slots[i]) {
      PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn->name.c_str(),
                   fn->params[i].c_str());
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

namespace {

// The function object calling `fn` (which must outlive it), its __module__ `module_name`.
py::object make_function(Function* fn, const py::object& module_name) {
  if (fn->params.size() > kMaxParams)
    throw InternalError("def_fast(" + fn->name + "): more than " + std::to_string(kMaxParams) + " parameters");
  fn->doc = doc_with_signature(*fn);
  for (const std::string& p : fn->params) {
    PyObject* name = PyUnicode_InternFromString(p.c_str());
    if (!name) throw py::error_already_set();
    fn->interned.push_back(py::reinterpret_steal<py::object>(name));
  }
  fn->def.ml_name = fn->name.c_str();
  fn->def.ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&entry));
  fn->def.ml_flags = METH_FASTCALL | METH_KEYWORDS;
  fn->def.ml_doc = fn->doc.c_str();
  const py::object self = py::reinterpret_steal<py::object>(PyModule_Create(&self_def));
  if (!self) throw py::error_already_set();
  *static_cast<Function**>(PyModule_GetState(self.ptr())) = fn;
  py::object f = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&fn->def, self.ptr(), module_name.ptr()));
  if (!f) throw py::error_already_set();
  return f;
}

}  // namespace

void add_to_module(py::module_& m, Function* fn) {
  m.add_object(fn->name.c_str(), make_function(fn, m.attr("__name__")), /*overwrite=*/true);
}

void bind_with_signature(py::module_& m) {
  m.def(
      "_with_signature",
      [](py::handle core_fn, py::handle python_function) -> py::object {
        const Function* core = function_of(core_fn);
        if (!core) throw TypeError("_with_signature(): core must be a function of kerf._kerf, got " +
                                   type_name(core_fn.ptr()));
        const py::module_ inspect = py::module_::import("inspect");
        const py::object parameter = inspect.attr("Parameter");
        const py::object empty = parameter.attr("empty");
        const std::string name = py::str(python_function.attr("__name__"));
        auto fn = std::make_unique<Function>();  // lives as long as the function object made from it
        fn->name = name;
        const py::object doc = python_function.attr("__doc__");
        fn->doc = doc.is_none() ? "" : std::string(py::str(doc));
        std::vector<size_t> to_core;
        const py::object params = inspect.attr("signature")(python_function).attr("parameters").attr("values")();
        for (const py::handle p : params) {
          const std::string pname = py::str(p.attr("name"));
          const py::object kind = p.attr("kind");
          const size_t at = fn->params.size();
          if (kind.equal(parameter.attr("KEYWORD_ONLY"))) {
            if (fn->positional == SIZE_MAX) fn->positional = at;
          } else if (!kind.equal(parameter.attr("POSITIONAL_OR_KEYWORD"))) {
            throw py::value_error("_with_signature(): " + name + "'s parameter '" + pname +
                             "' must be positional-or-keyword or keyword-only");
          }
          size_t i = 0;
          while (i < core->params.size() && core->params[i] != pname) ++i;
          if (i == core->params.size())
            throw py::value_error("_with_signature(): " + name + " declares '" + pname + "', which " + core->name +
                             " does not take");
          to_core.push_back(i);
          fn->params.push_back(pname);
          const py::object dflt = p.attr("default");
          fn->defaults.push_back(dflt.is(empty) ? py::object() : dflt);
        }
        if (fn->params.size() != core->params.size()) {
          std::string missing;
          for (const std::string& c : core->params)
            if (std::find(fn->params.begin(), fn->params.end(), c) == fn->params.end())
              missing += (missing.empty() ? "'" : ", '") + c + "'";
          throw py::value_error("_with_signature(): " + name + " does not declare " + missing + ", which " +
                           core->name + " takes");
        }
        fn->call = [core, to_core](PyObject* const* args) {
          PyObject* in_core_order[kMaxParams];
          for (size_t i = 0; i < to_core.size(); ++i) in_core_order[to_core[i]] = args[i];
          return core->call(in_core_order);
        };
        py::object f = make_function(fn.get(), python_function.attr("__module__"));
        fn.release();
        return f;
      },
      py::arg("core"), py::arg("python_function"),
      "`core` (a function of this module) called with python_function's signature, name, "
      "docstring and module; used by kerf.ops.");
}

}  // namespace kerf::python::fast_call
