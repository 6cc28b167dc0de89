// Bundles: writing, mapping and looking up (format in bundle.h).
#include "kerf/cache/bundle.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "cache/byte_io.h"
#include "kerf/cache/disk_cache.h"
#include "kerf/cache/key.h"
#include "kerf/cache/log.h"
#include "kerf/error.h"

namespace kerf::cache {
namespace {

using namespace detail;

constexpr char kMagic[8] = {'K', 'E', 'R', 'F', 'B', 'N', 'D', 'L'};
constexpr size_t kHeader = 64;

std::pair<uint64_t, uint64_t> words(const ir::Hash128& h) {
  return {h.hi, h.lo};
}

}  // namespace

// Bundles up to this size are read into memory when mounted: a file rewritten in place
// later (cp over it) then cannot cut the bytes a lookup reads short, which in a mapping
// raises SIGBUS. Larger ones are mapped (and must be replaced by rename).
constexpr size_t kReadWhole = size_t(256) << 20;

// The file's bytes for the bundle's lifetime: read into `owned`, or mapped read-only.
struct Bundle::Mapping {
  const char* data = nullptr;
  size_t size = 0;
  std::vector<char> owned;
  ~Mapping() {
    if (data && size && owned.empty()) ::munmap(const_cast<char*>(data), size);
  }
};

Bundle::Bundle(const std::string& path) : path_(path), map_(std::make_unique<Mapping>()) {
  const auto bad = [&](const std::string& why) {
    return CacheError("cannot mount kernel bundle " + path + ": " + why);
  };
  // O_NONBLOCK: a FIFO must not block the open (it is then refused as not a regular file).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw bad(std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw bad("not a regular file");
  }
  if (size_t(st.st_size) < kHeader) {
    ::close(fd);
    throw bad("too short to be a bundle (" + std::to_string(st.st_size) + " bytes)");
  }
  if (size_t(st.st_size) <= kReadWhole) {
    std::vector<char>& bytes = map_->owned;
    bytes.resize(size_t(st.st_size));
    size_t got = 0;
    while (got < bytes.size()) {
      const ssize_t n = ::pread(fd, bytes.data() + got, bytes.size() - got, off_t(got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += size_t(n);
    }
    ::close(fd);
    if (got != bytes.size()) throw bad("the file shrank while it was read");
    map_->data = bytes.data();
    map_->size = bytes.size();
  } else {
    void* p = ::mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);  // the mapping keeps the file
    if (p == MAP_FAILED) throw bad(std::string("mmap: ") + std::strerror(errno));
    map_->data = static_cast<const char*>(p);
    map_->size = size_t(st.st_size);
  }

  const char* d = map_->data;
  if (std::memcmp(d, kMagic, 8) != 0) throw bad("not a kerf bundle (no magic)");
  ByteReader h(d + 8, kHeader - 8);
  const uint32_t version = h.get<uint32_t>();
  if (version != kBundleFormatVersion)
    throw bad("bundle format version " + std::to_string(version) + ", this kerf reads " +
              std::to_string(kBundleFormatVersion));
  h.get<uint32_t>();
  const uint64_t index_at = h.get<uint64_t>();
  const uint64_t index_size = h.get<uint64_t>();
  const ir::Hash128 index_sum = h.hash();
  const ir::Hash128 header_sum = h.hash();
  if (ir::hash_bytes(d, 48) != header_sum) throw bad("header checksum mismatch");
  if (index_at < kHeader || index_at > map_->size || index_size > map_->size - index_at)
    throw bad("the manifest lies outside the file (truncated?)");
  if (ir::hash_bytes(d + index_at, index_size) != index_sum)
    throw bad("manifest checksum mismatch");

  ByteReader r(d + index_at, index_size);
  props_ = r.props();
  const uint32_t n = r.get<uint32_t>();
  for (uint32_t i = 0; i < n && r.ok(); ++i) {
    Record rec;
    rec.id = r.hash();
    rec.family = r.hash();
    rec.offset = r.get<uint64_t>();
    rec.bytes = r.get<uint64_t>();
    rec.kind = EntryKind(r.get<uint8_t>());
    rec.props = r.props();
    if (r.ok() &&
        (rec.offset < kHeader || rec.offset > index_at || rec.bytes > index_at - rec.offset))
      throw bad("record " + std::to_string(i) + " lies outside the entry area");
    records_.push_back(std::move(rec));
  }
  if (!r.ok()) throw bad("malformed manifest");
  // Entries are keyed by the kerf version that made them: another version's never match.
  if (const auto v = props_.find("kerf_version"); v != props_.end() && v->second != kerf_version())
    log::once(log::Level::warn, "bundle-version:" + path,
              "kernel bundle " + path + " was packed by kerf " + v->second + ", this is kerf " + kerf_version() +
                  ": none of its entries can be used; pack it again with this kerf");
  for (size_t i = 0; i < records_.size(); ++i) by_family_.emplace(words(records_[i].family), i);
}

Bundle::~Bundle() = default;

DecodedEntry Bundle::decode(const Record& r) const {
  return decode_entry(map_->data + r.offset, r.bytes);
}

std::vector<char> Bundle::image(const Record& r) const {
  return std::vector<char>(map_->data + r.offset, map_->data + r.offset + r.bytes);
}

std::optional<Entry> Bundle::find(const CacheKey& key, bool any_compiler) const {
  auto [lo, hi] = by_family_.equal_range(words(key.family));
  // The exact key first, then (without a compiler) any build of the same family.
  for (int pass = 0; pass < (any_compiler ? 2 : 1); ++pass) {
    for (auto it = lo; it != hi; ++it) {
      const Record& rec = records_[it->second];
      if (pass == 0 && rec.id != key.id) continue;
      DecodedEntry d = decode_entry_for(map_->data + rec.offset, rec.bytes, key, pass == 1);
      if (d.ok()) return std::move(d.entry);
      log::once(log::Level::warn, "bundle-entry:" + path_ + ":" + std::to_string(rec.offset),
                "ignoring an entry of bundle " + path_ + " at offset " +
                    std::to_string(rec.offset) + ": " + entry_problem_name(d.problem) +
                    (d.detail.empty() ? "" : " (" + d.detail + ")"));
    }
  }
  return std::nullopt;
}

void BundleWriter::add(const std::vector<char>& image) {
  DecodedEntry d = decode_entry(image.data(), image.size(), true);
  if (!d.ok())
    throw CacheError(std::string("cannot add an entry to a bundle: ") +
                     entry_problem_name(d.problem) +
                     (d.detail.empty() ? "" : " (" + d.detail + ")"));
  images_[words(d.key.id)] = image;
}

void BundleWriter::write(const std::string& path,
                         const std::map<std::string, std::string>& props) const {
  std::vector<char> out(kHeader, 0);
  std::vector<char> index;
  put_props(index, props);
  put_u32(index, uint32_t(images_.size()));
  for (const auto& [id, image] : images_) {
    while (out.size() % 16) out.push_back(0);  // keeps cubins aligned in the mapping
    const DecodedEntry d = decode_entry(image.data(), image.size());
    put_hash(index, d.key.id);
    put_hash(index, d.key.family);
    put_u64(index, out.size());
    put_u64(index, image.size());
    put_u8(index, uint8_t(d.entry.kind));
    put_props(index, d.entry.props);
    put_bytes(out, image.data(), image.size());
  }
  while (out.size() % 16) out.push_back(0);
  const uint64_t index_at = out.size();
  put_bytes(out, index.data(), index.size());

  std::vector<char> header;
  put_bytes(header, kMagic, 8);
  put_u32(header, kBundleFormatVersion);
  put_u32(header, 0);
  put_u64(header, index_at);
  put_u64(header, index.size());
  put_hash(header, ir::hash_bytes(index.data(), index.size()));
  put_hash(header, ir::hash_bytes(header.data(), header.size()));
  std::memcpy(out.data(), header.data(), header.size());
  write_file_atomically(path, out);
}

}  // namespace kerf::cache
