// Module functions called through CPython's vectorcall protocol (METH_FASTCALL)
// instead of pybind11's generic dispatcher.
//
// kerf's ops are launch-bound from Python: every 100 ns of host time per call
// shows. pybind11's dispatcher builds an argument vector, runs a type caster per
// argument and tries overloads; for an op of 11 arguments that is about 0.15 us.
// def_fast() binds a lambda whose parameters are py::handle, double, int64_t or
// bool (the types kerf's op bindings take) with the same py::arg list and
// docstring m.def() takes, and parses positional and keyword arguments itself.
// Errors are raised as pybind11 would: kerf errors through translate_error(),
// pybind11's own exceptions as theirs, anything else as RuntimeError.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kerf/error.h"
#include "module.h"
#include "tensor_bridge.h"

namespace kerf::python {

namespace fast_call {

// One bound function: its parameter names, which are required (the rest
// default to their py::arg_v values), from which one on they are keyword-only,
// and the call on the parsed arguments (in `params` order).
struct Function {
  std::string name;
  std::string doc;
  std::vector<std::string> params;
  std::vector<py::object> interned;  // the names as interned Python strings (made with the function)
  std::vector<py::object> defaults;  // one per parameter; null: required
  size_t positional = SIZE_MAX;      // parameters that may come by position (SIZE_MAX: all)
  std::function<PyObject*(PyObject* const* args)> call;
  PyMethodDef def{};
};

PyObject* entry(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames);

// Argument conversions, with pybind11's rules for the same C++ types (float and
// int for double, but not bool; int for int64_t; bool and anything with a truth value for bool).
inline py::handle convert(PyObject* o, py::handle*, const Function&, size_t) { return o; }

inline double convert(PyObject* o, double*, const Function& f, size_t i) {
  if (PyFloat_CheckExact(o)) return PyFloat_AS_DOUBLE(o);
  // A bool is an int to Python, but True as a scale or eps is a mistake, as for the int arguments.
  if (PyBool_Check(o))
    throw TypeError(f.name + "(): " + f.params[i] + " must be a float, got bool");
  const double v = PyFloat_AsDouble(o);
  if (v == -1.0 && PyErr_Occurred()) {
    // An int too large for a double (10**400) is a number, just not one that fits.
    const bool too_large = PyErr_ExceptionMatches(PyExc_OverflowError);
    PyErr_Clear();
    if (too_large)
      throw InvalidArgument(f.name + "(): " + f.params[i] + " is an int too large for a double");
    throw TypeError(f.name + "(): " + f.params[i] + " must be a float, got " + type_name(o));
  }
  return v;
}

// An int argument: a Python int or anything with __index__ (NumPy integers), not a
// bool; beyond 64 bits it is a ValueError naming the argument. `what` names it.
int64_t int_argument(PyObject* o, const std::string& what);

inline int64_t convert(PyObject* o, int64_t*, const Function& f, size_t i) {
  if (PyLong_CheckExact(o)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (!overflow && !(v == -1 && PyErr_Occurred())) return int64_t(v);
    PyErr_Clear();
  }
  return int_argument(o, f.name + "(): " + f.params[i]);
}

// A bool argument: True or False, an int, or a NumPy bool; anything else (a string,
// whose truth would be its length) is a TypeError.
bool bool_argument(PyObject* o, const std::string& what);

inline bool convert(PyObject* o, bool*, const Function& f, size_t i) {
  if (o == Py_True) return true;
  if (o == Py_False) return false;
  return bool_argument(o, f.name + "(): " + f.params[i]);
}

template <class T>
PyObject* to_python(T&& result) {
  if constexpr (std::is_base_of_v<py::handle, std::decay_t<T>>)
    return py::object(std::forward<T>(result)).release().ptr();
  else
    return py::cast(std::forward<T>(result)).release().ptr();
}

template <class F>
struct Signature : Signature<decltype(&F::operator())> {};
template <class C, class R, class... A>
struct Signature<R (C::*)(A...) const> {
  using Args = std::tuple<std::decay_t<A>...>;
};

template <class F, class Args, size_t... I>
PyObject* invoke(const F& f, const Function& fn, PyObject* const* args, std::index_sequence<I...>) {
  return to_python(f(convert(args[I], static_cast<std::tuple_element_t<I, Args>*>(nullptr), fn, I)...));
}

inline void add_extra(Function& fn, const py::arg_v& a) {
  fn.params.emplace_back(a.name);
  fn.defaults.push_back(a.value);
}
inline void add_extra(Function& fn, const py::arg& a) {
  fn.params.emplace_back(a.name);
  fn.defaults.emplace_back();
}
inline void add_extra(Function& fn, const char* doc) { fn.doc = doc; }

void add_to_module(py::module_& m, Function* fn);

// _kerf._with_signature(core, python_function): `core` (a def_fast function)
// called with `python_function`'s signature — its parameters' order, defaults
// and keyword-only marker — under its name, docstring and module. kerf.ops
// declares each op as a documented Python signature and is given this in its
// place: the same call without a Python frame in between (about 0.25 us of a
// launch-bound call). Both must name the same parameters, else ValueError.
void bind_with_signature(py::module_& m);

}  // namespace fast_call

// Binds `f` as m.def(name, f, extras...) would, for the argument types above.
template <class F, class... Extra>
void def_fast(py::module_& m, const char* name, F f, const Extra&... extra) {
  using Args = typename fast_call::Signature<F>::Args;
  auto* fn = new fast_call::Function;  // lives as long as the module's function objects
  fn->name = name;
  (fast_call::add_extra(*fn, extra), ...);
  if (fn->params.size() != std::tuple_size_v<Args>)
    throw InternalError(std::string("def_fast(") + name + "): " + std::to_string(fn->params.size()) +
                        " names for " + std::to_string(std::tuple_size_v<Args>) + " parameters");
  fn->call = [f, fn](PyObject* const* args) {
    return fast_call::invoke<F, Args>(f, *fn, args, std::make_index_sequence<std::tuple_size_v<Args>>{});
  };
  fast_call::add_to_module(m, fn);
}

}  // namespace kerf::python
