// NVRTC, opened with dlopen: CUDA C++ source in, a cubin (sm_XX) or PTX
// (compute_XX) image out. A failed compile comes back as a kerf::CompileError that
// shows each error next to the generated source lines it points at.
#include "kerf/jit/nvrtc.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/env_switch.h"
#include "common/never_destroyed.h"
#include "jit/cuda/nvrtc_api.h"
#include "kerf/error.h"

namespace kerf::nvrtc {
namespace detail {
namespace {

// Compiles running during static destruction still find the library (it is never closed).
using kerf::detail::NeverDestroyed;

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

bool is_file(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The build-time toolkit's directories; CMake may hand over a ';'-separated list.
std::vector<std::string> build_time_dirs(const char* list) {
  std::vector<std::string> dirs;
  std::string item;
  std::istringstream in(list ? list : "");
  while (std::getline(in, item, ';'))
    if (!item.empty()) dirs.push_back(item);
  return dirs;
}

#if defined(KERF_CUDA_LIBRARY_DIR)
constexpr const char* kBuildLibraryDirs = KERF_CUDA_LIBRARY_DIR;
#else
constexpr const char* kBuildLibraryDirs = "";
#endif
#if defined(KERF_CUDA_INCLUDE_DIR)
constexpr const char* kBuildIncludeDirs = KERF_CUDA_INCLUDE_DIR;
#else
constexpr const char* kBuildIncludeDirs = "";
#endif

constexpr const char* kLibraryNames[] = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};

template <class Fn>
bool resolve(void* handle, const char* symbol, Fn& slot, std::string& missing) {
  void* fn = dlsym(handle, symbol);
  if (!fn) {
    if (!missing.empty()) missing += ", ";
    missing += symbol;
    return false;
  }
  slot = reinterpret_cast<Fn>(fn);
  return true;
}

}  // namespace

std::vector<std::string> library_candidates() {
  const std::string override_path = env("KERF_NVRTC_PATH");
  if (!override_path.empty()) return {override_path};
  std::vector<std::string> candidates;
  const auto add_dir = [&](const std::string& dir) {
    if (dir.empty()) return;
    for (const char* name : kLibraryNames) {
      std::string path = dir + "/" + name;
      if (std::find(candidates.begin(), candidates.end(), path) == candidates.end())
        candidates.push_back(std::move(path));
    }
  };
  // A toolkit the user names wins over whatever the loader would find.
  if (!env("CUDA_HOME").empty()) add_dir(env("CUDA_HOME") + "/lib64");
  if (!env("CUDA_PATH").empty()) add_dir(env("CUDA_PATH") + "/lib64");
  for (const char* name : kLibraryNames) candidates.emplace_back(name);
  for (const std::string& dir : build_time_dirs(kBuildLibraryDirs)) add_dir(dir);
  add_dir("/usr/local/cuda/lib64");
  return candidates;
}

Library open_library(const std::vector<std::string>& candidates) {
  Library lib;
  void* handle = nullptr;
  std::string first_error;
  for (const std::string& candidate : candidates) {
    dlerror();
    // Never closed: compiled images and cached entry points outlive any one user.
    handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle) {
      lib.path = candidate;
      break;
    }
    if (first_error.empty()) {
      const char* error = dlerror();
      first_error = error ? error : candidate + ": unknown dlopen error";
    }
  }
  if (!handle) {
    const char* forced = std::getenv("KERF_NVRTC_PATH");
    if (forced && *forced && candidates.size() == 1 && candidates[0] == forced)  // the only place looked at
      lib.unavailable_reason = "NVRTC not found at KERF_NVRTC_PATH (" + first_error +
                               "); point it at libnvrtc.so's full path, or unset it to search the CUDA toolkit";
    else
      lib.unavailable_reason = "NVRTC not found (" + first_error + "; also tried " +
                               std::to_string(candidates.size() > 0 ? candidates.size() - 1 : 0) +
                               " other places; set KERF_NVRTC_PATH to libnvrtc.so's full path, or "
                               "CUDA_HOME to the CUDA toolkit)";
    return lib;
  }
  NvrtcApi& a = lib.api;
  std::string missing;
  resolve(handle, "nvrtcGetErrorString", a.GetErrorString, missing);
  resolve(handle, "nvrtcVersion", a.Version, missing);
  resolve(handle, "nvrtcGetNumSupportedArchs", a.GetNumSupportedArchs, missing);
  resolve(handle, "nvrtcGetSupportedArchs", a.GetSupportedArchs, missing);
  resolve(handle, "nvrtcCreateProgram", a.CreateProgram, missing);
  resolve(handle, "nvrtcDestroyProgram", a.DestroyProgram, missing);
  resolve(handle, "nvrtcCompileProgram", a.CompileProgram, missing);
  resolve(handle, "nvrtcGetProgramLogSize", a.GetProgramLogSize, missing);
  resolve(handle, "nvrtcGetProgramLog", a.GetProgramLog, missing);
  resolve(handle, "nvrtcGetPTXSize", a.GetPTXSize, missing);
  resolve(handle, "nvrtcGetPTX", a.GetPTX, missing);
  resolve(handle, "nvrtcGetCUBINSize", a.GetCUBINSize, missing);
  resolve(handle, "nvrtcGetCUBIN", a.GetCUBIN, missing);
  if (!missing.empty()) {
    lib.unavailable_reason = "the NVRTC in " + lib.path + " is too old: it lacks " + missing +
                             " (kerf needs NVRTC 11.2 or newer)";
    return lib;
  }
  int count = 0;
  if (a.Version(&lib.major, &lib.minor) != NVRTC_SUCCESS ||
      a.GetNumSupportedArchs(&count) != NVRTC_SUCCESS || count <= 0) {
    lib.unavailable_reason = "the NVRTC in " + lib.path + " does not report its version";
    return lib;
  }
  lib.archs.resize(size_t(count));
  if (a.GetSupportedArchs(lib.archs.data()) != NVRTC_SUCCESS) {
    lib.unavailable_reason = "the NVRTC in " + lib.path + " does not report its architectures";
    lib.archs.clear();
    return lib;
  }
  std::sort(lib.archs.begin(), lib.archs.end());
  lib.available = true;
  return lib;
}

}  // namespace detail

namespace {

using namespace detail;

const Library& library() {
  static NeverDestroyed<Library> process_library(open_library(library_candidates()));
  return process_library.value;
}

// Checked on every call rather than once, so that a test or a bundle-only deployment
// can turn NVRTC off at any point.
bool disabled_by_env() {
  const char* value = std::getenv("KERF_DISABLE_NVRTC");
  if (!value) return false;
  // Unset, empty, 0, false, no or off (any case, blanks around): NVRTC stays on.
  const std::string w = kerf::detail::switch_word(value);
  return !(w.empty() || kerf::detail::is_off_word(w));
}

const Library& require_library() {
  if (disabled_by_env())
    throw NotAvailable(
        "NVRTC is disabled (KERF_DISABLE_NVRTC is set): kernels must come from "
        "the cache or a bundle");
  const Library& lib = library();
  if (!lib.available) throw NotAvailable(lib.unavailable_reason);
  return lib;
}

std::string result_text(const Library& lib, nvrtcResult result) {
  const char* text = lib.api.GetErrorString ? lib.api.GetErrorString(result) : nullptr;
  return text ? text : "NVRTC error " + std::to_string(result);
}

// A parsed target: "sm_90a" -> {"sm", 90, 'a'}.
struct Target {
  bool is_cubin = true;
  int number = 0;
  char suffix = 0;  // 'a' (arch-specific), 'f' (family) or 0
};

std::string supported_text() {
  std::string text;
  for (const std::string& arch : supported_archs()) text += (text.empty() ? "" : ", ") + arch;
  return text + " (or compute_XX for PTX; sm_XXf family targets from sm_100)";
}

Target parse_target(const Library& lib, const std::string& arch) {
  static const std::regex pattern("(sm|compute)_([0-9]{2,3})([af]?)");
  std::smatch m;
  const auto invalid = [&](const std::string& why) {
    return InvalidArgument("NVRTC cannot compile for \"" + arch + "\": " + why + ". This NVRTC " +
                           std::to_string(lib.major) + "." + std::to_string(lib.minor) +
                           " supports " + supported_text());
  };
  if (!std::regex_match(arch, m, pattern))
    throw invalid("an architecture reads sm_XY, sm_XYa or compute_XY");
  Target t;
  t.is_cubin = m[1] == "sm";
  t.number = std::stoi(m[2]);
  t.suffix = m[3].length() ? m[3].str()[0] : 0;
  if (!std::binary_search(lib.archs.begin(), lib.archs.end(), t.number))
    throw invalid("it does not support architecture " + std::to_string(t.number));
  if (t.suffix == 'a' && t.number < 90)
    throw invalid("architecture-specific (\"a\") targets start at sm_90a");
  if (t.suffix == 'f' && t.number < 100) throw invalid("family (\"f\") targets start at sm_100f");
  return t;
}

// Destroys the program however compile() leaves.
struct Program {
  const NvrtcApi& api;
  nvrtcProgram handle = nullptr;
  ~Program() {
    if (handle) api.DestroyProgram(&handle);
  }
};

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The message of a CompileError: each error of the log, with the source lines it
// points at when it points into `name` (errors in included headers show no source).
std::string describe_errors(const std::string& name, const std::string& arch,
                            const std::string& log, const std::string& source) {
  static const std::regex located(
      R"(^(.*)\(([0-9]+)\): (?:catastrophic )?error(?: #[^:]*)?: (.*)$)");
  const std::vector<std::string> source_lines = split_lines(source);
  const std::vector<std::string> log_lines = split_lines(log);
  constexpr int kMaxShown = 8;
  constexpr int kContext = 2;
  std::ostringstream out;
  out << "NVRTC could not compile \"" << name << "\" for " << arch << ":";
  int errors = 0;
  for (const std::string& line : log_lines) {
    std::smatch m;
    if (!std::regex_match(line, m, located)) continue;
    if (++errors > kMaxShown) continue;
    out << "\n" << line;
    if (m[1] != name) continue;
    const long at = std::stol(m[2]);
    if (at < 1 || at > long(source_lines.size())) continue;
    const long first = std::max(1L, at - kContext);
    const long last = std::min(long(source_lines.size()), at + kContext);
    const int width = int(std::to_string(last).size());
    for (long n = first; n <= last; ++n) {
      std::string number = std::to_string(n);
      number.insert(0, size_t(width) - number.size(), ' ');
      out << "\n  " << (n == at ? "> " : "  ") << number << " | " << source_lines[size_t(n - 1)];
    }
  }
  if (errors > kMaxShown) out << "\n... and " << (errors - kMaxShown) << " more errors";
  if (errors == 0) {
    // No "file(line): error" lines (a command-line or catastrophic error): show the log.
    for (const std::string& line : log_lines)
      if (!line.empty()) out << "\n" << line;
  }
  out << "\n(CompileError::log() holds NVRTC's full log, CompileError::source() the source)";
  return out.str();
}

std::vector<char> fetch_image(const Library& lib, nvrtcProgram program, bool is_cubin,
                              const std::string& name) {
  const auto size_fn = is_cubin ? lib.api.GetCUBINSize : lib.api.GetPTXSize;
  const auto get_fn = is_cubin ? lib.api.GetCUBIN : lib.api.GetPTX;
  size_t bytes = 0;
  nvrtcResult r = size_fn(program, &bytes);
  std::vector<char> image;
  if (r == NVRTC_SUCCESS) {
    image.resize(bytes);
    r = bytes ? get_fn(program, image.data()) : NVRTC_ERROR_INTERNAL_ERROR;
  }
  if (r != NVRTC_SUCCESS)
    throw InternalError("NVRTC compiled \"" + name + "\" but returned no " +
                        (is_cubin ? "cubin" : "PTX") + ": " + result_text(lib, r));
  return image;
}

}  // namespace

bool available() {
  return !disabled_by_env() && library().available;
}

std::string unavailable_reason() {
  if (disabled_by_env()) return "NVRTC is disabled (KERF_DISABLE_NVRTC is set)";
  return library().unavailable_reason;
}

std::pair<int, int> version() {
  if (!available()) return {0, 0};
  return {library().major, library().minor};
}

std::vector<std::string> supported_archs() {
  std::vector<std::string> archs;
  if (!available()) return archs;
  for (const int arch : library().archs) {
    archs.push_back("sm_" + std::to_string(arch));
    // Architecture-specific variants exist from Hopper on.
    if (arch >= 90) archs.push_back("sm_" + std::to_string(arch) + "a");
  }
  return archs;
}

std::string cuda_include_dir() {
  std::vector<std::string> dirs;
  if (!env("CUDA_HOME").empty()) dirs.push_back(env("CUDA_HOME") + "/include");
  if (!env("CUDA_PATH").empty()) dirs.push_back(env("CUDA_PATH") + "/include");
  for (const std::string& dir : build_time_dirs(kBuildIncludeDirs)) dirs.push_back(dir);
  dirs.emplace_back("/usr/local/cuda/include");
  for (const std::string& dir : dirs)
    if (is_file(dir + "/cuda_runtime.h")) return dir;
  return "";
}

Output compile(const std::string& source, const std::string& name, const std::string& arch,
               const std::vector<std::string>& extra_options) {
  const Library& lib = require_library();
  const Target target = parse_target(lib, arch);
  const std::string program_name = name.empty() ? "kernel.cu" : name;

  std::vector<std::string> options = {"--gpu-architecture=" + arch, "-std=c++17",
                                      "-default-device"};
  if (const std::string include = cuda_include_dir(); !include.empty()) {
    options.push_back("--include-path=" + include);
    // CUDA 13 moved cuda/std, CUB and Thrust under include/cccl.
    if (is_dir(include + "/cccl")) options.push_back("--include-path=" + include + "/cccl");
  }
  options.insert(options.end(), extra_options.begin(), extra_options.end());
  std::vector<const char*> option_ptrs;
  for (const std::string& o : options) option_ptrs.push_back(o.c_str());

  const auto start = std::chrono::steady_clock::now();
  Program program{lib.api};
  nvrtcResult r = lib.api.CreateProgram(&program.handle, source.c_str(), program_name.c_str(), 0,
                                        nullptr, nullptr);
  if (r != NVRTC_SUCCESS)
    throw CompileError(
        "NVRTC could not create a program for \"" + program_name + "\": " + result_text(lib, r), "",
        source);
  const nvrtcResult compiled =
      lib.api.CompileProgram(program.handle, int(option_ptrs.size()), option_ptrs.data());

  std::string log;
  size_t log_bytes = 0;
  if (lib.api.GetProgramLogSize(program.handle, &log_bytes) == NVRTC_SUCCESS && log_bytes > 1) {
    log.resize(log_bytes);
    if (lib.api.GetProgramLog(program.handle, log.data()) != NVRTC_SUCCESS) log.clear();
    while (!log.empty() &&
           (log.back() == '\0' || std::isspace(static_cast<unsigned char>(log.back()))))
      log.pop_back();
  }

  if (compiled == NVRTC_ERROR_INVALID_OPTION) {
    std::string all;
    for (const std::string& o : options) all += " " + o;
    throw InvalidArgument("NVRTC rejected the options for \"" + program_name + "\":" + all + "\n" +
                          log);
  }
  if (compiled == NVRTC_ERROR_BUILTIN_OPERATION_FAILURE)
    throw NotAvailable("NVRTC in " + lib.path +
                       " could not load its builtins library "
                       "(libnvrtc-builtins.so, which must sit beside it): " +
                       log);
  if (compiled == NVRTC_ERROR_COMPILATION)
    throw CompileError(describe_errors(program_name, arch, log, source), log, source);
  if (compiled != NVRTC_SUCCESS)
    throw CompileError("NVRTC failed on \"" + program_name + "\" for " + arch + ": " +
                           result_text(lib, compiled) + (log.empty() ? "" : "\n" + log),
                       log, source);

  Output out;
  out.is_cubin = target.is_cubin;
  // PTX keeps its terminating NUL: cuModuleLoadData needs it.
  out.image = fetch_image(lib, program.handle, target.is_cubin, program_name);
  out.log = std::move(log);
  out.compile_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return out;
}

namespace {

// The integer just before `unit` in `line` ("432 bytes spill stores" -> 432), or -1.
int number_before(const std::string& line, const std::string& unit) {
  const size_t at = line.find(unit);
  if (at == std::string::npos) return -1;
  size_t end = at;
  while (end > 0 && line[end - 1] == ' ') --end;
  size_t begin = end;
  while (begin > 0 && std::isdigit(static_cast<unsigned char>(line[begin - 1]))) --begin;
  if (begin == end || end - begin > 9) return -1;
  return std::stoi(line.substr(begin, end - begin));
}

}  // namespace

PtxasUsage ptxas_usage(const std::string& log) {
  PtxasUsage u;
  for (const std::string& line : split_lines(log)) {
    if (line.rfind("ptxas", 0) != 0) continue;
    if (line.find("Used ") != std::string::npos && line.find(" registers") != std::string::npos) {
      u.registers = number_before(line, " registers");
    } else if (line.find("spill stores") != std::string::npos) {
      u.spill_store_bytes = number_before(line, " bytes spill stores");
      u.spill_load_bytes = number_before(line, " bytes spill loads");
      u.stack_frame_bytes = number_before(line, " bytes stack frame");
    } else if (line.find("Performance") != std::string::npos || line.find("serialized") != std::string::npos) {
      const size_t colon = line.find(": ");
      u.advisories.push_back(colon == std::string::npos ? line : line.substr(colon + 2));
    }
  }
  return u;
}

}  // namespace kerf::nvrtc
