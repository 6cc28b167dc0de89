// The kernel library as a list: each kernel with an example specialization
// (argument kinds, dtypes and facts for a given element type, and meta-
// parameters), for tools that inspect, compile or warm kernels by name.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kerf/dsl/dsl.h"

namespace kerf::kernels {

struct LibraryEntry {
  std::string name;
  std::function<const dsl::Kernel&()> kernel;
  // Argument specs for element type `t` (contiguous, 16-byte aligned tensors).
  std::function<std::vector<dsl::ArgSpec>(DType t)> example_args;
  std::function<dsl::MetaMap(DType t)> example_meta;
};

const std::vector<LibraryEntry>& library();
const LibraryEntry* find_in_library(const std::string& name);

}  // namespace kerf::kernels
