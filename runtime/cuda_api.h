// The slice of the CUDA driver API that kerf calls, declared by hand so that kerf
// builds without the CUDA toolkit: the library is opened at run time with dlopen
// (runtime/cuda_driver.cpp). tests/test_cuda_runtime.cpp checks every value below
// against <cuda.h> wherever that header is installed.
#pragma once

#include <string>

namespace kerf::cuda::detail {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;  // CUdeviceptr_v2 on 64-bit hosts
struct CUctx_st;
struct CUmod_st;
struct CUfunc_st;
struct CUstream_st;
struct CUevent_st;
using CUcontext = CUctx_st*;
using CUmodule = CUmod_st*;
using CUfunction = CUfunc_st*;
using CUstream = CUstream_st*;
using CUevent = CUevent_st*;
struct CUgraph_st;
struct CUgraphExec_st;
using CUgraph = CUgraph_st*;
using CUgraphExec = CUgraphExec_st*;

// CUresult
inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
inline constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
inline constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
inline constexpr CUresult CUDA_ERROR_DEINITIALIZED = 4;
inline constexpr CUresult CUDA_ERROR_STUB_LIBRARY = 34;
inline constexpr CUresult CUDA_ERROR_DEVICE_UNAVAILABLE = 46;
inline constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
inline constexpr CUresult CUDA_ERROR_INVALID_DEVICE = 101;
inline constexpr CUresult CUDA_ERROR_INVALID_IMAGE = 200;
inline constexpr CUresult CUDA_ERROR_INVALID_CONTEXT = 201;
inline constexpr CUresult CUDA_ERROR_NO_BINARY_FOR_GPU = 209;
inline constexpr CUresult CUDA_ERROR_INVALID_PTX = 218;
inline constexpr CUresult CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222;
inline constexpr CUresult CUDA_ERROR_INVALID_HANDLE = 400;
inline constexpr CUresult CUDA_ERROR_NOT_FOUND = 500;
inline constexpr CUresult CUDA_ERROR_NOT_READY = 600;
inline constexpr CUresult CUDA_ERROR_ILLEGAL_ADDRESS = 700;
inline constexpr CUresult CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701;
inline constexpr CUresult CUDA_ERROR_LAUNCH_FAILED = 719;
inline constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;
inline constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900;
inline constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901;
inline constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906;
inline constexpr CUresult CUDA_ERROR_SYSTEM_NOT_READY = 802;
inline constexpr CUresult CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803;
inline constexpr CUresult CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804;
inline constexpr CUresult CUDA_ERROR_UNKNOWN = 999;

// CUdevice_attribute
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1;
inline constexpr int CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13;
inline constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
inline constexpr int CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36;
inline constexpr int CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37;
inline constexpr int CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR = 82;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97;

// CUfunction_attribute
inline constexpr int CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0;
inline constexpr int CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1;
inline constexpr int CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3;
inline constexpr int CU_FUNC_ATTRIBUTE_NUM_REGS = 4;
inline constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;

// CUpointer_attribute and CUmemorytype
inline constexpr int CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2;
inline constexpr int CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9;
inline constexpr unsigned CU_MEMORYTYPE_HOST = 1;
inline constexpr unsigned CU_MEMORYTYPE_DEVICE = 2;
inline constexpr unsigned CU_MEMORYTYPE_ARRAY = 3;
inline constexpr unsigned CU_MEMORYTYPE_UNIFIED = 4;

// Flags
inline constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
inline constexpr unsigned CU_EVENT_DEFAULT = 0;
// CUstreamCaptureStatus and CUstreamCaptureMode
inline constexpr int CU_STREAM_CAPTURE_STATUS_NONE = 0;
inline constexpr int CU_STREAM_CAPTURE_MODE_GLOBAL = 0;
inline constexpr int CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1;
inline constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;
// Stream 0 means the legacy default stream, as cuda.h documents for kerf's StreamHandle.
inline constexpr unsigned long long CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1;

// cuLaunchKernelEx's configuration, laid out as cuda.h lays it out (checked in
// tests/test_cuda_runtime.cpp), for the launch attributes kerf sets.
inline constexpr int CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2;
inline constexpr int CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4;
inline constexpr int CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6;
struct CUlaunchAttribute {
  int id = 0;
  char pad[4] = {};
  union Value {
    alignas(8) char bytes[64];
    struct {
      unsigned x, y, z;
    } cluster_dim;
    int programmatic_stream_serialization_allowed;
    int cooperative;
  } value = {};
};
struct CUlaunchConfig {
  unsigned grid_x = 1, grid_y = 1, grid_z = 1;
  unsigned block_x = 1, block_y = 1, block_z = 1;
  unsigned dynamic_smem_bytes = 0;
  CUstream stream = nullptr;
  CUlaunchAttribute* attrs = nullptr;
  unsigned num_attrs = 0;
};

// The entry points kerf uses, named as the driver names them without the "cu"
// prefix (cuda.h defines several "cu..." names as macros, e.g. cuMemAlloc).
// Enum arguments are passed as int, which is how C passes them.
struct DriverApi {
  CUresult (*Init)(unsigned flags) = nullptr;
  CUresult (*GetErrorName)(CUresult error, const char** name) = nullptr;
  CUresult (*GetErrorString)(CUresult error, const char** text) = nullptr;
  CUresult (*DeviceGetCount)(int* count) = nullptr;
  CUresult (*DeviceGet)(CUdevice* device, int ordinal) = nullptr;
  CUresult (*DeviceGetName)(char* name, int length, CUdevice device) = nullptr;
  CUresult (*DeviceGetAttribute)(int* value, int attribute, CUdevice device) = nullptr;
  CUresult (*DeviceTotalMem)(size_t* bytes, CUdevice device) = nullptr;
  CUresult (*DevicePrimaryCtxRetain)(CUcontext* context, CUdevice device) = nullptr;
  CUresult (*CtxGetCurrent)(CUcontext* context) = nullptr;
  CUresult (*CtxSetCurrent)(CUcontext context) = nullptr;
  CUresult (*CtxGetDevice)(CUdevice* device) = nullptr;
  CUresult (*CtxSynchronize)() = nullptr;
  CUresult (*ModuleLoadData)(CUmodule* module, const void* image) = nullptr;
  CUresult (*ModuleUnload)(CUmodule module) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction* function, CUmodule module, const char* name) = nullptr;
  CUresult (*FuncGetAttribute)(int* value, int attribute, CUfunction function) = nullptr;
  CUresult (*FuncSetAttribute)(CUfunction function, int attribute, int value) = nullptr;
  CUresult (*LaunchKernel)(CUfunction function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                           unsigned block_x, unsigned block_y, unsigned block_z,
                           unsigned dynamic_smem_bytes, CUstream stream, void** params,
                           void** extra) = nullptr;
  CUresult (*LaunchKernelEx)(const CUlaunchConfig* config, CUfunction function, void** params,
                             void** extra) = nullptr;
  CUresult (*MemAlloc)(CUdeviceptr* ptr, size_t bytes) = nullptr;
  CUresult (*MemFree)(CUdeviceptr ptr) = nullptr;
  CUresult (*MemcpyHtoD)(CUdeviceptr dst, const void* src, size_t bytes) = nullptr;
  CUresult (*MemcpyDtoH)(void* dst, CUdeviceptr src, size_t bytes) = nullptr;
  CUresult (*MemcpyDtoHAsync)(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) = nullptr;
  CUresult (*MemcpyDtoDAsync)(CUdeviceptr dst, CUdeviceptr src, size_t bytes,
                              CUstream stream) = nullptr;
  CUresult (*MemsetD8)(CUdeviceptr dst, unsigned char value, size_t count) = nullptr;
  CUresult (*MemsetD8Async)(CUdeviceptr dst, unsigned char value, size_t count,
                            CUstream stream) = nullptr;
  CUresult (*PointerGetAttribute)(void* value, int attribute, CUdeviceptr ptr) = nullptr;
  CUresult (*StreamCreate)(CUstream* stream, unsigned flags) = nullptr;
  CUresult (*StreamDestroy)(CUstream stream) = nullptr;
  CUresult (*StreamSynchronize)(CUstream stream) = nullptr;
  CUresult (*StreamGetCtx)(CUstream stream, CUcontext* context) = nullptr;
  CUresult (*EventCreate)(CUevent* event, unsigned flags) = nullptr;
  CUresult (*EventDestroy)(CUevent event) = nullptr;
  CUresult (*EventRecord)(CUevent event, CUstream stream) = nullptr;
  CUresult (*EventSynchronize)(CUevent event) = nullptr;
  CUresult (*EventElapsedTime)(float* ms, CUevent start, CUevent end) = nullptr;
  CUresult (*StreamIsCapturing)(CUstream stream, int* status) = nullptr;
  CUresult (*MemAllocAsync)(CUdeviceptr* ptr, size_t bytes, CUstream stream) = nullptr;
  CUresult (*MemFreeAsync)(CUdeviceptr ptr, CUstream stream) = nullptr;
  CUresult (*StreamBeginCapture)(CUstream stream, int mode) = nullptr;
  CUresult (*StreamEndCapture)(CUstream stream, CUgraph* graph) = nullptr;
  CUresult (*GraphInstantiateWithFlags)(CUgraphExec* exec, CUgraph graph, unsigned long long flags) = nullptr;
  CUresult (*GraphLaunch)(CUgraphExec exec, CUstream stream) = nullptr;
  CUresult (*GraphExecDestroy)(CUgraphExec exec) = nullptr;
  CUresult (*GraphDestroy)(CUgraph graph) = nullptr;
};

// Every DriverApi entry point with the CUDA version whose signature DriverApi declares
// for it (cudaTypedefs.h names that signature PFN_cu<Name>_v<version>). cuGetProcAddress
// is asked for exactly that version, never the newest: newer variants may take other
// arguments (CUDA 12.5's cuStreamGetCtx and CUDA 13's cuCtxSynchronize take one more).
// A driver older than a version hands out its own variant, which for each entry here
// has the same signature. tests/test_cuda_runtime.cpp checks each against its PFN.
#define KERF_CUDA_ENTRY_POINTS(X)     \
  X(GetErrorName, 6000)               \
  X(GetErrorString, 6000)             \
  X(Init, 2000)                       \
  X(DeviceGetCount, 2000)             \
  X(DeviceGet, 2000)                  \
  X(DeviceGetName, 2000)              \
  X(DeviceGetAttribute, 2000)         \
  X(DeviceTotalMem, 3020)             \
  X(DevicePrimaryCtxRetain, 7000)     \
  X(CtxGetCurrent, 4000)              \
  X(CtxSetCurrent, 4000)              \
  X(CtxGetDevice, 2000)               \
  X(CtxSynchronize, 2000)             \
  X(ModuleLoadData, 2000)             \
  X(ModuleUnload, 2000)               \
  X(ModuleGetFunction, 2000)          \
  X(FuncGetAttribute, 2020)           \
  X(FuncSetAttribute, 9000)           \
  X(LaunchKernel, 4000)               \
  X(LaunchKernelEx, 11060)            \
  X(MemAlloc, 3020)                   \
  X(MemFree, 3020)                    \
  X(MemcpyHtoD, 3020)                 \
  X(MemcpyDtoH, 3020)                 \
  X(MemcpyDtoHAsync, 3020)            \
  X(MemcpyDtoDAsync, 3020)            \
  X(MemsetD8, 3020)                   \
  X(MemsetD8Async, 3020)              \
  X(PointerGetAttribute, 4000)        \
  X(StreamCreate, 2000)               \
  X(StreamDestroy, 4000)              \
  X(StreamSynchronize, 2000)          \
  X(StreamGetCtx, 9020)               \
  X(EventCreate, 2000)                \
  X(EventDestroy, 4000)               \
  X(EventRecord, 2000)                \
  X(EventSynchronize, 2000)           \
  X(EventElapsedTime, 12080)          \
  X(StreamIsCapturing, 10000)         \
  X(MemAllocAsync, 11020)             \
  X(MemFreeAsync, 11020)              \
  X(StreamBeginCapture, 10010)        \
  X(StreamEndCapture, 10000)          \
  X(GraphInstantiateWithFlags, 11040) \
  X(GraphLaunch, 10000)               \
  X(GraphExecDestroy, 10000)          \
  X(GraphDestroy, 10000)

// One opened driver library: its entry points and whether it initialised.
struct Driver {
  DriverApi api;
  bool available = false;          // loaded, initialised, and at least one device
  std::string unavailable_reason;  // "" when available
  int version = 0;                 // cuDriverGetVersion, e.g. 13000; 0 when unknown
  int device_count = 0;
};

// Opens `library` with dlopen, resolves its entry points through cuGetProcAddress and
// calls cuInit(0). Never throws; the library is never closed. The process opens
// "libcuda.so.1" once through driver(); tests open other files to check the messages.
Driver open_driver(const std::string& library);

// The process's driver, opened on first use (thread-safe) and never destroyed, so that
// objects released during static destruction can still call it.
const Driver& driver();

// The driver's name for `code` ("CUDA_ERROR_OUT_OF_MEMORY"), from the driver when it
// can say, else from kerf's own table of the codes above, else "CUDA error <code>".
std::string error_name(const Driver& d, CUresult code);

}  // namespace kerf::cuda::detail
