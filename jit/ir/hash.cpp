// A kernel's identity: XXH3-128 of its canonical text.
#include <xxhash.h>

#include <cstdio>

#include "kerf/jit/ir.h"

namespace kerf::ir {

std::string Hash128::hex() const {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return buf;
}

Hash128 hash_bytes(const void* data, size_t size) {
  const XXH128_hash_t h = XXH3_128bits(data, size);
  return Hash128{h.high64, h.low64};
}

Hash128 hash(const Function& f) {
  const std::string text = print(f);
  return hash_bytes(text.data(), text.size());
}

}  // namespace kerf::ir
