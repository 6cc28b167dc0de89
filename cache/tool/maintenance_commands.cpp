// kerf-cache pack, verify and prune: moving entries into bundles, checking
// checksums, and keeping the disk tier small.
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <memory>

#include "cache/tool/tool.h"
#include "kerf/cache/bundle.h"
#include "kerf/cache/disk_cache.h"
#include "kerf/cache/store.h"
#include "kerf/error.h"

namespace kerf::cache_tool {

std::string cache_dir() {
  const cache::Settings s = cache::current_settings();
  if (!s.dir_refused.empty())
    throw InvalidArgument(s.dir_refused + "; give the cache directory with --dir or KERF_CACHE_DIR");
  return s.dir;
}

int report_unreadable(const std::vector<std::string>& unreadable) {
  for (const std::string& u : unreadable) std::fprintf(stderr, "kerf-cache: skipped %s\n", u.c_str());
  return int(unreadable.size());
}

namespace {

// The disk tier's entries for a command that reads them all; a missing directory is
// an error (a mistyped --dir must not pack or verify nothing and pass).
std::vector<cache::DiskCache::Listed> listed_entries(const char* command, const cache::DiskCache& disk,
                                                     std::vector<std::string>* unreadable) {
  std::error_code ec;
  if (!std::filesystem::is_directory(disk.root(), ec))
    throw InvalidArgument(std::string(command) + ": there is no kernel cache at " + disk.root());
  // A directory without the entries' folder (its parent, the folder itself, another
  // directory) holds no cache either: nothing packed or verified there would pass.
  if (!std::filesystem::is_directory(disk.dir(), ec))
    throw InvalidArgument(std::string(command) + ": " + disk.root() + " holds no kernel cache (no folder " +
                          std::filesystem::path(disk.dir()).filename().string() +
                          " of entries in it); give the cache's root, as KERF_CACHE_DIR names it");
  return disk.list(unreadable);
}

cache::DiskCache disk_tier() {
  return cache::DiskCache(cache_dir(), cache::DiskMode::readonly);
}

std::string now_text() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// A decimal number (no sign, hex, inf or nan) and one unit letter from `units`
// (optional when `unit_needed` is false: then 1); at most 2^62 in all.
int64_t scaled(const std::string& text, const char* what,
               const std::vector<std::pair<char, int64_t>>& units, bool unit_needed) {
  std::string letters;
  for (const auto& [c, u] : units) letters += c;
  const auto bad = [&](const std::string& why) {
    return InvalidArgument("cannot read " + std::string(what) + " '" + text + "': " + why);
  };
  const size_t digits = text.find_first_not_of("0123456789.");
  if (digits == 0 || text.empty()) throw bad("it must start with a decimal number");
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + (digits == std::string::npos ? text.size() : digits))
    throw bad("it must start with a decimal number");
  int64_t unit = 1;
  if (*end) {
    bool found = false;
    for (const auto& [c, u] : units)
      if (*end == c || *end == char(c - 'a' + 'A')) {
        unit = u;
        found = true;
      }
    if (!found || end[1] != '\0') throw bad("the unit must be one letter of " + letters);
  } else if (unit_needed) {
    throw bad("give a unit, one of " + letters + " (e.g. 30d)");
  }
  const double total = v * double(unit);
  if (!(total <= double(int64_t(1) << 62))) throw bad("too large");
  return int64_t(total);
}

}  // namespace

int64_t whole_number(const std::string& what, const std::string& text, int64_t lo, int64_t hi) {
  size_t used = 0;
  long long v = 0;
  bool ok = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  if (ok) {
    try {
      v = std::stoll(text, &used);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  if (!ok || used != text.size() || v < lo || v > hi)
    throw InvalidArgument(what + " needs a whole number from " + std::to_string(lo) + " to " + std::to_string(hi) +
                          ", got '" + text + "'");
  return v;
}

int64_t parse_duration_s(const std::string& text) {
  return scaled(text, "the age",
                {{'s', 1}, {'m', 60}, {'h', 3600}, {'d', 86400}, {'w', 7 * 86400}}, true);
}

int64_t parse_size_bytes(const std::string& text) {
  return scaled(text, "the size",
                {{'k', 1ll << 10}, {'m', 1ll << 20}, {'g', 1ll << 30}, {'t', 1ll << 40}}, false);
}

std::string human_bytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", v, units[u]);
  return buf;
}

int pack(Args& args) {
  const std::string out = args.next();
  if (out.empty() || out[0] == '-')
    throw InvalidArgument("pack: the first argument is the bundle to write, got '" + out +
                          "' (kerf-cache pack BUNDLE [--add OTHER.bundle]...)");
  std::vector<std::string> merge;
  while (!args.empty()) {
    const std::string a = args.next();
    if (a != "--add") throw InvalidArgument("pack: unknown option '" + a + "'");
    merge.push_back(args.value_of(a));
  }
  // A bundle of another kerf version is refused before anything is written: merged, its
  // entries would carry this version's stamp, and no version could use them.
  std::vector<std::unique_ptr<cache::Bundle>> added;
  for (const std::string& path : merge) {
    added.push_back(std::make_unique<cache::Bundle>(path));
    const auto& props = added.back()->props();
    const auto v = props.find("kerf_version");
    if (v != props.end() && v->second != cache::kerf_version())
      throw InvalidArgument("pack: " + path + " was packed by kerf " + v->second + ", this is kerf " +
                            cache::kerf_version() + "; its entries cannot be used by this version (warm and "
                            "pack them again with this kerf)");
  }
  cache::BundleWriter writer;
  int skipped = 0;
  const cache::DiskCache disk = disk_tier();
  std::vector<std::string> unreadable;
  for (const cache::DiskCache::Listed& l : listed_entries("pack", disk, &unreadable)) {
    if (!l.decoded.ok()) {
      std::fprintf(stderr, "pack: skipping %s: %s\n", l.path.c_str(),
                   cache::entry_problem_name(l.decoded.problem));
      ++skipped;
      continue;
    }
    if (auto bytes = cache::read_file(l.path, cache::kMaxEntryBytes)) {
      try {
        writer.add(*bytes);
      } catch (const CacheError& e) {  // changed since list(): another process rewrote it
        std::fprintf(stderr, "pack: skipping %s: %s\n", l.path.c_str(), e.what());
        ++skipped;
      }
    }
  }
  // A damaged entry of a bundle is skipped as one on disk is, naming the bundle.
  for (size_t i = 0; i < added.size(); ++i) {
    size_t n = 0;
    for (const cache::Bundle::Record& r : added[i]->records()) {
      ++n;
      try {
        writer.add(added[i]->image(r));
      } catch (const CacheError& e) {
        std::fprintf(stderr, "pack: skipping entry %zu of %s: %s\n", n, merge[i].c_str(), e.what());
        ++skipped;
      }
    }
  }
  writer.write(out, {{"kerf_version", cache::kerf_version()},
                     {"created", now_text()},
                     {"source", disk.dir()},
                     {"entries", std::to_string(writer.size())}});
  std::printf("packed %zu entries into %s (%d skipped)\n", writer.size(), out.c_str(), skipped);
  // A bundle missing what an unreadable directory or a damaged entry holds is packed, but
  // not as a success.
  return report_unreadable(unreadable) || skipped ? 1 : 0;
}

int verify(Args& args) {
  int bad = 0, good = 0;
  const auto report = [&](const std::string& where, const cache::DecodedEntry& d) {
    if (d.ok()) {
      ++good;
      return;
    }
    ++bad;
    std::printf("BAD %s: %s%s\n", where.c_str(), cache::entry_problem_name(d.problem),
                d.detail.empty() ? "" : (" (" + d.detail + ")").c_str());
  };
  if (args.empty()) {
    std::vector<std::string> unreadable;
    for (const cache::DiskCache::Listed& l : listed_entries("verify", disk_tier(), &unreadable))
      report(l.path, l.decoded);  // an entry under another key's name is reported by DiskCache::list
    bad += report_unreadable(unreadable);
  }
  while (!args.empty()) {
    const std::string path = args.next();
    try {
      const cache::Bundle b(path);
      for (const cache::Bundle::Record& r : b.records()) {
        cache::DecodedEntry d = b.decode(r);
        if (d.ok() && (d.key.id != r.id || d.key.family != r.family)) {
          d.problem = cache::EntryProblem::wrong_key;
          d.detail = "the manifest names another key";
        }
        report(path + "@" + std::to_string(r.offset), d);
      }
    } catch (const CacheError& e) {
      ++bad;
      std::printf("BAD %s\n", e.what());
    }
  }
  std::printf("%d valid, %d bad\n", good, bad);
  return bad ? 1 : 0;
}

// The folders of other cache format versions beside `disk`'s own (v0, v2, ...): this kerf
// never reads them, and prune's limits do not count them.
std::vector<std::filesystem::path> other_format_folders(const cache::DiskCache& disk) {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  const std::filesystem::path own = std::filesystem::path(disk.dir()).filename();
  for (std::filesystem::directory_iterator it(disk.root(), ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const bool versioned = name.size() > 1 && name[0] == 'v' &&
                           name.find_first_not_of("0123456789", 1) == std::string::npos;
    if (versioned && it->path().filename() != own && it->is_directory(ec)) out.push_back(it->path());
  }
  return out;
}

uint64_t folder_bytes(const std::filesystem::path& dir) {
  uint64_t bytes = 0;
  std::error_code ec;
  for (std::filesystem::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->is_regular_file(ec)) bytes += it->file_size(ec);
  return bytes;
}

int prune(Args& args) {
  int64_t max_age = -1, max_size = -1;
  bool other_versions = false;
  while (!args.empty()) {
    const std::string a = args.next();
    if (a == "--max-age")
      max_age = parse_duration_s(args.value_of(a));
    else if (a == "--max-size")
      max_size = parse_size_bytes(args.value_of(a));
    else if (a == "--other-versions")
      other_versions = true;
    else
      throw InvalidArgument("prune: unknown option '" + a + "'");
  }
  cache::DiskCache disk(cache_dir(), cache::DiskMode::on);
  const cache::DiskCache::PruneResult r = disk.prune(max_age, max_size);
  std::printf("removed %d entries (%s); %s left in %s\n", r.removed,
              human_bytes(r.bytes_removed).c_str(), human_bytes(r.bytes_left).c_str(),
              disk.dir().c_str());
  int failed = r.failed;
  if (r.failed)
    std::fprintf(stderr, "kerf-cache: prune: %d file(s) could not be removed, the first %s\n", r.failed,
                 r.first_failure.c_str());
  for (const std::filesystem::path& dir : other_format_folders(disk)) {
    const uint64_t bytes = folder_bytes(dir);
    if (!other_versions) {
      std::printf("%s in %s, a folder of another cache format version (this kerf never reads it; "
                  "prune --other-versions removes it)\n",
                  human_bytes(bytes).c_str(), dir.c_str());
      continue;
    }
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    if (ec) {
      ++failed;
      std::fprintf(stderr, "kerf-cache: prune: could not remove %s (%s)\n", dir.c_str(), ec.message().c_str());
    } else {
      std::printf("removed %s, a folder of another cache format version (%s)\n", dir.c_str(),
                  human_bytes(bytes).c_str());
    }
  }
  const int skipped = report_unreadable(r.unreadable);
  return failed || skipped ? 1 : 0;
}

}  // namespace kerf::cache_tool
