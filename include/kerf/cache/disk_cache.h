// The on-disk tier: one file per entry under <dir>/v<format>/<2 hex>/<stem>.kerf
// (stem = "<family>-<id>", see CacheKey).
//
// Writes go to a private temporary file that is renamed over the entry, so a
// reader sees either no entry or a whole one, whatever crashes or races. A bad
// file (empty, truncated, corrupt, another version, another key) is reported
// once, ignored and overwritten by the next store. When the directory cannot
// be written (read-only, full, missing permissions), the cache says so once and
// the process keeps its kernels in memory.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "kerf/cache/entry.h"
#include "kerf/cache/settings.h"

namespace kerf::cache {

class DiskCache {
 public:
  DiskCache(std::string dir, DiskMode mode);

  const std::string& dir() const { return dir_; }    // <root>/v<format>
  const std::string& root() const { return root_; }  // the directory it was given
  DiskMode mode() const { return mode_; }
  bool writable() const;                                        // on, and no write has failed yet
  uint64_t bad_entries() const { return bad_entries_.load(); }  // damaged files seen so far
  std::string path_for(const CacheKey& key) const;

  // The entry for `key`, or nothing. With `any_compiler`, an entry of the key's
  // family (the same kernel built by another compiler version) also answers.
  std::optional<Entry> find(const CacheKey& key, bool any_compiler = false);
  // Stores `entry` (atomically). False when it was not written (mode, or an error
  // the cache has reported).
  bool store(const CacheKey& key, const Entry& entry);

  struct Listed {
    std::string path;
    uint64_t bytes = 0;
    int64_t mtime_s = 0;   // last use (a hit touches the file)
    DecodedEntry decoded;  // header and properties; the blob is dropped
  };
  // Every *.kerf file under the directory, valid or not (a file over
  // kMaxEntryBytes is listed as damaged without being read). Directories that
  // cannot be read are skipped and named in *unreadable (when given) with the
  // reason, so that a caller can say its answer is incomplete.
  std::vector<Listed> list(std::vector<std::string>* unreadable = nullptr) const;

  struct PruneResult {
    int removed = 0;
    uint64_t bytes_removed = 0;
    uint64_t bytes_left = 0;  // what stays, files that could not be removed included
    int failed = 0;           // files that were to go but could not be removed
    std::string first_failure;            // the first such file and why
    std::vector<std::string> unreadable;  // directories skipped, with the reason
  };
  // Removes entries unused for longer than `max_age_s` (if >= 0), then the least
  // recently used ones until the total is at most `max_bytes` (if >= 0), and any
  // temporary file a killed writer left (older than an hour).
  PruneResult prune(int64_t max_age_s, int64_t max_bytes);

  // Tests: called after each chunk of an entry is written to its temporary file.
  using WriteHook = void (*)(const std::string& temp_path, size_t bytes_written);
  static void set_write_hook(WriteHook hook);

 private:
  void report_bad(const std::string& path, const DecodedEntry& d);
  void report_unwritable(const std::string& why);
  void report_entry_unwritable(const std::string& path, const std::string& why);
  std::optional<Entry> read(const std::string& path, const CacheKey& key, bool any_compiler);

  std::string dir_;  // <root>/v<format>
  std::string root_;
  DiskMode mode_;
  mutable std::mutex mu_;
  bool write_failed_ = false;
  std::atomic<uint64_t> bad_entries_{0};
};

// Reads a whole file; nothing when it cannot be opened or is not a regular file.
// A file larger than `max_bytes` is not read: nothing, and *too_large (when
// given) is set. Shared with bundles and tools.
std::optional<std::vector<char>> read_file(const std::string& path, uint64_t max_bytes = UINT64_MAX,
                                           bool* too_large = nullptr);
// Up to the first `n` bytes of a file (a magic number); nothing when it cannot be read.
std::optional<std::vector<char>> read_file_head(const std::string& path, size_t n);
// Writes `bytes` to `path` through a temporary file in the same directory and a
// rename. Throws CacheError with errno's text on failure (no temporary is left);
// *error_number (when given) is then that errno.
void write_file_atomically(const std::string& path, const std::vector<char>& bytes,
                           int* error_number = nullptr);

}  // namespace kerf::cache
