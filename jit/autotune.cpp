// The autotuner's choice: memory, then the cache, then a fresh tuning (see autotune.h).
#include "kerf/jit/autotune.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "kerf/cache/cpu_kernel.h"
#include "kerf/error.h"
#include "kerf/cache/log.h"
#include "kerf/cache/settings.h"
#include "kerf/cache/store.h"
#include "kerf/jit/launch.h"
#include "kerf/runtime/cuda.h"

namespace kerf::autotune {
namespace {

using Clock = std::chrono::steady_clock;

// The interrupt check (set_interrupt_check); read by the tuning thread only.
std::mutex g_interrupt_mu;
std::function<bool()> g_interrupt;

bool interrupt_requested() {
  std::function<bool()> check;
  {
    std::lock_guard<std::mutex> lock(g_interrupt_mu);
    check = g_interrupt;
  }
  return check && check();
}

// The problem's target: a choice made on one GPU model (or CPU) is not another's.
cache::Target target_of(const Device& d) {
  if (!d.is_cuda()) {
    static const cache::Target cpu = [] {
      cache::Target t = cache::cpu_target();
      t.compiler.clear();  // choices outlive compiler upgrades
      return t;
    }();
    return cpu;
  }
  static std::mutex mu;
  static std::map<int, cache::Target> targets;
  std::lock_guard<std::mutex> lock(mu);
  auto it = targets.find(d.index);
  if (it != targets.end()) return it->second;
  cache::Target t;
  t.backend = "cuda";
  t.arch = device_arch(d.index);
  t.device = cuda::device_info(d.index).name;
  return targets[d.index] = t;
}

std::string bucket_text(const std::vector<int64_t>& b) {
  std::string s;
  for (int64_t v : b) s += (s.empty() ? "" : "x") + std::to_string(v);
  return s;
}

std::string ms_text(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, ms < 10 ? "%.3f ms" : "%.0f ms", ms);
  return buf;
}

std::string dtypes_text(const std::vector<DType>& ts) {
  std::string s;
  for (DType t : ts) s += (s.empty() ? "" : ",") + std::string(dtype_name(t));
  return s;
}

// Choices made in this process, by choice key id; one registry with a lock.
struct Memo {
  std::mutex mu;
  std::map<std::pair<uint64_t, uint64_t>, Choice> choices;
  // One tuning at a time per device: candidates timed on one device compete for it;
  // two GPUs (or a GPU and the CPU) tune side by side.
  std::mutex devices_mu;
  std::map<std::string, std::mutex> tuning;
  std::mutex& tuning_lock(const Device& d) {
    std::lock_guard<std::mutex> lock(devices_mu);
    return tuning[d.str()];  // map nodes stay put: the reference outlives the lock
  }
  std::atomic<uint64_t> forgotten{0};  // forget_choices() calls, for generation()
};

Memo& memo() {
  static Memo m;
  return m;
}

// Compiles every candidate on up to `threads` threads; returns which succeeded.
// Compiles the candidates on `threads` threads (the calling one among them).
// The calling thread asks the interrupt check before each compile it starts;
// once it says stop, no thread starts another and kerf::Interrupted is thrown.
std::vector<bool> compile_all(const std::vector<Config>& cands, const Hooks& hooks, int threads,
                              int* failed) {
  std::vector<bool> ok(cands.size(), false);
  std::vector<char> done(cands.size(), 0);
  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  const std::thread::id caller = std::this_thread::get_id();
  const auto work = [&] {
    for (size_t i; !stop && (i = next++) < cands.size();) {
      if (std::this_thread::get_id() == caller && interrupt_requested()) {
        stop = true;
        break;
      }
      try {
        if (hooks.compile) hooks.compile(cands[i]);
        done[i] = 1;
      } catch (const std::exception& e) {
        log::write(log::Level::debug,
                   "autotune: candidate " + config_text(cands[i]) + " dropped: " + e.what());
      }
    }
  };
  const int n = std::max(1, std::min<int>(threads, int(cands.size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (stop) throw kerf::Interrupted("autotuning interrupted while compiling candidates");
  for (size_t i = 0; i < cands.size(); ++i) {
    ok[i] = done[i] != 0;
    if (!ok[i]) ++*failed;
  }
  return ok;
}

}  // namespace

const char* from_name(Choice::From f) {
  switch (f) {
    case Choice::From::defaults:
      return "defaults";
    case Choice::From::memory:
      return "memory";
    case Choice::From::cache:
      return "cache";
    case Choice::From::tuned:
      return "tuned";
  }
  return "?";
}

bool enabled_for(const Device& device) {
  switch (cache::autotune_mode()) {
    case cache::AutotuneMode::off:
      return false;
    case cache::AutotuneMode::gpu_only:
      return device.is_cuda();
    case cache::AutotuneMode::on:
    case cache::AutotuneMode::force:
      return true;
  }
  return false;
}

std::vector<Config> product(const std::vector<std::pair<std::string, std::vector<int64_t>>>& axes) {
  std::vector<Config> out = {{}};
  for (const auto& [name, values] : axes) {
    std::vector<Config> next;
    for (const Config& partial : out)
      for (int64_t v : values) {
        Config c = partial;
        c[name] = v;
        next.push_back(std::move(c));
      }
    out = std::move(next);
  }
  return out;
}

int64_t value_or_zero(const Config& c, const std::string& name) {
  auto it = c.find(name);
  return it == c.end() ? 0 : it->second;
}

std::string config_text(const Config& c) {
  std::string s;
  for (const auto& [k, v] : c) s += (s.empty() ? "" : ",") + k + "=" + std::to_string(v);
  return s;
}

Config parse_config(const std::string& text) {
  Config c;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(',', at);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(at, end - at);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) return {};
    try {
      size_t used = 0;
      const int64_t v = std::stoll(item.substr(eq + 1), &used);
      if (used != item.size() - eq - 1) return {};
      c[item.substr(0, eq)] = v;
    } catch (const std::exception&) {
      return {};
    }
    at = end + 1;
  }
  return c;
}

void set_interrupt_check(std::function<bool()> check) {
  std::lock_guard<std::mutex> lock(g_interrupt_mu);
  g_interrupt = std::move(check);
}

cache::CacheKey choice_key(const Problem& p) {
  cache::TuneKeyFields f;
  f.op = p.op;
  f.shape_bucket = p.shape_bucket;
  f.dtypes = p.dtypes;
  f.layout = p.layout;
  f.target = target_of(p.device);
  f.kerf_version = cache::kerf_version();
  return cache::tune_key(f);
}

void forget_choices() {
  Memo& m = memo();
  std::lock_guard<std::mutex> lock(m.mu);
  m.choices.clear();
  m.forgotten.fetch_add(1, std::memory_order_acq_rel);
}

uint64_t generation() {
  // Two counters that only grow: their sum changes whenever either does.
  return memo().forgotten.load(std::memory_order_acquire) + cache::settings_generation();
}

Choice choose(const Problem& p, const std::vector<Config>& candidates, const Config& fallback,
              const Hooks& hooks, const Options& o) {
  Choice c;
  c.config = fallback;
  if (!enabled_for(p.device)) return c;

  const cache::CacheKey key = choice_key(p);
  const std::pair<uint64_t, uint64_t> id{key.id.hi, key.id.lo};
  Memo& m = memo();
  const auto remembered = [&]() -> std::optional<Choice> {
    std::lock_guard<std::mutex> lock(m.mu);
    auto it = m.choices.find(id);
    if (it == m.choices.end()) return std::nullopt;
    Choice r = it->second;
    r.from = Choice::From::memory;
    return r;
  };
  const auto keep_choice = [&](const Choice& r) {
    std::lock_guard<std::mutex> lock(m.mu);
    m.choices[id] = r;
  };
  if (auto r = remembered()) return *r;

  const std::string what = p.op + " [" + bucket_text(p.shape_bucket) + "] " +
                           dtypes_text(p.dtypes) + (p.layout.empty() ? "" : " layout " + p.layout) +
                           " on " + target_of(p.device).arch;
  // A stored choice, looked up before the tuning lock (a call whose choice is stored does
  // not wait for another thread's tuning pass, nor does a capture). It must still compile:
  // a record from another build of kerf may name a config this one cannot run.
  const bool force = cache::current_settings().autotune == cache::AutotuneMode::force;
  if (o.persist && !force) {
    if (std::optional<cache::Found> f = cache::lookup(key)) {
      const std::string stored_text = f->entry.prop("config");
      Config stored = parse_config(stored_text);
      // A record whose config does not parse, or that this build's tuner would prune (a
      // tile over this device's shared memory), is tuned again, and says so.
      const char* refused = nullptr;
      if (f->entry.kind == cache::EntryKind::tune_choice && stored.empty() && !stored_text.empty())
        refused = "its config does not parse";
      else if (f->entry.kind == cache::EntryKind::tune_choice && !stored.empty() && hooks.keep && !hooks.keep(stored))
        refused = "it is not among this device's candidates (its shared memory, or its tiles)";
      if (refused)
        log::once(log::Level::warn, "autotune-unusable:" + key.id.hex(),
                  "autotune " + what + ": the stored choice '" + stored_text + "' (cache entry " + key.id.hex() +
                      ") cannot be used here (" + refused + "); " +
                      (o.lookup_only ? "the defaults this time" : "tuning again"));
      if (f->entry.kind == cache::EntryKind::tune_choice && !stored.empty() &&
          (!hooks.keep || hooks.keep(stored))) {
        std::string unusable = hooks.usable ? hooks.usable(stored) : std::string();
        try {
          if (unusable.empty() && hooks.compile) hooks.compile(stored);
        } catch (const kerf::Interrupted&) {
          throw;
        } catch (const std::exception& e) {
          unusable = e.what();
        }
        if (unusable.empty()) {
          c.config = std::move(stored);
          c.from = Choice::From::cache;
          log::write(log::Level::info, "autotune " + what + ": " + config_text(c.config) + " (stored choice)");
          keep_choice(c);
          return c;
        }
        log::once(log::Level::warn, "autotune-unusable:" + key.id.hex(),
                  "autotune " + what + ": the stored choice " + config_text(stored) + " (cache entry " +
                      key.id.hex() + ") cannot be used here (" + unusable + "); " +
                      (o.lookup_only ? "the defaults this time" : "tuning again"));
      }
    }
  }

  if (o.lookup_only) {
    log::write(log::Level::info, "autotune " + what +
                                     ": no choice yet and none may be timed now (Options::lookup_only, as while "
                                     "a stream captures a CUDA graph): the default config this time");
    return c;
  }
  // Timing on a stream of another device would fail candidate by candidate: say why first.
  if (p.device.is_cuda()) cuda::expect_stream_on(o.stream, p.device.index);
  std::lock_guard<std::mutex> one_at_a_time(m.tuning_lock(p.device));
  if (auto r = remembered()) return *r;  // another thread tuned it meanwhile

  const auto t0 = Clock::now();
  std::vector<Config> kept, seen;  // seen: every distinct form, kept or pruned
  const auto canonical = [&](const Config& x) { return hooks.canonical ? hooks.canonical(x) : x; };
  for (const Config& given : candidates) {
    const Config cand = canonical(given);
    if (std::find(seen.begin(), seen.end(), cand) != seen.end()) continue;  // runs as one already taken
    seen.push_back(cand);
    if (!hooks.keep || hooks.keep(cand))
      kept.push_back(cand);
    else
      ++c.pruned;
  }
  c.candidates = int(seen.size());
  const int threads = o.compile_threads > 0
                          ? o.compile_threads
                          : int(std::max(1u, std::thread::hardware_concurrency()));
  const std::vector<bool> ok = compile_all(kept, hooks, threads, &c.failed);

  std::unique_ptr<Timer> own_timer;
  Timer* timer = o.timer;
  if (!timer) {
    own_timer = p.device.is_cuda() ? cuda_event_timer(o.stream, p.device.index) : wall_clock_timer();
    timer = own_timer.get();
  }
  // First round: every candidate once. Then the few fastest run again, in turns,
  // so that one noisy median (a clock change, another process) cannot crown a
  // candidate that is not the fastest.
  std::vector<std::pair<double, size_t>> timed;
  // Once a candidate has run, the op's in-place inputs hold its result: they are put back
  // on every way out, an interrupt or an error included (restoring here, not only at the end).
  bool ran = false;
  const auto run = [&](const Config& cand) {
    ran = true;
    hooks.run(cand);
  };
  struct PutBack {
    const Hooks& hooks;
    const bool& ran;
    bool done = false;
    ~PutBack() {
      if (done || !ran || !hooks.restore) return;
      try {
        hooks.restore();
      } catch (...) {
        // Already leaving with an error; that one is reported.
      }
    }
  } put_back{hooks, ran};
  const auto check_interrupt = [] {
    if (interrupt_requested()) throw kerf::Interrupted("autotuning interrupted while timing candidates");
  };
  for (size_t i = 0; i < kept.size(); ++i) {
    if (!ok[i]) continue;
    check_interrupt();
    try {
      const double ms =
          timer->median_ms([&] { run(kept[i]); }, hooks.restore, o.warmup, o.repeats);
      log::write(log::Level::debug,
                 "autotune " + what + ": " + config_text(kept[i]) + " " + ms_text(ms));
      timed.emplace_back(ms, i);
    } catch (const std::exception& e) {
      ++c.failed;
      log::write(log::Level::debug,
                 "autotune: candidate " + config_text(kept[i]) + " failed to run: " + e.what());
    }
  }
  std::sort(timed.begin(), timed.end());
  double best = timed.empty() ? -1.0 : timed.front().first;
  if (!timed.empty()) c.config = kept[timed.front().second];
  const size_t finalists = std::min<size_t>(timed.size(), size_t(std::max(1, o.finalists)));
  // The final rounds' candidates: the finalists, then their variants.
  std::vector<size_t> pool;
  for (size_t f = 0; f < finalists; ++f) pool.push_back(timed[f].second);
  // The incumbent (Options::incumbent), where it ran, is a finalist wherever it placed.
  std::optional<size_t> incumbent;
  double incumbent_ms = -1.0;
  if (!o.incumbent.empty()) {
    const Config own = canonical(o.incumbent);
    for (const auto& [ms, i] : timed)
      if (kept[i] == own) {
        incumbent = i;
        incumbent_ms = ms;
        if (o.finalists > 0 && std::find(pool.begin(), pool.end(), i) == pool.end()) pool.push_back(i);
      }
  }
  if (!o.finalist_variants.empty() && finalists > 0) {
    std::vector<Config> variants;
    for (size_t f = 0; f < finalists; ++f)
      for (const Config& v : o.finalist_variants) {
        Config m = kept[timed[f].second];
        for (const auto& [name, value] : v) m[name] = value;
        m = canonical(m);
        if (std::find(kept.begin(), kept.end(), m) != kept.end() ||
            std::find(variants.begin(), variants.end(), m) != variants.end())
          continue;
        if (hooks.keep && !hooks.keep(m)) {
          ++c.pruned;
          continue;
        }
        variants.push_back(std::move(m));
      }
    c.candidates += int(variants.size());
    const std::vector<bool> vok = compile_all(variants, hooks, threads, &c.failed);
    for (size_t i = 0; i < variants.size(); ++i) {
      if (!vok[i]) continue;
      check_interrupt();
      kept.push_back(variants[i]);
      try {
        const double ms = timer->median_ms([&] { run(kept.back()); }, hooks.restore, o.warmup, o.repeats);
        log::write(log::Level::debug, "autotune " + what + ": variant " + config_text(kept.back()) + " " + ms_text(ms));
        pool.push_back(kept.size() - 1);
        if (ms < best) {
          best = ms;
          c.config = kept.back();
        }
      } catch (const std::exception& e) {
        ++c.failed;
        log::write(log::Level::debug,
                   "autotune: variant " + config_text(kept.back()) + " failed to run: " + e.what());
      }
    }
  }
  if (pool.size() > 1 && o.final_rounds > 0) {
    std::vector<std::vector<double>> rounds(pool.size());
    std::vector<bool> dropped(pool.size(), false);  // failed in a final round: out of the running
    for (int round = 0; round < o.final_rounds; ++round)
      for (size_t f = 0; f < pool.size(); ++f) {
        if (dropped[f]) continue;
        check_interrupt();
        const Config& cand = kept[pool[f]];
        try {
          rounds[f].push_back(timer->median_ms([&] { run(cand); }, hooks.restore, 1, o.repeats));
        } catch (const kerf::Interrupted&) {
          throw;
        } catch (const std::exception& e) {
          dropped[f] = true;
          ++c.failed;
          log::write(log::Level::debug,
                     "autotune: finalist " + config_text(cand) + " failed to run: " + e.what());
        }
      }
    bool any = false;
    for (size_t f = 0; f < pool.size(); ++f) {
      const bool own = incumbent && pool[f] == *incumbent;
      if (dropped[f]) {
        if (own) incumbent.reset();  // failed in a final round: out of the running too
        continue;
      }
      std::vector<double>& v = rounds[f];
      std::sort(v.begin(), v.end());
      const double ms = v[v.size() / 2];
      log::write(log::Level::debug, "autotune " + what + ": finalist " + config_text(kept[pool[f]]) + " " +
                                        ms_text(ms));
      if (own) incumbent_ms = ms;
      if (!any || ms < best) {
        best = ms;
        c.config = kept[pool[f]];
      }
      any = true;
    }
    if (!any) best = -1.0;  // every finalist failed: the defaults below
  }
  // The incumbent stays unless the fastest beats it by more than the margin.
  if (incumbent && best >= 0 && incumbent_ms >= 0 && c.config != kept[*incumbent] &&
      best > incumbent_ms * (1.0 - o.incumbent_margin)) {
    char margin[32];
    std::snprintf(margin, sizeof margin, "%.3g%%", o.incumbent_margin * 100.0);
    log::write(log::Level::debug, "autotune " + what + ": " + config_text(c.config) + " (" + ms_text(best) +
                                      ") is within " + margin + " of the op's own config " +
                                      config_text(kept[*incumbent]) + " (" + ms_text(incumbent_ms) + "): keeping it");
    c.config = kept[*incumbent];
    best = incumbent_ms;
  }
  // The op's own launch must see the inputs it was given. A restore that fails after a
  // run leaves them changed: that is the op's error, not a reason to go on.
  put_back.done = true;
  if (ran && hooks.restore) hooks.restore();
  c.tune_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (best < 0) {
    log::once(log::Level::warn, "autotune-none:" + key.id.hex(),
              "autotune " + what + ": no candidate of " + std::to_string(c.candidates) +
                  " could run (" + std::to_string(c.pruned) + " pruned, " +
                  std::to_string(c.failed) +
                  " failed; KERF_LOG=debug says why); using the defaults " + config_text(fallback));
    c.config = fallback;
    c.from = Choice::From::defaults;
    keep_choice(c);
    return c;
  }
  c.best_ms = best;
  c.from = Choice::From::tuned;
  log::write(log::Level::info, "autotune " + what + ": chose " + config_text(c.config) + " (" +
                                   ms_text(best) + ") from " + std::to_string(c.candidates) +
                                   " candidates (" + std::to_string(c.pruned) + " pruned, " +
                                   std::to_string(c.failed) + " failed) in " + ms_text(c.tune_ms));
  if (o.persist) {
    cache::Entry e;
    e.kind = cache::EntryKind::tune_choice;
    const cache::Target t = target_of(p.device);
    e.props = {{"op", p.op},
               {"shape_bucket", bucket_text(p.shape_bucket)},
               {"dtypes", dtypes_text(p.dtypes)},
               {"layout", p.layout},
               {"backend", t.backend},
               {"arch", t.arch},
               {"device", t.device},
               {"config", config_text(c.config)},
               {"best_ms", std::to_string(best)},
               {"candidates", std::to_string(c.candidates)},
               {"tune_ms", std::to_string(c.tune_ms)},
               {"kerf_version", cache::kerf_version()}};
    cache::remember(key, e);
  }
  keep_choice(c);
  return c;
}

}  // namespace kerf::autotune
