// Private state of a Builder while a kernel body is traced.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>
#include <cctype>

#include "kerf/dsl/dsl.h"
#include "kerf/error.h"

namespace kerf::dsl {

struct Builder::Impl {
  Builder* self = nullptr;
  ir::Function fn;
  std::vector<ArgSpec> args;     // what the call passes, in declaration order
  const MetaMap* meta = nullptr;  // what the call sets
  std::map<std::string, int64_t> meta_used;
  std::vector<ir::Block*> blocks;  // innermost last
  std::map<std::pair<int, int>, ir::ValueId> dims, strides;  // (param, dim) -> value
  std::vector<const ir::Block*> defined_in;  // ValueId -> block that defines it

  // Throws when `v` belongs to another trace or to a loop body that has ended.
  void check_usable(const Value& v, const char* op) const;

  // Appends an op to the innermost block and returns its single result (or -1).
  ir::ValueId emit(ir::Operation op, const ir::Type* result_type);

  [[noreturn]] void fail(const std::string& op, const std::string& msg) const {
    throw DefinitionError("kernel '" + fn.name + "', op '" + op + "': " + msg);
  }
  const ir::Type& type(ir::ValueId v) const { return fn.type(v); }
};

// The builder tracing on this thread; throws when none is.
Builder& current_builder(const char* op);
// The builder tracing on this thread, or null.
Builder* tracing_builder();

}  // namespace kerf::dsl
