// kerf._torch_bridge: torch.Tensor objects read in C++ (see ../src/torch_bridge_abi.h),
// and the graph node of kerf.autograd.dora_scale (dora_scale_with_grad).
//
// Built only against the PyTorch the package's interpreter has, with that
// PyTorch's own headers; it refuses to import into a process running another
// torch version (kerf then reads tensors through Python attributes).
#include <ATen/core/Tensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>
#include <c10/core/ScalarType.h>
#include <c10/core/ScalarTypeToTypeMeta.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <exception>
#include <optional>
#include <string>

#include "../src/torch_bridge_abi.h"

#ifndef KERF_TORCH_VERSION
#error "KERF_TORCH_VERSION (the torch.__version__ built against) must be defined"
#endif

namespace {

// c10's scalar type of each kerf DType code (torch_bridge_abi.h): the index is the code.
constexpr c10::ScalarType kTypes[] = {c10::ScalarType::Bool,  c10::ScalarType::Int,
                                      c10::ScalarType::Long,  c10::ScalarType::Half,
                                      c10::ScalarType::BFloat16, c10::ScalarType::Float,
                                      c10::ScalarType::Double, c10::ScalarType::Byte};
constexpr int32_t kNumTypes = int32_t(sizeof(kTypes) / sizeof(kTypes[0]));

int32_t kerf_code(c10::ScalarType t) {
  for (int32_t code = 0; code < kNumTypes; ++code)
    if (kTypes[code] == t) return code;
  return -1;
}

bool scalar_type_of(int32_t code, c10::ScalarType* out) {
  if (code < 0 || code >= kNumTypes) return false;
  *out = kTypes[code];
  return true;
}

int32_t view(PyObject* obj, int32_t written, KerfTorchTensor* out) {
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != c10::kStrided) return kKerfTorchUnhandled;
    const c10::Device dev = t.device();
    if (dev.is_cuda())
      out->device_index = dev.index();
    else if (dev.is_cpu())
      out->device_index = -1;
    else
      return kKerfTorchUnhandled;
    out->dtype = kerf_code(t.scalar_type());
    if (out->dtype < 0) return kKerfTorchUnhandled;
    if (t.is_neg()) return kKerfTorchNegBit;
    const int64_t rank = t.dim();
    if (rank > KERF_TORCH_BRIDGE_MAX_RANK) return kKerfTorchUnhandled;
    const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
    out->rank = int32_t(rank);
    for (int64_t d = 0; d < rank; ++d) {
      out->shape[d] = sizes[size_t(d)];
      out->strides[d] = strides[size_t(d)];
    }
    if (!written) {
      out->data = const_cast<void*>(t.const_data_ptr());
      return kKerfTorchOk;
    }
    if (t.requires_grad() && c10::GradMode::is_enabled()) return kKerfTorchWrittenNeedsGrad;
    out->data = t.mutable_data_ptr();
    return kKerfTorchOk;
  } catch (...) {
    return kKerfTorchUnhandled;
  }
}

int32_t bump_version(PyObject* obj) {
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined()) return 0;
    // Throws for an inference tensor outside inference mode (it keeps no counter).
    t.unsafeGetTensorImpl()->bump_version();
    return 1;
  } catch (...) {
    return 0;
  }
}

int32_t current_stream(int32_t device, void** stream) {
  try {
    *stream = static_cast<void*>(c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(device)).stream());
    return 1;
  } catch (...) {
    return 0;
  }
}

int32_t empty_many(const int64_t* shape, int32_t rank, int32_t dtype, int32_t device_index, int32_t count,
                   PyObject** tensors, void** data) {
  c10::ScalarType st;
  if (rank < 0 || rank > KERF_TORCH_BRIDGE_MAX_RANK || count < 1 || count > 8 || !scalar_type_of(dtype, &st))
    return 0;
  int32_t made = 0;
  try {
    int64_t numel = 1;
    for (int32_t d = 0; d < rank; ++d) {
      if (shape[d] < 0 || (shape[d] > 0 && numel > (int64_t(1) << 40) / shape[d])) return 0;
      numel *= shape[d];
    }
    const caffe2::TypeMeta meta = c10::scalarTypeToTypeMeta(st);
    const int64_t item = int64_t(meta.itemsize());
    // Each tensor on a 256-byte boundary (as the allocator's own blocks): kernels
    // specialize on 16-byte alignment.
    const int64_t span = (numel * item + 255) / 256 * 256;
    std::optional<c10::cuda::CUDAGuard> guard;
    c10::Allocator* allocator = nullptr;
    c10::DispatchKeySet keys;
    if (device_index < 0) {
      allocator = c10::GetCPUAllocator();
      keys = c10::DispatchKeySet(c10::DispatchKey::CPU);
    } else {
      guard.emplace(c10::DeviceIndex(device_index));  // the caching allocator serves the current device
      allocator = c10::cuda::CUDACachingAllocator::get();
      keys = c10::DispatchKeySet(c10::DispatchKey::CUDA);
    }
    const c10::Storage storage(c10::Storage::use_byte_size_t(), span * count, allocator, /*resizable=*/true);
    for (; made < count; ++made) {
      at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), keys, meta);
      c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      impl->set_storage_offset(made * (span / item));
      impl->set_sizes_contiguous(c10::IntArrayRef(shape, size_t(rank)));
      data[made] = t.mutable_data_ptr();
      tensors[made] = THPVariable_Wrap(std::move(t));
      if (!tensors[made]) {
        PyErr_Clear();
        break;
      }
    }
  } catch (...) {
  }
  if (made == count) return 1;
  for (int32_t i = 0; i < made; ++i) Py_DECREF(tensors[i]);
  return 0;
}

// One new tensor: empty_many's single case (the tensor at::empty would make,
// without going through the dispatcher).
PyObject* empty(const int64_t* shape, int32_t rank, int32_t dtype, int32_t device_index,
                void** data) {
  PyObject* tensor = nullptr;
  return empty_many(shape, rank, dtype, device_index, 1, &tensor, data) ? tensor : nullptr;
}

// ---------------------------------------------------------------- DoRA's scale in autograd
}  // namespace

namespace kerf {

// The forward's results, made by kerf before the graph node is: not inputs of the node.
struct DoraScaleMade {
  at::Tensor norm, scale;
};

// scale = m / norm with the norm a constant (DoRA detaches it): grad_m = grad_scale /
// norm, formed in float32 and rounded once to m's dtype. A PyTorch custom function
// written in C++ (its graph node's name is "kerf::DoraScale"), so that
// kerf.autograd.dora_scale records its history without a torch.autograd.Function,
// whose Python forward and context cost about ten microseconds per call. Compiled
// autograd runs its backward as an opaque call.
struct DoraScale : torch::autograd::Function<DoraScale> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& m,
                            const DoraScaleMade& made) {
    ctx->save_for_backward({made.norm});
    ctx->saved_data["m_type"] = static_cast<int64_t>(m.scalar_type());
    return made.scale;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor norm = ctx->get_saved_variables()[0];
    const auto m_type = static_cast<c10::ScalarType>(ctx->saved_data["m_type"].toInt());
    at::Tensor g;
    if (grads[0].defined()) {
      g = grads[0].div(norm);  // mixed dtypes promote inside one kernel: a bf16 gradient is read as such
      if (g.scalar_type() != m_type) g = g.to(m_type);
    }
    return {g, at::Tensor()};
  }
};

}  // namespace kerf

namespace {

// kerf._torch_bridge.dora_scale_with_grad(m, norm, scale): `scale` (kerf's
// float32 m / norm, fresh from the call) in m's dtype, with the history that
// makes it differentiable in m when grad mode is on and m requires a gradient.
PyObject* dora_scale_with_grad(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "dora_scale_with_grad() takes 3 arguments (m, norm, scale), got %zd",
                 nargs);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < 3; ++i)
    if (!THPVariable_Check(args[i])) {
      PyErr_SetString(PyExc_TypeError, "dora_scale_with_grad(): m, norm and scale must be torch tensors");
      return nullptr;
    }
  try {
    const at::Tensor& m = THPVariable_Unpack(args[0]);
    const at::Tensor& norm = THPVariable_Unpack(args[1]);
    const at::Tensor& kerf_scale = THPVariable_Unpack(args[2]);
    TORCH_CHECK(norm.scalar_type() == at::kFloat && kerf_scale.scalar_type() == at::kFloat,
                "dora_scale_with_grad(): norm and scale must be float32");
    TORCH_CHECK(m.scalar_type() != at::kDouble, "dora_scale_with_grad(): m must not be float64");
    TORCH_CHECK(!kerf_scale.requires_grad(), "dora_scale_with_grad(): scale must be a fresh kerf output");
    const bool same = m.scalar_type() == at::kFloat;
    at::Tensor scale = same ? kerf_scale : kerf_scale.to(m.scalar_type());
    if (c10::GradMode::is_enabled() && m.requires_grad())
      return THPVariable_Wrap(kerf::DoraScale::apply(m, kerf::DoraScaleMade{norm, scale}));
    if (same) {
      Py_INCREF(args[2]);
      return args[2];
    }
    return THPVariable_Wrap(std::move(scale));
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef methods[] = {
    {"dora_scale_with_grad", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&dora_scale_with_grad)),
     METH_FASTCALL,
     "dora_scale_with_grad(m, norm, scale): kerf's float32 scale in m's dtype, differentiable in m "
     "(grad_m = grad / norm) when m requires a gradient; used by kerf.autograd.dora_scale."},
    {nullptr, nullptr, 0, nullptr}};

const KerfTorchBridge api = {
    KERF_TORCH_BRIDGE_ABI, sizeof(KerfTorchBridge), KERF_TORCH_VERSION,
    &view, &current_stream, &empty, &empty_many, &bump_version,
};

// The torch.__version__ of this process, or "" when torch is not imported.
std::string running_torch_version() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (!torch) return "";
  PyObject* v = PyObject_GetAttrString(torch, "__version__");
  Py_DECREF(torch);
  if (!v) return "";
  PyObject* s = PyObject_Str(v);
  Py_DECREF(v);
  if (!s) return "";
  const char* c = PyUnicode_AsUTF8(s);
  std::string out = c ? c : "";
  Py_DECREF(s);
  return out;
}

PyModuleDef module_def = {PyModuleDef_HEAD_INIT,
                          "_torch_bridge",
                          "kerf's reader of torch.Tensor objects (PyTorch " KERF_TORCH_VERSION
                          "); used by kerf._kerf and kerf.autograd, not by users.",
                          -1,
                          methods,
                          nullptr,
                          nullptr,
                          nullptr,
                          nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__torch_bridge() {
  const std::string running = running_torch_version();
  if (running.empty()) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_ImportError, "kerf._torch_bridge: torch.__version__ is unreadable");
    return nullptr;
  }
  if (running != KERF_TORCH_VERSION) {
    PyErr_Format(PyExc_ImportError,
                 "kerf._torch_bridge was built against torch %s but this process runs torch %s; "
                 "rebuild kerf to use it",
                 KERF_TORCH_VERSION, running.c_str());
    return nullptr;
  }
  PyObject* m = PyModule_Create(&module_def);
  if (!m) return nullptr;
  PyObject* capsule =
      PyCapsule_New(const_cast<KerfTorchBridge*>(&api), KERF_TORCH_BRIDGE_CAPSULE, nullptr);
  if (!capsule || PyModule_AddObject(m, "_C_API", capsule) < 0) {
    Py_XDECREF(capsule);
    Py_DECREF(m);
    return nullptr;
  }
  if (PyModule_AddStringConstant(m, "torch_version", KERF_TORCH_VERSION) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
