// Little-endian byte writing and bounds-checked reading, for the entry and
// bundle formats. The reader never trusts a size it reads: any overrun marks
// it bad and yields zeros.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "kerf/jit/ir.h"

namespace kerf::cache::detail {

// resize + memcpy rather than vector::insert: GCC 12 warns falsely about the latter.
inline void put_bytes(std::vector<char>& out, const void* p, size_t n) {
  const size_t at = out.size();
  out.resize(at + n);
  if (n) std::memcpy(out.data() + at, p, n);
}
inline void put_u8(std::vector<char>& out, uint8_t v) {
  out.push_back(char(v));
}
inline void put_u32(std::vector<char>& out, uint32_t v) {
  put_bytes(out, &v, 4);
}
inline void put_u64(std::vector<char>& out, uint64_t v) {
  put_bytes(out, &v, 8);
}
inline void put_hash(std::vector<char>& out, const ir::Hash128& h) {
  put_u64(out, h.hi);
  put_u64(out, h.lo);
}
inline void put_str(std::vector<char>& out, const std::string& s) {
  put_u32(out, uint32_t(s.size()));
  put_bytes(out, s.data(), s.size());
}
inline void put_props(std::vector<char>& out, const std::map<std::string, std::string>& props) {
  put_u32(out, uint32_t(props.size()));
  for (const auto& [k, v] : props) {
    put_str(out, k);
    put_str(out, v);
  }
}

class ByteReader {
 public:
  ByteReader(const char* p, size_t n) : p_(p), n_(n) {}
  bool ok() const { return ok_; }
  size_t left() const { return n_ - at_; }
  const char* here() const { return p_ + at_; }

  bool bytes(void* dst, size_t n) {
    if (!ok_ || n > left()) return ok_ = false;
    std::memcpy(dst, p_ + at_, n);
    at_ += n;
    return true;
  }
  template <class T>
  T get() {
    T v{};
    bytes(&v, sizeof(T));
    return v;
  }
  ir::Hash128 hash() {
    ir::Hash128 h;
    h.hi = get<uint64_t>();
    h.lo = get<uint64_t>();
    return h;
  }
  std::string str() {
    const uint32_t n = get<uint32_t>();
    if (!ok_ || n > left()) {
      ok_ = false;
      return "";
    }
    std::string s(p_ + at_, n);
    at_ += n;
    return s;
  }
  std::map<std::string, std::string> props() {
    std::map<std::string, std::string> m;
    const uint32_t n = get<uint32_t>();
    for (uint32_t i = 0; i < n && ok_; ++i) {
      std::string k = str();
      std::string v = str();
      m.emplace(std::move(k), std::move(v));
    }
    return m;
  }

 private:
  const char* p_;
  size_t n_;
  size_t at_ = 0;
  bool ok_ = true;
};

}  // namespace kerf::cache::detail
