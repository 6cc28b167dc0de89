// One cache entry as bytes: the same image is a file of the disk tier and a
// record inside a bundle.
//
//   offset  size  field
//        0     8  magic "KERFENT\x1a"
//        8     4  format version (kEntryFormatVersion)
//       12     4  header size in bytes (from offset 0 to the payload)
//       16    16  key id (XXH3-128 of the key encoding)
//       32    16  key family
//       48     8  payload size in bytes
//       56    16  payload checksum (XXH3-128)
//       72     4  key encoding size E
//       76     E  key encoding
//     76+E    16  header checksum (XXH3-128 of bytes [0, 76+E))
//   header     .  payload: u8 kind, u32 property count, (str key, str value)...,
//                 u64 blob size, blob        (str = u32 size + bytes; little endian)
//
// A reader trusts nothing it has not checked: sizes against the file, both
// checksums, the id against the encoding, and (the caller) the encoding
// against the key it wants.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kerf/cache/key.h"

namespace kerf::cache {

inline constexpr uint32_t kEntryFormatVersion = 1;
// No entry is larger (a kernel's machine code is kilobytes to a few megabytes): a
// file over it at an entry's path is damaged, and is not read into memory.
inline constexpr uint64_t kMaxEntryBytes = uint64_t(1) << 30;

enum class EntryKind : uint8_t { cuda_kernel = 1, cpu_kernel = 2, tune_choice = 3 };
const char* entry_kind_name(EntryKind k);

struct Entry {
  EntryKind kind = EntryKind::cuda_kernel;
  // Facts for loading and for people: "kernel", "arch", "entry", "threads", "smem_bytes",
  // "meta", "args", "layout", "config", ... (kerf-cache inspect prints them).
  std::map<std::string, std::string> props;
  std::vector<char> blob;  // cubin / PTX / object code; empty for tune choices

  const std::string& prop(const std::string& name) const;  // "" when absent
};

// Why an image was not accepted.
enum class EntryProblem {
  none,
  empty,            // zero bytes
  truncated,        // shorter than its header says
  bad_magic,        // not a kerf cache entry
  wrong_version,    // another format version
  corrupt_header,   // header checksum or sizes do not hold
  corrupt_payload,  // payload checksum does not hold, or it does not parse
  wrong_key,        // a valid entry, for another key (another arch, kernel, compiler ...)
  too_large,        // a file over kMaxEntryBytes (not read)
  unreadable,       // the file could not be read (permissions, I/O error)
};
const char* entry_problem_name(EntryProblem p);

struct DecodedEntry {
  EntryProblem problem = EntryProblem::none;
  std::string detail;  // what exactly, for the warning
  CacheKey key;
  Entry entry;
  uint32_t format_version = 0;
  bool ok() const { return problem == EntryProblem::none; }
};

std::vector<char> encode_entry(const CacheKey& key, const Entry& entry);

// Never throws; `header_only` skips parsing the payload (not its checksum).
DecodedEntry decode_entry(const void* data, size_t size, bool header_only = false);

// decode_entry, then the key check: wrong_key unless the entry is for `want`
// (or, with `any_compiler`, for its family).
DecodedEntry decode_entry_for(const void* data, size_t size, const CacheKey& want,
                              bool any_compiler);

}  // namespace kerf::cache
