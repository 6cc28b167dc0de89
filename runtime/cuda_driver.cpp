// The CUDA driver, opened with dlopen("libcuda.so.1"): entry points come from
// cuGetProcAddress, each device's primary context is retained once, and modules,
// memory, streams and events are owned by RAII objects. Every driver call is
// checked; a failure becomes a kerf::CudaError that names the driver's error.
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kerf/error.h"
#include "kerf/runtime/cuda.h"
#include "common/never_destroyed.h"
#include "runtime/cuda_api.h"

namespace kerf::cuda {
namespace detail {
namespace {

// Buffers, modules and streams owned by static objects are released during
// static destruction and still need the driver then.
using kerf::detail::NeverDestroyed;

struct NamedCode {
  CUresult code;
  const char* name;
};
// Names for the codes kerf declares, for drivers that cannot name them (the stub).
#define KERF_NAMED_CODE(code) \
  NamedCode {                 \
    code, #code               \
  }
constexpr NamedCode kKnownCodes[] = {
    KERF_NAMED_CODE(CUDA_SUCCESS),
    KERF_NAMED_CODE(CUDA_ERROR_INVALID_VALUE),
    KERF_NAMED_CODE(CUDA_ERROR_OUT_OF_MEMORY),
    KERF_NAMED_CODE(CUDA_ERROR_NOT_INITIALIZED),
    KERF_NAMED_CODE(CUDA_ERROR_DEINITIALIZED),
    KERF_NAMED_CODE(CUDA_ERROR_STUB_LIBRARY),
    KERF_NAMED_CODE(CUDA_ERROR_DEVICE_UNAVAILABLE),
    KERF_NAMED_CODE(CUDA_ERROR_NO_DEVICE),
    KERF_NAMED_CODE(CUDA_ERROR_INVALID_DEVICE),
    KERF_NAMED_CODE(CUDA_ERROR_INVALID_IMAGE),
    KERF_NAMED_CODE(CUDA_ERROR_INVALID_CONTEXT),
    KERF_NAMED_CODE(CUDA_ERROR_NO_BINARY_FOR_GPU),
    KERF_NAMED_CODE(CUDA_ERROR_INVALID_PTX),
    KERF_NAMED_CODE(CUDA_ERROR_UNSUPPORTED_PTX_VERSION),
    KERF_NAMED_CODE(CUDA_ERROR_INVALID_HANDLE),
    KERF_NAMED_CODE(CUDA_ERROR_NOT_FOUND),
    KERF_NAMED_CODE(CUDA_ERROR_NOT_READY),
    KERF_NAMED_CODE(CUDA_ERROR_ILLEGAL_ADDRESS),
    KERF_NAMED_CODE(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES),
    KERF_NAMED_CODE(CUDA_ERROR_LAUNCH_FAILED),
    KERF_NAMED_CODE(CUDA_ERROR_NOT_SUPPORTED),
    KERF_NAMED_CODE(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
    KERF_NAMED_CODE(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
    KERF_NAMED_CODE(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT),
    KERF_NAMED_CODE(CUDA_ERROR_SYSTEM_NOT_READY),
    KERF_NAMED_CODE(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH),
    KERF_NAMED_CODE(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE),
    KERF_NAMED_CODE(CUDA_ERROR_UNKNOWN),
};
#undef KERF_NAMED_CODE

std::string version_text(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

// "NAME: description", or just "NAME" when the driver has no description.
std::string describe(const Driver& d, CUresult code) {
  std::string text = error_name(d, code);
  const char* description = nullptr;
  if (d.api.GetErrorString && d.api.GetErrorString(code, &description) == CUDA_SUCCESS &&
      description)
    text += std::string(": ") + description;
  return text;
}

// Why the driver cannot be used, given that `call` returned `code` while opening it.
std::string failure_reason(const Driver& d, const std::string& library, const char* call,
                           CUresult code) {
  const std::string what = "(" + std::string(call) + ": " + describe(d, code) + ")";
  switch (code) {
    case CUDA_ERROR_STUB_LIBRARY:
      return "no CUDA driver found: " + library +
             " is the CUDA toolkit's stub library, not a driver " + what +
             "; install the NVIDIA driver, or take the toolkit's lib64/stubs out of the "
             "library path";
    case CUDA_ERROR_NO_DEVICE:
      return "no CUDA device found " + what;
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
      return "the CUDA driver library in " + library +
             " does not match the NVIDIA kernel driver or this device " + what +
             "; reinstall the NVIDIA driver, or take a CUDA forward-compatibility libcuda out "
             "of the library path";
    default:
      return "the CUDA driver in " + library + " failed to initialise " + what;
  }
}

// dlerror() repeats the file name first; keep one copy of it.
std::string dl_error_text(const std::string& library) {
  const char* error = dlerror();
  std::string text = error ? error : "unknown dlopen error";
  if (text.rfind(library + ": ", 0) == 0) text.erase(0, library.size() + 2);
  return library + ": " + text;
}

using GetProcAddressV2 = CUresult (*)(const char* symbol, void** fn, int cuda_version,
                                      unsigned long long flags, int* status);
using GetProcAddressV1 = CUresult (*)(const char* symbol, void** fn, int cuda_version,
                                      unsigned long long flags);
using DriverGetVersion = CUresult (*)(int* version);

// The entry point that could not be resolved, and why.
struct ResolveFailure {
  const char* symbol = nullptr;
  CUresult code = CUDA_SUCCESS;
};

template <class Fn>
void resolve_into(Fn& slot, const char* symbol, int version, GetProcAddressV2 gpa2,
                  GetProcAddressV1 gpa1, ResolveFailure& failure) {
  if (failure.symbol) return;
  void* fn = nullptr;
  CUresult code = gpa2 ? gpa2(symbol, &fn, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM, nullptr)
                       : gpa1(symbol, &fn, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM);
  if (code == CUDA_SUCCESS && !fn) code = CUDA_ERROR_NOT_FOUND;
  if (code != CUDA_SUCCESS) {
    failure = {symbol, code};
    return;
  }
  slot = reinterpret_cast<Fn>(fn);
}

// Resolves every entry point in its declared variant (KERF_CUDA_ENTRY_POINTS); error
// naming comes first in that list, so that later failures can be described.
ResolveFailure resolve_all(DriverApi& api, GetProcAddressV2 gpa2, GetProcAddressV1 gpa1,
                           int driver_version) {
  ResolveFailure failure;
#define KERF_RESOLVE(name, version) \
  resolve_into(api.name, "cu" #name, std::min(version, driver_version), gpa2, gpa1, failure);
  KERF_CUDA_ENTRY_POINTS(KERF_RESOLVE)
#undef KERF_RESOLVE
  return failure;
}

}  // namespace

std::string error_name(const Driver& d, CUresult code) {
  const char* name = nullptr;
  if (d.api.GetErrorName && d.api.GetErrorName(code, &name) == CUDA_SUCCESS && name) return name;
  for (const NamedCode& known : kKnownCodes)
    if (known.code == code) return known.name;
  return "CUDA error " + std::to_string(code);
}

Driver open_driver(const std::string& library) {
  Driver d;
  dlerror();
  // Never closed: entry points must outlive every object that may still call them.
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    d.unavailable_reason = "no CUDA driver found (" + dl_error_text(library) + ")";
    return d;
  }
  // cuGetProcAddress_v2 is CUDA 12's; drivers from 11.3 on only have the first one.
  const auto gpa2 = reinterpret_cast<GetProcAddressV2>(dlsym(handle, "cuGetProcAddress_v2"));
  const auto gpa1 = reinterpret_cast<GetProcAddressV1>(dlsym(handle, "cuGetProcAddress"));
  // The one entry point besides cuGetProcAddress taken with dlsym: cuGetProcAddress
  // refuses versions newer than the driver, so it needs the driver's version first.
  const auto get_version = reinterpret_cast<DriverGetVersion>(dlsym(handle, "cuDriverGetVersion"));
  if ((!gpa2 && !gpa1) || !get_version) {
    d.unavailable_reason = "the CUDA driver in " + library +
                           " is too old or not a CUDA driver: it has no cuGetProcAddress "
                           "(kerf needs a driver for CUDA 11.6 or newer)";
    return d;
  }
  int version = 0;
  if (const CUresult code = get_version(&version); code != CUDA_SUCCESS) {
    d.unavailable_reason = failure_reason(d, library, "cuDriverGetVersion", code);
    return d;
  }
  d.version = version;
  const ResolveFailure failure = resolve_all(d.api, gpa2, gpa1, version);
  if (failure.symbol) {
    if (failure.code == CUDA_ERROR_STUB_LIBRARY) {
      d.unavailable_reason = failure_reason(d, library, "cuGetProcAddress", failure.code);
    } else {
      d.unavailable_reason = "the CUDA driver " + version_text(version) + " in " + library +
                             " has no usable " + failure.symbol + " (" + describe(d, failure.code) +
                             "); update the NVIDIA driver";
    }
    return d;
  }
  if (const CUresult code = d.api.Init(0); code != CUDA_SUCCESS) {
    d.unavailable_reason = failure_reason(d, library, "cuInit", code);
    return d;
  }
  if (const CUresult code = d.api.DeviceGetCount(&d.device_count); code != CUDA_SUCCESS) {
    d.device_count = 0;
    d.unavailable_reason = failure_reason(d, library, "cuDeviceGetCount", code);
    return d;
  }
  if (d.device_count <= 0) {
    d.device_count = 0;
    d.unavailable_reason =
        "no CUDA device found (the CUDA driver " + version_text(version) + " reports none)";
    return d;
  }
  d.available = true;
  return d;
}

const Driver& driver() {
  static NeverDestroyed<Driver> process_driver(open_driver("libcuda.so.1"));
  return process_driver.value;
}

}  // namespace detail

namespace {

using namespace detail;

const DriverApi& api() {
  const Driver& d = driver();
  if (!d.available) throw NotAvailable(d.unavailable_reason);
  return d.api;
}

[[noreturn]] void throw_cuda_error(const std::string& what, CUresult code) {
  throw CudaError(what + ": " + describe(driver(), code), code);
}

// Checks a driver call; `what` says what kerf was doing ("allocating 4096 bytes ...").
void check(CUresult code, const char* what) {
  if (code != CUDA_SUCCESS) throw_cuda_error(what, code);
}
// The same, for messages that are only worth building when the call failed.
template <class Describe>
requires std::is_invocable_r_v<std::string, Describe>
void check(CUresult code, Describe&& what) {
  if (code != CUDA_SUCCESS) throw_cuda_error(what(), code);
}

CUdeviceptr device_ptr(const void* p) {
  return CUdeviceptr(reinterpret_cast<uintptr_t>(p));
}

CUdevice device_handle(int device) {
  CUdevice handle = 0;
  check(api().DeviceGet(&handle, device),
        [&] { return "getting CUDA device " + std::to_string(device); });
  return handle;
}

int device_attribute(CUdevice handle, int attribute, int device) {
  int value = 0;
  check(api().DeviceGetAttribute(&value, attribute, handle), [&] {
    return "querying attribute " + std::to_string(attribute) + " of CUDA device " +
           std::to_string(device);
  });
  return value;
}

// Each device's primary context, retained once and kept for the life of the process
// (the driver releases it at exit).
struct PrimaryContexts {
  std::mutex mutex;
  std::vector<CUcontext> by_device;
};

CUcontext primary_context(int device) {
  static NeverDestroyed<PrimaryContexts> contexts;
  PrimaryContexts& p = contexts.value;
  std::lock_guard<std::mutex> lock(p.mutex);
  if (p.by_device.empty()) p.by_device.resize(size_t(device_count()), nullptr);
  CUcontext& slot = p.by_device[size_t(device)];
  if (!slot) {
    check(api().DevicePrimaryCtxRetain(&slot, device_handle(device)),
          [&] { return "retaining the primary context of CUDA device " + std::to_string(device); });
  }
  return slot;
}

void make_current(CUcontext context) {
  CUcontext current = nullptr;
  check(api().CtxGetCurrent(&current), "querying this thread's current CUDA context");
  if (current != context)
    check(api().CtxSetCurrent(context), "making a CUDA context current on this thread");
}

// A context made current for one of kerf's driver calls, and the caller's put back
// after it: kerf's calls never change the device that the caller's own CUDA code
// (PyTorch, CuPy, the runtime API, which follow the driver's current context) works
// on. A thread that had no current context keeps this one, as the CUDA runtime's
// first call would make one current.
class ContextScope {
 public:
  explicit ContextScope(CUcontext context) {
    check(api().CtxGetCurrent(&previous_), "querying this thread's current CUDA context");
    if (previous_ != context) {
      check(api().CtxSetCurrent(context), "making a CUDA context current on this thread");
      switched_ = true;
    }
  }
  ~ContextScope() {
    if (switched_ && previous_) api().CtxSetCurrent(previous_);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

// Device `device`'s primary context, current for the scope.
ContextScope device_scope(int device) {
  require_device(device);
  return ContextScope(primary_context(device));
}

// For calls that take no device: the stream's context when there is a stream, else
// the thread's current context, else device 0's primary context; current for the scope.
ContextScope stream_scope(StreamHandle stream) {
  const DriverApi& a = api();
  CUcontext context = nullptr;
  if (stream) {
    check(a.StreamGetCtx(static_cast<CUstream>(stream), &context), "finding the CUDA context of a stream");
    return ContextScope(context);
  }
  check(a.CtxGetCurrent(&context), "querying this thread's current CUDA context");
  if (!context) {
    require_device(0);
    context = primary_context(0);
  }
  return ContextScope(context);
}

// For a call on `stream` about memory of `device`: the stream's context, and for the
// null stream `device`'s (its legacy stream), not whatever context the thread has current.
ContextScope stream_scope(StreamHandle stream, int device) {
  return stream ? stream_scope(stream) : device_scope(device);
}

// Destructors release handles with this: it never throws (at exit the driver may
// already be shutting down, so failures are ignored), and puts the caller's context back.
template <class Release>
void in_device_quietly(int device, Release release) noexcept {
  try {
    const ContextScope scope = device_scope(device);
    release();
  } catch (...) {
  }
}

void unload_module(void* handle, int device) noexcept {
  if (!handle) return;
  const Driver& d = driver();
  if (d.available) in_device_quietly(device, [&] { d.api.ModuleUnload(static_cast<CUmodule>(handle)); });
}

void free_device_memory(void* ptr, int device) noexcept {
  if (!ptr) return;
  const Driver& d = driver();
  if (d.available) in_device_quietly(device, [&] { d.api.MemFree(device_ptr(ptr)); });
}

void check_range(const char* operation, size_t offset, size_t bytes, size_t size) {
  if (offset > size || bytes > size - offset)
    throw InvalidArgument(std::string("DeviceBuffer::") + operation + ": bytes [" +
                          std::to_string(offset) + ", " + std::to_string(offset + bytes) +
                          ") lie outside the buffer of " + std::to_string(size) + " bytes");
}

}  // namespace

bool driver_available() {
  return driver().available;
}

std::string driver_unavailable_reason() {
  return driver().unavailable_reason;
}

int device_count() {
  return driver().available ? driver().device_count : 0;
}

int driver_version() {
  return driver().available ? driver().version : 0;
}

void require_device(int device) {
  const Driver& d = driver();
  if (!d.available) throw NotAvailable(d.unavailable_reason);
  if (device < 0)
    throw InvalidArgument("CUDA device index " + std::to_string(device) + " is negative");
  if (device >= d.device_count)
    throw NotAvailable("CUDA device " + std::to_string(device) + " was requested, but the driver " +
                       "reports " + std::to_string(d.device_count) + " device(s) (0 to " +
                       std::to_string(d.device_count - 1) + ")");
}

std::string arch_name(int cc_major, int cc_minor) {
  if (cc_major < 1 || cc_minor < 0 || cc_minor > 9)
    throw InvalidArgument("compute capability " + std::to_string(cc_major) + "." +
                          std::to_string(cc_minor) + " is not a valid one");
  // Architecture-specific targets ("a") unlock wgmma, TMA multicast and tcgen05.
  const bool arch_specific = cc_minor == 0 && (cc_major == 9 || cc_major == 10 || cc_major == 12);
  return "sm_" + std::to_string(cc_major) + std::to_string(cc_minor) + (arch_specific ? "a" : "");
}

DeviceInfo device_info(int device) {
  require_device(device);
  const CUdevice handle = device_handle(device);
  const auto attribute = [&](int which) { return device_attribute(handle, which, device); };
  DeviceInfo info;
  info.index = device;
  char name[256] = {};
  check(api().DeviceGetName(name, int(sizeof(name)), handle),
        [&] { return "getting the name of CUDA device " + std::to_string(device); });
  info.name = name;
  info.cc_major = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  info.cc_minor = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  info.sm_count = attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  info.max_threads_per_block = attribute(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
  info.max_smem_per_block_optin = attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
  info.smem_per_sm = attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
  info.regs_per_sm = attribute(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR);
  info.l2_bytes = attribute(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
  info.clock_khz = attribute(CU_DEVICE_ATTRIBUTE_CLOCK_RATE);
  info.mem_clock_khz = attribute(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE);
  info.mem_bus_width_bits = attribute(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH);
  size_t total = 0;
  check(api().DeviceTotalMem(&total, handle),
        [&] { return "getting the memory size of CUDA device " + std::to_string(device); });
  info.total_mem_bytes = int64_t(total);
  return info;
}

void set_current_device(int device) {
  require_device(device);
  make_current(primary_context(device));
}

int current_device() {
  require_device(0);
  CUcontext context = nullptr;
  check(api().CtxGetCurrent(&context), "querying this thread's current CUDA context");
  if (!context) return 0;
  CUdevice device = 0;
  check(api().CtxGetDevice(&device), "querying the device of this thread's current CUDA context");
  return static_cast<int>(device);
}

// ---------------------------------------------------------------- Module

Module::Module(const void* image, int device) : device_(device) {
  if (!image) throw InvalidArgument("cuda::Module: the kernel image is null");
  const ContextScope scope = device_scope(device);
  CUmodule module = nullptr;
  check(api().ModuleLoadData(&module, image), [&] {
    const DeviceInfo info = device_info(device);
    return "loading a kernel image on CUDA device " + std::to_string(device) + " (" + info.name +
           ", " + arch_name(info.cc_major, info.cc_minor) +
           "; was it compiled for this architecture?)";
  });
  handle_ = module;
  context_ = primary_context(device);
}

Module::~Module() {
  unload_module(handle_, device_);
}

Module::Module(Module&& o) noexcept
    : handle_(std::exchange(o.handle_, nullptr)), context_(std::exchange(o.context_, nullptr)), device_(o.device_) {}

Module& Module::operator=(Module&& o) noexcept {
  if (this != &o) {
    unload_module(handle_, device_);
    handle_ = std::exchange(o.handle_, nullptr);
    context_ = std::exchange(o.context_, nullptr);
    device_ = o.device_;
  }
  return *this;
}

void* Module::function(const std::string& name) const {
  if (!handle_)
    throw InvalidArgument("cuda::Module::function(\"" + name + "\"): no module is loaded");
  CUfunction function = nullptr;
  check(api().ModuleGetFunction(&function, static_cast<CUmodule>(handle_), name.c_str()), [&] {
    return "looking up kernel \"" + name +
           "\" in a loaded module (kernels keep their names only when declared extern \"C\")";
  });
  return function;
}

void set_max_dynamic_smem(void* function, int bytes) {
  if (!function) throw InvalidArgument("set_max_dynamic_smem: the function is null");
  if (bytes < 0)
    throw InvalidArgument("set_max_dynamic_smem: bytes must be >= 0, got " + std::to_string(bytes));
  check(api().FuncSetAttribute(static_cast<CUfunction>(function),
                               CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes),
        [&] {
          return "raising a kernel's dynamic shared memory limit to " + std::to_string(bytes) +
                 " bytes";
        });
}

FunctionAttributes function_attributes(void* function) {
  if (!function) throw InvalidArgument("function_attributes: the function is null");
  const auto attribute = [&](int which) {
    int value = 0;
    check(api().FuncGetAttribute(&value, which, static_cast<CUfunction>(function)),
          "querying a kernel's attributes");
    return value;
  };
  FunctionAttributes attrs;
  attrs.num_regs = attribute(CU_FUNC_ATTRIBUTE_NUM_REGS);
  attrs.local_bytes = attribute(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES);
  attrs.static_smem_bytes = attribute(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES);
  attrs.max_threads_per_block = attribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
  return attrs;
}

namespace {

// launch()'s argument checks and the launch itself, in whatever context is current.
void launch_current(void* function, Grid grid, int block_threads, int dynamic_smem_bytes, StreamHandle stream,
                    void** params, bool overlap_prior, unsigned cluster_x, bool cooperative) {
  if (!function) throw InvalidArgument("cuda::launch: the function is null");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0)
    throw InvalidArgument("cuda::launch: grid (" + std::to_string(grid.x) + ", " +
                          std::to_string(grid.y) + ", " + std::to_string(grid.z) +
                          ") has an empty axis");
  if (block_threads <= 0)
    throw InvalidArgument("cuda::launch: block_threads must be positive, got " +
                          std::to_string(block_threads));
  if (dynamic_smem_bytes < 0)
    throw InvalidArgument("cuda::launch: dynamic_smem_bytes must be >= 0, got " +
                          std::to_string(dynamic_smem_bytes));
  if (cluster_x == 0 || grid.x % cluster_x != 0)
    throw InvalidArgument("cuda::launch: grid x (" + std::to_string(grid.x) +
                          ") must be a positive multiple of the cluster size " + std::to_string(cluster_x));
  CUresult code;
  if (overlap_prior || cluster_x > 1 || cooperative) {
    CUlaunchAttribute attrs[3];
    unsigned n = 0;
    if (overlap_prior) {
      attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs[n++].value.programmatic_stream_serialization_allowed = 1;
    }
    if (cluster_x > 1) {
      attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
      attrs[n++].value.cluster_dim = {cluster_x, 1, 1};
    }
    if (cooperative) {
      attrs[n].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
      attrs[n++].value.cooperative = 1;
    }
    CUlaunchConfig config;
    config.grid_x = grid.x;
    config.grid_y = grid.y;
    config.grid_z = grid.z;
    config.block_x = unsigned(block_threads);
    config.dynamic_smem_bytes = unsigned(dynamic_smem_bytes);
    config.stream = static_cast<CUstream>(stream);
    config.attrs = attrs;
    config.num_attrs = n;
    code = api().LaunchKernelEx(&config, static_cast<CUfunction>(function), params, nullptr);
  } else {
    code = api().LaunchKernel(static_cast<CUfunction>(function), grid.x, grid.y, grid.z,
                              unsigned(block_threads), 1, 1, unsigned(dynamic_smem_bytes),
                              static_cast<CUstream>(stream), params, nullptr);
  }
  check(code,
        [&] {
          return "launching a kernel with grid (" + std::to_string(grid.x) + ", " +
                 std::to_string(grid.y) + ", " + std::to_string(grid.z) + "), " +
                 std::to_string(block_threads) + " threads per block and " +
                 std::to_string(dynamic_smem_bytes) + " bytes of dynamic shared memory" +
                 (cluster_x > 1 ? ", in clusters of " + std::to_string(cluster_x) : std::string()) +
                 (overlap_prior ? ", overlapping the previous kernel" : "") +
                 (cooperative ? ", cooperatively (every block resident at once)" : "");
        });
}

}  // namespace

void launch(void* function, Grid grid, int block_threads, int dynamic_smem_bytes,
            StreamHandle stream, void** params, bool overlap_prior, unsigned cluster_x, bool cooperative) {
  const ContextScope scope = stream_scope(stream);
  launch_current(function, grid, block_threads, dynamic_smem_bytes, stream, params, overlap_prior, cluster_x,
                 cooperative);
}

namespace {

// The device index of a context.
int context_device(CUcontext context) {
  const ContextScope scope(context);
  CUdevice device = 0;
  check(api().CtxGetDevice(&device), "querying the device of a CUDA context");
  for (int i = 0; i < device_count(); ++i)
    if (device_handle(i) == device) return i;
  return int(device);
}

// A stream of another device (or context) than `context`'s is the caller's mistake, said
// in words rather than as the driver's "invalid resource handle" of a failed launch.
// Returns when the stream is the context's (or the driver cannot say whose it is).
void refuse_foreign_stream(CUcontext context, StreamHandle stream) {
  CUcontext owner = nullptr;
  if (!stream || api().StreamGetCtx(static_cast<CUstream>(stream), &owner) != CUDA_SUCCESS || owner == context)
    return;
  const int want = context_device(context), got = context_device(owner);
  throw InvalidArgument(
      "the stream given belongs to CUDA device " + std::to_string(got) +
      (got == want ? " (another context of it)" : std::string()) + ", but the kernel runs on device " +
      std::to_string(want) + ", where its tensors are: pass a stream of that device, or none for its default stream");
}

}  // namespace

void expect_stream_on(StreamHandle stream, int device) {
  if (!stream) return;
  require_device(device);
  refuse_foreign_stream(primary_context(device), stream);
}

void launch_in(void* context, void* function, Grid grid, int block_threads, int dynamic_smem_bytes,
               StreamHandle stream, void** params, bool overlap_prior, unsigned cluster_x, bool cooperative) {
  if (!context) throw InvalidArgument("cuda::launch_in: the context is null");
  const ContextScope scope(static_cast<CUcontext>(context));  // the caller's context is current again after
  // A stream of another context is refused before the launch; each thread remembers the
  // last pair it checked, so a stream used again costs no driver call.
  thread_local StreamHandle checked_stream = nullptr;
  thread_local void* checked_context = nullptr;
  if (stream && (stream != checked_stream || context != checked_context)) {
    refuse_foreign_stream(static_cast<CUcontext>(context), stream);
    checked_stream = stream;
    checked_context = context;
  }
  try {
    launch_current(function, grid, block_threads, dynamic_smem_bytes, stream, params, overlap_prior, cluster_x,
                   cooperative);
  } catch (const CudaError&) {
    refuse_foreign_stream(static_cast<CUcontext>(context), stream);
    throw;
  }
}

// ---------------------------------------------------------------- DeviceBuffer

DeviceBuffer::DeviceBuffer(size_t bytes, int device) : device_(device) {
  const ContextScope scope = device_scope(device);
  if (bytes == 0) return;  // cuMemAlloc refuses 0 bytes; an empty buffer needs no memory
  CUdeviceptr ptr = 0;
  check(api().MemAlloc(&ptr, bytes), [&] {
    return "allocating " + std::to_string(bytes) + " bytes on CUDA device " +
           std::to_string(device);
  });
  ptr_ = reinterpret_cast<void*>(uintptr_t(ptr));
  bytes_ = bytes;
}

DeviceBuffer::~DeviceBuffer() {
  free_device_memory(ptr_, device_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      device_(o.device_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    free_device_memory(ptr_, device_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    device_ = o.device_;
  }
  return *this;
}

void DeviceBuffer::copy_from_host(const void* src, size_t bytes, size_t offset) {
  check_range("copy_from_host", offset, bytes, bytes_);
  if (bytes == 0) return;
  if (!src) throw InvalidArgument("DeviceBuffer::copy_from_host: the source pointer is null");
  const ContextScope scope = device_scope(device_);
  const auto what = [&] {
    return "copying " + std::to_string(bytes) + " bytes from the host to CUDA device " +
           std::to_string(device_);
  };
  check(api().MemcpyHtoD(device_ptr(static_cast<char*>(ptr_) + offset), src, bytes), what);
  // From pageable memory the copy may still be in flight when cuMemcpyHtoD returns;
  // wait, so that kernels on non-blocking streams see the data.
  check(api().StreamSynchronize(nullptr), what);
}

void DeviceBuffer::copy_to_host(void* dst, size_t bytes, size_t offset) const {
  check_range("copy_to_host", offset, bytes, bytes_);
  if (bytes == 0) return;
  if (!dst) throw InvalidArgument("DeviceBuffer::copy_to_host: the destination pointer is null");
  const ContextScope scope = device_scope(device_);
  const auto what = [&] {
    return "copying " + std::to_string(bytes) + " bytes from CUDA device " +
           std::to_string(device_) + " to the host";
  };
  // Non-blocking streams do not order with the legacy stream the copy runs on: wait
  // for all work on the device, so that results of kernels on any stream are seen.
  check(api().CtxSynchronize(), what);
  check(api().MemcpyDtoH(dst, device_ptr(static_cast<const char*>(ptr_) + offset), bytes), what);
}

void DeviceBuffer::copy_to_host_after(StreamHandle stream, void* dst, size_t bytes) const {
  check_range("copy_to_host_after", 0, bytes, bytes_);
  if (bytes == 0) return;
  if (!dst) throw InvalidArgument("DeviceBuffer::copy_to_host_after: the destination pointer is null");
  const ContextScope scope = stream_scope(stream, device_);
  const auto what = [&] {
    return "copying " + std::to_string(bytes) + " bytes from CUDA device " + std::to_string(device_) +
           " to the host after a stream's work";
  };
  check(api().MemcpyDtoHAsync(dst, device_ptr(ptr_), bytes, static_cast<CUstream>(stream)), what);
  check(api().StreamSynchronize(static_cast<CUstream>(stream)), what);
}

void DeviceBuffer::fill_bytes(uint8_t value) {
  if (bytes_ == 0) return;
  const ContextScope scope = device_scope(device_);
  const auto what = [&] {
    return "setting " + std::to_string(bytes_) + " bytes on CUDA device " + std::to_string(device_);
  };
  check(api().MemsetD8(device_ptr(ptr_), value, bytes_), what);
  check(api().StreamSynchronize(nullptr), what);  // see copy_from_host
}

void DeviceBuffer::fill_bytes_async(uint8_t value, StreamHandle stream) {
  if (bytes_ == 0) return;
  const ContextScope scope = stream_scope(stream, device_);
  check(api().MemsetD8Async(device_ptr(ptr_), value, bytes_, static_cast<CUstream>(stream)), [&] {
    return "queueing a fill of " + std::to_string(bytes_) + " bytes on CUDA device " + std::to_string(device_);
  });
}

// ---------------------------------------------------------------- StreamOrderedBuffer

StreamOrderedBuffer::StreamOrderedBuffer(size_t bytes, StreamHandle stream) : stream_(stream) {
  const ContextScope scope = stream_scope(stream);
  if (bytes == 0) return;
  CUdeviceptr ptr = 0;
  check(api().MemAllocAsync(&ptr, bytes, static_cast<CUstream>(stream)),
        [&] { return "allocating " + std::to_string(bytes) + " bytes in a stream's order (cuMemAllocAsync)"; });
  ptr_ = reinterpret_cast<void*>(uintptr_t(ptr));
  bytes_ = bytes;
}

void StreamOrderedBuffer::release() noexcept {
  if (!ptr_) return;
  const Driver& d = driver();
  // Destructors never throw: the stream's own failure shows in its next call.
  if (d.available) d.api.MemFreeAsync(device_ptr(ptr_), static_cast<CUstream>(stream_));
  ptr_ = nullptr;
  bytes_ = 0;
}

StreamOrderedBuffer::~StreamOrderedBuffer() { release(); }

StreamOrderedBuffer::StreamOrderedBuffer(StreamOrderedBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), stream_(o.stream_) {}

StreamOrderedBuffer& StreamOrderedBuffer::operator=(StreamOrderedBuffer&& o) noexcept {
  if (this != &o) {
    release();
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    stream_ = o.stream_;
  }
  return *this;
}

// ---------------------------------------------------------------- graph capture

bool stream_capturing(StreamHandle stream) {
  if (!stream) return false;
  int status = CU_STREAM_CAPTURE_STATUS_NONE;
  check(api().StreamIsCapturing(static_cast<CUstream>(stream), &status),
        "asking whether a CUDA stream is capturing a graph");
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

Graph Graph::capture(StreamHandle stream, const std::function<void()>& work, CaptureMode mode) {
  if (!stream)
    throw InvalidArgument("cuda::Graph::capture: the legacy default stream cannot capture a graph; "
                          "pass a created stream");
  const ContextScope scope = stream_scope(stream);
  const DriverApi& a = api();
  const int cu_mode = mode == CaptureMode::global        ? CU_STREAM_CAPTURE_MODE_GLOBAL
                      : mode == CaptureMode::this_thread ? CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
                                                         : CU_STREAM_CAPTURE_MODE_RELAXED;
  check(a.StreamBeginCapture(static_cast<CUstream>(stream), cu_mode), "beginning a CUDA graph capture");
  CUgraph graph = nullptr;
  try {
    work();
  } catch (...) {
    a.StreamEndCapture(static_cast<CUstream>(stream), &graph);  // ends it; the partial graph goes
    if (graph) a.GraphDestroy(graph);
    throw;
  }
  check(a.StreamEndCapture(static_cast<CUstream>(stream), &graph),
        "ending a CUDA graph capture (a call during it waited for the GPU or allocated memory "
        "outside the stream's order)");
  Graph g;
  g.graph_ = graph;
  CUgraphExec exec = nullptr;
  check(a.GraphInstantiateWithFlags(&exec, graph, 0), "instantiating a captured CUDA graph");
  g.exec_ = exec;
  return g;
}

void Graph::launch(StreamHandle stream) const {
  if (!exec_) throw InvalidArgument("cuda::Graph::launch: the graph is empty (default-constructed or moved from)");
  const ContextScope scope = stream_scope(stream);
  check(api().GraphLaunch(static_cast<CUgraphExec>(exec_), static_cast<CUstream>(stream)),
        "launching a CUDA graph");
}

void Graph::release() noexcept {
  const Driver& d = driver();
  if (d.available) {
    if (exec_) d.api.GraphExecDestroy(static_cast<CUgraphExec>(exec_));
    if (graph_) d.api.GraphDestroy(static_cast<CUgraph>(graph_));
  }
  exec_ = graph_ = nullptr;
}

Graph::~Graph() { release(); }

Graph::Graph(Graph&& o) noexcept : graph_(std::exchange(o.graph_, nullptr)), exec_(std::exchange(o.exec_, nullptr)) {}

Graph& Graph::operator=(Graph&& o) noexcept {
  if (this != &o) {
    release();
    graph_ = std::exchange(o.graph_, nullptr);
    exec_ = std::exchange(o.exec_, nullptr);
  }
  return *this;
}

// ---------------------------------------------------------------- copies and synchronization

namespace {

void copy_in_scope(void* dst, const void* src, size_t bytes, StreamHandle stream) {
  if (!dst || !src) throw InvalidArgument("memcpy_device_to_device: a pointer is null");
  check(
      api().MemcpyDtoDAsync(device_ptr(dst), device_ptr(src), bytes, static_cast<CUstream>(stream)),
      [&] { return "copying " + std::to_string(bytes) + " bytes between device buffers"; });
}

}  // namespace

void memcpy_device_to_device(void* dst, const void* src, size_t bytes, StreamHandle stream) {
  if (bytes == 0) return;
  const ContextScope scope = stream_scope(stream);
  copy_in_scope(dst, src, bytes, stream);
}

void memcpy_device_to_device(void* dst, const void* src, size_t bytes, StreamHandle stream,
                             int device) {
  if (bytes == 0) return;
  const ContextScope scope = stream_scope(stream, device);
  copy_in_scope(dst, src, bytes, stream);
}

void memset_device_async(void* dst, uint8_t value, size_t bytes, StreamHandle stream) {
  if (bytes == 0) return;
  if (!dst) throw InvalidArgument("memset_device_async: the pointer is null");
  const ContextScope scope = stream_scope(stream);
  check(api().MemsetD8Async(device_ptr(dst), value, bytes, static_cast<CUstream>(stream)),
        [&] { return "queueing a fill of " + std::to_string(bytes) + " bytes"; });
}

void stream_synchronize(StreamHandle stream) {
  const ContextScope scope = stream_scope(stream);
  // Waiting here would invalidate the capture (the driver refuses it): say so first.
  if (stream_capturing(stream))
    throw InvalidArgument("cannot wait for a CUDA stream while it captures a graph");
  check(api().StreamSynchronize(static_cast<CUstream>(stream)), "synchronizing a CUDA stream");
}

void stream_synchronize(StreamHandle stream, int device) {
  if (stream) {
    stream_synchronize(stream);
    return;
  }
  const ContextScope scope = device_scope(device);
  check(api().StreamSynchronize(nullptr),
        [&] { return "synchronizing the legacy stream of CUDA device " + std::to_string(device); });
}

void device_synchronize(int device) {
  const ContextScope scope = device_scope(device);
  check(api().CtxSynchronize(),
        [&] { return "synchronizing CUDA device " + std::to_string(device); });
}

// ---------------------------------------------------------------- Stream and Event

Stream::Stream(int device) {
  const ContextScope scope = device_scope(device);
  CUstream stream = nullptr;
  check(api().StreamCreate(&stream, CU_STREAM_NON_BLOCKING),
        [&] { return "creating a stream on CUDA device " + std::to_string(device); });
  handle_ = stream;
}

Stream::~Stream() {
  if (handle_ && driver().available) driver().api.StreamDestroy(static_cast<CUstream>(handle_));
}

void Stream::synchronize() const {
  stream_synchronize(handle_);
}

Event::Event(int device) {
  const ContextScope scope = device >= 0 ? device_scope(device) : stream_scope(nullptr);
  CUevent event = nullptr;
  check(api().EventCreate(&event, CU_EVENT_DEFAULT), "creating a CUDA event");
  handle_ = event;
  CUcontext context = nullptr;
  check(api().CtxGetCurrent(&context), "querying this thread's current CUDA context");
  context_ = context;
}

Event::~Event() {
  if (handle_ && driver().available) driver().api.EventDestroy(static_cast<CUevent>(handle_));
}

void Event::record(StreamHandle stream) {
  // The event's context current: a null stream is then its device's legacy stream.
  const ContextScope scope(static_cast<CUcontext>(context_));
  check(api().EventRecord(static_cast<CUevent>(handle_), static_cast<CUstream>(stream)),
        "recording a CUDA event on a stream");
}

void Event::synchronize() const {
  check(api().EventSynchronize(static_cast<CUevent>(handle_)), "waiting for a CUDA event");
}

float Event::elapsed_ms(const Event& start, const Event& end) {
  end.synchronize();
  float ms = 0.0f;
  check(api().EventElapsedTime(&ms, static_cast<CUevent>(start.handle_),
                               static_cast<CUevent>(end.handle_)),
        "measuring the time between two CUDA events (were both recorded on the same device?)");
  return ms;
}

// ---------------------------------------------------------------- pointers

Device pointer_device(const void* ptr) {
  const Driver& d = driver();
  if (!ptr || !d.available) return Device::cpu();
  const ContextScope scope = stream_scope(nullptr);
  unsigned memory_type = 0;
  // Memory the driver does not know (plain host memory) is an error here: it is the CPU's.
  if (d.api.PointerGetAttribute(&memory_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, device_ptr(ptr)) !=
      CUDA_SUCCESS)
    return Device::cpu();
  if (memory_type != CU_MEMORYTYPE_DEVICE && memory_type != CU_MEMORYTYPE_UNIFIED)
    return Device::cpu();
  int ordinal = 0;
  check(d.api.PointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, device_ptr(ptr)),
        "finding the CUDA device that owns a pointer");
  return Device::cuda(ordinal);
}

}  // namespace kerf::cuda
