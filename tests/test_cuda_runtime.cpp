// The CUDA driver and NVRTC wrappers: both opened at run time, both clear about what
// is missing, and NVRTC compile errors point at the generated source. [cuda] tests run
// anywhere; [gpu] tests need a device and are skipped (KERF-SKIPPED) without one.
#include <cstddef>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "catch.h"
#include "gpu_test_util.h"
#include "jit/cuda/nvrtc_api.h"
#include "kerf/dtype.h"
#include "kerf/error.h"
#include "kerf/jit/nvrtc.h"
#include "kerf/runtime/cuda.h"
#include "runtime/cuda_api.h"

#if __has_include(<cuda.h>) && __has_include(<cudaTypedefs.h>)
#include <cuda.h>
#include <cudaTypedefs.h>
#define KERF_TEST_HAVE_CUDA_H 1
#endif
#if __has_include(<nvrtc.h>)
#include <nvrtc.h>
#define KERF_TEST_HAVE_NVRTC_H 1
#endif

using namespace kerf;

namespace {

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

// Sets (or unsets) an environment variable for one scope, then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_.c_str(), old_->c_str(), 1);
    else
      unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// Expects `fn` to throw E whose message contains every needle; returns the message.
template <class E, class F>
std::string expect_throw(F&& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
  } catch (const E& e) {
    const std::string msg = e.what();
    INFO("message: " << msg);
    for (const auto& n : needles) CHECK(contains(msg, n));
    return msg;
  }
  FAIL("no error of the expected type was raised");
  return "";
}

// Whether two function pointer types pass the same number of arguments of the same
// sizes and kinds: kerf declares its own handle types and passes enums as int.
template <class R1, class... A1, class R2, class... A2>
constexpr bool same_abi(R1 (*)(A1...), R2 (*)(A2...)) {
  if constexpr (sizeof...(A1) != sizeof...(A2)) {
    return false;
  } else {
    return sizeof(R1) == sizeof(R2) &&
           ((sizeof(A1) == sizeof(A2) && std::is_pointer_v<A1> == std::is_pointer_v<A2>)&&...);
  }
}

// out[i] = bf16(float(x[i]) + float(y[i])); bf16 values travel as raw 16-bit patterns,
// so the kernel needs no CUDA header. Rounds like kerf::float_to_bf16 (nearest even).
const char* const kBf16AddSource = R"(
__device__ float bf16_to_float(unsigned short h) { return __uint_as_float(unsigned(h) << 16); }
__device__ unsigned short float_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return (unsigned short)(u >> 16);
}
extern "C" __global__ void bf16_add(const unsigned short* x, const unsigned short* y,
                                    unsigned short* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(y[i]));
}
)";

bool starts_with_elf_magic(const std::vector<char>& image) {
  return image.size() > 4 && image[0] == 0x7f && image[1] == 'E' && image[2] == 'L' &&
         image[3] == 'F';
}

// The CUDA toolkit's stub libcuda, where this machine has one.
std::string stub_libcuda() {
  std::vector<std::string> dirs;
  if (const char* home = std::getenv("CUDA_HOME")) dirs.push_back(home);
  dirs.emplace_back("/usr/local/cuda");
  for (const auto& dir : dirs)
    if (file_exists(dir + "/lib64/stubs/libcuda.so")) return dir + "/lib64/stubs/libcuda.so";
  return "";
}

}  // namespace

// ---------------------------------------------------------------- driver, anywhere

TEST_CASE("without a usable driver kerf says why, reports no devices and does not crash",
          "[cuda]") {
  if (cuda::driver_available()) {
    CHECK(cuda::device_count() > 0);
    CHECK(cuda::driver_unavailable_reason().empty());
    CHECK(cuda::driver_version() >= 11030);
    return;
  }
  const std::string reason = cuda::driver_unavailable_reason();
  INFO("reason: " << reason);
  CHECK(contains(reason, "CUDA"));
  CHECK(cuda::device_count() == 0);
  CHECK(cuda::driver_version() == 0);
  expect_throw<NotAvailable>([] { cuda::require_device(0); }, {"CUDA", reason});
  expect_throw<NotAvailable>([] { cuda::set_current_device(0); }, {"CUDA"});
  expect_throw<NotAvailable>([] { (void)cuda::current_device(); }, {"CUDA"});
  expect_throw<NotAvailable>([] { cuda::device_info(0); }, {"CUDA"});
  expect_throw<NotAvailable>([] { cuda::DeviceBuffer buffer(256); }, {"CUDA"});
  expect_throw<NotAvailable>([] { cuda::Stream stream; }, {"CUDA"});
  expect_throw<NotAvailable>([] { cuda::Event event; }, {"CUDA"});
  expect_throw<NotAvailable>([] { cuda::Module module("not an image", 0); }, {"CUDA"});
  expect_throw<NotAvailable>([] { cuda::device_synchronize(0); }, {"CUDA"});
  // Empty handles own nothing and destroy quietly.
  cuda::Module empty_module;
  cuda::DeviceBuffer empty_buffer;
  CHECK_FALSE(empty_module.loaded());
  CHECK(empty_buffer.data() == nullptr);
}

TEST_CASE("the toolkit's stub libcuda is reported as a stub", "[cuda]") {
  // Open the process's driver first: the stub's soname is libcuda.so.1, so once it is
  // loaded a later dlopen("libcuda.so.1") would find it instead of a real driver.
  if (cuda::driver_available()) {
    SUCCEED("a real driver is loaded; the stub is not opened beside it");
    return;
  }
  const std::string stub = stub_libcuda();
  if (stub.empty()) {
    SUCCEED("no stub libcuda on this machine");
    return;
  }
  const cuda::detail::Driver d = cuda::detail::open_driver(stub);
  INFO("reason: " << d.unavailable_reason);
  CHECK_FALSE(d.available);
  CHECK(d.device_count == 0);
  CHECK(contains(d.unavailable_reason, "CUDA_ERROR_STUB_LIBRARY"));
  CHECK(contains(d.unavailable_reason, "stub"));
}

TEST_CASE("a missing or foreign driver library is reported by name", "[cuda]") {
  const cuda::detail::Driver missing = cuda::detail::open_driver("/nonexistent/libcuda.so.1");
  CHECK_FALSE(missing.available);
  CHECK(missing.unavailable_reason.rfind("no CUDA driver found (/nonexistent/libcuda.so.1: ", 0) ==
        0);
  // A library that is not a CUDA driver at all.
  const cuda::detail::Driver foreign = cuda::detail::open_driver("libm.so.6");
  INFO("reason: " << foreign.unavailable_reason);
  CHECK_FALSE(foreign.available);
  CHECK(contains(foreign.unavailable_reason, "cuGetProcAddress"));
}

TEST_CASE("driver error codes are named even when the driver cannot name them", "[cuda]") {
  const cuda::detail::Driver none;  // no entry points at all
  CHECK(cuda::detail::error_name(none, 34) == "CUDA_ERROR_STUB_LIBRARY");
  CHECK(cuda::detail::error_name(none, 2) == "CUDA_ERROR_OUT_OF_MEMORY");
  CHECK(cuda::detail::error_name(none, 100) == "CUDA_ERROR_NO_DEVICE");
  CHECK(cuda::detail::error_name(none, 12345) == "CUDA error 12345");
}

TEST_CASE("arch_name gives NVRTC the exact target of a compute capability", "[cuda]") {
  CHECK(cuda::arch_name(9, 0) == "sm_90a");
  CHECK(cuda::arch_name(10, 0) == "sm_100a");
  CHECK(cuda::arch_name(12, 0) == "sm_120a");
  CHECK(cuda::arch_name(8, 0) == "sm_80");
  CHECK(cuda::arch_name(8, 6) == "sm_86");
  CHECK(cuda::arch_name(8, 9) == "sm_89");
  CHECK(cuda::arch_name(7, 5) == "sm_75");
  CHECK(cuda::arch_name(10, 3) == "sm_103");
  CHECK(cuda::arch_name(12, 1) == "sm_121");
  CHECK_THROWS_AS(cuda::arch_name(0, 0), InvalidArgument);
  CHECK_THROWS_AS(cuda::arch_name(9, 10), InvalidArgument);
}

TEST_CASE("pointer_device calls host memory the CPU's", "[cuda]") {
  int on_stack = 0;
  std::vector<float> on_heap(1024);
  CHECK(cuda::pointer_device(&on_stack) == Device::cpu());
  CHECK(cuda::pointer_device(on_heap.data()) == Device::cpu());
  CHECK(cuda::pointer_device(nullptr) == Device::cpu());
}

TEST_CASE("kerf's declarations of the driver and NVRTC APIs match cuda.h and nvrtc.h", "[cuda]") {
#if defined(KERF_TEST_HAVE_CUDA_H)
  namespace d = cuda::detail;
  STATIC_REQUIRE(sizeof(d::CUdeviceptr) == sizeof(::CUdeviceptr));
  STATIC_REQUIRE(sizeof(d::CUresult) == sizeof(::CUresult));
  STATIC_REQUIRE(sizeof(d::CUdevice) == sizeof(::CUdevice));
  // Each entry point's declared signature against the variant it is resolved as.
#define KERF_PIN_ENTRY_POINT(name, version) \
  STATIC_REQUIRE(same_abi(decltype(d::DriverApi::name){}, PFN_cu##name##_v##version{}));
  KERF_CUDA_ENTRY_POINTS(KERF_PIN_ENTRY_POINT)
#undef KERF_PIN_ENTRY_POINT
  // cuLaunchKernelEx's configuration, as kerf lays it out.
  STATIC_REQUIRE(d::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION ==
                 int(::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION));
  STATIC_REQUIRE(d::CU_LAUNCH_ATTRIBUTE_COOPERATIVE == int(::CU_LAUNCH_ATTRIBUTE_COOPERATIVE));
  STATIC_REQUIRE(d::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION == int(::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION));
  STATIC_REQUIRE(sizeof(d::CUlaunchAttribute) == sizeof(::CUlaunchAttribute));
  STATIC_REQUIRE(alignof(d::CUlaunchAttribute) == alignof(::CUlaunchAttribute));
  STATIC_REQUIRE(offsetof(d::CUlaunchAttribute, value) == offsetof(::CUlaunchAttribute, value));
  STATIC_REQUIRE(sizeof(d::CUlaunchConfig) == sizeof(::CUlaunchConfig));
  STATIC_REQUIRE(offsetof(d::CUlaunchConfig, dynamic_smem_bytes) == offsetof(::CUlaunchConfig, sharedMemBytes));
  STATIC_REQUIRE(offsetof(d::CUlaunchConfig, stream) == offsetof(::CUlaunchConfig, hStream));
  STATIC_REQUIRE(offsetof(d::CUlaunchConfig, attrs) == offsetof(::CUlaunchConfig, attrs));
  STATIC_REQUIRE(offsetof(d::CUlaunchConfig, num_attrs) == offsetof(::CUlaunchConfig, numAttrs));
  STATIC_REQUIRE(d::CUDA_SUCCESS == ::CUDA_SUCCESS);
  STATIC_REQUIRE(d::CUDA_ERROR_INVALID_VALUE == ::CUDA_ERROR_INVALID_VALUE);
  STATIC_REQUIRE(d::CUDA_ERROR_OUT_OF_MEMORY == ::CUDA_ERROR_OUT_OF_MEMORY);
  STATIC_REQUIRE(d::CUDA_ERROR_NOT_INITIALIZED == ::CUDA_ERROR_NOT_INITIALIZED);
  STATIC_REQUIRE(d::CUDA_ERROR_DEINITIALIZED == ::CUDA_ERROR_DEINITIALIZED);
  STATIC_REQUIRE(d::CUDA_ERROR_STUB_LIBRARY == ::CUDA_ERROR_STUB_LIBRARY);
  STATIC_REQUIRE(d::CUDA_ERROR_DEVICE_UNAVAILABLE == ::CUDA_ERROR_DEVICE_UNAVAILABLE);
  STATIC_REQUIRE(d::CUDA_ERROR_NO_DEVICE == ::CUDA_ERROR_NO_DEVICE);
  STATIC_REQUIRE(d::CUDA_ERROR_INVALID_DEVICE == ::CUDA_ERROR_INVALID_DEVICE);
  STATIC_REQUIRE(d::CUDA_ERROR_INVALID_IMAGE == ::CUDA_ERROR_INVALID_IMAGE);
  STATIC_REQUIRE(d::CUDA_ERROR_INVALID_CONTEXT == ::CUDA_ERROR_INVALID_CONTEXT);
  STATIC_REQUIRE(d::CUDA_ERROR_NO_BINARY_FOR_GPU == ::CUDA_ERROR_NO_BINARY_FOR_GPU);
  STATIC_REQUIRE(d::CUDA_ERROR_INVALID_PTX == ::CUDA_ERROR_INVALID_PTX);
  STATIC_REQUIRE(d::CUDA_ERROR_UNSUPPORTED_PTX_VERSION == ::CUDA_ERROR_UNSUPPORTED_PTX_VERSION);
  STATIC_REQUIRE(d::CUDA_ERROR_INVALID_HANDLE == ::CUDA_ERROR_INVALID_HANDLE);
  STATIC_REQUIRE(d::CUDA_ERROR_NOT_FOUND == ::CUDA_ERROR_NOT_FOUND);
  STATIC_REQUIRE(d::CUDA_ERROR_NOT_READY == ::CUDA_ERROR_NOT_READY);
  STATIC_REQUIRE(d::CUDA_ERROR_ILLEGAL_ADDRESS == ::CUDA_ERROR_ILLEGAL_ADDRESS);
  STATIC_REQUIRE(d::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES == ::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES);
  STATIC_REQUIRE(d::CUDA_ERROR_LAUNCH_FAILED == ::CUDA_ERROR_LAUNCH_FAILED);
  STATIC_REQUIRE(d::CUDA_ERROR_NOT_SUPPORTED == ::CUDA_ERROR_NOT_SUPPORTED);
  STATIC_REQUIRE(d::CUDA_ERROR_SYSTEM_NOT_READY == ::CUDA_ERROR_SYSTEM_NOT_READY);
  STATIC_REQUIRE(d::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH == ::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH);
  STATIC_REQUIRE(d::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE ==
                 ::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE);
  STATIC_REQUIRE(d::CUDA_ERROR_UNKNOWN == ::CUDA_ERROR_UNKNOWN);
  STATIC_REQUIRE(d::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK ==
                 ::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
  STATIC_REQUIRE(d::CU_DEVICE_ATTRIBUTE_CLOCK_RATE == ::CU_DEVICE_ATTRIBUTE_CLOCK_RATE);
  STATIC_REQUIRE(d::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT ==
                 ::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  STATIC_REQUIRE(d::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE ==
                 ::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE);
  STATIC_REQUIRE(d::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH ==
                 ::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH);
  STATIC_REQUIRE(d::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE == ::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
  STATIC_REQUIRE(d::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR ==
                 ::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  STATIC_REQUIRE(d::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR ==
                 ::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  STATIC_REQUIRE(d::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR ==
                 ::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
  STATIC_REQUIRE(d::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR ==
                 ::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR);
  STATIC_REQUIRE(d::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN ==
                 ::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
  STATIC_REQUIRE(d::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ==
                 ::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
  STATIC_REQUIRE(d::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES == ::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES);
  STATIC_REQUIRE(d::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES == ::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES);
  STATIC_REQUIRE(d::CU_FUNC_ATTRIBUTE_NUM_REGS == ::CU_FUNC_ATTRIBUTE_NUM_REGS);
  STATIC_REQUIRE(d::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES ==
                 ::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES);
  STATIC_REQUIRE(d::CU_POINTER_ATTRIBUTE_MEMORY_TYPE == ::CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
  STATIC_REQUIRE(d::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL == ::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
  STATIC_REQUIRE(d::CU_MEMORYTYPE_HOST == unsigned(::CU_MEMORYTYPE_HOST));
  STATIC_REQUIRE(d::CU_MEMORYTYPE_DEVICE == unsigned(::CU_MEMORYTYPE_DEVICE));
  STATIC_REQUIRE(d::CU_MEMORYTYPE_ARRAY == unsigned(::CU_MEMORYTYPE_ARRAY));
  STATIC_REQUIRE(d::CU_MEMORYTYPE_UNIFIED == unsigned(::CU_MEMORYTYPE_UNIFIED));
  STATIC_REQUIRE(sizeof(unsigned) == sizeof(::CUmemorytype));
  STATIC_REQUIRE(d::CU_STREAM_NON_BLOCKING == unsigned(::CU_STREAM_NON_BLOCKING));
  STATIC_REQUIRE(d::CU_EVENT_DEFAULT == unsigned(::CU_EVENT_DEFAULT));
  STATIC_REQUIRE(d::CU_GET_PROC_ADDRESS_LEGACY_STREAM ==
                 (unsigned long long)(::CU_GET_PROC_ADDRESS_LEGACY_STREAM));
#else
  SUCCEED("cuda.h is not installed here; nothing to compare the driver declarations with");
#endif
#if defined(KERF_TEST_HAVE_NVRTC_H)
  namespace n = nvrtc::detail;
  STATIC_REQUIRE(n::NVRTC_SUCCESS == ::NVRTC_SUCCESS);
  STATIC_REQUIRE(n::NVRTC_ERROR_OUT_OF_MEMORY == ::NVRTC_ERROR_OUT_OF_MEMORY);
  STATIC_REQUIRE(n::NVRTC_ERROR_PROGRAM_CREATION_FAILURE == ::NVRTC_ERROR_PROGRAM_CREATION_FAILURE);
  STATIC_REQUIRE(n::NVRTC_ERROR_INVALID_INPUT == ::NVRTC_ERROR_INVALID_INPUT);
  STATIC_REQUIRE(n::NVRTC_ERROR_INVALID_PROGRAM == ::NVRTC_ERROR_INVALID_PROGRAM);
  STATIC_REQUIRE(n::NVRTC_ERROR_INVALID_OPTION == ::NVRTC_ERROR_INVALID_OPTION);
  STATIC_REQUIRE(n::NVRTC_ERROR_COMPILATION == ::NVRTC_ERROR_COMPILATION);
  STATIC_REQUIRE(n::NVRTC_ERROR_BUILTIN_OPERATION_FAILURE ==
                 ::NVRTC_ERROR_BUILTIN_OPERATION_FAILURE);
  STATIC_REQUIRE(n::NVRTC_ERROR_INTERNAL_ERROR == ::NVRTC_ERROR_INTERNAL_ERROR);
  STATIC_REQUIRE(sizeof(n::nvrtcResult) == sizeof(::nvrtcResult));
#else
  SUCCEED("nvrtc.h is not installed here; nothing to compare the NVRTC declarations with");
#endif
}

// ---------------------------------------------------------------- NVRTC, anywhere

TEST_CASE("NVRTC compiles a bf16 kernel to sm_80 and sm_90a cubins", "[cuda]") {
  KERF_REQUIRE_NVRTC();
  for (const std::string arch : {"sm_80", "sm_90a"}) {
    INFO("arch " << arch);
    const nvrtc::Output out = nvrtc::compile(kBf16AddSource, "bf16_add", arch);
    CHECK(out.is_cubin);
    CHECK(starts_with_elf_magic(out.image));
    CHECK(out.compile_ms > 0.0);
  }
}

TEST_CASE("NVRTC compiles to PTX text for compute_XX targets", "[cuda]") {
  KERF_REQUIRE_NVRTC();
  const nvrtc::Output out = nvrtc::compile(kBf16AddSource, "bf16_add", "compute_90");
  CHECK_FALSE(out.is_cubin);
  REQUIRE_FALSE(out.image.empty());
  CHECK(out.image.back() == '\0');  // cuModuleLoadData takes PTX as a C string
  const std::string ptx(out.image.data());
  CHECK(contains(ptx, ".version"));
  CHECK(contains(ptx, ".target sm_90"));
  CHECK(contains(ptx, "bf16_add"));
}

TEST_CASE("an NVRTC compile error shows the offending source line and its number", "[cuda]") {
  KERF_REQUIRE_NVRTC();
  const std::string source =
      "extern \"C\" __global__ void broken(float* out, int n) {\n"  // 1
      "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"          // 2
      "  if (i >= n) return;\n"                                     // 3
      "  float a = out[i];\n"                                       // 4
      "  float b = a * 2.0f;\n"                                     // 5
      "  out[i] = b + not_declared_anywhere;\n"                     // 6
      "}\n";                                                        // 7
  try {
    nvrtc::compile(source, "broken_kernel", "sm_80");
    FAIL("the broken kernel compiled");
  } catch (const CompileError& e) {
    const std::string msg = e.what();
    INFO("message:\n" << msg);
    CHECK(contains(msg, "broken_kernel(6): error"));
    CHECK(contains(msg, "not_declared_anywhere"));
    CHECK(contains(msg, "> 6 |   out[i] = b + not_declared_anywhere;"));
    CHECK(contains(msg, "  4 |   float a = out[i];"));  // two lines of context each side
    CHECK(contains(msg, "  7 | }"));
    CHECK_FALSE(contains(msg, "  3 |"));
    CHECK(contains(msg, "sm_80"));
    CHECK(contains(e.log(), "error"));
    CHECK(e.source() == source);
    CHECK(e.kind() == ErrorKind::Compile);
  }
}

TEST_CASE("NVRTC refuses unknown architectures before compiling, listing the known ones",
          "[cuda]") {
  KERF_REQUIRE_NVRTC();
  for (const std::string arch : {"sm_70", "sm_999", "banana", "sm_86a", "sm_90x", ""}) {
    INFO("arch \"" << arch << "\"");
    expect_throw<InvalidArgument>([&] { nvrtc::compile(kBf16AddSource, "bf16_add", arch); },
                                  {"\"" + arch + "\"", "sm_80", "sm_90a"});
  }
}

TEST_CASE("supported_archs lists base and architecture-specific targets", "[cuda]") {
  KERF_REQUIRE_NVRTC();
  const std::vector<std::string> archs = nvrtc::supported_archs();
  const auto has = [&](const std::string& a) {
    return std::find(archs.begin(), archs.end(), a) != archs.end();
  };
  CHECK(has("sm_80"));
  CHECK(has("sm_90"));
  CHECK(has("sm_90a"));
  CHECK_FALSE(has("sm_80a"));
  CHECK(nvrtc::version().first >= 12);
}

TEST_CASE("generated code may include the CUDA toolkit's headers, cccl included", "[cuda]") {
  KERF_REQUIRE_NVRTC();
  if (nvrtc::cuda_include_dir().empty()) {
    std::cout << "KERF-SKIPPED: no CUDA headers found (set CUDA_HOME)" << std::endl;
    return;
  }
  const std::string source = R"(
#include <cuda_bf16.h>
#include <cuda/std/limits>
extern "C" __global__ void scale(__nv_bfloat16* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = __float2bfloat16(__bfloat162float(x[i]) * cuda::std::numeric_limits<float>::epsilon());
}
)";
  const nvrtc::Output out = nvrtc::compile(source, "scale_bf16", "sm_90a");
  CHECK(starts_with_elf_magic(out.image));
}

TEST_CASE("extra options reach NVRTC, and options it rejects are invalid arguments", "[cuda]") {
  KERF_REQUIRE_NVRTC();
  const nvrtc::Output out =
      nvrtc::compile(kBf16AddSource, "bf16_add", "compute_80", {"-DKERF_UNUSED=1", "-lineinfo"});
  CHECK(contains(std::string(out.image.data()), ".loc"));  // -lineinfo emits line records
  expect_throw<InvalidArgument>(
      [] { nvrtc::compile(kBf16AddSource, "bf16_add", "sm_80", {"--no-such-option"}); },
      {"--no-such-option"});
}

TEST_CASE("KERF_DISABLE_NVRTC=1 makes NVRTC unavailable at once", "[cuda]") {
  {
    ScopedEnv disable("KERF_DISABLE_NVRTC", "1");
    CHECK_FALSE(nvrtc::available());
    CHECK(contains(nvrtc::unavailable_reason(), "KERF_DISABLE_NVRTC"));
    CHECK(nvrtc::supported_archs().empty());
    CHECK(nvrtc::version() == std::pair<int, int>{0, 0});
    expect_throw<NotAvailable>([] { nvrtc::compile(kBf16AddSource, "bf16_add", "sm_80"); },
                               {"KERF_DISABLE_NVRTC"});
  }
  {
    ScopedEnv enable("KERF_DISABLE_NVRTC", "0");
    CHECK(nvrtc::available() ==
          nvrtc::detail::open_library(nvrtc::detail::library_candidates()).available);
  }
}

TEST_CASE("a missing NVRTC is reported with the place looked at and how to point at one",
          "[cuda]") {
  const nvrtc::detail::Library lib =
      nvrtc::detail::open_library({"/nonexistent/libnvrtc.so.13", "/nonexistent/libnvrtc.so"});
  CHECK_FALSE(lib.available);
  INFO("reason: " << lib.unavailable_reason);
  CHECK(lib.unavailable_reason.rfind("NVRTC not found (/nonexistent/libnvrtc.so.13: ", 0) == 0);
  CHECK(contains(lib.unavailable_reason, "KERF_NVRTC_PATH"));
  {
    ScopedEnv path("KERF_NVRTC_PATH", "/opt/somewhere/libnvrtc.so.13");
    CHECK(nvrtc::detail::library_candidates() ==
          std::vector<std::string>{"/opt/somewhere/libnvrtc.so.13"});
    // With the override the only place looked at, the message says so (CUDA_HOME would not help).
    const nvrtc::detail::Library forced = nvrtc::detail::open_library(nvrtc::detail::library_candidates());
    CHECK(forced.unavailable_reason.rfind("NVRTC not found at KERF_NVRTC_PATH (/opt/somewhere/libnvrtc.so.13", 0) == 0);
    CHECK_FALSE(contains(forced.unavailable_reason, "CUDA_HOME"));
  }
  {
    ScopedEnv path("KERF_NVRTC_PATH", nullptr);
    ScopedEnv home("CUDA_HOME", "/opt/cuda-x");
    const auto candidates = nvrtc::detail::library_candidates();
    REQUIRE_FALSE(candidates.empty());
    CHECK(candidates.front() == "/opt/cuda-x/lib64/libnvrtc.so.13");
    CHECK(std::find(candidates.begin(), candidates.end(), "libnvrtc.so.12") != candidates.end());
  }
}

// ---------------------------------------------------------------- on a GPU

TEST_CASE("device_info describes the device sensibly", "[gpu]") {
  KERF_REQUIRE_GPU();
  const cuda::DeviceInfo info = cuda::device_info(0);
  INFO(info.name << " cc " << info.cc_major << "." << info.cc_minor);
  CHECK(info.index == 0);
  CHECK_FALSE(info.name.empty());
  CHECK(info.cc_major >= 7);
  CHECK(info.sm_count > 0);
  CHECK(info.max_threads_per_block >= 1024);
  CHECK(info.max_smem_per_block_optin >= 48 * 1024);
  CHECK(info.smem_per_sm >= info.max_smem_per_block_optin);
  CHECK(info.regs_per_sm >= 64 * 1024);
  CHECK(info.l2_bytes > 0);
  CHECK(info.total_mem_bytes > (int64_t(1) << 30));
  CHECK(info.clock_khz > 0);
  CHECK(info.mem_clock_khz > 0);
  CHECK(info.mem_bus_width_bits > 0);
  CHECK(cuda::driver_version() >= 12000);
  CHECK_THROWS_AS(cuda::require_device(cuda::device_count()), NotAvailable);
  CHECK_THROWS_AS(cuda::require_device(-1), InvalidArgument);
}

TEST_CASE("a kernel compiled by NVRTC runs on a stream, is timed by events, and is right",
          "[gpu]") {
  KERF_REQUIRE_GPU();
  KERF_REQUIRE_NVRTC();
  const cuda::DeviceInfo info = cuda::device_info(0);
  const std::string arch = cuda::arch_name(info.cc_major, info.cc_minor);
  const nvrtc::Output compiled = nvrtc::compile(kBf16AddSource, "bf16_add", arch);
  cuda::Module module(compiled.image.data(), 0);
  REQUIRE(module.loaded());
  void* fn = module.function("bf16_add");
  REQUIRE(fn != nullptr);
  const cuda::FunctionAttributes attrs = cuda::function_attributes(fn);
  CHECK(attrs.num_regs > 0);
  CHECK(attrs.max_threads_per_block > 0);

  int n = 10007;  // not a multiple of the block
  std::vector<uint16_t> x(static_cast<size_t>(n)), y(static_cast<size_t>(n)),
      out(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    x[size_t(i)] = float_to_bf16(0.25f * float(i % 97) - 3.0f);
    y[size_t(i)] = float_to_bf16(1.0f / float(1 + i % 13));
  }
  const size_t bytes = size_t(n) * sizeof(uint16_t);
  cuda::DeviceBuffer dx(bytes), dy(bytes), dout(bytes);
  CHECK(cuda::pointer_device(dx.data()) == Device::cuda(0));
  dx.copy_from_host(x.data(), bytes);
  dy.copy_from_host(y.data(), bytes);
  dout.fill_bytes(0xff);

  cuda::Stream stream;
  cuda::Event start, stop;
  void* px = dx.data();
  void* py = dy.data();
  void* pout = dout.data();
  void* params[] = {&px, &py, &pout, &n};
  const int block = 256;
  const Grid grid{uint32_t((n + block - 1) / block), 1, 1};
  start.record(stream.handle());
  cuda::launch(fn, grid, block, 0, stream.handle(), params);
  stop.record(stream.handle());
  stream.synchronize();
  CHECK(cuda::Event::elapsed_ms(start, stop) >= 0.0f);

  dout.copy_to_host(out.data(), bytes);
  int wrong = 0;
  for (size_t i = 0; i < size_t(n); ++i)
    if (out[i] != float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(y[i]))) ++wrong;
  CHECK(wrong == 0);

  // A device-to-device copy on the stream, then a partial read back at an offset.
  cuda::DeviceBuffer copy(bytes);
  cuda::memcpy_device_to_device(copy.data(), dout.data(), bytes, stream.handle());
  cuda::stream_synchronize(stream.handle());
  std::vector<uint16_t> tail(10);
  copy.copy_to_host(tail.data(), tail.size() * 2, bytes - tail.size() * 2);
  for (size_t i = 0; i < tail.size(); ++i) CHECK(tail[i] == out[size_t(n) - tail.size() + i]);
  cuda::device_synchronize(0);
}

TEST_CASE("a PTX image is JIT-compiled by the driver and runs", "[gpu]") {
  KERF_REQUIRE_GPU();
  KERF_REQUIRE_NVRTC();
  const cuda::DeviceInfo info = cuda::device_info(0);
  const std::string arch =
      "compute_" + std::to_string(info.cc_major) + std::to_string(info.cc_minor);
  const nvrtc::Output ptx = nvrtc::compile(kBf16AddSource, "bf16_add", arch);
  cuda::Module module(ptx.image.data(), 0);
  void* fn = module.function("bf16_add");
  int n = 3;
  std::vector<uint16_t> x = {float_to_bf16(1.0f), float_to_bf16(2.0f), float_to_bf16(-4.0f)};
  std::vector<uint16_t> out(3);
  cuda::DeviceBuffer dx(6), dout(6);
  dx.copy_from_host(x.data(), 6);
  void* px = dx.data();
  void* pout = dout.data();
  void* params[] = {&px, &px, &pout, &n};
  cuda::launch(fn, Grid{1, 1, 1}, 32, 0, nullptr, params);
  cuda::stream_synchronize(nullptr);
  dout.copy_to_host(out.data(), 6);
  CHECK(bf16_to_float(out[0]) == 2.0f);
  CHECK(bf16_to_float(out[1]) == 4.0f);
  CHECK(bf16_to_float(out[2]) == -8.0f);
}

TEST_CASE("driver failures are CudaErrors that name the driver's error", "[gpu][provokes-errors]") {
  KERF_REQUIRE_GPU();
  KERF_REQUIRE_NVRTC();
  const cuda::DeviceInfo info = cuda::device_info(0);
  const nvrtc::Output compiled =
      nvrtc::compile(kBf16AddSource, "bf16_add", cuda::arch_name(info.cc_major, info.cc_minor));
  cuda::Module module(compiled.image.data(), 0);
  void* fn = module.function("bf16_add");
  cuda::DeviceBuffer buffer(64);
  void* p = buffer.data();
  int n = 0;
  void* params[] = {&p, &p, &p, &n};

  SECTION("too many threads per block") {
    try {
      cuda::launch(fn, Grid{1, 1, 1}, info.max_threads_per_block * 2, 0, nullptr, params);
      FAIL("the launch was accepted");
    } catch (const CudaError& e) {
      INFO(e.what());
      CHECK(e.code() == 1);
      CHECK(contains(e.what(), "CUDA_ERROR_INVALID_VALUE"));
      CHECK(contains(e.what(), std::to_string(info.max_threads_per_block * 2) + " threads"));
    }
  }
  SECTION("a kernel the module does not have") {
    expect_throw<CudaError>([&] { module.function("no_such_kernel"); },
                            {"no_such_kernel", "CUDA_ERROR_NOT_FOUND"});
  }
  SECTION("more memory than the device has") {
    expect_throw<CudaError>([] { cuda::DeviceBuffer huge(size_t(1) << 50); },
                            {"CUDA_ERROR_OUT_OF_MEMORY", "allocating"});
  }
  SECTION("copies outside a buffer are refused before the driver sees them") {
    std::vector<char> host(128);
    expect_throw<InvalidArgument>([&] { buffer.copy_from_host(host.data(), 65); }, {"64 bytes"});
    expect_throw<InvalidArgument>([&] { buffer.copy_to_host(host.data(), 8, 60); }, {"64 bytes"});
  }
  SECTION("invalid launch arguments are refused before the driver sees them") {
    CHECK_THROWS_AS(cuda::launch(fn, Grid{0, 1, 1}, 32, 0, nullptr, params), InvalidArgument);
    CHECK_THROWS_AS(cuda::launch(fn, Grid{1, 1, 1}, 0, 0, nullptr, params), InvalidArgument);
    CHECK_THROWS_AS(cuda::launch(nullptr, Grid{1, 1, 1}, 32, 0, nullptr, params), InvalidArgument);
  }
}

TEST_CASE("a thread with no current context can launch, copy and time", "[gpu]") {
  KERF_REQUIRE_GPU();
  KERF_REQUIRE_NVRTC();
  const cuda::DeviceInfo info = cuda::device_info(0);
  const nvrtc::Output compiled =
      nvrtc::compile(kBf16AddSource, "bf16_add", cuda::arch_name(info.cc_major, info.cc_minor));
  cuda::Module module(compiled.image.data(), 0);
  void* fn = module.function("bf16_add");
  cuda::Stream stream;
  cuda::DeviceBuffer buffer(2 * 64);
  const std::vector<uint16_t> ones(64, float_to_bf16(1.0f));
  buffer.copy_from_host(ones.data(), 128);
  std::vector<uint16_t> out(64);
  std::string error;
  // A new thread starts with no current CUDA context: kerf takes the stream's.
  std::thread worker([&] {
    try {
      void* p = buffer.data();
      int n = 64;
      void* params[] = {&p, &p, &p, &n};
      cuda::Event start, stop;
      start.record(stream.handle());
      cuda::launch(fn, Grid{1, 1, 1}, 64, 0, stream.handle(), params);
      stop.record(stream.handle());
      stream.synchronize();
      (void)cuda::Event::elapsed_ms(start, stop);
      buffer.copy_to_host(out.data(), 128);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  worker.join();
  CHECK(error.empty());
  for (const uint16_t v : out) CHECK(bf16_to_float(v) == 2.0f);
}

TEST_CASE("events and device copies on a device's legacy stream need no current context", "[gpu]") {
  KERF_REQUIRE_GPU();
  const int last = cuda::device_count() - 1;
  cuda::DeviceBuffer src(4096, last), dst(4096, last);
  std::vector<uint8_t> bytes(4096);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(i * 7 + 3);
  src.copy_from_host(bytes.data(), bytes.size());
  std::string error;
  std::vector<uint8_t> back(4096);
  // A new thread has no current context: a null stream is the event's (or the given
  // device's) legacy stream, as when the autotuner times a call on the null stream of
  // the tensors' device while another device is current.
  std::thread worker([&] {
    try {
      cuda::Event start(last), stop(last);
      start.record(nullptr);
      cuda::memcpy_device_to_device(dst.data(), src.data(), 4096, nullptr, last);
      stop.record(nullptr);
      (void)cuda::Event::elapsed_ms(start, stop);
      cuda::stream_synchronize(nullptr, last);
      dst.copy_to_host(back.data(), back.size());
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  worker.join();
  CHECK(error.empty());
  CHECK(back == bytes);
}

TEST_CASE("current_device is the device of the thread's current context, 0 without one", "[gpu]") {
  KERF_REQUIRE_GPU();
  std::vector<int> seen;
  std::string error;
  // A new thread starts with no current context; each set_current_device makes one current.
  std::thread worker([&] {
    try {
      seen.push_back(cuda::current_device());
      for (int d = cuda::device_count() - 1; d >= 0; --d) {
        cuda::set_current_device(d);
        seen.push_back(cuda::current_device());
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  worker.join();
  REQUIRE(error.empty());
  std::vector<int> expected{0};
  for (int d = cuda::device_count() - 1; d >= 0; --d) expected.push_back(d);
  CHECK(seen == expected);
}

TEST_CASE("RAII handles move, and moved-from handles own nothing", "[gpu]") {
  KERF_REQUIRE_GPU();
  cuda::DeviceBuffer a(1024);
  void* p = a.data();
  cuda::DeviceBuffer b(std::move(a));
  CHECK(b.data() == p);
  CHECK(b.bytes() == 1024);
  CHECK(a.data() == nullptr);  // NOLINT(bugprone-use-after-move)
  cuda::DeviceBuffer c(16);
  c = std::move(b);
  CHECK(c.data() == p);
  cuda::DeviceBuffer empty(0);
  CHECK(empty.data() == nullptr);
  empty.fill_bytes(0);
}
