// kerf-cache's commands, one file each; they share the argument reader and
// the printing helpers declared here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kerf::cache_tool {

// The arguments after the command name, consumed front to back.
class Args {
 public:
  explicit Args(std::vector<std::string> items) : items_(std::move(items)) {}
  bool empty() const { return at_ >= items_.size(); }
  const std::string& peek() const { return items_[at_]; }
  std::string next();                               // throws InvalidArgument when none is left
  std::string value_of(const std::string& option);  // the value after `option`

 private:
  std::vector<std::string> items_;
  size_t at_ = 0;
};

int warm(Args& args);
int pack(Args& args);
int list(Args& args, bool details);  // list (one line each) and inspect (every property)
int verify(Args& args);
int prune(Args& args);

// "30d" -> seconds; "2G" -> bytes. Throw InvalidArgument on anything else.
// A whole number in [lo, hi] given for `what`, or InvalidArgument saying so.
int64_t whole_number(const std::string& what, const std::string& text, int64_t lo, int64_t hi);
int64_t parse_duration_s(const std::string& text);
int64_t parse_size_bytes(const std::string& text);
std::string human_bytes(uint64_t bytes);

bool have_json();  // built with nlohmann-json

// The cache directory the commands work on: KERF_CACHE_DIR (or --dir), else the
// default one. Throws InvalidArgument when the library refuses the default (a
// /tmp fallback another user could have filled): tools neither ship nor delete
// what is there.
std::string cache_dir();
// Prints each directory a walk of the cache had to skip (stderr); their count.
int report_unreadable(const std::vector<std::string>& unreadable);

}  // namespace kerf::cache_tool
