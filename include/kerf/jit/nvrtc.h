// NVRTC, opened at run time (dlopen of libnvrtc.so.<major>), so that a machine
// without it still runs kernels that come from a cache or a bundle.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace kerf::nvrtc {

bool available();
std::string unavailable_reason();  // e.g. "NVRTC not found (libnvrtc.so.13: ...)"
std::pair<int, int> version();     // (13, 0); (0, 0) when unavailable
// Architectures this NVRTC accepts, e.g. {"sm_75", ..., "sm_90a", ...}.
std::vector<std::string> supported_archs();

// The CUDA headers NVRTC may include: $CUDA_HOME, $CUDA_PATH, the build-time
// toolkit, then /usr/local/cuda; "" when none has include/cuda_runtime.h.
std::string cuda_include_dir();

struct Output {
  std::vector<char> image;  // cubin for "sm_XX[a]" targets, PTX text for "compute_XX[a]"
  bool is_cubin = true;
  std::string log;          // NVRTC's log (warnings), may be empty
  double compile_ms = 0.0;
};

// Compiles CUDA C++ `source` (program name `name`, used in diagnostics) for
// `arch` ("sm_90a", "sm_80", "compute_90", ...). Throws kerf::NotAvailable
// without NVRTC, kerf::InvalidArgument for an architecture it does not know,
// and kerf::CompileError whose message holds each error with the generated
// source lines it points at, and whose log()/source() hold the full texts.
Output compile(const std::string& source, const std::string& name, const std::string& arch,
               const std::vector<std::string>& extra_options = {});

// The option that makes ptxas report each kernel's resources in the log
// (cubin targets only), for ptxas_usage below.
inline const char* const kPtxasVerbose = "--ptxas-options=-v";

// What ptxas reported for the one kernel of a log compiled with kPtxasVerbose:
// registers per thread, spilled bytes, the stack frame, and its performance
// advisories (e.g. wgmma instructions serialized for want of registers), each a
// line of its own. -1 where the log does not say (PTX targets, no option).
struct PtxasUsage {
  int registers = -1;
  int spill_store_bytes = -1, spill_load_bytes = -1;
  int stack_frame_bytes = -1;
  std::vector<std::string> advisories;  // "Potential Performance Loss: ..." and the like
};
PtxasUsage ptxas_usage(const std::string& log);

}  // namespace kerf::nvrtc
