// Bundles: one read-only file holding many cache entries and a manifest, to
// ship with an application so that its kernels load without NVRTC.
//
//   offset  size  field
//        0     8  magic "KERFBNDL"
//        8     4  format version (kBundleFormatVersion)
//       12     4  0
//       16     8  manifest offset
//       24     8  manifest size
//       32    16  manifest checksum (XXH3-128)
//       48    16  header checksum (XXH3-128 of bytes [0, 48))
//       64     .  entries: each the same bytes as a disk-tier file (entry.h)
//   manifest   .  u32 property count, (str, str)...   bundle facts (kerf version, created)
//                 u32 record count, per record: id (16), family (16), u64 offset,
//                 u64 size, u8 kind, u32 property count, (str, str)...
//                 (str = u32 size + bytes; the properties are each entry's own:
//                 kernel, meta, args, layout, arch, compiler / op, shape, config)
//
// Mounting checks the header and the manifest; each entry is checked again (its
// own checksums and key) when it is used.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kerf/cache/entry.h"

namespace kerf::cache {

inline constexpr uint32_t kBundleFormatVersion = 1;

class Bundle {
 public:
  struct Record {
    ir::Hash128 id, family;
    uint64_t offset = 0, bytes = 0;
    EntryKind kind = EntryKind::cuda_kernel;
    std::map<std::string, std::string> props;
  };

  // Opens and maps `path`; throws CacheError naming the problem when it is not a bundle.
  explicit Bundle(const std::string& path);
  ~Bundle();
  Bundle(const Bundle&) = delete;
  Bundle& operator=(const Bundle&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& props() const { return props_; }
  const std::vector<Record>& records() const { return records_; }

  // The entry for `key` (or, with `any_compiler`, for its family); damaged records
  // are reported once and skipped.
  std::optional<Entry> find(const CacheKey& key, bool any_compiler) const;
  // A record's bytes checked in full (kerf-cache verify).
  DecodedEntry decode(const Record& r) const;
  // A record's raw entry image (kerf-cache pack copies bundles into bundles).
  std::vector<char> image(const Record& r) const;

 private:
  std::string path_;
  struct Mapping;
  std::unique_ptr<Mapping> map_;
  std::map<std::string, std::string> props_;
  std::vector<Record> records_;
  std::multimap<std::pair<uint64_t, uint64_t>, size_t> by_family_;
};

// Collects entry images and writes them as one bundle (atomically).
class BundleWriter {
 public:
  // Adds an entry image; throws CacheError unless it decodes as valid. A second
  // entry with the same id replaces the first.
  void add(const std::vector<char>& image);
  size_t size() const { return images_.size(); }
  void write(const std::string& path, const std::map<std::string, std::string>& props) const;

 private:
  std::map<std::pair<uint64_t, uint64_t>, std::vector<char>> images_;
};

}  // namespace kerf::cache
