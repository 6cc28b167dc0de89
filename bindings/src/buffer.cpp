#include "buffer.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>

#include "dlpack_abi.h"
#include "kerf/error.h"
#include "kerf/runtime/cuda.h"
#include "module.h"
#include "tensor_bridge.h"

namespace kerf::python {

struct Buffer::Storage {
  struct HostFree {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, HostFree> host;
  cuda::DeviceBuffer device;
  void* data = nullptr;
  size_t bytes = 0;
};

namespace {

constexpr size_t kHostAlignment = 64;

Device parse_device(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  // As PyTorch and CuPy read "cuda": the thread's current device (the device of its
  // current CUDA context, which torch.cuda.set_device and cupy.cuda.Device make current).
  if (text == "cuda") return Device::cuda(cuda::driver_available() ? cuda::current_device() : 0);
  if (text.rfind("cuda:", 0) == 0) {
    size_t used = 0;
    int index = -1;
    try {
      index = std::stoi(text.substr(5), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == text.size() - 5 && index >= 0) return Device::cuda(index);
  }
  throw InvalidArgument("device must be 'cpu', 'cuda' or 'cuda:N', got '" + text + "'");
}

dlpack::DLDataType dlpack_dtype(DType t) {
  switch (t) {
    case DType::i1:
      return {dlpack::kDLBool, 8, 1};
    case DType::i32:
      return {dlpack::kDLInt, 32, 1};
    case DType::i64:
      return {dlpack::kDLInt, 64, 1};
    case DType::f16:
      return {dlpack::kDLFloat, 16, 1};
    case DType::bf16:
      return {dlpack::kDLBfloat, 16, 1};
    case DType::f32:
      return {dlpack::kDLFloat, 32, 1};
    case DType::f64:
      return {dlpack::kDLFloat, 64, 1};
    case DType::u8:
      return {dlpack::kDLUInt, 8, 1};
  }
  throw InternalError("kerf.Buffer: unknown dtype");
}

// One DLPack export: it shares the buffer's storage, so the memory outlives the
// Buffer object for as long as a consumer holds the export.
template <class Managed>
struct Export {
  std::shared_ptr<Buffer::Storage> storage;
  std::vector<int64_t> shape, strides;
  Managed managed{};
};

template <class Managed>
void delete_export(Managed* m) {
  std::unique_ptr<Export<Managed>> owner(static_cast<Export<Managed>*>(m->manager_ctx));
}

// A capsule nobody consumed still owns its tensor; a consumed one ("used_...") was
// handed over and its consumer calls the deleter.
template <class Managed>
void capsule_destructor(PyObject* capsule, const char* name) {
  // A destructor may run while an exception is being raised: keep it.
#if PY_VERSION_HEX >= 0x030C0000
  PyObject* pending = PyErr_GetRaisedException();
#else
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
#endif
  if (PyCapsule_IsValid(capsule, name)) {
    auto* m = static_cast<Managed*>(PyCapsule_GetPointer(capsule, name));
    if (m && m->deleter) m->deleter(m);
  }
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(pending);
#else
  PyErr_Restore(type, value, traceback);
#endif
}

void destroy_legacy(PyObject* c) {
  capsule_destructor<dlpack::DLManagedTensor>(c, dlpack::kCapsuleName);
}
void destroy_versioned(PyObject* c) {
  capsule_destructor<dlpack::DLManagedTensorVersioned>(c, dlpack::kCapsuleNameVersioned);
}

template <class Managed>
py::object export_capsule(const Buffer& b, const std::shared_ptr<Buffer::Storage>& storage,
                          const char* name, PyCapsule_Destructor destructor) {
  auto e = std::make_unique<Export<Managed>>();
  e->storage = storage;
  e->shape = b.shape();
  e->strides.assign(e->shape.size(), 1);
  for (size_t i = e->shape.size(); i-- > 1;) e->strides[i - 1] = e->strides[i] * e->shape[i];
  dlpack::DLTensor& t = e->managed.dl_tensor;
  t.data = b.data();
  t.device = {b.device().is_cuda() ? dlpack::kDLCUDA : dlpack::kDLCPU,
              b.device().is_cuda() ? b.device().index : 0};
  t.ndim = int32_t(e->shape.size());
  t.dtype = dlpack_dtype(b.dtype());
  t.shape = e->shape.data();
  t.strides = e->strides.data();
  t.byte_offset = 0;
  e->managed.manager_ctx = e.get();
  e->managed.deleter = &delete_export<Managed>;
  if constexpr (std::is_same_v<Managed, dlpack::DLManagedTensorVersioned>) {
    e->managed.version = {dlpack::kMajorVersion, dlpack::kMinorVersion};
    e->managed.flags = 0;
  }
  PyObject* capsule = PyCapsule_New(&e->managed, name, destructor);
  if (!capsule) throw py::error_already_set();
  e.release();  // the capsule (or its consumer) owns it now
  return py::reinterpret_steal<py::object>(capsule);
}

// The struct-module format of a dtype for the buffer protocol (none for bf16).
const char* buffer_format(DType t) {
  switch (t) {
    case DType::i1:
      return "?";
    case DType::i32:
      return "i";
    case DType::i64:
      return "q";
    case DType::f16:
      return "e";
    case DType::f32:
      return "f";
    case DType::f64:
      return "d";
    case DType::u8:
      return "B";
    case DType::bf16:
      return nullptr;
  }
  return nullptr;
}

py::tuple int_tuple(const std::vector<int64_t>& v) {
  py::tuple t(v.size());
  for (size_t i = 0; i < v.size(); ++i) t[i] = py::int_(v[i]);
  return t;
}

}  // namespace

Buffer::Buffer(const std::vector<int64_t>& shape, DType dtype, Device device)
    : shape_(shape), dtype_(dtype), device_(device) {
  if (shape.size() > size_t(kMaxRank))
    throw InvalidArgument("kerf.Buffer: at most " + std::to_string(kMaxRank) + " dimensions, got " +
                          std::to_string(shape.size()));
  // The byte count must fit (a wrapped product would make a small buffer that
  // claims a huge shape): at most 2^62 bytes, far beyond any memory. The nonzero
  // sizes of an empty buffer too, whose strides are their products.
  uint64_t reach = uint64_t(dtype_size_bytes(dtype));  // the bytes the nonzero sizes span
  bool too_big = false, empty = false;
  for (int64_t d : shape) {
    if (d < 0) throw InvalidArgument("kerf.Buffer: sizes must be >= 0, got " + std::to_string(d));
    if (d == 0) {
      empty = true;
      continue;
    }
    too_big = too_big || reach > (uint64_t(1) << 62) / uint64_t(d);
    reach *= uint64_t(d);
  }
  if (too_big) {
    std::string dims;
    for (int64_t d : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    throw InvalidArgument("kerf.Buffer: [" + dims + "] " + std::string(dtype_name(dtype)) +
                          ": its sizes multiply past 2^62 bytes");
  }
  storage_ = std::make_shared<Storage>();
  storage_->bytes = empty ? 0 : size_t(reach);
  // At least one aligned block, so that an empty buffer still has a real address.
  const size_t bytes = std::max<size_t>(
      kHostAlignment, (storage_->bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment);
  if (device.is_cuda()) {
    storage_->device = cuda::DeviceBuffer(bytes, device.index);
    storage_->data = storage_->device.data();
  } else {
    storage_->host.reset(std::aligned_alloc(kHostAlignment, bytes));
    if (!storage_->host)
      throw HostOutOfMemory("kerf.Buffer: could not allocate " + std::to_string(bytes) + " bytes of host memory");
    storage_->data = storage_->host.get();
  }
}

void* Buffer::data() const {
  return storage_->data;
}
size_t Buffer::nbytes() const {
  return storage_->bytes;
}

TensorView Buffer::view() const {
  return TensorView::contiguous(data(), dtype_, shape_, device_);
}

void Buffer::wait_for(const Buffer& b, void* stream) {
  if (b.device_.is_cuda() && b.stream_ != stream) cuda::stream_synchronize(b.stream_, b.device_.index);
}

std::pair<int, int> Buffer::dlpack_device() const {
  return {device_.is_cuda() ? dlpack::kDLCUDA : dlpack::kDLCPU,
          device_.is_cuda() ? device_.index : 0};
}

py::object Buffer::dlpack(py::handle stream, py::handle max_version, py::handle dl_device,
                          py::handle copy) const {
  if (copy && !copy.is_none() && py::cast<bool>(copy))
    throw py::buffer_error(
        "kerf.Buffer.__dlpack__: copy=True is not supported (kerf exports its memory as is)");
  // The arguments' types, named (pybind11's own cast error names none).
  const auto cast_arg = [](py::handle h, const char* name, const char* want, auto* out) {
    try {
      *out = py::cast<std::remove_pointer_t<decltype(out)>>(h);
    } catch (const py::cast_error&) {
      throw TypeError(std::string("kerf.Buffer.__dlpack__: ") + name + " must be " + want +
                      ", got " + type_name(h));
    }
  };
  // The consumer's stream, read once: None (unset), or an int (not a bool).
  std::optional<long long> consumer_stream;
  if (stream && !stream.is_none()) {
    if (PyBool_Check(stream.ptr()))
      throw TypeError("kerf.Buffer.__dlpack__: stream must be an int or None, got bool");
    long long v = 0;
    cast_arg(stream, "stream", "an int or None", &v);
    consumer_stream = v;
  }
  if (dl_device && !dl_device.is_none()) {
    std::pair<int, int> want;
    cast_arg(dl_device, "dl_device", "a (device type, device id) tuple of ints", &want);
    if (want != dlpack_device())
      throw py::buffer_error("kerf.Buffer.__dlpack__: the buffer lives on " + device_.str() +
                             " and cannot be exported to another device");
  }
  if (device_.is_cuda()) {
    // The consumer's stream: None, 1 (and the disallowed 0) are the legacy default stream;
    // -1 asks for no synchronization.
    const long long s = consumer_stream.value_or(1);
    if (s != -1) {
      void* consumer = s == 0 || s == 1 ? nullptr : reinterpret_cast<void*>(uintptr_t(s));
      py::gil_scoped_release nogil;
      wait_for(*this, consumer);
    }
  } else if (consumer_stream && *consumer_stream != -1) {
    // A CPU buffer has no stream to order against: None (or -1, no synchronization) only.
    throw InvalidArgument(
        "kerf.Buffer.__dlpack__: stream must be None for a buffer on the CPU, got " +
        std::to_string(*consumer_stream));
  }
  bool versioned = false;
  if (max_version && !max_version.is_none()) {
    std::pair<long long, long long> v;
    cast_arg(max_version, "max_version", "a (major, minor) tuple of ints", &v);
    versioned = v.first >= 1;
  }
  if (versioned)
    return export_capsule<dlpack::DLManagedTensorVersioned>(
        *this, storage_, dlpack::kCapsuleNameVersioned, &destroy_versioned);
  return export_capsule<dlpack::DLManagedTensor>(*this, storage_, dlpack::kCapsuleName,
                                                 &destroy_legacy);
}

void bind_buffer(py::module_& m) {
  py::class_<Buffer, std::shared_ptr<Buffer>>(m, "Buffer", R"doc(
Memory kerf allocated: an op's output when the inputs are neither PyTorch
tensors nor NumPy arrays (CuPy, JAX, DLPack capsules, kerf buffers).

A Buffer is a DLPack producer: ``numpy.from_dlpack(buf)``,
``cupy.from_dlpack(buf)``, ``jax.dlpack.from_dlpack(buf)`` and
``torch.from_dlpack(buf)`` view its memory without a copy, and the memory
lives until the Buffer and every such view are gone. It can also be passed
back to any kerf op. ``buf.numpy()`` is a writable NumPy view of a CPU
buffer (NumPy < 2 imports DLPack read-only).
)doc")

      .def(py::init([](const std::vector<int64_t>& shape, const std::string& dtype,
                       const std::string& device) {
             const std::optional<DType> t = parse_dtype(dtype);
             if (!t) throw kerf::TypeError("kerf.Buffer: unknown dtype '" + dtype + "'");
             const Device dev = parse_device(device);
             py::gil_scoped_release nogil;
             return std::make_shared<Buffer>(shape, *t, dev);
           }),
           py::arg("shape"), py::arg("dtype") = "float32", py::arg("device") = "cpu",
           "Uninitialised contiguous memory of `shape` and `dtype` on `device` ('cpu', 'cuda:N', or "
           "'cuda': the thread's current CUDA device, as PyTorch means it).")
      .def("__dlpack__", &Buffer::dlpack, py::kw_only(), py::arg("stream") = py::none(),
           py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(),
           py::arg("copy") = py::none(),
           "A DLPack capsule of this buffer (versioned when max_version >= (1, 0)).")
      .def("__dlpack_device__", &Buffer::dlpack_device,
           "(device_type, device_id) as DLPack numbers them.")
      .def_property_readonly("shape", [](const Buffer& b) { return int_tuple(b.shape()); })
      .def_property_readonly(
          "strides",
          [](const Buffer& b) {
            const TensorView v = b.view();
            return int_tuple(std::vector<int64_t>(v.strides.begin(), v.strides.begin() + v.rank));
          },
          "Strides in elements (always row-major contiguous).")
      .def_property_readonly(
          "dtype", [](const Buffer& b) { return std::string(dtype_name(b.dtype())); },
          "kerf's dtype name: 'f32', 'bf16', ...")
      .def_property_readonly(
          "device", [](const Buffer& b) { return b.device().str(); }, "'cpu' or 'cuda:N'.")
      .def_property_readonly("nbytes", &Buffer::nbytes)
      .def(
          "numpy",
          [](const py::object& self) {
            const Buffer& b = self.cast<const Buffer&>();
            if (b.device().is_cuda())
              throw py::buffer_error(
                  "kerf.Buffer on " + b.device().str() +
                  " is not in host memory; use cupy.from_dlpack or torch.from_dlpack");
            const char* format = buffer_format(b.dtype());
            if (!format)
              throw py::buffer_error("NumPy has no " + std::string(dtype_name(b.dtype())) +
                                     "; use torch.from_dlpack or ml_dtypes");
            const TensorView v = b.view();
            std::vector<py::ssize_t> shape(b.shape().begin(), b.shape().end()), strides;
            for (int d = 0; d < v.rank; ++d)
              strides.push_back(v.strides[size_t(d)] * dtype_size_bytes(b.dtype()));
            // The array keeps the Buffer (and so the memory) alive.
            return py::array(py::dtype(format), shape, strides, b.data(), self);
          },
          "A writable NumPy view of a CPU buffer (no copy).")
      .def(
          "data_ptr", [](const Buffer& b) { return reinterpret_cast<uintptr_t>(b.data()); },
          "The address of the first element.")
      .def("__repr__", [](const Buffer& b) {
        std::string s = "kerf.Buffer(" + std::string(dtype_name(b.dtype())) + "[";
        for (size_t i = 0; i < b.shape().size(); ++i)
          s += (i ? ", " : "") + std::to_string(b.shape()[i]);
        return s + "] on " + b.device().str() + ")";
      });
}

}  // namespace kerf::python
