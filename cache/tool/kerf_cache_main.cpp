// kerf-cache: warm, pack, list, inspect, verify and prune kerf's kernel cache.
//
//   kerf-cache [--dir DIR] warm --op NAME --shape AxBxC [--dtype T] [--layout L] [--arch A] ...
//   kerf-cache [--dir DIR] pack BUNDLE [--add BUNDLE]...
//   kerf-cache [--dir DIR] list [BUNDLE] [--json]
//   kerf-cache [--dir DIR] inspect [BUNDLE | ENTRY.kerf] [--json]
//   kerf-cache [--dir DIR] verify [BUNDLE...]
//   kerf-cache [--dir DIR] prune [--max-age 30d] [--max-size 2G]
//
// DIR defaults to $KERF_CACHE_DIR, else ${XDG_CACHE_HOME:-~/.cache}/kerf.
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "cache/tool/tool.h"
#include "kerf/cache/store.h"
#include "kerf/error.h"

namespace kerf::cache_tool {

std::string Args::next() {
  if (empty()) throw InvalidArgument("missing an argument (kerf-cache --help shows the usage)");
  return items_[at_++];
}

std::string Args::value_of(const std::string& option) {
  if (empty()) throw InvalidArgument(option + " needs a value");
  return next();
}

namespace {

constexpr const char* kUsage = R"(usage: kerf-cache [--dir DIR] COMMAND ...

  warm     compile (and, on a GPU of that architecture, tune) ops for shapes:
             --op NAME       repeatable or a,b; default: all of
                               dora_norm, dora_norm_4bit,
                               dora_norm_partial, lora_merge          shape out x in x r
                               moe_lora_materialize,
                               moe_lora_materialize_backward          shape E x N x K x r
                               lora_embedding,
                               lora_embedding_backward                shape T x vocab x dim x r
             --shape S       sizes joined by 'x' in the op's order (repeatable; each
                             op takes the shapes of its own length)
             --dtype T       bf16, f16, f32: every operand's (repeatable or a,b; default bf16);
                             mixed calls (bf16 W, fp32 adapters) are warmed by running them
             --layout L      a sharding layout as ops::Layout::canonical() writes it, e.g.
                             "mesh(tp=4) B[tp] W[tp] m[tp] norm[tp] scale[tp]" (repeatable;
                             default unsharded; --shape gives the local shards' sizes)
             --arch A        sm_90a, sm_80, ..., cpu, or native (repeatable or a,b;
                             default: the GPU's, else cpu). An architecture without a
                             device here is compiled but not tuned.
             --all-candidates  without a device, compile every autotune candidate
                             (so that the target can tune without NVRTC; not with --no-tune)
             --sm-count N    multiprocessors to plan for without a device
             --no-tune       compile the default configurations only
             -j N            compile threads without a device (default: all cores)
  pack     BUNDLE [--add OTHER.bundle]...   write the cache's entries into one bundle
  list     [BUNDLE] [--json]                one line per entry; exit 1 if one is damaged
  inspect  [BUNDLE | FILE.kerf] [--json]    every property of every entry (exit 1 likewise)
  verify   [BUNDLE...]                      check every checksum; exit 1 if any fails
  prune    [--max-age AGE] [--max-size SIZE]  AGE with a unit (s, m, h, d, w) like 30d,
           [--other-versions]                12h; SIZE in bytes or with k, m, g, t like 500M;
                                             --other-versions: also remove the folders of other
                                             cache format versions (named, not counted, without it)

DIR defaults to $KERF_CACHE_DIR, else ${XDG_CACHE_HOME:-~/.cache}/kerf.
Exit status: 0 done; 1 done but something is wrong or missing (a damaged entry,
a folder that could not be read, a file prune could not remove, an entry warm
could not store); 2 refused (bad arguments; for pack and verify, a --dir that holds
no cache). list and prune of a directory that is not there find 0 entries.
)";

}  // namespace
}  // namespace kerf::cache_tool

int main(int argc, char** argv) {
  using namespace kerf::cache_tool;
  std::vector<std::string> items(argv + 1, argv + argc);
  if (items.empty() || items[0] == "--help" || items[0] == "-h") {
    std::fputs(kUsage, items.empty() ? stderr : stdout);
    return items.empty() ? 2 : 0;
  }
  try {
    Args args(items);
    std::string command = args.next();
    if (command == "--dir") {
      // The command works on this directory (and warm writes there).
      const std::string dir = args.value_of("--dir");
      // An empty value (an unset shell variable) must not fall back to the default cache.
      if (dir.empty()) throw kerf::InvalidArgument("--dir needs a directory, got an empty string");
      ::setenv("KERF_CACHE_DIR", dir.c_str(), 1);
      command = args.next();
      if (command == "--dir") throw kerf::InvalidArgument("--dir given twice");
    }
    kerf::cache::reload_settings();
    if (command == "warm") return warm(args);
    if (command == "pack") return pack(args);
    if (command == "list") return list(args, false);
    if (command == "inspect") return list(args, true);
    if (command == "verify") return verify(args);
    if (command == "prune") return prune(args);
    throw kerf::InvalidArgument("unknown command '" + command + "' (kerf-cache --help lists them)");
  } catch (const kerf::Error& e) {
    std::fprintf(stderr, "kerf-cache: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "kerf-cache: out of memory (a --shape too large for this machine to hold the op's "
                         "tensors?)\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kerf-cache: %s\n", e.what());
    return 2;
  }
}
