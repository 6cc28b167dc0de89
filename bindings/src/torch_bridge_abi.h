// The C interface between kerf._kerf and kerf._torch_bridge.
//
// kerf._torch_bridge is a small extension module built against the installed
// PyTorch's C++ headers (only where they exist). It reads a torch.Tensor's
// data pointer, dtype, device, sizes and strides straight from the at::Tensor
// behind it, asks c10 for the current CUDA stream and allocates outputs from
// PyTorch's caching allocator (several outputs of one call in one allocation),
// each for a few tens of nanoseconds instead of the microseconds that Python
// attribute reads cost (or, for outputs, that at::empty's dispatch costs). kerf._kerf imports it when torch has been
// imported and falls back to the attribute path when it is missing, built for
// another torch, or disabled with KERF_TORCH_BRIDGE=0.
//
// The two modules share no C++ types: only this plain C table, reached through
// the capsule `kerf._torch_bridge._C_API`.
#pragma once

#include <Python.h>

#include <cstdint>

#define KERF_TORCH_BRIDGE_ABI 4
#define KERF_TORCH_BRIDGE_CAPSULE "kerf._torch_bridge._C_API"
#define KERF_TORCH_BRIDGE_MAX_RANK 8

extern "C" {

// A strided torch tensor as the bridge sees it. dtype is kerf's DType code
// (bool 0, int32 1, int64 2, float16 3, bfloat16 4, float32 5, float64 6, uint8 7).
struct KerfTorchTensor {
  void* data;            // storage offset included
  int32_t dtype;
  int32_t device_index;  // -1: CPU, else the CUDA device
  int32_t rank;
  int32_t reserved;
  int64_t shape[KERF_TORCH_BRIDGE_MAX_RANK];
  int64_t strides[KERF_TORCH_BRIDGE_MAX_RANK];  // in elements
};

// Results of KerfTorchBridge::view.
enum KerfTorchViewResult : int32_t {
  kKerfTorchUnhandled = 0,  // read it through Python (other dtype, device, layout, rank, error)
  kKerfTorchOk = 1,
  kKerfTorchNegBit = 2,  // a lazily negated view (e.g. x.conj().imag): its memory holds -x
  kKerfTorchWrittenNeedsGrad = 3,  // to be written, but it requires grad and grad mode is on
};

// Every function is called with the GIL held and never raises a Python error:
// anything it cannot do it leaves to kerf's Python-attribute path, which
// raises PyTorch's own error where there is one.
struct KerfTorchBridge {
  uint32_t abi;   // KERF_TORCH_BRIDGE_ABI
  uint32_t size;  // sizeof(KerfTorchBridge)
  const char* torch_version;  // the torch.__version__ it was built against
  // `tensor` must be exactly a torch.Tensor or torch.nn.Parameter (the caller
  // checks the type). `written`: the pointer is for writing (copy-on-write
  // storage is materialized, as Tensor.data_ptr() does) and refused for a tensor
  // that requires grad while grad mode is on; its version counter is left to
  // bump_version, called once the op may have written.
  int32_t (*view)(PyObject* tensor, int32_t written, KerfTorchTensor* out);
  // PyTorch's current stream on CUDA device `device` (a CUstream); 1 on success.
  int32_t (*current_stream)(int32_t device, void** stream);
  // A new contiguous torch tensor (a new reference) of `dtype` (kerf's code)
  // on `device_index` (-1: CPU), its data pointer in *data; nullptr when the
  // bridge cannot make it.
  PyObject* (*empty)(const int64_t* shape, int32_t rank, int32_t dtype, int32_t device_index,
                     void** data);
  // `count` (1..8) such tensors of one shape and dtype in one allocation, each
  // starting on a 256-byte boundary; no one is a view of another (each has its
  // own version counter). New references in tensors[i], data pointers in
  // data[i]; 1 on success, 0 (nothing made) when the bridge cannot.
  int32_t (*empty_many)(const int64_t* shape, int32_t rank, int32_t dtype, int32_t device_index,
                        int32_t count, PyObject** tensors, void** data);
  // Bumps `tensor`'s version counter, as an in-place torch op does, so that autograd
  // notices a write; 1 on success, 0 when the bridge cannot (an inference tensor
  // outside inference mode, which keeps no counter, or another type).
  int32_t (*bump_version)(PyObject* tensor);
};

}  // extern "C"
