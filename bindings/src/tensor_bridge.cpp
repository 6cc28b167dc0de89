#include "tensor_bridge.h"

#include <array>
#include <cstdlib>
#include <memory>
#include <string>

#include "buffer.h"
#include "common/env_switch.h"
#include "dlpack_abi.h"
#include "kerf/error.h"
#include "kerf/runtime/cuda.h"
#include "torch_bridge_abi.h"

namespace kerf::python {

namespace {

// A new reference from the C API as an owned object; a null one raises the pending Python error.
py::object steal(PyObject* p) {
  if (!p) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(p);
}

std::string str_of(py::handle h) {
  PyObject* s = PyObject_Str(h.ptr());
  if (!s) {
    PyErr_Clear();
    return "?";
  }
  const char* c = PyUnicode_AsUTF8(s);
  std::string out = c ? c : "?";
  if (!c) PyErr_Clear();
  Py_DECREF(s);
  return out;
}

std::string where(const char* op, const char* name) {
  return std::string(op) + ": " + name;
}

// Interned names and keyword tuples, made once (at import, with the GIL) and kept
// for the life of the process (never released: no destructor runs after Python is gone).
struct Names {
  PyObject* data_ptr;
  PyObject* stride;
  PyObject* get_device;
  PyObject* dtype;
  PyObject* shape;
  PyObject* is_cuda;
  PyObject* is_cpu;
  PyObject* is_neg;
  PyObject* layout;
  PyObject* device;
  PyObject* dlpack;
  PyObject* dlpack_device;
  PyObject* torch;
  PyObject* numpy;
  PyObject* kw_stream;        // ("stream",)
  PyObject* kw_max_version;   // ("max_version",)
  PyObject* kw_stream_max;    // ("stream", "max_version")
  PyObject* kw_dtype_device;  // ("dtype", "device")
  PyObject* kw_dtype;         // ("dtype",)
  PyObject* max_version;      // (1, 0)
};

PyObject* intern(const char* s) {
  PyObject* p = PyUnicode_InternFromString(s);
  if (!p) throw py::error_already_set();
  return p;
}

PyObject* names_tuple(std::initializer_list<const char*> items) {
  PyObject* t = PyTuple_New(Py_ssize_t(items.size()));
  if (!t) throw py::error_already_set();
  Py_ssize_t i = 0;
  for (const char* s : items) PyTuple_SET_ITEM(t, i++, intern(s));
  return t;
}

const Names& names() {
  static const Names n = [] {
    Names x{};
    x.data_ptr = intern("data_ptr");
    x.stride = intern("stride");
    x.get_device = intern("get_device");
    x.dtype = intern("dtype");
    x.shape = intern("shape");
    x.is_cuda = intern("is_cuda");
    x.is_cpu = intern("is_cpu");
    x.is_neg = intern("is_neg");
    x.layout = intern("layout");
    x.device = intern("device");
    x.dlpack = intern("__dlpack__");
    x.dlpack_device = intern("__dlpack_device__");
    x.torch = intern("torch");
    x.numpy = intern("numpy");
    x.kw_stream = names_tuple({"stream"});
    x.kw_max_version = names_tuple({"max_version"});
    x.kw_stream_max = names_tuple({"stream", "max_version"});
    x.kw_dtype_device = names_tuple({"dtype", "device"});
    x.kw_dtype = names_tuple({"dtype"});
    x.max_version = Py_BuildValue("(II)", dlpack::kMajorVersion, dlpack::kMinorVersion);
    if (!x.max_version) throw py::error_already_set();
    return x;
  }();
  return n;
}

// A module already imported by someone (kerf never imports torch or numpy itself to convert).
PyObject* imported_module(PyObject* name) {
  PyObject* m = PyDict_GetItemWithError(PyImport_GetModuleDict(), name);  // borrowed
  if (!m && PyErr_Occurred()) PyErr_Clear();
  return m;
}

PyObject* attr_or_null(PyObject* obj, const char* name) {
  PyObject* a = PyObject_GetAttrString(obj, name);
  if (!a) PyErr_Clear();
  return a;
}

// ---------------------------------------------------------------- PyTorch (when imported)
// What the torch fast path needs, looked up once torch has been imported.
// Mutated only with the GIL held; the references are kept for the process's life.
struct TorchApi {
  bool ready = false;
  PyObject* tensor_type = nullptr;     // torch.Tensor
  PyObject* parameter_type = nullptr;  // torch.nn.Parameter
  std::array<PyObject*, 8> dtypes{};   // torch.bool ... torch.float64, torch.uint8, indexed by kerf::DType
  PyObject* empty = nullptr;           // torch.empty
  PyObject* raw_stream = nullptr;  // torch._C._cuda_getCurrentRawStream(device) -> int, if present
  PyObject* current_stream = nullptr;  // torch.cuda.current_stream (the documented fallback)
  PyObject* is_grad_enabled = nullptr;    // torch.is_grad_enabled
  PyObject* increment_version = nullptr;  // torch.autograd.graph.increment_version (torch >= 2.1), if present
  // kerf._torch_bridge when it imported (see torch_bridge_abi.h), and why not when it did not.
  const KerfTorchBridge* bridge = nullptr;
  std::string bridge_status;
};

// Whether calls use kerf._torch_bridge when it is there (tests compare both paths).
bool bridge_enabled = true;

// kerf._torch_bridge's function table, or nullptr with the reason in `status`.
const KerfTorchBridge* load_torch_bridge(std::string& status) {
  if (const char* env = std::getenv("KERF_TORCH_BRIDGE");
      env && kerf::detail::is_off_word(kerf::detail::switch_word(env))) {
    status = std::string("disabled by KERF_TORCH_BRIDGE=") + env;
    return nullptr;
  }
  PyObject* m = PyImport_ImportModule("kerf._torch_bridge");
  if (!m) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    status = value ? str_of(value) : "kerf._torch_bridge did not import";
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return nullptr;
  }
  PyObject* capsule = PyObject_GetAttrString(m, "_C_API");
  Py_DECREF(m);  // the module stays in sys.modules
  const auto* api = capsule ? static_cast<const KerfTorchBridge*>(
                                  PyCapsule_GetPointer(capsule, KERF_TORCH_BRIDGE_CAPSULE))
                            : nullptr;
  Py_XDECREF(capsule);
  if (!api) {
    PyErr_Clear();
    status = "kerf._torch_bridge has no _C_API capsule";
    return nullptr;
  }
  if (api->abi != KERF_TORCH_BRIDGE_ABI || api->size < sizeof(KerfTorchBridge)) {
    status = "kerf._torch_bridge speaks interface " + std::to_string(api->abi) + ", this kerf " +
             std::to_string(KERF_TORCH_BRIDGE_ABI) + "; rebuild kerf";
    return nullptr;
  }
  status = std::string("active (built against torch ") + api->torch_version + ")";
  return api;
}

const TorchApi* torch_api() {
  static TorchApi api;
  if (api.ready) return &api;
  PyObject* torch = imported_module(names().torch);
  if (!torch) return nullptr;
  // torch may be half-imported (kerf called from inside its import): try again next time.
  TorchApi a;
  a.tensor_type = attr_or_null(torch, "Tensor");
  PyObject* nn = attr_or_null(torch, "nn");
  a.parameter_type = nn ? attr_or_null(nn, "Parameter") : nullptr;
  Py_XDECREF(nn);
  static constexpr std::array<const char*, 8> dtype_names = {
      "bool", "int32", "int64", "float16", "bfloat16", "float32", "float64", "uint8"};
  static_assert(int(DType::i1) == 0 && int(DType::i32) == 1 && int(DType::i64) == 2 &&
                int(DType::f16) == 3 && int(DType::bf16) == 4 && int(DType::f32) == 5 &&
                int(DType::f64) == 6 && int(DType::u8) == 7);
  bool ok = a.tensor_type && a.parameter_type;
  for (size_t i = 0; ok && i < dtype_names.size(); ++i)
    ok = (a.dtypes[i] = attr_or_null(torch, dtype_names[i]));
  a.empty = ok ? attr_or_null(torch, "empty") : nullptr;
  if (!ok || !a.empty) {
    Py_XDECREF(a.tensor_type);
    Py_XDECREF(a.parameter_type);
    for (PyObject* d : a.dtypes) Py_XDECREF(d);
    return nullptr;
  }
  if (PyObject* c = attr_or_null(torch, "_C")) {
    a.raw_stream = attr_or_null(c, "_cuda_getCurrentRawStream");
    Py_DECREF(c);
  }
  if (PyObject* cuda = attr_or_null(torch, "cuda")) {
    a.current_stream = attr_or_null(cuda, "current_stream");
    Py_DECREF(cuda);
  }
  a.is_grad_enabled = attr_or_null(torch, "is_grad_enabled");
  if (PyObject* autograd = attr_or_null(torch, "autograd")) {
    if (PyObject* graph = attr_or_null(autograd, "graph")) {
      a.increment_version = attr_or_null(graph, "increment_version");
      Py_DECREF(graph);
    }
    Py_DECREF(autograd);
  }
  a.bridge = load_torch_bridge(a.bridge_status);
  a.ready = true;
  api = a;
  return &api;
}

const KerfTorchBridge* torch_bridge(const TorchApi* api) {
  return api && bridge_enabled ? api->bridge : nullptr;
}

// Exactly torch.Tensor or torch.nn.Parameter: types whose attributes kerf may read
// directly. Subclasses (tensor wrappers, DTensor, fake tensors) go through DLPack.
bool is_plain_torch(const TorchApi* api, py::handle obj) {
  PyObject* t = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  return api && (t == api->tensor_type || t == api->parameter_type);
}

bool is_torch(const TorchApi* api, py::handle obj) {
  if (!api) return false;
  if (is_plain_torch(api, obj)) return true;
  const int r = PyObject_IsInstance(obj.ptr(), api->tensor_type);
  if (r < 0) PyErr_Clear();
  return r == 1;
}

DType torch_dtype(const TorchApi& api, PyObject* dtype, const char* op, const char* name) {
  for (size_t i = 0; i < api.dtypes.size(); ++i)
    if (dtype == api.dtypes[i]) return DType(i);
  throw TypeError(
      where(op, name) + " has dtype " + str_of(dtype) +
      ", which kerf does not take (bool, int32, int64, float16, bfloat16, float32, float64, uint8)");
}

int64_t as_int64(PyObject* o) {
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return int64_t(v);
}

[[noreturn]] void throw_neg_bit(const char* op, const char* name) {
  throw InvalidArgument(where(op, name) +
                        " is a lazily negated view (its negative bit is set, e.g. x.conj().imag); "
                        "pass x.resolve_neg()");
}

// A torch tensor read through kerf._torch_bridge (C++) when it is there and can,
// else through its attributes: data_ptr() (storage offset included), dtype,
// device, shape, stride().
[[noreturn]] void throw_written_needs_grad(const char* op, const char* name) {
  throw InvalidArgument(where(op, name) +
                        " requires grad, and kerf writes into it in place, which autograd cannot record: "
                        "call the op under torch.no_grad() (as merging weights is done) or pass a tensor "
                        "that does not require grad");
}

// A torch tensor kerf is about to write, read through Python: refused when autograd
// would need to record the write.
void check_torch_write(const TorchApi& api, py::handle obj, const char* op, const char* name) {
  if (steal(PyObject_GetAttrString(obj.ptr(), "requires_grad")).ptr() == Py_True && api.is_grad_enabled &&
      steal(PyObject_CallNoArgs(api.is_grad_enabled)).ptr() == Py_True)
    throw_written_needs_grad(op, name);
}

}  // namespace

// A torch tensor kerf may have written: its version counter bumped as an in-place torch op
// bumps it (through kerf._torch_bridge, else where this torch can:
// torch.autograd.graph.increment_version, else an in-place op on an empty view of it).
void bump_torch_version(py::handle obj) {
  const TorchApi* api = torch_api();
  if (!api) return;
  if (const KerfTorchBridge* bridge = torch_bridge(api); bridge && bridge->bump_version(obj.ptr()))
    return;
  if (api->increment_version) {
    steal(PyObject_CallOneArg(api->increment_version, obj.ptr()));
    return;
  }
  // An older torch: an in-place op on an empty view of the tensor bumps the counter
  // the view shares with it, and touches no element (nor launches a kernel). An
  // inference tensor keeps no counter (and takes no in-place op outside inference mode).
  if (PyObject* inference = PyObject_CallMethod(obj.ptr(), "is_inference", nullptr)) {
    const bool is_inference = inference == Py_True;
    Py_DECREF(inference);
    if (is_inference) return;
  } else {
    PyErr_Clear();  // a torch before inference mode (1.9)
  }
  const py::object empty = steal(PyObject_CallMethod(obj.ptr(), "as_strided", "((i)(i))", 0, 1));
  steal(PyObject_CallMethod(empty.ptr(), "add_", "(i)", 0));
}

namespace {

TensorView torch_view(const TorchApi& api, py::handle obj, bool written, const char* op,
                      const char* name) {
  if (const KerfTorchBridge* bridge = torch_bridge(&api)) {
    KerfTorchTensor t;
    const int32_t r = bridge->view(obj.ptr(), written ? 1 : 0, &t);
    if (r == kKerfTorchNegBit) throw_neg_bit(op, name);
    if (r == kKerfTorchWrittenNeedsGrad) throw_written_needs_grad(op, name);
    if (r == kKerfTorchOk) {
      TensorView v;
      v.data = t.data;
      v.dtype = DType(t.dtype);
      v.device = t.device_index < 0 ? Device::cpu() : Device::cuda(t.device_index);
      v.rank = t.rank;
      for (int d = 0; d < t.rank; ++d) {
        v.shape[size_t(d)] = t.shape[d];
        v.strides[size_t(d)] = t.strides[d];
      }
      return v;
    }
  }
  if (written) check_torch_write(api, obj, op, name);
  const Names& n = names();
  PyObject* o = obj.ptr();
  TensorView v;
  {
    const py::object dtype = steal(PyObject_GetAttr(o, n.dtype));
    v.dtype = torch_dtype(api, dtype.ptr(), op, name);
  }
  if (steal(PyObject_GetAttr(o, n.is_cuda)).ptr() == Py_True) {
    v.device = Device::cuda(int(as_int64(steal(PyObject_CallMethodNoArgs(o, n.get_device)).ptr())));
  } else if (steal(PyObject_GetAttr(o, n.is_cpu)).ptr() == Py_True) {
    v.device = Device::cpu();
  } else {
    throw InvalidArgument(where(op, name) + " is on device '" +
                          str_of(steal(PyObject_GetAttr(o, n.device))) +
                          "'; kerf runs on CPU and CUDA tensors");
  }
  if (steal(PyObject_CallMethodNoArgs(o, n.is_neg)).ptr() == Py_True) throw_neg_bit(op, name);
  // Sparse (COO, CSR, ...) and other layouts have no strided memory to read.
  {
    const std::string layout = str_of(steal(PyObject_GetAttr(o, n.layout)));
    if (layout != "torch.strided")
      throw TypeError(where(op, name) + " is a " + layout +
                      " tensor; kerf takes dense (torch.strided) tensors (use .to_dense())");
  }
  {
    const py::object ptr = steal(PyObject_CallMethodNoArgs(o, n.data_ptr));
    v.data = PyLong_AsVoidPtr(ptr.ptr());
    if (!v.data && PyErr_Occurred()) throw py::error_already_set();
  }
  const py::object shape = steal(PyObject_GetAttr(o, n.shape));
  const py::object strides = steal(PyObject_CallMethodNoArgs(o, n.stride));
  if (!PyTuple_Check(shape.ptr()) || !PyTuple_Check(strides.ptr()))
    throw InvalidArgument(where(op, name) + ": torch tensor shape or stride() is not a tuple");
  const Py_ssize_t rank = PyTuple_GET_SIZE(shape.ptr());
  if (rank > kMaxRank || PyTuple_GET_SIZE(strides.ptr()) != rank)
    throw InvalidArgument(where(op, name) + " has rank " + std::to_string(rank) +
                          "; kerf takes at most " + std::to_string(kMaxRank) + " dimensions");
  v.rank = int(rank);
  for (Py_ssize_t d = 0; d < rank; ++d) {
    v.shape[size_t(d)] = as_int64(PyTuple_GET_ITEM(shape.ptr(), d));
    v.strides[size_t(d)] = as_int64(PyTuple_GET_ITEM(strides.ptr(), d));
  }
  return v;
}

// ---------------------------------------------------------------- NumPy (when imported)
struct NumpyApi {
  bool ready = false;
  PyObject* ndarray = nullptr;
  PyObject* empty = nullptr;
};

const NumpyApi* numpy_api() {
  static NumpyApi api;
  if (api.ready) return &api;
  PyObject* np = imported_module(names().numpy);
  if (!np) return nullptr;
  NumpyApi a;
  a.ndarray = attr_or_null(np, "ndarray");
  a.empty = attr_or_null(np, "empty");
  if (!a.ndarray || !a.empty) {
    Py_XDECREF(a.ndarray);
    Py_XDECREF(a.empty);
    return nullptr;
  }
  a.ready = true;
  api = a;
  return &api;
}

bool is_numpy(py::handle obj) {
  const NumpyApi* api = numpy_api();
  if (!api) return false;
  const int r = PyObject_IsInstance(obj.ptr(), api->ndarray);
  if (r < 0) PyErr_Clear();
  return r == 1;
}

// A kerf.Buffer: its type object is looked up once (py::isinstance<Buffer> hashes
// the C++ type's name on every call, twice per tensor of a NumPy/DLPack call).
bool is_buffer(py::handle obj) {
  static PyTypeObject* const type = reinterpret_cast<PyTypeObject*>(py::type::of<Buffer>().ptr());
  return PyObject_TypeCheck(obj.ptr(), type) != 0;
}

Framework framework_of(const TorchApi* torch, py::handle obj) {
  if (is_plain_torch(torch, obj)) return Framework::torch;
  if (is_buffer(obj)) return Framework::kerf;
  if (is_torch(torch, obj)) return Framework::torch;
  if (is_numpy(obj)) return Framework::numpy;
  return Framework::other;
}

// ---------------------------------------------------------------- DLPack
DType dlpack_dtype(const dlpack::DLDataType& t, const char* op, const char* name) {
  if (t.lanes == 1) {
    switch (t.code) {
      case dlpack::kDLFloat:
        if (t.bits == 16) return DType::f16;
        if (t.bits == 32) return DType::f32;
        if (t.bits == 64) return DType::f64;
        break;
      case dlpack::kDLBfloat:
        if (t.bits == 16) return DType::bf16;
        break;
      case dlpack::kDLInt:
        if (t.bits == 32) return DType::i32;
        if (t.bits == 64) return DType::i64;
        break;
      case dlpack::kDLUInt:
        if (t.bits == 8) return DType::u8;
        break;
      case dlpack::kDLBool:
        if (t.bits == 8) return DType::i1;
        break;
      default:
        break;
    }
  }
  static constexpr std::array<const char*, 7> codes = {"int",    "uint",    "float", "handle",
                                                       "bfloat", "complex", "bool"};
  const std::string code = t.code < codes.size() ? codes[t.code] : "code" + std::to_string(t.code);
  throw TypeError(
      where(op, name) + " has DLPack dtype " + code + std::to_string(t.bits) +
      (t.lanes != 1 ? "x" + std::to_string(t.lanes) : std::string()) +
      ", which kerf does not take (bool, int32, int64, float16, bfloat16, float32, float64, uint8)");
}

Device dlpack_device(const dlpack::DLDevice& d, const char* op, const char* name) {
  switch (d.device_type) {
    case dlpack::kDLCPU:
    case dlpack::kDLCUDAHost:
      return Device::cpu();
    case dlpack::kDLCUDA:
    case dlpack::kDLCUDAManaged:
      return Device::cuda(d.device_id);
    default:
      throw InvalidArgument(
          where(op, name) + " lives on DLPack device type " + std::to_string(d.device_type) +
          "; kerf runs on CPU (1), CUDA (2), CUDA host (3) and CUDA managed (13) memory");
  }
}

TensorView dltensor_view(const dlpack::DLTensor& t, const char* op, const char* name) {
  if (t.ndim < 0 || t.ndim > kMaxRank)
    throw InvalidArgument(where(op, name) + " has rank " + std::to_string(t.ndim) +
                          "; kerf takes at most " + std::to_string(kMaxRank) + " dimensions");
  TensorView v;
  v.dtype = dlpack_dtype(t.dtype, op, name);
  v.device = dlpack_device(t.device, op, name);
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  v.rank = t.ndim;
  int64_t contiguous = 1;
  for (int d = t.ndim; d-- > 0;) {
    v.shape[size_t(d)] = t.shape[d];
    v.strides[size_t(d)] =
        t.strides ? t.strides[d] : contiguous;  // NULL strides: compact row-major
    contiguous *= t.shape[d];
  }
  return v;
}

// A NumPy array as kerf sees it through __array_interface__, for the arrays that
// NumPy before 2.1 will not export through DLPack (read-only ones: broadcast_to,
// frombuffer, read-only memory maps). Host memory; the same checks as a DLPack
// tensor's (read through a DLTensor made of the interface's fields).
TensorView numpy_interface_view(py::handle obj, const char* op, const char* name, bool written) {
  const py::dict ai = py::reinterpret_steal<py::dict>(PyObject_GetAttrString(obj.ptr(), "__array_interface__"));
  if (!ai) throw py::error_already_set();
  const py::tuple data = ai["data"];
  if (written && data[1].cast<bool>())
    throw InvalidArgument(where(op, name) + " is read-only; kerf writes into it");
  const std::string ts = ai["typestr"].cast<std::string>();
  dlpack::DLDataType dt{0, 0, 1};
  const bool little = ts.size() >= 3 && (ts[0] == '<' || ts[0] == '|');
  const int bytes = little ? std::atoi(ts.c_str() + 2) : 0;
  switch (little ? ts[1] : '?') {
    case 'f': dt.code = dlpack::kDLFloat; break;
    case 'i': dt.code = dlpack::kDLInt; break;
    case 'u': dt.code = dlpack::kDLUInt; break;
    case 'b': dt.code = dlpack::kDLBool; break;
    default:
      throw TypeError(where(op, name) + " is a NumPy array of type '" + ts + "', which kerf does not take");
  }
  dt.bits = uint8_t(bytes * 8);
  const py::tuple shape = ai["shape"];
  std::vector<int64_t> dims, strides;
  for (const py::handle d : shape) dims.push_back(d.cast<int64_t>());
  const py::object st = ai["strides"];
  if (!st.is_none())
    for (const py::handle d : st) {
      const int64_t b = d.cast<int64_t>();
      if (bytes == 0 || b % bytes)
        throw InvalidArgument(where(op, name) + " has a stride of " + std::to_string(b) +
                              " bytes, not a whole number of its " + std::to_string(bytes) + "-byte elements");
      strides.push_back(b / bytes);
    }
  dlpack::DLTensor t{};
  t.data = reinterpret_cast<void*>(uintptr_t(data[0].cast<uint64_t>()));
  t.device = dlpack::DLDevice{dlpack::kDLCPU, 0};
  t.ndim = int32_t(dims.size());
  t.dtype = dt;
  t.shape = dims.data();
  t.strides = st.is_none() ? nullptr : strides.data();
  t.byte_offset = 0;
  return dltensor_view(t, op, name);
}

// The DLTensor inside a capsule (either generation), and its flags.
struct CapsuleTensor {
  const dlpack::DLTensor* tensor = nullptr;
  uint64_t flags = 0;
};

CapsuleTensor read_capsule(py::handle cap, const char* op, const char* name) {
  PyObject* c = cap.ptr();
  const char* cname = PyCapsule_GetName(c);
  if (!cname && PyErr_Occurred()) throw py::error_already_set();
  const std::string n = cname ? cname : "";
  CapsuleTensor out;
  if (n == dlpack::kCapsuleName) {
    auto* m = static_cast<dlpack::DLManagedTensor*>(PyCapsule_GetPointer(c, cname));
    if (!m) throw py::error_already_set();
    out.tensor = &m->dl_tensor;
  } else if (n == dlpack::kCapsuleNameVersioned) {
    auto* m = static_cast<dlpack::DLManagedTensorVersioned*>(PyCapsule_GetPointer(c, cname));
    if (!m) throw py::error_already_set();
    if (m->version.major > dlpack::kMajorVersion)
      throw InvalidArgument(where(op, name) + " is a DLPack " + std::to_string(m->version.major) +
                            "." + std::to_string(m->version.minor) +
                            " tensor; kerf reads DLPack up to " +
                            std::to_string(dlpack::kMajorVersion) + ".x");
    out.tensor = &m->dl_tensor;
    out.flags = m->flags;
  } else if (n == dlpack::kUsedCapsuleName || n == dlpack::kUsedCapsuleNameVersioned) {
    throw InvalidArgument(where(op, name) + " is a DLPack capsule that was already consumed");
  } else {
    throw TypeError(where(op, name) + " is a capsule named '" + n + "', not a DLPack tensor");
  }
  return out;
}

// Whether a type's __dlpack__ accepts max_version (DLPack 1.x producers). Unknown
// types are asked with it first; a TypeError marks them legacy. A stale entry
// (a type freed and its address reused) costs one retry, never a wrong result.
struct VersionSupport {
  std::array<PyTypeObject*, 16> legacy{};
  size_t next = 0;
  bool is_legacy(PyTypeObject* t) const {
    for (PyTypeObject* l : legacy)
      if (l == t) return true;
    return false;
  }
  void mark_legacy(PyTypeObject* t) { legacy[next++ % legacy.size()] = t; }
};
VersionSupport& version_support() {
  static VersionSupport v;  // touched only with the GIL held
  return v;
}

// obj.__dlpack__(stream=..., max_version=(1, 0)), or without max_version for legacy producers.
// `stream` is null for CPU tensors (NumPy refuses any stream there).
py::object export_dlpack(py::handle obj, PyObject* stream) {
  const Names& n = names();
  PyTypeObject* type = Py_TYPE(obj.ptr());
  VersionSupport& vs = version_support();
  if (!vs.is_legacy(type)) {
    PyObject* args[3] = {obj.ptr(), stream ? stream : n.max_version, n.max_version};
    PyObject* r =
        PyObject_VectorcallMethod(n.dlpack, args, 1, stream ? n.kw_stream_max : n.kw_max_version);
    if (r) return py::reinterpret_steal<py::object>(r);
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
    PyErr_Clear();
    vs.mark_legacy(type);
  }
  PyObject* args[2] = {obj.ptr(), stream};
  return steal(PyObject_VectorcallMethod(n.dlpack, args, 1, stream ? n.kw_stream : nullptr));
}

// (device_type, device_id) from __dlpack_device__().
dlpack::DLDevice device_of(py::handle obj, const char* op, const char* name) {
  const py::object d = steal(PyObject_CallMethodNoArgs(obj.ptr(), names().dlpack_device));
  if (!PyTuple_Check(d.ptr()) || PyTuple_GET_SIZE(d.ptr()) != 2)
    throw TypeError(where(op, name) +
                    ": __dlpack_device__() must return (device_type, device_id), got " + str_of(d));
  return dlpack::DLDevice{int32_t(as_int64(PyTuple_GET_ITEM(d.ptr(), 0))),
                          int32_t(as_int64(PyTuple_GET_ITEM(d.ptr(), 1)))};
}

// The stream value __dlpack__ expects for a CUstream: 1 is the legacy default stream (0 is not
// allowed).
py::object dlpack_stream_value(void* stream) {
  return steal(PyLong_FromVoidPtr(stream ? stream : reinterpret_cast<void*>(uintptr_t(1))));
}

bool type_module_starts_with(py::handle obj, const char* prefix) {
  PyObject* mod = attr_or_null(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())), "__module__");
  if (!mod) return false;
  const char* s = PyUnicode_Check(mod) ? PyUnicode_AsUTF8(mod) : nullptr;
  if (!s) PyErr_Clear();
  const bool r = s && std::string(s).rfind(prefix, 0) == 0;
  Py_DECREF(mod);
  return r;
}

// CuPy's current stream on `device` (the array's, which need not be CuPy's current
// device), or nullptr.
void* cupy_current_stream(int device) {
  py::object cupy = py::reinterpret_borrow<py::object>(imported_module(py::str("cupy").ptr()));
  if (!cupy) return nullptr;
  const py::object cuda = cupy.attr("cuda");
  // Under `with cupy.cuda.Device(device)`: get_current_stream's device_id argument is
  // not in every CuPy version, the context manager is.
  const py::object scope = cuda.attr("Device")(device);
  scope.attr("__enter__")();
  py::object stream;
  try {
    stream = cuda.attr("get_current_stream")();
  } catch (...) {
    scope.attr("__exit__")(py::none(), py::none(), py::none());
    throw;
  }
  scope.attr("__exit__")(py::none(), py::none(), py::none());
  return parse_stream(stream);
}

}  // namespace

std::string type_name(py::handle h) {
  return Py_TYPE(h.ptr())->tp_name;
}

// ---------------------------------------------------------------- streams
void* parse_stream(py::handle stream) {
  PyObject* s = stream.ptr();
  if (PyBool_Check(s)) throw TypeError("stream must be a CUstream handle (an int >= 0) or a stream object, got bool");
  // NumPy integers (np.int64 from an array of handles) count as ints, as elsewhere.
  if (!PyLong_Check(s) && PyIndex_Check(s)) {
    const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(s));
    if (!index) throw py::error_already_set();
    return parse_stream(index);
  }
  if (PyLong_Check(s)) {
    const long long v = PyLong_AsLongLong(s);
    if (v == -1 && PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw py::error_already_set();
      PyErr_Clear();
      throw InvalidArgument("stream must be a CUstream handle (an int >= 0), got " + str_of(stream) +
                            ", which does not fit in 64 bits");
    }
    if (v < 0)
      throw InvalidArgument("stream must be a CUstream handle (an int >= 0), got " +
                            std::to_string(v));
    return reinterpret_cast<void*>(uintptr_t(v));
  }
  if (PyObject* h =
          attr_or_null(s, "cuda_stream")) {  // torch.cuda.Stream, torch.cuda.ExternalStream
    const py::object owned = py::reinterpret_steal<py::object>(h);
    return parse_stream(owned);
  }
  if (PyObject* proto =
          attr_or_null(s, "__cuda_stream__")) {  // the CUDA stream protocol: (version, handle)
    const py::object method = py::reinterpret_steal<py::object>(proto);
    const py::object r = method();
    if (!PyTuple_Check(r.ptr()) || PyTuple_GET_SIZE(r.ptr()) != 2)
      throw TypeError("stream.__cuda_stream__() must return (version, handle), got " + str_of(r));
    return parse_stream(PyTuple_GET_ITEM(r.ptr(), 1));
  }
  if (PyObject* ptr = attr_or_null(s, "ptr")) {  // cupy.cuda.Stream
    const py::object owned = py::reinterpret_steal<py::object>(ptr);
    if (PyLong_Check(owned.ptr())) return parse_stream(owned);
  }
  throw TypeError(
      "stream must be None, an int CUstream handle, a torch.cuda.Stream, a CuPy stream or an "
      "object with __cuda_stream__, got " +
      type_name(stream));
}

const char* numpy_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::i1:
      return "bool";
    case DType::i32:
      return "int32";
    case DType::i64:
      return "int64";
    case DType::f16:
      return "float16";
    case DType::f32:
      return "float32";
    case DType::f64:
      return "float64";
    case DType::u8:
      return "uint8";
    case DType::bf16:
      return nullptr;
  }
  return nullptr;
}

// ---------------------------------------------------------------- Call
Call::Call(const char* op, py::handle stream) : op_(op), stream_arg_(stream) {}

void Call::check_signals() {
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

void Call::check_unused_stream() {
  if (!stream_resolved_ && stream_arg_ && !stream_arg_.is_none()) (void)parse_stream(stream_arg_);
}

void Call::resolve_stream(py::handle obj, Framework framework, int device) {
  if (stream_resolved_) return;
  stream_resolved_ = true;
  if (stream_arg_ && !stream_arg_.is_none()) {
    stream_ = parse_stream(stream_arg_);
    return;
  }
  if (framework == Framework::torch) {
    const TorchApi* api = torch_api();
    if (const KerfTorchBridge* bridge = torch_bridge(api);
        bridge && bridge->current_stream(device, &stream_) == 1)
      return;
    if (api && api->raw_stream) {
      const py::object s = steal(PyObject_CallFunction(api->raw_stream, "i", device));
      stream_ = PyLong_AsVoidPtr(s.ptr());
      if (!stream_ && PyErr_Occurred()) throw py::error_already_set();
    } else if (api && api->current_stream) {
      stream_ = parse_stream(steal(PyObject_CallFunction(api->current_stream, "i", device)));
    }
    return;
  }
  if (framework == Framework::other && type_module_starts_with(obj, "cupy")) {
    stream_ = cupy_current_stream(device);
    return;
  }
  stream_ = nullptr;  // the legacy default stream
}

TensorView Call::input(py::handle obj, const char* name) {
  return convert(obj, name, false);
}

TensorView Call::output(py::handle obj, const char* name) {
  return convert(obj, name, true);
}

TensorView Call::convert(py::handle obj, const char* name, bool written) {
  if (!obj || obj.is_none()) throw TypeError(where(op_, name) + " is None; a tensor is required");
  const TorchApi* torch = torch_api();
  TensorView v;
  Framework framework;
  if (is_plain_torch(torch, obj)) {
    framework = Framework::torch;
    v = torch_view(*torch, obj, written, op_, name);
    // Its version counter is bumped once the op may have written it (run()).
    if (written) written_torch_.push_back(obj);
    if (v.device.is_cuda()) resolve_stream(obj, framework, v.device.index);
  } else if (is_buffer(obj)) {
    framework = Framework::kerf;
    Buffer& b = obj.cast<Buffer&>();
    v = b.view();
    if (v.device.is_cuda()) {
      resolve_stream(obj, framework, v.device.index);
      // A buffer written on another stream is finished before this call reads or writes it.
      if (b.stream() != stream_) {
        if (cuda::stream_capturing(stream_))
          throw InvalidArgument(where(op_, name) +
                                " is a kerf.Buffer last written on another stream, and kerf cannot wait for that "
                                "stream while this one captures a CUDA graph; synchronize it before the capture");
        py::gil_scoped_release nogil;
        Buffer::wait_for(b, stream_);
      }
      if (written) b.set_stream(stream_);
    }
  } else {
    framework = framework_of(torch, obj);
    v = from_dlpack(obj, name, written, framework);
  }
  if (!have_first_) {
    have_first_ = true;
    first_ = obj;
    first_framework_ = framework;
    first_device_ = v.device;
  }
  return v;
}

TensorView Call::from_dlpack(py::handle obj, const char* name, bool written, Framework framework) {
  py::object capsule;
  if (PyCapsule_CheckExact(obj.ptr())) {
    capsule =
        py::reinterpret_borrow<py::object>(obj);  // the caller's capsule: read, never consumed
  } else {
    if (!PyObject_HasAttr(obj.ptr(), names().dlpack))
      throw TypeError(where(op_, name) +
                      " must be a tensor (an object with __dlpack__, such as a torch.Tensor, "
                      "numpy.ndarray, CuPy or JAX array, or a DLPack capsule), got " +
                      type_name(obj));
    const dlpack::DLDevice dev = device_of(obj, op_, name);
    const Device device = dlpack_device(dev, op_, name);
    py::object stream_value;
    if (device.is_cuda()) {
      resolve_stream(obj, framework, device.index);
      stream_value = dlpack_stream_value(stream_);
    }
    try {
      capsule = export_dlpack(obj, stream_value ? stream_value.ptr() : nullptr);
    } catch (py::error_already_set& e) {
      // NumPy before 2.1 exports no read-only array through DLPack.
      if (framework == Framework::numpy && e.matches(PyExc_BufferError))
        return numpy_interface_view(obj, op_, name, written);
      // The producer's own refusal (a torch subclass that requires grad, say), said for this op.
      throw InvalidArgument(where(op_, name) + ": its __dlpack__() refused: " +
                            std::string(py::str(e.type().attr("__name__"))) + ": " + std::string(py::str(e.value())));
    }
    if (!PyCapsule_CheckExact(capsule.ptr()))
      throw TypeError(where(op_, name) + ": __dlpack__() returned " + type_name(capsule) +
                      ", not a capsule");
  }
  const CapsuleTensor ct = read_capsule(capsule, op_, name);
  if (written && (ct.flags & dlpack::kFlagReadOnly))
    throw InvalidArgument(where(op_, name) + " is read-only; kerf writes into it");
  if (written && (ct.flags & dlpack::kFlagIsCopied))
    throw InvalidArgument(where(op_, name) +
                          " was exported as a copy; kerf's results would be lost");
  TensorView v = dltensor_view(*ct.tensor, op_, name);
  if (v.device.is_cuda()) resolve_stream(obj, framework, v.device.index);  // raw capsules
  exports_.push_back(std::move(capsule));
  return v;
}

std::pair<py::object, TensorView> Call::output_or_new(py::handle obj, const char* name,
                                                      const std::vector<int64_t>& shape,
                                                      DType dtype) {
  if (obj && !obj.is_none()) return {py::reinterpret_borrow<py::object>(obj), output(obj, name)};
  if (!have_first_)
    throw InternalError(where(op_, name) + ": an output was allocated before any input");
  if (shape.size() > size_t(kMaxRank))
    throw InvalidArgument(where(op_, name) + " would have " + std::to_string(shape.size()) +
                          " dims, and kerf's tensors have at most " + std::to_string(kMaxRank) +
                          " (flatten some of the inputs' leading dims)");
  if (first_framework_ == Framework::torch) {
    if (const KerfTorchBridge* bridge = torch_bridge(torch_api())) {
      void* data = nullptr;
      const int32_t device = first_device_.is_cuda() ? first_device_.index : -1;
      if (PyObject* t = bridge->empty(shape.data(), int32_t(shape.size()), int32_t(dtype), device,
                                      &data))
        return {steal(t), TensorView::contiguous(data, dtype, shape, first_device_)};
    }
  }
  const Names& n = names();
  py::tuple dims(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) dims[i] = py::int_(shape[i]);

  if (first_framework_ == Framework::torch) {
    const TorchApi* api = torch_api();
    const py::object device = steal(PyObject_GetAttr(first_.ptr(), n.device));
    PyObject* args[3] = {dims.ptr(), api->dtypes[size_t(dtype)], device.ptr()};
    py::object t = steal(PyObject_Vectorcall(api->empty, args, 1, n.kw_dtype_device));
    const py::object ptr = steal(PyObject_CallMethodNoArgs(t.ptr(), n.data_ptr));
    void* data = PyLong_AsVoidPtr(ptr.ptr());
    if (!data && PyErr_Occurred()) throw py::error_already_set();
    TensorView v = TensorView::contiguous(data, dtype, shape, first_device_);
    return {std::move(t), v};
  }
  if (first_framework_ == Framework::numpy && first_device_ == Device::cpu()) {
    if (const char* np_name = numpy_dtype_name(dtype)) {
      const py::object dt = py::str(np_name);
      PyObject* args[2] = {dims.ptr(), dt.ptr()};
      py::object a = steal(PyObject_Vectorcall(numpy_api()->empty, args, 1, n.kw_dtype));
      TensorView v = output(a, name);
      return {std::move(a), v};
    }
  }
  // Everything else (CuPy, JAX, capsules, kerf buffers, bf16 for NumPy): a kerf.Buffer.
  if (first_device_.is_cuda() && cuda::stream_capturing(stream_))
    throw InvalidArgument(where(op_, name) +
                          " was not given, and kerf cannot allocate it while the stream captures a CUDA graph "
                          "(the driver allows no cuMemAlloc then); pass it");
  std::shared_ptr<Buffer> b;
  {
    py::gil_scoped_release nogil;
    b = std::make_shared<Buffer>(shape, dtype, first_device_);
  }
  if (first_device_.is_cuda()) b->set_stream(stream_);
  TensorView v = b->view();
  return {py::cast(std::move(b)), v};
}

std::array<std::pair<py::object, TensorView>, 2> Call::output_pair_or_new(py::handle a, const char* a_name,
                                                                          py::handle b, const char* b_name,
                                                                          std::initializer_list<int64_t> shape,
                                                                          DType dtype) {
  const bool a_new = !a || a.is_none(), b_new = !b || b.is_none();
  if (a_new && b_new && have_first_ && first_framework_ == Framework::torch && first_device_.is_cuda() &&
      shape.size() <= size_t(kMaxRank)) {
    if (const KerfTorchBridge* bridge = torch_bridge(torch_api())) {
      PyObject* made[2] = {nullptr, nullptr};
      void* data[2] = {nullptr, nullptr};
      if (bridge->empty_many(shape.begin(), int32_t(shape.size()), int32_t(dtype), first_device_.index, 2, made,
                             data) == 1) {
        const std::vector<int64_t> dims(shape);
        std::array<std::pair<py::object, TensorView>, 2> out;
        for (size_t i = 0; i < 2; ++i)
          out[i] = {steal(made[i]), TensorView::contiguous(data[i], dtype, dims, first_device_)};
        return out;
      }
    }
  }
  auto first = output_or_new(a, a_name, shape, dtype);
  return {std::move(first), output_or_new(b, b_name, shape, dtype)};
}

TensorView view_of(py::handle obj, py::handle stream) {
  Call call("kerf", stream);
  return call.input(obj, "tensor");
}

void init_bridge() {
  names();
}

std::string torch_bridge_status() {
  const TorchApi* api = torch_api();
  if (!api) return "torch is not imported";
  return api->bridge_status;
}

bool set_torch_bridge(bool enabled) {
  const bool was = bridge_enabled;
  bridge_enabled = enabled;
  return was;
}

}  // namespace kerf::python
