// kerf.Buffer: memory kerf allocated for an op's output when the caller's
// tensors are neither PyTorch tensors nor NumPy arrays (CuPy, JAX, capsules).
// It is a DLPack producer: np.from_dlpack(buf), cupy.from_dlpack(buf),
// jax.dlpack.from_dlpack(buf) and torch.from_dlpack(buf) all view it without
// a copy, and the memory lives until the Buffer and every view are gone.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <utility>
#include <vector>

#include "kerf/runtime/tensor.h"

namespace kerf::python {

namespace py = pybind11;

class Buffer {
 public:
  // Contiguous, uninitialised memory on `device` (cuMemAlloc on a GPU).
  Buffer(const std::vector<int64_t>& shape, DType dtype, Device device);

  TensorView view() const;
  const std::vector<int64_t>& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  void* data() const;
  size_t nbytes() const;

  // The stream of the last op that wrote it: a consumer on another stream waits for it.
  void set_stream(void* stream) { stream_ = stream; }
  void* stream() const { return stream_; }
  // Makes work on `stream` safe to use `b`: waits for b's last writer when it ran on another
  // stream.
  static void wait_for(const Buffer& b, void* stream);

  // __dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None).
  py::object dlpack(py::handle stream, py::handle max_version, py::handle dl_device,
                    py::handle copy) const;
  std::pair<int, int> dlpack_device() const;

  struct Storage;

 private:
  std::shared_ptr<Storage> storage_;
  std::vector<int64_t> shape_;
  DType dtype_;
  Device device_;
  void* stream_ = nullptr;
};

void bind_buffer(py::module_& m);

}  // namespace kerf::python
