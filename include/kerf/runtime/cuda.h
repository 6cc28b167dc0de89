// The CUDA driver, opened at run time with dlopen("libcuda.so.1"): kerf links
// no CUDA library, so it loads and works (CPU back end, code generation,
// NVRTC) on machines without a GPU, and says clearly when one is needed.
//
// Contexts: kerf uses each device's primary context (the one the CUDA runtime,
// PyTorch and CuPy use), so pointers and streams pass freely between them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kerf/runtime/tensor.h"

namespace kerf::cuda {

// Never throw: whether the driver loaded and initialised, and why not.
bool driver_available();
std::string driver_unavailable_reason();  // e.g. "no CUDA driver found (libcuda.so.1: ...)"
int device_count();                       // 0 when the driver is unavailable
int driver_version();                     // e.g. 13000; 0 when unavailable

// Throws kerf::NotAvailable with driver_unavailable_reason() when no driver or no device.
void require_device(int device = 0);

struct DeviceInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  int max_threads_per_block = 0;
  int max_smem_per_block_optin = 0;  // bytes a block may use after opting in
  int smem_per_sm = 0;
  int regs_per_sm = 0;
  int l2_bytes = 0;
  int64_t total_mem_bytes = 0;
  int clock_khz = 0;
  int mem_clock_khz = 0;
  int mem_bus_width_bits = 0;
};
DeviceInfo device_info(int device);

// The exact architecture NVRTC should compile for: "sm_90a" on Hopper (9.0),
// "sm_100a" on 10.0, "sm_120a" on 12.0, otherwise "sm_XY".
std::string arch_name(int cc_major, int cc_minor);

// Makes the device's primary context current on this thread (retaining it once).
void set_current_device(int device);

// The device of this thread's current CUDA context (what PyTorch's and CuPy's current
// device make current, and set_current_device), or 0 when the thread has none. Throws
// kerf::NotAvailable without a driver.
int current_device();

using StreamHandle = void*;  // a CUstream; nullptr is the legacy default stream

// A loaded module (cubin or PTX image) and its kernels.
class Module {
 public:
  Module() = default;
  Module(const void* image, int device);  // cuModuleLoadData on the device's primary context
  ~Module();
  Module(Module&& o) noexcept;
  Module& operator=(Module&& o) noexcept;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  void* function(const std::string& name) const;  // a CUfunction; throws when missing
  bool loaded() const { return handle_ != nullptr; }
  void* context() const { return context_; }  // the CUcontext it is loaded in (null when none is)
  int device() const { return device_; }

 private:
  void* handle_ = nullptr;
  void* context_ = nullptr;
  int device_ = 0;
};

// Raises the dynamic shared memory limit of `function` to `bytes` (needed above 48 KiB).
void set_max_dynamic_smem(void* function, int bytes);
// Registers and spilled bytes of a loaded kernel, for reports.
struct FunctionAttributes {
  int num_regs = 0;
  int local_bytes = 0;
  int static_smem_bytes = 0;
  int max_threads_per_block = 0;
};
FunctionAttributes function_attributes(void* function);

// cuLaunchKernel. `params` follows the driver's kernelParams convention. With
// `overlap_prior` (cuLaunchKernelEx with programmatic stream serialization) the
// grid may start before the kernel launched ahead of it on `stream` has finished;
// the kernel must wait for it (griddepcontrol.wait) before it touches what that
// kernel writes. Only for kernels that do; sm_90 and later. `cluster_x` > 1
// launches thread-block clusters of that many blocks along x (sm_90 and later;
// grid.x must be a multiple of it). `cooperative`: all blocks resident at once
// (CU_LAUNCH_ATTRIBUTE_COOPERATIVE; the driver refuses a grid that cannot be),
// for kernels whose blocks wait for each other (dsl::grid_sync).
void launch(void* function, Grid grid, int block_threads, int dynamic_smem_bytes,
            StreamHandle stream, void** params, bool overlap_prior = false, unsigned cluster_x = 1,
            bool cooperative = false);
// The same for a function of a module loaded in `context` (Module::context()):
// that context is made current for the launch unless it already is (one query),
// where launch() first asks the driver for the stream's; another context the
// thread had current is made current again afterwards. `stream` must belong to
// `context` (the driver refuses the launch otherwise).
void launch_in(void* context, void* function, Grid grid, int block_threads, int dynamic_smem_bytes,
               StreamHandle stream, void** params, bool overlap_prior = false, unsigned cluster_x = 1,
               bool cooperative = false);

// Device memory owned by this object (cuMemAlloc / cuMemFree).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, int device = 0);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  int device() const { return device_; }
  void copy_from_host(const void* src, size_t bytes, size_t offset = 0);
  void copy_to_host(void* dst, size_t bytes, size_t offset = 0) const;
  // The first `bytes` to the host after the work queued on `stream` (a stream of this
  // device): waits for that stream alone, not for the whole device.
  void copy_to_host_after(StreamHandle stream, void* dst, size_t bytes) const;
  void fill_bytes(uint8_t value);  // cuMemsetD8
  void fill_bytes_async(uint8_t value, StreamHandle stream);  // cuMemsetD8Async, queued on stream

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  int device_ = 0;
};

// Device memory in `stream`'s order: cuMemAllocAsync when made, cuMemFreeAsync on the
// same stream when destroyed. Work queued on the stream between the two may use it.
// While the stream captures a CUDA graph both become nodes of the graph, which then
// owns the memory for all its launches (nothing outside the graph can reach it).
class StreamOrderedBuffer {
 public:
  StreamOrderedBuffer() = default;
  StreamOrderedBuffer(size_t bytes, StreamHandle stream);
  ~StreamOrderedBuffer();
  StreamOrderedBuffer(StreamOrderedBuffer&& o) noexcept;
  StreamOrderedBuffer& operator=(StreamOrderedBuffer&& o) noexcept;
  StreamOrderedBuffer(const StreamOrderedBuffer&) = delete;
  StreamOrderedBuffer& operator=(const StreamOrderedBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void release() noexcept;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  StreamHandle stream_ = nullptr;
};

// Whether `stream` is capturing a CUDA graph (cuStreamIsCapturing; a capture that
// an earlier call invalidated counts too). While it is, nothing may wait for the
// GPU or allocate with cuMemAlloc (the driver refuses and invalidates the capture),
// so kerf's ops then take their workspaces in the stream's order
// (StreamOrderedBuffer), do not tune, and report bad token ids later (ops.h). The
// legacy default stream (nullptr) never captures.
bool stream_capturing(StreamHandle stream);

// How a capture treats calls that are unsafe while it runs (CUstreamCaptureMode):
// refused on every thread, on the capturing thread, or allowed.
enum class CaptureMode { global, this_thread, relaxed };

// An instantiated CUDA graph: the work `work` queued on `stream` (a created stream,
// not the legacy default one), captured and launched again by launch() on any
// stream of the device. When `work` throws, the capture is ended, the partial
// graph discarded, and the exception passed on.
class Graph {
 public:
  static Graph capture(StreamHandle stream, const std::function<void()>& work,
                       CaptureMode mode = CaptureMode::global);
  Graph() = default;
  ~Graph();
  Graph(Graph&& o) noexcept;
  Graph& operator=(Graph&& o) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  void launch(StreamHandle stream) const;  // queued on `stream` (cuGraphLaunch)
  bool valid() const { return exec_ != nullptr; }

 private:
  void release() noexcept;
  void* graph_ = nullptr;
  void* exec_ = nullptr;
};

// cuMemcpyDtoDAsync on `stream`; a null stream is the legacy stream of the thread's
// current context (of device 0 when it has none).
void memcpy_device_to_device(void* dst, const void* src, size_t bytes, StreamHandle stream);
// The same, where a null stream is `device`'s legacy stream (memory of `device`, while
// another device may be current).
void memcpy_device_to_device(void* dst, const void* src, size_t bytes, StreamHandle stream,
                             int device);
// cuMemsetD8Async: `bytes` bytes at `dst` set to `value`, queued on `stream`.
void memset_device_async(void* dst, uint8_t value, size_t bytes, StreamHandle stream);
void stream_synchronize(StreamHandle stream);
// The same, where a null stream is `device`'s legacy stream (not the thread's current
// context's, which may be another device's).
void stream_synchronize(StreamHandle stream, int device);
void device_synchronize(int device);
// Throws InvalidArgument, naming both devices, when `stream` (not null) is not a stream
// of `device` (of its primary context, where kerf loads its kernels).
void expect_stream_on(StreamHandle stream, int device);

class Stream {
 public:
  explicit Stream(int device = 0);  // a non-blocking stream
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  StreamHandle handle() const { return handle_; }
  void synchronize() const;

 private:
  StreamHandle handle_ = nullptr;
};

class Event {
 public:
  // An event of `device` (-1: of the thread's current context, else device 0); it can
  // only be recorded on streams of that device.
  explicit Event(int device = -1);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  // A null stream is the legacy stream of the event's device, whatever is current.
  void record(StreamHandle stream);
  void synchronize() const;
  // Milliseconds between two recorded events.
  static float elapsed_ms(const Event& start, const Event& end);

 private:
  void* handle_ = nullptr;
  void* context_ = nullptr;  // the context it was created in
};

// Where a pointer lives: Device::cpu() for host memory the driver does not know,
// Device::cuda(n) for device (or managed) memory of device n.
Device pointer_device(const void* ptr);

}  // namespace kerf::cuda
