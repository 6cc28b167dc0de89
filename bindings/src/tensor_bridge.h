// Python tensors as kerf TensorViews, without copies.
//
// Any object with __dlpack__/__dlpack_device__ (PyTorch, JAX, CuPy, NumPy,
// kerf.Buffer) and raw DLPack capsules are accepted. Plain torch.Tensor and
// torch.nn.Parameter objects take a fast path: read in C++ from the at::Tensor
// by kerf._torch_bridge where kerf was built against this torch
// (torch_bridge_abi.h), else through data_ptr(), dtype, shape, stride() and the
// device (still cheaper than a DLPack export per call); every other object goes
// through DLPack, whose export is kept alive until the call returns.
//
// Streams: a call on CUDA tensors runs on the explicit `stream=` when given,
// else on PyTorch's current stream of the device when the tensors are torch
// tensors, else on CuPy's current stream for CuPy arrays, else on the legacy
// default stream. That stream is what __dlpack__(stream=...) receives.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "kerf/jit/launch_count.h"
#include "kerf/runtime/tensor.h"

namespace kerf::python {

namespace py = pybind11;

// Bumps a torch tensor's version counter, as an in-place torch op does (a kerf op wrote it).
void bump_torch_version(py::handle obj);

// Which library made a tensor: outputs kerf allocates follow their inputs' library.
enum class Framework : uint8_t { torch, numpy, kerf, other };

// The arguments of one op call, converted one by one in the order the op reads them.
class Call {
 public:
  // `op` names the operation in error messages; `stream` is the caller's stream= argument.
  Call(const char* op, py::handle stream);
  const char* op() const { return op_; }

  // A tensor the op reads.
  TensorView input(py::handle obj, const char* name);
  // A tensor the op writes: it must be writable and the producer's own memory.
  TensorView output(py::handle obj, const char* name);
  // `obj` when it is not None (then as output()), else a new contiguous tensor of
  // `shape` and `dtype`, made by the library of the call's first tensor on its device.
  std::pair<py::object, TensorView> output_or_new(py::handle obj, const char* name,
                                                  const std::vector<int64_t>& shape, DType dtype);
  // The same for a shape written out at the call: no vector is made when `obj` is given.
  std::pair<py::object, TensorView> output_or_new(py::handle obj, const char* name,
                                                  std::initializer_list<int64_t> shape, DType dtype) {
    if (obj && !obj.is_none()) return {py::reinterpret_borrow<py::object>(obj), output(obj, name)};
    return output_or_new(obj, name, std::vector<int64_t>(shape), dtype);
  }

  // Two outputs of one shape and dtype (`a` and `b` as output_or_new). When both are
  // None and the call's tensors are torch tensors on a GPU, both are made in one
  // allocation through kerf._torch_bridge (neither a view of the other).
  std::array<std::pair<py::object, TensorView>, 2> output_pair_or_new(py::handle a, const char* a_name,
                                                                      py::handle b, const char* b_name,
                                                                      std::initializer_list<int64_t> shape,
                                                                      DType dtype);

  // The CUstream the op runs on (nullptr: the legacy default stream, and always on the CPU).
  void* stream() const { return stream_; }

  // Runs `work` (the C++ op) without the GIL, then lets a pending Ctrl-C raise
  // KeyboardInterrupt at once. The torch tensors it writes have their version counters
  // bumped after it, as an in-place torch op's are, unless it failed before launching
  // anything (its checks refused the call: nothing was written, as for a refused torch op).
  template <class Work>
  void run(Work&& work) {
    check_unused_stream();
    const uint64_t launches = launches_on_this_thread();
    try {
      py::gil_scoped_release nogil;
      work();
    } catch (...) {
      if (launches_on_this_thread() != launches) bump_written();
      throw;
    }
    bump_written();
    check_signals();
  }

 private:
  TensorView convert(py::handle obj, const char* name, bool written);
  TensorView from_dlpack(py::handle obj, const char* name, bool written, Framework framework);
  void resolve_stream(py::handle obj, Framework framework, int device);
  static void check_signals();
  // A stream= that no GPU tensor used (a CPU call) must still be a stream.
  void check_unused_stream();
  void bump_written() {
    for (const py::handle t : written_torch_) bump_torch_version(t);
    written_torch_.clear();
  }

  const char* op_;
  py::handle stream_arg_;
  void* stream_ = nullptr;
  bool stream_resolved_ = false;
  // The first tensor: outputs kerf allocates are made like it.
  py::handle first_;
  Framework first_framework_ = Framework::other;
  Device first_device_;
  bool have_first_ = false;
  std::vector<py::object> exports_;  // DLPack capsules, alive until the call returns
  std::vector<py::handle> written_torch_;  // torch tensors the op writes (the caller's arguments)
};

// The parts of a tensor as kerf sees them (tests, debugging): conversion alone.
TensorView view_of(py::handle obj, py::handle stream = py::none());

// A CUstream from a Python value: an int handle, a torch.cuda.Stream
// (.cuda_stream), an object with __cuda_stream__ (the CUDA stream protocol),
// or a CuPy stream (.ptr).
void* parse_stream(py::handle stream);

// The name of h's type, for messages ("str", "numpy.ndarray").
std::string type_name(py::handle h);

// NumPy's name of a kerf dtype; nullptr when NumPy has none (bf16).
const char* numpy_dtype_name(DType dtype);

// Makes the interned names the conversions use (at import, with the GIL held).
void init_bridge();

// Whether torch tensors are read in C++ through kerf._torch_bridge ("active ..."),
// else why not (not built, another torch version, KERF_TORCH_BRIDGE=0, torch not imported).
std::string torch_bridge_status();
// Turns the use of kerf._torch_bridge on or off (tests compare both paths); returns the old value.
bool set_torch_bridge(bool enabled);

}  // namespace kerf::python
