// Encoding and checking cache entries (format in entry.h).
#include "kerf/cache/entry.h"

#include <cstring>

#include "cache/byte_io.h"

namespace kerf::cache {
namespace {

using namespace detail;

constexpr char kMagic[8] = {'K', 'E', 'R', 'F', 'E', 'N', 'T', '\x1a'};
constexpr size_t kFixedHeader = 76;  // up to the key encoding
constexpr size_t kMaxEncoding = 1 << 20;

DecodedEntry fail(EntryProblem p, std::string detail) {
  DecodedEntry d;
  d.problem = p;
  d.detail = std::move(detail);
  return d;
}

}  // namespace

const char* entry_kind_name(EntryKind k) {
  switch (k) {
    case EntryKind::cuda_kernel:
      return "cuda-kernel";
    case EntryKind::cpu_kernel:
      return "cpu-kernel";
    case EntryKind::tune_choice:
      return "tune-choice";
  }
  return "unknown";
}

const char* entry_problem_name(EntryProblem p) {
  switch (p) {
    case EntryProblem::none:
      return "valid";
    case EntryProblem::empty:
      return "empty";
    case EntryProblem::truncated:
      return "truncated";
    case EntryProblem::bad_magic:
      return "not a kerf cache entry";
    case EntryProblem::wrong_version:
      return "another format version";
    case EntryProblem::corrupt_header:
      return "corrupt header";
    case EntryProblem::corrupt_payload:
      return "corrupt payload";
    case EntryProblem::wrong_key:
      return "entry for another key";
    case EntryProblem::too_large:
      return "larger than any entry";
    case EntryProblem::unreadable:
      return "unreadable";
  }
  return "?";
}

const std::string& Entry::prop(const std::string& name) const {
  static const std::string none;
  auto it = props.find(name);
  return it == props.end() ? none : it->second;
}

std::vector<char> encode_entry(const CacheKey& key, const Entry& entry) {
  std::vector<char> payload;
  payload.reserve(entry.blob.size() + 256);
  put_u8(payload, uint8_t(entry.kind));
  put_props(payload, entry.props);
  put_u64(payload, entry.blob.size());
  put_bytes(payload, entry.blob.data(), entry.blob.size());

  std::vector<char> out;
  const size_t header = kFixedHeader + key.encoding.size() + 16;
  out.reserve(header + payload.size());
  put_bytes(out, kMagic, 8);
  put_u32(out, kEntryFormatVersion);
  put_u32(out, uint32_t(header));
  put_hash(out, key.id);
  put_hash(out, key.family);
  put_u64(out, payload.size());
  put_hash(out, ir::hash_bytes(payload.data(), payload.size()));
  put_str(out, key.encoding);
  put_hash(out, ir::hash_bytes(out.data(), out.size()));
  put_bytes(out, payload.data(), payload.size());
  return out;
}

DecodedEntry decode_entry(const void* data, size_t size, bool header_only) {
  if (size == 0) return fail(EntryProblem::empty, "the file is empty");
  const char* p = static_cast<const char*>(data);
  if (size < 12)
    return fail(EntryProblem::truncated, std::to_string(size) + " bytes, shorter than any header");
  if (std::memcmp(p, kMagic, 8) != 0) return fail(EntryProblem::bad_magic, "no kerf entry magic");
  ByteReader r(p, size);
  char magic[8];
  r.bytes(magic, 8);
  const uint32_t version = r.get<uint32_t>();
  if (version != kEntryFormatVersion) {
    DecodedEntry d = fail(EntryProblem::wrong_version, "format version " + std::to_string(version) +
                                                           ", this kerf reads " +
                                                           std::to_string(kEntryFormatVersion));
    d.format_version = version;
    return d;
  }
  if (size < kFixedHeader) return fail(EntryProblem::truncated, "the header is cut short");
  const uint32_t header = r.get<uint32_t>();
  DecodedEntry d;
  d.format_version = version;
  d.key.id = r.hash();
  d.key.family = r.hash();
  const uint64_t payload_size = r.get<uint64_t>();
  const ir::Hash128 payload_sum = r.hash();
  const uint32_t enc_size = r.get<uint32_t>();
  if (enc_size > kMaxEncoding || header != kFixedHeader + uint64_t(enc_size) + 16)
    return fail(EntryProblem::corrupt_header, "inconsistent header sizes");
  if (size < header) return fail(EntryProblem::truncated, "the header is cut short");
  d.key.encoding.assign(r.here(), enc_size);
  const ir::Hash128 header_sum = ir::hash_bytes(p, header - 16);
  ByteReader tail(p + header - 16, 16);
  if (tail.hash() != header_sum)
    return fail(EntryProblem::corrupt_header, "header checksum mismatch");
  if (ir::hash_bytes(d.key.encoding.data(), d.key.encoding.size()) != d.key.id)
    return fail(EntryProblem::corrupt_header, "the key does not hash to its id");
  if (size - header < payload_size)
    return fail(EntryProblem::truncated, std::to_string(size - header) + " of " +
                                             std::to_string(payload_size) + " payload bytes");
  if (size - header > payload_size)
    return fail(EntryProblem::corrupt_payload, "trailing bytes after the payload");
  const char* payload = p + header;
  if (ir::hash_bytes(payload, payload_size) != payload_sum)
    return fail(EntryProblem::corrupt_payload, "payload checksum mismatch");
  if (header_only) return d;

  ByteReader pr(payload, payload_size);
  const uint8_t kind = pr.get<uint8_t>();
  if (kind < 1 || kind > 3) return fail(EntryProblem::corrupt_payload, "unknown entry kind");
  d.entry.kind = EntryKind(kind);
  d.entry.props = pr.props();
  const uint64_t blob = pr.get<uint64_t>();
  if (!pr.ok() || blob != pr.left())
    return fail(EntryProblem::corrupt_payload, "malformed payload");
  d.entry.blob.assign(pr.here(), pr.here() + blob);
  return d;
}

DecodedEntry decode_entry_for(const void* data, size_t size, const CacheKey& want,
                              bool any_compiler) {
  DecodedEntry d = decode_entry(data, size);
  if (!d.ok()) return d;
  const bool match = any_compiler ? d.key.family == want.family : d.key == want;
  if (!match) {
    d.problem = EntryProblem::wrong_key;
    d.detail = "it holds " + std::string(entry_kind_name(d.entry.kind)) + " '" +
               d.entry.prop("kernel") + d.entry.prop("op") + "' for " + d.entry.prop("arch");
  }
  return d;
}

}  // namespace kerf::cache
