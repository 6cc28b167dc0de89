// The disk tier: atomic entries, damaged files detected, ignored, rebuilt and
// reported once; a writer killed mid-write; read-only, unwritable and off.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utime.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "catch.h"
#include "kerf/cache/disk_cache.h"
#include "kerf/cache/entry.h"
#include "kerf/cache/settings.h"
#include "kerf/cache/store.h"
#include "test_cache_util.h"

using namespace kerf;

namespace {

cache::CacheKey key_for(const std::string& arch, const std::string& compiler = "nvrtc 13.0") {
  cache::KernelKeyFields f;
  f.kernel = "test_kernel";
  f.ir_hash = {7, 8};
  f.code_hash = {9, 10};
  f.meta = {{"BLOCK", 256}};
  f.args = {dsl::ArgSpec::tensor(DType::f32, 1)};
  f.target = {"cuda", arch, compiler, "", ""};
  f.kerf_version = "test";
  return cache::kernel_key(f);
}

cache::Entry entry_for(const std::string& arch, size_t blob_bytes = 4096) {
  cache::Entry e;
  e.kind = cache::EntryKind::cuda_kernel;
  e.props = {{"kernel", "test_kernel"}, {"arch", arch}, {"entry", "kerf_test"}};
  e.blob.resize(blob_bytes);
  for (size_t i = 0; i < blob_bytes; ++i) e.blob[i] = char(i * 131 + 7);
  return e;
}

std::vector<char> read_all(const std::string& path) {
  return *cache::read_file(path);
}

void write_all(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), std::streamsize(bytes.size()));
}

}  // namespace

TEST_CASE("an entry written to the disk tier reads back whole", "[cache]") {
  test::TempDir dir;
  cache::DiskCache disk(dir.path(), cache::DiskMode::on);
  const cache::CacheKey key = key_for("sm_90a");
  CHECK_FALSE(disk.find(key));
  REQUIRE(disk.store(key, entry_for("sm_90a")));
  const std::string path = disk.path_for(key);
  CHECK(path.find(key.stem() + ".kerf") != std::string::npos);
  const std::optional<cache::Entry> e = disk.find(key);
  REQUIRE(e);
  CHECK(e->blob == entry_for("sm_90a").blob);
  CHECK(e->prop("arch") == "sm_90a");
  // No temporary file is left behind.
  int files = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir.path()))
    files += f.is_regular_file();
  CHECK(files == 1);
}

TEST_CASE("an entry under another key's file name is listed as damaged", "[cache]") {
  test::TempDir dir;
  cache::DiskCache disk(dir.path(), cache::DiskMode::on);
  REQUIRE(disk.store(key_for("sm_90a"), entry_for("sm_90a")));
  const std::string path = disk.path_for(key_for("sm_90a"));
  const std::string moved = disk.path_for(key_for("sm_80"));  // the name another key looks under
  std::filesystem::create_directories(std::filesystem::path(moved).parent_path());
  std::filesystem::rename(path, moved);
  const std::vector<cache::DiskCache::Listed> listed = disk.list();
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].decoded.problem == cache::EntryProblem::wrong_key);
  CHECK(listed[0].decoded.detail == "stored under another key's name");
}

TEST_CASE("without its compiler, a kernel built by another compiler version is found by family",
          "[cache]") {
  test::TempDir dir;
  cache::DiskCache disk(dir.path(), cache::DiskMode::on);
  REQUIRE(disk.store(key_for("sm_90a", "nvrtc 13.0"), entry_for("sm_90a")));
  const cache::CacheKey absent = key_for("sm_90a", "nvrtc unavailable");
  CHECK_FALSE(disk.find(absent));
  CHECK(disk.find(absent, /*any_compiler=*/true));
  CHECK_FALSE(disk.find(key_for("sm_80", "nvrtc unavailable"), true));  // never another arch
}

TEST_CASE("damaged entries are detected, ignored, rebuilt and reported once", "[cache]") {
  test::ScopedEnv env({{"KERF_LOG", "warn"}});
  test::TempDir dir;
  cache::DiskCache disk(dir.path(), cache::DiskMode::on);
  const cache::CacheKey key = key_for("sm_90a");
  REQUIRE(disk.store(key, entry_for("sm_90a")));
  const std::string path = disk.path_for(key);
  const std::vector<char> good = read_all(path);

  // A valid entry for another arch, written under this key's name (a copied or renamed file).
  std::vector<char> foreign = cache::encode_entry(key_for("sm_80"), entry_for("sm_80"));
  std::vector<char> other_version = good;
  other_version[8] = char(cache::kEntryFormatVersion + 1);

  struct Damage {
    const char* what;
    std::vector<char> bytes;
    cache::EntryProblem problem;
  };
  const auto flip = [&](size_t at) {
    std::vector<char> b = good;
    b[at] ^= 0x10;
    return b;
  };
  const std::vector<Damage> damages = {
      {"zero-length", {}, cache::EntryProblem::empty},
      {"truncated in the header", std::vector<char>(good.begin(), good.begin() + 40),
       cache::EntryProblem::truncated},
      {"truncated in the payload", std::vector<char>(good.begin(), good.end() - 100),
       cache::EntryProblem::truncated},
      {"bit flipped in the key", flip(20), cache::EntryProblem::corrupt_header},
      {"bit flipped in the payload", flip(good.size() - 10), cache::EntryProblem::corrupt_payload},
      {"wrong format version", other_version, cache::EntryProblem::wrong_version},
      {"wrong arch", foreign, cache::EntryProblem::wrong_key},
      {"not an entry", std::vector<char>(300, 'x'), cache::EntryProblem::bad_magic},
  };
  for (const Damage& d : damages) {
    CAPTURE(d.what);
    // The decoder names the problem.
    const cache::DecodedEntry decoded =
        cache::decode_entry_for(d.bytes.data(), d.bytes.size(), key, false);
    CHECK(decoded.problem == d.problem);

    log::reload();
    test::LogCapture logs;
    write_all(path, d.bytes);
    CHECK_FALSE(disk.find(key));
    CHECK_FALSE(disk.find(key));                  // asked twice ...
    CHECK(logs.count(path) == 1);                 // ... reported once
    CHECK(disk.store(key, entry_for("sm_90a")));  // rebuilt
    const std::optional<cache::Entry> e = disk.find(key);
    REQUIRE(e);
    CHECK(e->blob == entry_for("sm_90a").blob);
  }
}

TEST_CASE("a file at an entry's path larger than any entry is not read, and is rebuilt", "[cache]") {
  test::ScopedEnv env({{"KERF_LOG", "warn"}});
  log::reload();
  test::LogCapture logs;
  test::TempDir dir;
  cache::DiskCache disk(dir.path(), cache::DiskMode::on);
  const cache::CacheKey key = key_for("sm_90a");
  REQUIRE(disk.store(key, entry_for("sm_90a")));
  const std::string path = disk.path_for(key);
  // 2 TiB, sparse: reading it whole threw std::bad_alloc out of every launch of the kernel.
  REQUIRE(::truncate(path.c_str(), off_t(2) << 40) == 0);
  CHECK_FALSE(disk.find(key));
  CHECK(logs.count("larger than any entry") == 1);
  const std::vector<cache::DiskCache::Listed> listed = disk.list();
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].decoded.problem == cache::EntryProblem::too_large);
  CHECK(disk.store(key, entry_for("sm_90a")));  // rebuilt over it
  REQUIRE(disk.find(key));
  CHECK(disk.find(key)->blob == entry_for("sm_90a").blob);
}

TEST_CASE("something in the way of one entry's file spoils that entry only", "[cache]") {
  test::ScopedEnv env({{"KERF_LOG", "warn"}});
  log::reload();
  test::LogCapture logs;
  test::TempDir dir;
  cache::DiskCache disk(dir.path(), cache::DiskMode::on);
  // A directory (with a file in it) where one entry's file goes.
  const std::string blocked = disk.path_for(key_for("sm_90a"));
  REQUIRE(std::filesystem::create_directories(blocked + "/inside"));
  CHECK_FALSE(disk.store(key_for("sm_90a"), entry_for("sm_90a")));
  CHECK(logs.count("cannot store a kernel at " + blocked) == 1);
  CHECK(logs.count("cannot be written") == 0);  // not the whole directory ...
  CHECK(disk.writable());
  CHECK(disk.store(key_for("sm_80"), entry_for("sm_80")));  // ... which takes the others
  CHECK(disk.find(key_for("sm_80")));
  // Through the process's store: counted as a failed store.
  test::ScopedEnv here({{"KERF_CACHE_DIR", dir.path()}, {"KERF_CACHE", "on"}});
  cache::reset_stats();
  CHECK_FALSE(cache::remember(key_for("sm_90a"), entry_for("sm_90a")));
  CHECK(cache::remember(key_for("sm_86"), entry_for("sm_86")));
  CHECK(cache::stats().store_failures == 1);
  CHECK(cache::stats().stores == 1);
}

TEST_CASE("a folder of the cache that cannot be read is named; the others are listed and pruned", "[cache]") {
  if (::geteuid() == 0) {
    std::printf("KERF-SKIPPED: running as root, permissions do not stop reads or removals\n");
    return;
  }
  test::TempDir dir;
  cache::DiskCache disk(dir.path(), cache::DiskMode::on);
  const std::vector<std::string> archs = {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90a"};
  for (const std::string& a : archs) REQUIRE(disk.store(key_for(a), entry_for(a)));
  const std::string closed = std::filesystem::path(disk.path_for(key_for("sm_80"))).parent_path();
  size_t inside = 0;
  for (const std::string& a : archs) inside += disk.path_for(key_for(a)).rfind(closed, 0) == 0;
  REQUIRE(::chmod(closed.c_str(), 0) == 0);
  std::vector<std::string> unreadable;
  CHECK(disk.list(&unreadable).size() == archs.size() - inside);  // the walk goes on past it
  REQUIRE(unreadable.size() == 1);
  CHECK(unreadable[0].rfind(closed, 0) == 0);
  cache::DiskCache::PruneResult r = disk.prune(-1, 0);
  CHECK(r.removed == int(archs.size() - inside));
  CHECK(r.unreadable.size() == 1);
  // A file that cannot be removed is counted, and stays in what is left.
  REQUIRE(::chmod(closed.c_str(), 0755) == 0);
  REQUIRE(::chmod(closed.c_str(), 0555) == 0);
  r = disk.prune(-1, 0);
  CHECK(r.removed == 0);
  CHECK(r.failed == int(inside));
  CHECK(r.first_failure.find("Permission denied") != std::string::npos);
  CHECK(r.bytes_left > 0);
  ::chmod(closed.c_str(), 0755);
  // An entry that cannot be read is listed as unreadable, with the reason (it was
  // listed as "empty").
  cache::DiskCache fresh(dir.path(), cache::DiskMode::on);  // the prunes above removed the others
  REQUIRE(fresh.store(key_for("sm_90a"), entry_for("sm_90a")));
  const std::string entry = fresh.path_for(key_for("sm_90a"));
  REQUIRE(::chmod(entry.c_str(), 0) == 0);
  bool seen = false;
  for (const cache::DiskCache::Listed& l : fresh.list()) {
    if (l.path != entry) continue;
    seen = true;
    CHECK(l.decoded.problem == cache::EntryProblem::unreadable);
    CHECK(std::string(cache::entry_problem_name(l.decoded.problem)) == "unreadable");
    CHECK(l.decoded.detail.find("Permission denied") != std::string::npos);
  }
  CHECK(seen);
  ::chmod(entry.c_str(), 0644);
}

TEST_CASE("a writer killed mid-write leaves no entry that reads as valid", "[cache]") {
  test::TempDir dir;
  const cache::CacheKey key = key_for("sm_90a");
  test::Child writer(test::self_test("[.cache-child-slow-writer]"),
                     {{"KERF_TEST_DIR", dir.path()}});
  // The child writes an 8 MiB entry in 1 MiB chunks and stops after the first.
  const std::string marker = dir / "first-chunk-written";
  for (int i = 0; i < 500 && !std::filesystem::exists(marker); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  REQUIRE(std::filesystem::exists(marker));
  ::kill(writer.pid(), SIGKILL);
  CHECK(writer.wait() == 128 + SIGKILL);

  cache::DiskCache disk(dir.path(), cache::DiskMode::on);
  CHECK_FALSE(disk.find(key));
  for (const cache::DiskCache::Listed& l : disk.list()) CHECK_FALSE(l.decoded.ok());
  // The torn temporary file is there, but never under an entry's name.
  int temps = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir.path()))
    temps += f.path().string().find(".tmp-") != std::string::npos;
  CHECK(temps == 1);
  // The next writer succeeds; prune clears the leftover once it is old.
  REQUIRE(disk.store(key, entry_for("sm_90a")));
  CHECK(disk.find(key));
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir.path()))
    if (f.path().string().find(".tmp-") != std::string::npos) {
      struct utimbuf old = {std::time(nullptr) - 7200, std::time(nullptr) - 7200};
      ::utime(f.path().c_str(), &old);
    }
  CHECK(disk.prune(-1, -1).removed == 1);
  CHECK(disk.find(key));
}

TEST_CASE("child: write an entry slowly until killed", "[.cache-child-slow-writer]") {
  static std::string dir;
  const char* parent_dir = std::getenv("KERF_TEST_DIR");
  if (!parent_dir) {  // run on its own (a filter of exclusions only selects hidden tests too)
    WARN("a child of the cache's kill-during-write test: run by it, with KERF_TEST_DIR set");
    return;
  }
  dir = parent_dir;
  cache::DiskCache::set_write_hook([](const std::string&, size_t) {
    std::ofstream(dir + "/first-chunk-written") << "1";
    std::this_thread::sleep_for(std::chrono::seconds(30));
  });
  cache::DiskCache disk(dir, cache::DiskMode::on);
  disk.store(key_for("sm_90a"), entry_for("sm_90a", size_t(8) << 20));
}

TEST_CASE("an unwritable cache directory keeps kerf working from memory and says so once",
          "[cache]") {
  test::TempDir dir;
  // A directory below a regular file cannot be made, even by root.
  write_all(dir / "file", {'x'});
  const std::string unwritable = dir / "file/cache";
  test::ScopedEnv env({{"KERF_CACHE_DIR", unwritable}, {"KERF_LOG", "warn"}});
  test::LogCapture logs;
  cache::DiskCache disk(unwritable, cache::DiskMode::on);
  CHECK(disk.writable());
  CHECK_FALSE(disk.store(key_for("sm_90a"), entry_for("sm_90a")));
  CHECK_FALSE(disk.writable());
  CHECK_FALSE(disk.store(key_for("sm_80"), entry_for("sm_80")));
  CHECK(logs.count("cannot be written") == 1);
  CHECK(logs.count("in memory") == 1);
  // Through the process's store too: a failed write is reported, never thrown.
  CHECK_FALSE(cache::remember(key_for("sm_90a"), entry_for("sm_90a")));
  CHECK_FALSE(cache::lookup(key_for("sm_90a")));
}

TEST_CASE("a cache directory that is a dangling symbolic link is reported as one", "[cache]") {
  test::TempDir dir;
  const std::string link = dir / "cache";
  std::filesystem::create_directory_symlink(dir / "gone", link);
  test::ScopedEnv env({{"KERF_LOG", "warn"}});
  test::LogCapture logs;
  cache::DiskCache disk(link, cache::DiskMode::on);
  CHECK_FALSE(disk.store(key_for("sm_90a"), entry_for("sm_90a")));
  CHECK(logs.count("cannot be written (it is a symbolic link to " + (dir / "gone") + ", which does not exist)") == 1);
}

TEST_CASE("a read-only directory (permissions) keeps kerf working from memory", "[cache]") {
  if (::geteuid() == 0) {
    std::printf(
        "KERF-SKIPPED: running as root, permissions do not stop writes (the unwritable-directory "
        "test covers it)\n");
    return;
  }
  test::TempDir dir;
  cache::DiskCache writer(dir.path(), cache::DiskMode::on);
  REQUIRE(writer.store(key_for("sm_90a"), entry_for("sm_90a")));
  ::chmod(dir.path().c_str(), 0555);
  ::chmod((dir.path() + "/v1").c_str(), 0555);
  cache::DiskCache disk(dir.path(), cache::DiskMode::on);
  CHECK(disk.find(key_for("sm_90a")));
  CHECK_FALSE(disk.store(key_for("sm_80"), entry_for("sm_80")));
  ::chmod((dir.path() + "/v1").c_str(), 0755);
  ::chmod(dir.path().c_str(), 0755);
}

TEST_CASE("KERF_CACHE=readonly reads without writing, and off does neither", "[cache]") {
  test::TempDir dir;
  const cache::CacheKey key = key_for("sm_90a");
  {
    test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_CACHE", "on"}});
    REQUIRE(cache::remember(key, entry_for("sm_90a")));
  }
  {
    test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_CACHE", "readonly"}});
    CHECK(cache::current_settings().disk == cache::DiskMode::readonly);
    CHECK(cache::lookup(key));
    CHECK_FALSE(cache::remember(key_for("sm_80"), entry_for("sm_80")));
    CHECK_FALSE(std::filesystem::exists(
        cache::DiskCache(dir.path(), cache::DiskMode::on).path_for(key_for("sm_80"))));
  }
  {
    test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_CACHE", "off"}});
    CHECK_FALSE(cache::lookup(key));
    CHECK_FALSE(cache::remember(key_for("sm_80"), entry_for("sm_80")));
  }
}

TEST_CASE("prune removes entries by age, then the least recently used by size", "[cache]") {
  test::TempDir dir;
  cache::DiskCache disk(dir.path(), cache::DiskMode::on);
  const std::vector<std::string> archs = {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90a"};
  const time_t now = std::time(nullptr);
  for (size_t i = 0; i < archs.size(); ++i) {
    REQUIRE(disk.store(key_for(archs[i]), entry_for(archs[i], 10000)));
    const time_t t = now - time_t(i) * 86400;  // sm_75 used today ... sm_90a four days ago
    struct utimbuf when = {t, t};
    ::utime(disk.path_for(key_for(archs[i])).c_str(), &when);
  }
  CHECK(disk.prune(3 * 86400 + 600, -1).removed == 1);  // sm_90a
  CHECK_FALSE(disk.find(key_for("sm_90a")));
  const cache::DiskCache::PruneResult r = disk.prune(-1, 25000);  // room for two
  CHECK(r.removed == 2);
  CHECK(r.bytes_left <= 25000);
  CHECK(disk.find(key_for("sm_75")));
  CHECK(disk.find(key_for("sm_80")));
  CHECK_FALSE(disk.find(key_for("sm_89")));
}

TEST_CASE("without a home the cache's /tmp fallback is used only when it is this user's alone", "[cache]") {
  const std::string dir = "/tmp/kerf-cache-" + std::to_string(::getuid());
  struct stat before {};
  const bool existed = ::stat(dir.c_str(), &before) == 0;
  test::ScopedEnv env({{"KERF_CACHE_DIR", std::nullopt}, {"HOME", std::nullopt}, {"XDG_CACHE_HOME", std::nullopt},
                       {"KERF_CACHE", std::nullopt}, {"KERF_LOG", "warn"}});
  test::LogCapture logs;
  cache::Settings s = cache::settings_from_env();
  CHECK(s.dir == dir);
  CHECK(s.disk == cache::DiskMode::on);  // made here (0700), or this user's already
  REQUIRE(::chmod(dir.c_str(), 0777) == 0);  // as a directory others could plant entries in
  s = cache::settings_from_env();
  CHECK(s.disk == cache::DiskMode::off);
  CHECK(logs.count("is not this user's alone") == 1);
  ::chmod(dir.c_str(), existed ? (before.st_mode & 07777) : 0700);
  if (!existed) ::rmdir(dir.c_str());
}

TEST_CASE("settings the environment gives in a form kerf does not know are reported", "[cache]") {
  test::LogCapture logs;  // before the environment changes: its reload reads them
  test::ScopedEnv env({{"KERF_LOG", "nonsense"}, {"KERF_CACHE", "maybe"}, {"KERF_AUTOTUNE", "banana"}});
  (void)cache::settings_from_env();
  CHECK(logs.count("KERF_LOG='nonsense' is not one of off, warn, info, debug; using warn") == 1);
  CHECK(logs.count("KERF_CACHE='maybe' is not one of on (1), readonly (ro), off (0)") == 1);
  CHECK(logs.count("KERF_AUTOTUNE='banana' is not one of 0 (off), 1 (on), force") == 1);
}

TEST_CASE("the switches take the usual spellings of on and off in any case", "[cache]") {
  const auto tune = [](const char* v) {
    test::ScopedEnv env({{"KERF_AUTOTUNE", v}});
    return cache::settings_from_env().autotune;
  };
  for (const char* off : {"0", "off", "OFF", "false", "False", "no", " off "}) {
    INFO(off);
    CHECK(tune(off) == cache::AutotuneMode::off);  // "false" tuned on GPUs before
  }
  for (const char* on : {"1", "on", "ON", "true", "yes", "1\n"}) {
    INFO(on);
    CHECK(tune(on) == cache::AutotuneMode::on);
  }
  CHECK(tune("Force") == cache::AutotuneMode::force);
  CHECK(tune("2") == cache::AutotuneMode::gpu_only);  // unknown: the default, with a warning
  const auto disk = [](const char* v) {
    test::ScopedEnv env({{"KERF_CACHE", v}});
    return cache::settings_from_env().disk;
  };
  CHECK(disk("Off") == cache::DiskMode::off);
  CHECK(disk("false") == cache::DiskMode::off);
  CHECK(disk("RO") == cache::DiskMode::readonly);
  CHECK(disk("yes") == cache::DiskMode::on);
  // KERF_LOG's levels the same way: any case, blanks around dropped (INFO read as warn before).
  const auto level = [](const char* v) {
    test::ScopedEnv env({{"KERF_LOG", v}});
    log::reload();
    return log::level();
  };
  CHECK(level("INFO") == log::Level::info);
  CHECK(level(" debug\n") == log::Level::debug);
  CHECK(level("Off") == log::Level::off);
  CHECK(level("false") == log::Level::off);
  CHECK(level("Warning") == log::Level::warn);
  log::reload();
}
