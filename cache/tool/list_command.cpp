// kerf-cache list / inspect: what a cache directory, a bundle or one entry
// file holds, as text for people or JSON for tools.
#include <cstdio>
#include <ctime>

#include "cache/tool/tool.h"
#include "kerf/cache/bundle.h"
#include "kerf/cache/disk_cache.h"
#include "kerf/cache/store.h"
#include "kerf/error.h"

#if defined(KERF_HAVE_JSON)
#include <nlohmann/json.hpp>
#endif

namespace kerf::cache_tool {
namespace {

// One entry, wherever it lives.
struct Row {
  std::string where;  // a file, or bundle@offset
  uint64_t bytes = 0;
  int64_t mtime_s = -1;  // -1: in a bundle
  cache::DecodedEntry decoded;
};

std::string name_of(const cache::Entry& e) {
  return e.kind == cache::EntryKind::tune_choice ? e.prop("op") : e.prop("kernel");
}

std::string details_of(const cache::Entry& e) {
  if (e.kind == cache::EntryKind::tune_choice)
    return e.prop("shape_bucket") + " " + e.prop("dtypes") + " -> " + e.prop("config");
  return e.prop("meta");
}

std::string age_text(int64_t mtime_s) {
  if (mtime_s < 0) return "-";
  const int64_t s = int64_t(std::time(nullptr)) - mtime_s;
  char buf[32];
  if (s < 120)
    std::snprintf(buf, sizeof buf, "%llds ago", (long long)s);
  else if (s < 7200)
    std::snprintf(buf, sizeof buf, "%lldm ago", (long long)(s / 60));
  else if (s < 172800)
    std::snprintf(buf, sizeof buf, "%lldh ago", (long long)(s / 3600));
  else
    std::snprintf(buf, sizeof buf, "%lldd ago", (long long)(s / 86400));
  return buf;
}

std::vector<Row> rows_of(const std::string& target,
                         std::map<std::string, std::string>* bundle_props, int* unreadable) {
  std::vector<Row> rows;
  if (target.empty()) {
    std::vector<std::string> skipped;
    for (cache::DiskCache::Listed& l : cache::DiskCache(cache_dir(), cache::DiskMode::readonly).list(&skipped))
      rows.push_back(Row{l.path, l.bytes, l.mtime_s, std::move(l.decoded)});
    *unreadable = report_unreadable(skipped);
    return rows;
  }
  // A bundle is known by its magic (and then mapped, not read here whole).
  const std::optional<std::vector<char>> magic = cache::read_file_head(target, 8);
  if (!magic) throw InvalidArgument("cannot read '" + target + "'");
  if (magic->size() >= 8 && std::string(magic->data(), 8) == "KERFBNDL") {
    const cache::Bundle b(target);
    *bundle_props = b.props();
    for (const cache::Bundle::Record& r : b.records()) {
      Row row{target + "@" + std::to_string(r.offset), r.bytes, -1, b.decode(r)};
      row.decoded.entry.blob.clear();
      rows.push_back(std::move(row));
    }
    return rows;
  }
  bool too_large = false;
  const std::optional<std::vector<char>> head = cache::read_file(target, cache::kMaxEntryBytes, &too_large);
  if (!head && !too_large) throw InvalidArgument("cannot read '" + target + "'");
  if (too_large) {
    Row big{target, 0, -1, {}};
    big.decoded.problem = cache::EntryProblem::too_large;
    return {big};
  }
  Row row{target, head->size(), -1, cache::decode_entry(head->data(), head->size())};
  row.decoded.entry.blob.clear();
  rows.push_back(std::move(row));
  return rows;
}

#if defined(KERF_HAVE_JSON)
void print_json(const std::vector<Row>& rows,
                const std::map<std::string, std::string>& bundle_props, bool details) {
  nlohmann::json out;
  out["bundle"] = bundle_props;
  out["entries"] = nlohmann::json::array();
  for (const Row& r : rows) {
    const cache::Entry& e = r.decoded.entry;
    nlohmann::json j;
    j["where"] = r.where;
    j["bytes"] = r.bytes;
    if (r.mtime_s >= 0) j["mtime"] = r.mtime_s;
    j["status"] = cache::entry_problem_name(r.decoded.problem);
    if (!r.decoded.ok()) j["problem"] = r.decoded.detail;
    if (r.decoded.ok()) {
      j["kind"] = cache::entry_kind_name(e.kind);
      j["name"] = name_of(e);
      j["arch"] = e.prop("arch");
      j["key"] = r.decoded.key.id.hex();
      j["family"] = r.decoded.key.family.hex();
      if (details)
        j["props"] = e.props;
      else
        j["details"] = details_of(e);
    }
    out["entries"].push_back(std::move(j));
  }
  std::printf("%s\n", out.dump(2).c_str());
}
#endif

}  // namespace

bool have_json() {
#if defined(KERF_HAVE_JSON)
  return true;
#else
  return false;
#endif
}

int list(Args& args, bool details) {
  std::string target;
  bool json = false;
  while (!args.empty()) {
    const std::string a = args.next();
    if (a == "--json")
      json = true;
    else if (target.empty() && a.rfind("--", 0) != 0)
      target = a;
    else
      throw InvalidArgument(std::string(details ? "inspect" : "list") + ": unknown option '" + a +
                            "'");
  }
  std::map<std::string, std::string> bundle_props;
  int unreadable = 0;
  std::vector<Row> rows;
  try {
    rows = rows_of(target, &bundle_props, &unreadable);
  } catch (const CacheError& e) {
    // A bundle that cannot be mounted (cut short, a damaged manifest): damaged, as verify
    // reports it (exit 1), not a refused argument.
    std::printf("BAD %s\n", e.what());
    return 1;
  }
  // As verify: a listing that shows a damaged entry, or misses a directory, exits 1.
  int status = unreadable ? 1 : 0;
  for (const Row& r : rows)
    if (!r.decoded.ok()) status = 1;
  if (json) {
#if defined(KERF_HAVE_JSON)
    print_json(rows, bundle_props, details);
    return status;
#else
    throw NotAvailable("this kerf-cache was built without nlohmann-json, so --json is off");
#endif
  }
  for (const auto& [k, v] : bundle_props) std::printf("# %s: %s\n", k.c_str(), v.c_str());
  if (!details) {
    std::printf("%-12s %-24s %-8s %10s %9s  %s\n", "KIND", "NAME", "ARCH", "SIZE", "USED",
                "DETAILS");
    for (const Row& r : rows) {
      const cache::Entry& e = r.decoded.entry;
      if (!r.decoded.ok()) {
        std::printf(
            "%-12s %-24s %-8s %10s %9s  %s\n", "BAD", "-", "-", human_bytes(r.bytes).c_str(),
            age_text(r.mtime_s).c_str(),
            (std::string(cache::entry_problem_name(r.decoded.problem)) + ": " + r.where).c_str());
        continue;
      }
      std::printf("%-12s %-24s %-8s %10s %9s  %s\n", cache::entry_kind_name(e.kind),
                  name_of(e).c_str(), e.prop("arch").c_str(), human_bytes(r.bytes).c_str(),
                  age_text(r.mtime_s).c_str(), details_of(e).c_str());
    }
    std::printf("%zu entries\n", rows.size());
    return status;
  }
  for (const Row& r : rows) {
    std::printf("%s\n", r.where.c_str());
    std::printf("  status: %s%s\n", cache::entry_problem_name(r.decoded.problem),
                r.decoded.detail.empty() ? "" : (" (" + r.decoded.detail + ")").c_str());
    std::printf("  size: %s\n", human_bytes(r.bytes).c_str());
    if (!r.decoded.ok()) continue;
    std::printf("  kind: %s\n  key: %s\n  family: %s\n  format: %u\n",
                cache::entry_kind_name(r.decoded.entry.kind), r.decoded.key.id.hex().c_str(),
                r.decoded.key.family.hex().c_str(), r.decoded.format_version);
    for (const auto& [k, v] : r.decoded.entry.props)
      std::printf("  %s: %s\n", k.c_str(), v.c_str());
  }
  return status;
}

}  // namespace kerf::cache_tool
