// Helpers for tests that read generated source.
#pragma once

#include <cstddef>
#include <string>

namespace kerf::test {

// How many times `what` occurs in `src` from offset `from` on.
inline size_t occurrences(const std::string& src, const std::string& what, size_t from = 0) {
  size_t n = 0;
  for (size_t at = src.find(what, from); at != std::string::npos; at = src.find(what, at + 1)) ++n;
  return n;
}

}  // namespace kerf::test
