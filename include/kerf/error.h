// kerf's one exception hierarchy. Every failure a user can cause or observe is a
// kerf::Error; its kind says which Python exception it maps to.
#pragma once

#include <stdexcept>
#include <string>

namespace kerf {

enum class ErrorKind {
  InvalidArgument,  // bad shape, value, stride, layout ... (Python: ValueError)
  Type,             // wrong dtype (Python: TypeError)
  Definition,       // a mistake in a DSL kernel definition (Python: ValueError)
  Compile,          // NVRTC or LLVM rejected generated code (Python: RuntimeError)
  Cuda,             // the CUDA driver reported an error (Python: RuntimeError)
  NotAvailable,     // no driver, no device, backend not built (Python: RuntimeError)
  Cache,            // a cache or bundle could not be used (Python: RuntimeError)
  Internal,         // a bug in kerf itself (Python: RuntimeError)
  Interrupted,      // stopped on request, e.g. an autotuning pass and Ctrl-C (Python: the
                    // signal handler's exception, KeyboardInterrupt by default)
};

const char* error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& m) : Error(ErrorKind::InvalidArgument, m) {}
};

class TypeError : public Error {
 public:
  explicit TypeError(const std::string& m) : Error(ErrorKind::Type, m) {}
};

class DefinitionError : public Error {
 public:
  explicit DefinitionError(const std::string& m) : Error(ErrorKind::Definition, m) {}
};

// Carries the compiler's log and the generated source, so a user can see both.
class CompileError : public Error {
 public:
  CompileError(const std::string& m, std::string log, std::string source)
      : Error(ErrorKind::Compile, m), log_(std::move(log)), source_(std::move(source)) {}
  const std::string& log() const { return log_; }
  const std::string& source() const { return source_; }

 private:
  std::string log_;
  std::string source_;
};

class CudaError : public Error {
 public:
  CudaError(const std::string& m, int code) : Error(ErrorKind::Cuda, m), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

class NotAvailable : public Error {
 public:
  explicit NotAvailable(const std::string& m) : Error(ErrorKind::NotAvailable, m) {}
};

class CacheError : public Error {
 public:
  explicit CacheError(const std::string& m) : Error(ErrorKind::Cache, m) {}
};

class InternalError : public Error {
 public:
  explicit InternalError(const std::string& m) : Error(ErrorKind::Internal, m) {}
};

class Interrupted : public Error {
 public:
  explicit Interrupted(const std::string& m) : Error(ErrorKind::Interrupted, m) {}
};

}  // namespace kerf
