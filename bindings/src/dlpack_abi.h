// The DLPack ABI (https://dmlc.github.io/dlpack): the structs a producer hands
// over in a PyCapsule, declared here from the specification rather than
// vendored. Two generations travel in capsules:
//   "dltensor"            DLManagedTensor           (DLPack <= 0.8, every producer)
//   "dltensor_versioned"  DLManagedTensorVersioned  (DLPack 1.x: __dlpack__(max_version=(1, 0)))
// A consumer that takes ownership renames the capsule "used_dltensor" /
// "used_dltensor_versioned" and calls the deleter itself; kerf only borrows
// for the duration of a call, so it never renames and the capsule's own
// destructor releases the tensor.
#pragma once

#include <cstdint>

namespace kerf::python::dlpack {

// DLDeviceType values kerf understands (the enum is append-only in the spec).
enum DeviceType : int32_t {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,  // pinned host memory: the CPU back end reads it
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13,  // managed memory: treated like device memory
  kDLOneAPI = 14,
};

// DLDataTypeCode values.
enum TypeCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLOpaqueHandle = 3,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6,
};

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; NULL means compact row-major
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};

// Flags of DLManagedTensorVersioned.
inline constexpr uint64_t kFlagReadOnly = uint64_t(1) << 0;
inline constexpr uint64_t kFlagIsCopied = uint64_t(1) << 1;

struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
};

// The version kerf produces and the newest major it reads.
inline constexpr uint32_t kMajorVersion = 1;
inline constexpr uint32_t kMinorVersion = 0;

inline constexpr const char* kCapsuleName = "dltensor";
inline constexpr const char* kCapsuleNameVersioned = "dltensor_versioned";
inline constexpr const char* kUsedCapsuleName = "used_dltensor";
inline constexpr const char* kUsedCapsuleNameVersioned = "used_dltensor_versioned";

}  // namespace kerf::python::dlpack
