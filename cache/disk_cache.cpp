// The on-disk tier (see disk_cache.h).
#include "kerf/cache/disk_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <random>

#include "kerf/cache/log.h"
#include "kerf/error.h"

namespace kerf::cache {
namespace {

namespace fs = std::filesystem;

constexpr size_t kWriteChunk = size_t(1) << 20;
constexpr int64_t kStaleTempSeconds = 3600;
constexpr const char* kSuffix = ".kerf";

std::atomic<DiskCache::WriteHook> g_write_hook{nullptr};

// Closes a descriptor however the function leaves.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string errno_text(int e) {
  return std::strerror(e);
}

int64_t now_s() {
  return int64_t(std::time(nullptr));
}

}  // namespace

namespace {

// Reads up to `limit` bytes of the regular file at `path` (all of it when it is
// no larger than `max_bytes`; else nothing and *too_large).
std::optional<std::vector<char>> read_some(const std::string& path, uint64_t max_bytes, size_t limit,
                                           bool* too_large) {
  if (too_large) *too_large = false;
  Fd f;
  // O_NONBLOCK: a FIFO at an entry's path must not block the open (it is then refused as not regular).
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f.fd < 0) return std::nullopt;
  struct stat st {};
  if (::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  if (uint64_t(st.st_size) > max_bytes) {
    if (too_large) *too_large = true;
    return std::nullopt;
  }
  std::vector<char> bytes(std::min(size_t(st.st_size), limit));
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::read(f.fd, bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += size_t(n);
  }
  bytes.resize(got);  // a file cut short while we read: the checks catch it
  return bytes;
}

// Calls `visit` with each regular file under `root` (symbolic links to directories
// are not followed). A directory that cannot be read is skipped and named, with
// the reason, in *unreadable (when given); the walk goes on with the others.
void walk_files(const fs::path& root, const std::function<void(const fs::directory_entry&)>& visit,
                std::vector<std::string>* unreadable, int depth = 0) {
  const auto note = [&](const fs::path& dir, const std::error_code& ec) {
    if (unreadable) unreadable->push_back(dir.string() + ": " + ec.message());
  };
  std::error_code ec;
  fs::directory_iterator it(root, ec);
  if (ec) {
    note(root, ec);
    return;
  }
  for (const fs::directory_iterator end; it != end;) {
    const fs::directory_entry& e = *it;
    std::error_code type_ec;
    if (e.is_directory(type_ec) && !e.is_symlink(type_ec)) {
      if (depth < 8) walk_files(e.path(), visit, unreadable, depth + 1);
    } else if (e.is_regular_file(type_ec)) {
      visit(e);
    }
    it.increment(ec);
    if (ec) {
      note(root, ec);
      return;
    }
  }
}

}  // namespace

std::optional<std::vector<char>> read_file(const std::string& path, uint64_t max_bytes, bool* too_large) {
  return read_some(path, max_bytes, SIZE_MAX, too_large);
}

std::optional<std::vector<char>> read_file_head(const std::string& path, size_t n) {
  return read_some(path, UINT64_MAX, n, nullptr);
}

void write_file_atomically(const std::string& path, const std::vector<char>& bytes, int* error_number) {
  static std::atomic<uint64_t> counter{0};
  // The pid alone repeats across containers and hosts sharing a directory (pid 1 in
  // each): a random word per process, and a new name when one exists already (a
  // leftover of a writer that was killed).
  static const std::string word = [] {
    std::random_device rd;
    char text[17];
    std::snprintf(text, sizeof text, "%016llx",
                  static_cast<unsigned long long>((uint64_t(rd()) << 32) ^ uint64_t(rd())));
    return std::string(text);
  }();
  std::string temp;
  Fd f;
  for (int attempt = 0; attempt < 8 && f.fd < 0; ++attempt) {
    temp = path + ".tmp-" + std::to_string(::getpid()) + "-" + word + "-" + std::to_string(counter++);
    f.fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (f.fd < 0 && errno != EEXIST) break;
  }
  if (f.fd < 0) {
    if (error_number) *error_number = errno;
    throw CacheError("cannot create " + temp + ": " + errno_text(errno));
  }
  const auto failed = [&](const std::string& what, int e) {
    if (error_number) *error_number = e;
    ::unlink(temp.c_str());
    return CacheError("cannot " + what + " " + path + ": " + errno_text(e));
  };
  {
    size_t done = 0;
    while (done < bytes.size()) {
      const size_t n = std::min(kWriteChunk, bytes.size() - done);
      const ssize_t w = ::write(f.fd, bytes.data() + done, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw failed("write", w < 0 ? errno : ENOSPC);
      done += size_t(w);
      if (DiskCache::WriteHook hook = g_write_hook.load()) hook(temp, done);
    }
    if (::close(f.fd) != 0) {
      f.fd = -1;
      throw failed("write", errno);
    }
    f.fd = -1;
  }
  // rename() is atomic: readers see the old entry, or none, or the whole new one.
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    throw failed("rename into", e);
  }
}

DiskCache::DiskCache(std::string dir, DiskMode mode)
    : dir_(dir + "/v" + std::to_string(kEntryFormatVersion)), root_(std::move(dir)), mode_(mode) {}

void DiskCache::set_write_hook(WriteHook hook) {
  g_write_hook.store(hook);
}

bool DiskCache::writable() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mode_ == DiskMode::on && !write_failed_;
}

std::string DiskCache::path_for(const CacheKey& key) const {
  const std::string stem = key.stem();
  return dir_ + "/" + stem.substr(0, 2) + "/" + stem + kSuffix;
}

void DiskCache::report_bad(const std::string& path, const DecodedEntry& d) {
  ++bad_entries_;
  const bool rebuilds = writable();
  log::once(log::Level::warn, "cache-entry:" + path,
            "ignoring cache entry " + path + ": " + entry_problem_name(d.problem) +
                (d.detail.empty() ? "" : " (" + d.detail + ")") +
                (rebuilds ? "; it is rebuilt" : "; it is rebuilt in memory only"));
}

void DiskCache::report_unwritable(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    write_failed_ = true;
  }
  log::once(log::Level::warn, "cache-dir:" + root_,
            "the kernel cache directory " + root_ + " cannot be written (" + why +
                "); kerf keeps compiled kernels in memory for this process (set KERF_CACHE_DIR to "
                "a writable directory, or KERF_CACHE=readonly to silence this)");
}

std::optional<Entry> DiskCache::read(const std::string& path, const CacheKey& key,
                                     bool any_compiler) {
  bool too_large = false;
  std::optional<std::vector<char>> bytes = read_file(path, kMaxEntryBytes, &too_large);
  if (too_large) {
    DecodedEntry big;
    big.problem = EntryProblem::too_large;
    report_bad(path, big);
    return std::nullopt;
  }
  if (!bytes) return std::nullopt;
  DecodedEntry d = decode_entry_for(bytes->data(), bytes->size(), key, any_compiler);
  if (!d.ok()) {
    report_bad(path, d);
    return std::nullopt;
  }
  // Last use, for prune's LRU order; a read-only cache is not touched.
  if (mode_ == DiskMode::on) ::utimensat(AT_FDCWD, path.c_str(), nullptr, 0);
  return std::move(d.entry);
}

std::optional<Entry> DiskCache::find(const CacheKey& key, bool any_compiler) {
  if (mode_ == DiskMode::off) return std::nullopt;
  const std::string path = path_for(key);
  if (std::optional<Entry> e = read(path, key, false)) return e;
  if (!any_compiler) return std::nullopt;
  // Another compiler's build of the same kernel: "<family>-*.kerf" beside it.
  const std::string folder = path.substr(0, path.rfind('/'));
  const std::string prefix = key.family.hex() + "-";
  std::vector<std::string> candidates;
  if (DIR* d = ::opendir(folder.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.rfind(prefix, 0) == 0 && ends_with(name, kSuffix))
        candidates.push_back(folder + "/" + name);
    }
    ::closedir(d);
  }
  std::sort(candidates.begin(), candidates.end());
  for (const std::string& c : candidates)
    if (c != path)
      if (std::optional<Entry> e = read(c, key, true)) return e;
  return std::nullopt;
}

bool DiskCache::store(const CacheKey& key, const Entry& entry) {
  if (!writable()) return false;
  const std::string path = path_for(key);
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  // Something other than a directory where this entry's folder (in a cache directory
  // that is there) should be: that entry's problem, not the directory's.
  std::error_code dir_ec;
  if (ec && (ec == std::errc::file_exists || ec == std::errc::not_a_directory) && fs::is_directory(dir_, dir_ec)) {
    report_entry_unwritable(path, ec.message());
    return false;
  }
  if (ec) {
    // A symbolic link whose target is gone reads as "File exists" to create_directories.
    std::error_code link_ec;
    const bool dangling = fs::is_symlink(root_, link_ec) && !fs::exists(root_, link_ec);
    report_unwritable(dangling ? "it is a symbolic link to " + fs::read_symlink(root_, link_ec).string() +
                                     ", which does not exist"
                               : ec.message());
    return false;
  }
  int error_number = 0;
  try {
    write_file_atomically(path, encode_entry(key, entry), &error_number);
  } catch (const CacheError& e) {
    // A directory (or a non-empty one) at the entry's own path spoils that entry only;
    // no permission, a read-only or full file system, the whole directory.
    if (error_number == EISDIR || error_number == ENOTDIR || error_number == ENOTEMPTY ||
        error_number == EEXIST)
      report_entry_unwritable(path, e.what());
    else
      report_unwritable(e.what());
    return false;
  }
  return true;
}

void DiskCache::report_entry_unwritable(const std::string& path, const std::string& why) {
  log::once(log::Level::warn, "cache-entry-path:" + path,
            "cannot store a kernel at " + path + " (" + why +
                "); it is kept in memory for this process (remove what is at that path)");
}

std::vector<DiskCache::Listed> DiskCache::list(std::vector<std::string>* unreadable) const {
  std::vector<Listed> out;
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return out;
  walk_files(dir_, [&](const fs::directory_entry& e) {
    if (!ends_with(e.path().string(), kSuffix)) return;
    Listed l;
    l.path = e.path().string();
    struct stat st {};
    if (::stat(l.path.c_str(), &st) != 0) return;
    l.bytes = uint64_t(st.st_size);
    l.mtime_s = int64_t(st.st_mtime);
    bool too_large = false;
    if (std::optional<std::vector<char>> bytes = read_file(l.path, kMaxEntryBytes, &too_large)) {
      l.decoded = decode_entry(bytes->data(), bytes->size());
      l.decoded.entry.blob.clear();
      // The file's name is its key: an entry under another key's name is never found
      // under its own, and is as bad as a torn one (list, verify and pack agree on it).
      if (l.decoded.ok() && e.path().filename().string().find(l.decoded.key.stem()) == std::string::npos) {
        l.decoded.problem = EntryProblem::wrong_key;
        l.decoded.detail = "stored under another key's name";
      }
    } else if (too_large) {
      l.decoded.problem = EntryProblem::too_large;
    } else {
      l.decoded.problem = EntryProblem::unreadable;
      l.decoded.detail = "cannot be read: " + errno_text(errno);
    }
    out.push_back(std::move(l));
  }, unreadable);
  std::sort(out.begin(), out.end(),
            [](const Listed& a, const Listed& b) { return a.path < b.path; });
  return out;
}

DiskCache::PruneResult DiskCache::prune(int64_t max_age_s, int64_t max_bytes) {
  struct File {
    std::string path;
    uint64_t bytes;
    int64_t mtime_s;
  };
  std::vector<File> files;
  PruneResult r;
  const int64_t now = now_s();
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return r;
  uint64_t stuck = 0;  // entries due to go that could not be removed: they stay
  // Whether `f` is gone (ENOENT: another prune or process removed it first).
  const auto remove = [&](const File& f) {
    if (::unlink(f.path.c_str()) == 0 || errno == ENOENT) {
      ++r.removed;
      r.bytes_removed += f.bytes;
      return true;
    }
    if (r.failed++ == 0) r.first_failure = f.path + ": " + errno_text(errno);
    return false;
  };
  walk_files(dir_, [&](const fs::directory_entry& e) {
    const std::string p = e.path().string();
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) return;
    File f{p, uint64_t(st.st_size), int64_t(st.st_mtime)};
    // A leftover temp file is known by its name, not by its directories' names.
    if (e.path().filename().string().find(".tmp-") != std::string::npos) {
      if (now - f.mtime_s > kStaleTempSeconds) remove(f);  // a killed writer's leftover
      return;
    }
    if (!ends_with(p, kSuffix)) return;
    if (max_age_s >= 0 && now - f.mtime_s > max_age_s) {
      if (!remove(f)) stuck += f.bytes;
      return;
    }
    files.push_back(f);
  }, &r.unreadable);
  uint64_t total = 0;
  for (const File& f : files) total += f.bytes;
  if (max_bytes >= 0 && total > uint64_t(max_bytes)) {
    std::sort(files.begin(), files.end(),
              [](const File& a, const File& b) { return a.mtime_s < b.mtime_s; });
    for (const File& f : files) {
      if (total <= uint64_t(max_bytes)) break;
      total -= f.bytes;
      if (!remove(f)) stuck += f.bytes;
    }
  }
  r.bytes_left = total + stuck;
  return r;
}

}  // namespace kerf::cache
