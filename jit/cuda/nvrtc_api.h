// The slice of the NVRTC API that kerf calls, declared by hand so that kerf builds
// without the CUDA toolkit: the library is opened at run time with dlopen
// (jit/cuda/nvrtc.cpp). tests/test_cuda_runtime.cpp checks the values below against
// <nvrtc.h> wherever that header is installed.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace kerf::nvrtc::detail {

using nvrtcResult = int;
struct NvrtcProgramImpl;
using nvrtcProgram = NvrtcProgramImpl*;

inline constexpr nvrtcResult NVRTC_SUCCESS = 0;
inline constexpr nvrtcResult NVRTC_ERROR_OUT_OF_MEMORY = 1;
inline constexpr nvrtcResult NVRTC_ERROR_PROGRAM_CREATION_FAILURE = 2;
inline constexpr nvrtcResult NVRTC_ERROR_INVALID_INPUT = 3;
inline constexpr nvrtcResult NVRTC_ERROR_INVALID_PROGRAM = 4;
inline constexpr nvrtcResult NVRTC_ERROR_INVALID_OPTION = 5;
inline constexpr nvrtcResult NVRTC_ERROR_COMPILATION = 6;
inline constexpr nvrtcResult NVRTC_ERROR_BUILTIN_OPERATION_FAILURE = 7;
inline constexpr nvrtcResult NVRTC_ERROR_INTERNAL_ERROR = 11;

// The entry points kerf uses, named as NVRTC names them without the "nvrtc" prefix.
struct NvrtcApi {
  const char* (*GetErrorString)(nvrtcResult result) = nullptr;
  nvrtcResult (*Version)(int* major, int* minor) = nullptr;
  nvrtcResult (*GetNumSupportedArchs)(int* count) = nullptr;
  nvrtcResult (*GetSupportedArchs)(int* archs) = nullptr;
  nvrtcResult (*CreateProgram)(nvrtcProgram* program, const char* source, const char* name,
                               int num_headers, const char* const* headers,
                               const char* const* include_names) = nullptr;
  nvrtcResult (*DestroyProgram)(nvrtcProgram* program) = nullptr;
  nvrtcResult (*CompileProgram)(nvrtcProgram program, int num_options,
                                const char* const* options) = nullptr;
  nvrtcResult (*GetProgramLogSize)(nvrtcProgram program, size_t* bytes) = nullptr;
  nvrtcResult (*GetProgramLog)(nvrtcProgram program, char* log) = nullptr;
  nvrtcResult (*GetPTXSize)(nvrtcProgram program, size_t* bytes) = nullptr;
  nvrtcResult (*GetPTX)(nvrtcProgram program, char* ptx) = nullptr;
  nvrtcResult (*GetCUBINSize)(nvrtcProgram program, size_t* bytes) = nullptr;
  nvrtcResult (*GetCUBIN)(nvrtcProgram program, char* cubin) = nullptr;
};

// One opened NVRTC library.
struct Library {
  NvrtcApi api;
  bool available = false;
  std::string unavailable_reason;  // "" when available
  std::string path;                // the candidate that opened
  int major = 0, minor = 0;
  std::vector<int> archs;  // nvrtcGetSupportedArchs: 75, 80, ..., 121
};

// Where NVRTC is looked for, in order: $KERF_NVRTC_PATH alone when it is set; else
// libnvrtc.so.{13,12,} under $CUDA_HOME/lib64 and $CUDA_PATH/lib64, then by name
// through the loader's search path, then under the build-time toolkit and
// /usr/local/cuda/lib64.
std::vector<std::string> library_candidates();

// Opens the first candidate that dlopen accepts and resolves its entry points.
// Never throws; the library is never closed.
Library open_library(const std::vector<std::string>& candidates);

}  // namespace kerf::nvrtc::detail
