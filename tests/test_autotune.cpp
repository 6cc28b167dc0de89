// The autotuner: the fastest candidate by the timer wins, pruned and failing
// candidates drop out, choices persist (keyed without the candidate list),
// KERF_AUTOTUNE switches it, inputs are restored between runs; the ops tune
// on the CPU back end with the wall clock and on a GPU with CUDA events.
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "catch.h"
#include "cpu_test_util.h"
#include "device_tensor.h"
#include "gpu_test_util.h"
#include "kerf/cache/disk_cache.h"
#include "kerf/jit/autotune.h"
#include "kerf/ops/ops.h"
#include "test_cache_util.h"

using namespace kerf;

namespace {

autotune::Config cand(int64_t block, int64_t warps) {
  return {{"BLOCK", block}, {"num_warps", warps}};
}

// Times each candidate by a table instead of running anything.
class FakeTimer final : public autotune::Timer {
 public:
  explicit FakeTimer(std::map<int64_t, double> ms_by_block) : ms_(std::move(ms_by_block)) {}
  double median_ms(const std::function<void()>& run, const std::function<void()>& restore,
                   int warmup, int repeats) override {
    for (int i = 0; i < warmup + repeats; ++i) {
      if (restore) restore();
      run();
    }
    return ms_.at(current);
  }
  int64_t current = 0;

 private:
  std::map<int64_t, double> ms_;
};

struct FakeOp {
  FakeTimer timer{{{16, 3.0}, {32, 1.5}, {64, 0.7}, {128, 2.0}, {256, 0.9}}};
  std::atomic<int> compiles{0}, runs{0}, restores{0};
  std::mutex mu;
  std::set<int64_t> compiled;

  autotune::Hooks hooks() {
    autotune::Hooks h;
    h.compile = [this](const autotune::Config& c) {
      ++compiles;
      std::lock_guard<std::mutex> lock(mu);
      compiled.insert(c.at("BLOCK"));
    };
    h.run = [this](const autotune::Config& c) {
      ++runs;
      timer.current = c.at("BLOCK");
    };
    h.restore = [this] { ++restores; };
    return h;
  }
};

autotune::Problem fake_problem(const std::string& op = "fake_op") {
  return autotune::Problem{op, {1024, 64}, {DType::bf16}, "", Device::cpu()};
}

const std::vector<autotune::Config> kCandidates = {cand(16, 4), cand(32, 4), cand(64, 4),
                                                   cand(128, 4), cand(256, 8)};

autotune::Options options_with(autotune::Timer* timer) {
  autotune::Options o;
  o.timer = timer;
  o.warmup = 1;
  o.repeats = 3;
  return o;
}

}  // namespace

// Times each candidate by a table, except that the first measurement of one
// candidate comes out too fast (a noisy run).
class NoisyTimer final : public autotune::Timer {
 public:
  double median_ms(const std::function<void()>& run, const std::function<void()>& restore,
                   int warmup, int repeats) override {
    for (int i = 0; i < warmup + repeats; ++i) {
      if (restore) restore();
      run();
    }
    const int n = calls[current]++;
    if (current == 256 && n == 0) return 0.5;  // really 0.9
    return std::map<int64_t, double>{{16, 3.0}, {32, 1.5}, {64, 0.7}, {128, 2.0}, {256, 0.9}}.at(current);
  }
  int64_t current = 0;
  std::map<int64_t, int> calls;
};

TEST_CASE("the tuner times its fastest candidates again before it chooses", "[autotune]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}});
  NoisyTimer timer;
  autotune::Hooks h;
  h.compile = [](const autotune::Config&) {};
  h.run = [&](const autotune::Config& c) { timer.current = c.at("BLOCK"); };
  autotune::Options o = options_with(&timer);
  const autotune::Choice c = autotune::choose(fake_problem("noisy_op"), kCandidates, cand(32, 4), h, o);
  CHECK(c.config == cand(64, 4));
  CHECK(c.best_ms == 0.7);
  // The finalists (256, 64 and 32 by the first round) ran three more times each; the others did not.
  CHECK(timer.calls[256] == 4);
  CHECK(timer.calls[64] == 4);
  CHECK(timer.calls[32] == 4);
  CHECK(timer.calls[128] == 1);
  CHECK(timer.calls[16] == 1);

  // Without the final rounds, the noisy first measurement wins.
  NoisyTimer fresh;
  h.run = [&](const autotune::Config& c) { fresh.current = c.at("BLOCK"); };
  o = options_with(&fresh);
  o.finalists = 0;
  o.persist = false;
  const autotune::Choice once = autotune::choose(fake_problem("noisy_op_2"), kCandidates, cand(32, 4), h, o);
  CHECK(once.config == cand(256, 8));
}

// Options::incumbent: the op's own config joins the final rounds wherever it placed, and
// stays unless another is faster by more than the margin (1% by default).
TEST_CASE("the tuner keeps the op's own config unless another beats it beyond the margin", "[autotune]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}});
  struct Case {
    std::map<int64_t, double> ms;
    int64_t incumbent, chosen;
    double margin;
  };
  // 128 is the incumbent: 0.5% slower than 64 (kept), 1.5% slower (64 wins), 5% slower with
  // a 10% margin (kept), or fourth of five in the first round and within the margin (it is
  // timed again and kept), or slowest by far (64 wins). Without an incumbent the fastest wins.
  const std::vector<Case> cases = {
      {{{16, 3.0}, {32, 1.5}, {64, 1.000}, {128, 1.005}, {256, 1.2}}, 128, 128, 0.01},
      {{{16, 3.0}, {32, 1.5}, {64, 1.000}, {128, 1.015}, {256, 1.2}}, 128, 64, 0.01},
      {{{16, 3.0}, {32, 1.5}, {64, 1.000}, {128, 1.050}, {256, 1.2}}, 128, 128, 0.10},
      {{{16, 3.0}, {32, 1.0}, {64, 1.000}, {128, 1.009}, {256, 1.001}}, 128, 128, 0.01},
      {{{16, 3.0}, {32, 1.5}, {64, 1.000}, {128, 9.0}, {256, 1.2}}, 128, 64, 0.01},
      {{{16, 3.0}, {32, 1.5}, {64, 1.000}, {128, 1.005}, {256, 1.2}}, 0, 64, 0.01},
  };
  int n = 0;
  for (const Case& k : cases) {
    CAPTURE(n, k.incumbent, k.margin);
    FakeTimer timer(k.ms);
    std::map<int64_t, int> runs;
    autotune::Hooks h;
    h.compile = [](const autotune::Config&) {};
    h.run = [&](const autotune::Config& c) {
      timer.current = c.at("BLOCK");
      ++runs[timer.current];
    };
    autotune::Options o = options_with(&timer);
    o.persist = false;
    if (k.incumbent) o.incumbent = cand(k.incumbent, 4);
    o.incumbent_margin = k.margin;
    const autotune::Choice c =
        autotune::choose(fake_problem("incumbent_op_" + std::to_string(n++)), kCandidates, cand(32, 4), h, o);
    CHECK(c.config.at("BLOCK") == k.chosen);
    CHECK(c.best_ms == k.ms.at(k.chosen));
    // The incumbent ran in the final rounds too (1 + 3 timings of warmup 1 + repeats 3).
    if (k.incumbent) CHECK(runs[k.incumbent] == 16);
  }
}

// Times by BLOCK, and a variant (V=1) by its own table.
class VariantTimer final : public autotune::Timer {
 public:
  double median_ms(const std::function<void()>& run, const std::function<void()>& restore, int warmup,
                   int repeats) override {
    for (int i = 0; i < warmup + repeats; ++i) {
      if (restore) restore();
      run();
    }
    const std::map<int64_t, double> base = {{16, 3.0}, {32, 1.5}, {64, 0.7}, {128, 2.0}, {256, 0.9}};
    const std::map<int64_t, double> with_v = {{32, 1.6}, {64, 0.5}, {256, 1.2}};
    return (variant ? with_v : base).at(current);
  }
  int64_t current = 0;
  bool variant = false;
};

TEST_CASE("the tuner tries its finalist variants on the finalists only, and keeps one that wins", "[autotune]") {
  VariantTimer timer;
  std::mutex mu;
  std::vector<autotune::Config> compiled;
  autotune::Hooks h;
  h.compile = [&](const autotune::Config& c) {
    std::lock_guard<std::mutex> lock(mu);
    compiled.push_back(c);
  };
  h.run = [&](const autotune::Config& c) {
    timer.current = c.at("BLOCK");
    timer.variant = autotune::value_or_zero(c, "V") == 1;
  };
  autotune::Options o = options_with(&timer);
  o.persist = false;
  o.finalist_variants = {{{"V", 1}}, {{"num_warps", 4}}};  // the second changes nothing for 4-warp finalists
  {
    test::ScopedEnv env({{"KERF_AUTOTUNE", "1"}});
    const autotune::Choice c = autotune::choose(fake_problem("variant_op"), kCandidates, cand(32, 4), h, o);
    autotune::Config want = cand(64, 4);
    want["V"] = 1;
    CHECK(c.config == want);
    CHECK(c.best_ms == 0.5);
  }
  // Compiled: the 5 candidates, V=1 on the finalists 64, 256 and 32, and 256 with 4 warps.
  CHECK(compiled.size() == 9);
  int variants = 0;
  for (const autotune::Config& c : compiled) variants += autotune::value_or_zero(c, "V") == 1;
  CHECK(variants == 3);
  for (const autotune::Config& c : compiled)
    if (autotune::value_or_zero(c, "V") == 1) CHECK((c.at("BLOCK") == 64 || c.at("BLOCK") == 256 || c.at("BLOCK") == 32));
}

TEST_CASE("candidates and variants that run as one are compiled and timed once", "[autotune]") {
  VariantTimer timer;
  std::mutex mu;
  std::vector<autotune::Config> compiled;
  std::map<autotune::Config, int> timed;
  autotune::Hooks h;
  h.compile = [&](const autotune::Config& c) {
    std::lock_guard<std::mutex> lock(mu);
    compiled.push_back(c);
  };
  h.run = [&](const autotune::Config& c) {
    ++timed[c];
    timer.current = c.at("BLOCK");
    timer.variant = autotune::value_or_zero(c, "V") == 1;
  };
  // IGNORED is an entry the fake op overrides: a config runs as the one without it.
  h.canonical = [](autotune::Config c) {
    c.erase("IGNORED");
    return c;
  };
  h.keep = [](const autotune::Config& c) { return c.at("BLOCK") != 16; };
  autotune::Options o = options_with(&timer);
  o.persist = false;
  o.finalist_variants = {{{"IGNORED", 2}}, {{"V", 1}, {"IGNORED", 3}}};
  std::vector<autotune::Config> candidates = kCandidates;
  autotune::Config twin = cand(64, 4);
  twin["IGNORED"] = 1;
  candidates.push_back(twin);  // runs as cand(64, 4)
  autotune::Config pruned_twin = cand(16, 4);
  pruned_twin["IGNORED"] = 1;
  candidates.push_back(pruned_twin);  // runs as cand(16, 4), which the pruning rule drops
  test::ScopedEnv env({{"KERF_AUTOTUNE", "1"}});
  const autotune::Choice c = autotune::choose(fake_problem("canonical_op"), candidates, cand(32, 4), h, o);
  autotune::Config want = cand(64, 4);
  want["V"] = 1;
  CHECK(c.config == want);  // in its canonical form
  // The 4 distinct candidates kept (16 is pruned, once), and V=1 on the finalists 64, 256
  // and 32: the IGNORED-only variant and the twin candidates are the finalists and
  // candidates themselves.
  CHECK(compiled.size() == 7);
  CHECK(c.pruned == 1);
  CHECK(c.candidates == 8);
  for (const autotune::Config& k : compiled) CHECK(k.count("IGNORED") == 0);
  CHECK(timed.size() == 7);
}

TEST_CASE("an interrupt check stops a tuning pass, and nothing is stored", "[autotune]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}});
  // Asked before each of the 5 compiles (1-5), the 5 timed candidates (6-10), and
  // each finalist's turn in the final rounds (11-19).
  for (const int stop_at : {1, 7, 13}) {
    CAPTURE(stop_at);
    FakeOp op;
    int asked = 0;
    autotune::set_interrupt_check([&] { return ++asked >= stop_at; });
    autotune::Options o = options_with(&op.timer);
    o.compile_threads = 1;
    const autotune::Problem problem = fake_problem("interrupted_op_" + std::to_string(stop_at));
    CHECK_THROWS_AS(autotune::choose(problem, kCandidates, cand(32, 4), op.hooks(), o), kerf::Interrupted);
    CHECK(asked == stop_at);
    autotune::set_interrupt_check({});
    // Tuned afresh: the interrupted pass left no choice in memory or in the cache.
    const autotune::Choice c = autotune::choose(problem, kCandidates, cand(32, 4), op.hooks(), o);
    CHECK(c.from == autotune::Choice::From::tuned);
    CHECK(c.config == cand(64, 4));
  }
}

TEST_CASE("an interrupted or failing tuning pass puts an in-place op's input back", "[autotune]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}});
  // The op adds 1 to its input in place; restore sets it back. Whatever ends the pass,
  // the input must be what the caller gave (an interrupt used to leave it changed).
  for (const int stop_at : {7, 9, 13, 16}) {
    CAPTURE(stop_at);
    FakeOp op;
    int input = 0;
    autotune::Hooks h = op.hooks();
    h.run = [&](const autotune::Config& c) {
      op.timer.current = c.at("BLOCK");
      ++input;
    };
    h.restore = [&] { input = 0; };
    int asked = 0;
    autotune::set_interrupt_check([&] { return ++asked >= stop_at; });
    autotune::Options o = options_with(&op.timer);
    o.compile_threads = 1;
    CHECK_THROWS_AS(autotune::choose(fake_problem("put_back_" + std::to_string(stop_at)), kCandidates, cand(32, 4),
                                     h, o),
                    kerf::Interrupted);
    autotune::set_interrupt_check({});
    CHECK(input == 0);
  }
  // A finalist that fails in a final round drops out; the pass still chooses, and puts back.
  FakeOp op;
  int input = 0, runs_of_64 = 0;
  autotune::Hooks h = op.hooks();
  h.run = [&](const autotune::Config& c) {
    op.timer.current = c.at("BLOCK");
    ++input;
    if (c.at("BLOCK") == 64 && ++runs_of_64 > 4) throw CudaError("lost in a final round", 1);
  };
  h.restore = [&] { input = 0; };
  const autotune::Choice c =
      autotune::choose(fake_problem("finalist_fails"), kCandidates, cand(32, 4), h, options_with(&op.timer));
  CHECK(c.from == autotune::Choice::From::tuned);
  CHECK(c.config == cand(256, 8));  // the next fastest (64 was fastest but failed)
  CHECK(c.failed == 1);
  CHECK(input == 0);
}

TEST_CASE("a stored choice that no longer compiles is reported and tuned again", "[autotune]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "warn"}});
  {
    FakeOp op;
    autotune::choose(fake_problem("stale"), kCandidates, cand(32, 4), op.hooks(), options_with(&op.timer));
  }
  autotune::forget_choices();  // as a new process (another build of kerf) would
  test::LogCapture logs;
  FakeOp op;
  autotune::Hooks h = op.hooks();
  h.compile = [&](const autotune::Config& c) {
    if (c.at("BLOCK") == 64) throw DefinitionError("BLOCK=64 is not a tile this build makes");
    ++op.compiles;
  };
  const autotune::Choice c = autotune::choose(fake_problem("stale"), kCandidates, cand(32, 4), h, options_with(&op.timer));
  CHECK(c.from == autotune::Choice::From::tuned);
  CHECK(c.config == cand(256, 8));
  CHECK(logs.count("the stored choice BLOCK=64,num_warps=4") == 1);
  CHECK(logs.count("BLOCK=64 is not a tile this build makes); tuning again") == 1);
}

TEST_CASE("a stored choice the op's usable hook refuses is reported and tuned again, not compiled", "[autotune]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "warn"}});
  {
    FakeOp op;
    autotune::choose(fake_problem("refused"), kCandidates, cand(32, 4), op.hooks(), options_with(&op.timer));
  }
  autotune::forget_choices();
  test::LogCapture logs;
  FakeOp op;
  autotune::Hooks h = op.hooks();
  bool compiled_64 = false;
  h.compile = [&](const autotune::Config& c) {
    compiled_64 = compiled_64 || c.at("BLOCK") == 64;
    ++op.compiles;
  };
  h.usable = [](const autotune::Config& c) -> std::string {
    return c.at("BLOCK") == 64 ? "BLOCK=64 is outside the [128, 256] the tuner tries" : "";
  };
  const autotune::Choice c =
      autotune::choose(fake_problem("refused"), kCandidates, cand(32, 4), h, options_with(&op.timer));
  CHECK(c.from == autotune::Choice::From::tuned);
  CHECK(logs.count("the stored choice BLOCK=64,num_warps=4") == 1);
  CHECK(logs.count("BLOCK=64 is outside the [128, 256] the tuner tries); tuning again") == 1);
}

TEST_CASE("the tuner picks the fastest candidate by its timer and stores the choice",
          "[autotune]") {
  test::TempDir dir;
  test::ScopedEnv env(
      {{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "info"}});
  test::LogCapture logs;
  FakeOp op;
  const autotune::Choice c = autotune::choose(fake_problem(), kCandidates, cand(32, 4), op.hooks(),
                                              options_with(&op.timer));
  CHECK(c.from == autotune::Choice::From::tuned);
  CHECK(c.config == cand(64, 4));
  CHECK(c.best_ms == 0.7);
  CHECK(c.candidates == 5);
  CHECK(op.compiles == 5);
  CHECK(op.compiled.size() == 5);
  // First round: 5 candidates x (1 warm-up + 3 timed); then the 3 fastest again,
  // 3 rounds each of (1 warm-up + 3 timed).
  CHECK(op.runs == 5 * 4 + 3 * 3 * 4);
  // A restore before every run, and one at the end for the op's own launch.
  CHECK(op.restores == 5 * 4 + 3 * 3 * 4 + 1);
  // The log line says what, from how many, in how long.
  CHECK(logs.count("autotune fake_op [1024x64] bf16") == 1);
  CHECK(logs.count("chose BLOCK=64,num_warps=4") == 1);
  CHECK(logs.count("from 5 candidates") == 1);
  // Stored in the cache.
  const std::optional<cache::Found> stored = cache::lookup(autotune::choice_key(fake_problem()));
  REQUIRE(stored);
  CHECK(stored->entry.kind == cache::EntryKind::tune_choice);
  CHECK(stored->entry.prop("config") == "BLOCK=64,num_warps=4");

  // The same process asks again: from memory, nothing compiled or run.
  const autotune::Choice again = autotune::choose(fake_problem(), kCandidates, cand(32, 4),
                                                  op.hooks(), options_with(&op.timer));
  CHECK(again.from == autotune::Choice::From::memory);
  CHECK(again.config == cand(64, 4));
  CHECK(op.compiles == 5);
}

TEST_CASE("a stored choice is reused, also when candidates are added", "[autotune]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}});
  {
    FakeOp op;
    autotune::choose(fake_problem(), kCandidates, cand(32, 4), op.hooks(), options_with(&op.timer));
  }
  autotune::forget_choices();  // as a new process would
  FakeOp op;
  std::vector<autotune::Config> more = kCandidates;
  more.push_back(cand(512, 8));
  const autotune::Choice c =
      autotune::choose(fake_problem(), more, cand(32, 4), op.hooks(), options_with(&op.timer));
  CHECK(c.from == autotune::Choice::From::cache);
  CHECK(c.config == cand(64, 4));
  CHECK(op.compiles == 1);  // the stored choice is readied (it must still compile), nothing else
  CHECK(op.compiled == std::set<int64_t>{64});
  CHECK(op.runs == 0);

  SECTION("in another process") {
    test::Child child(test::self_test("[.autotune-child-stored]"),
                      {{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}});
    REQUIRE(child.wait() == 0);
    CHECK(child.value("FROM") == "cache");
    CHECK(child.value("CONFIG") == "BLOCK=64,num_warps=4");
  }
  SECTION("KERF_AUTOTUNE=force tunes again") {
    test::ScopedEnv force({{"KERF_AUTOTUNE", "force"}});
    FakeOp again;
    const autotune::Choice f = autotune::choose(fake_problem(), more, cand(32, 4), again.hooks(),
                                                options_with(&again.timer));
    CHECK(f.from == autotune::Choice::From::tuned);
    CHECK(again.compiles == 6);
  }
  SECTION("a stored choice the pruning rule now rejects is tuned again") {
    FakeOp again;
    autotune::Hooks h = again.hooks();
    h.keep = [](const autotune::Config& c) { return c.at("BLOCK") != 64; };
    autotune::forget_choices();
    test::ScopedEnv warn({{"KERF_LOG", "warn"}});
    test::LogCapture logs;
    const autotune::Choice f =
        autotune::choose(fake_problem(), kCandidates, cand(32, 4), h, options_with(&again.timer));
    CHECK(f.from == autotune::Choice::From::tuned);
    CHECK(f.config == cand(256, 8));
    CHECK(f.pruned == 1);
    // Said, not silent.
    CHECK(logs.count("the stored choice 'BLOCK=64,num_warps=4'") == 1);
    CHECK(logs.count("cannot be used here (it is not among this device's candidates") == 1);
  }
}

TEST_CASE("child: the stored choice of the fake op", "[.autotune-child-stored]") {
  FakeOp op;
  op.hooks();
  autotune::Hooks h;  // nothing but the stored choice may be compiled, nothing run
  h.compile = [](const autotune::Config& c) {
    if (c.at("BLOCK") != 64) throw InternalError("compiled");
  };
  h.run = [](const autotune::Config&) { throw InternalError("ran"); };
  const autotune::Choice c =
      autotune::choose(fake_problem(), kCandidates, cand(32, 4), h, options_with(&op.timer));
  std::printf("FROM=%s\nCONFIG=%s\n", autotune::from_name(c.from),
              autotune::config_text(c.config).c_str());
}

TEST_CASE("pruned, failing and crashing candidates drop out", "[autotune]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}});
  FakeOp op;
  autotune::Hooks h = op.hooks();
  const auto compile = h.compile;
  const auto run = h.run;
  h.keep = [](const autotune::Config& c) {
    return c.at("BLOCK") != 256;
  };  // say, too much shared memory
  h.compile = [&](const autotune::Config& c) {
    if (c.at("BLOCK") == 64) throw CompileError("NVRTC says no", "", "");
    compile(c);
  };
  h.run = [&](const autotune::Config& c) {
    if (c.at("BLOCK") == 32) throw CudaError("launch failed: too many resources requested", 701);
    run(c);
  };
  const autotune::Choice c = autotune::choose(fake_problem("fake_op_2"), kCandidates, cand(16, 4),
                                              h, options_with(&op.timer));
  CHECK(c.from == autotune::Choice::From::tuned);
  CHECK(c.config == cand(128, 4));  // 2.0 ms beats 3.0 ms once 64, 32 and 256 are out
  CHECK(c.pruned == 1);
  CHECK(c.failed == 2);
}

TEST_CASE("with no candidate left, the defaults are used and a warning says why", "[autotune]") {
  test::TempDir dir;
  test::ScopedEnv env(
      {{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "warn"}});
  test::LogCapture logs;
  FakeOp op;
  autotune::Hooks h = op.hooks();
  h.keep = [](const autotune::Config&) { return false; };
  const autotune::Choice c = autotune::choose(fake_problem("fake_op_3"), kCandidates, cand(16, 4),
                                              h, options_with(&op.timer));
  CHECK(c.from == autotune::Choice::From::defaults);
  CHECK(c.config == cand(16, 4));
  CHECK(logs.count("no candidate") == 1);
  CHECK_FALSE(cache::lookup(autotune::choice_key(fake_problem("fake_op_3"))));  // nothing stored
}

TEST_CASE("KERF_AUTOTUNE=0 uses the defaults without running anything", "[autotune]") {
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "0"}});
  FakeOp op;
  const autotune::Choice c = autotune::choose(fake_problem(), kCandidates, cand(32, 4), op.hooks(),
                                              options_with(&op.timer));
  CHECK(c.from == autotune::Choice::From::defaults);
  CHECK(c.config == cand(32, 4));
  CHECK(op.compiles == 0);
  CHECK_FALSE(autotune::enabled_for(Device::cuda(0)));
  test::ScopedEnv unset({{"KERF_AUTOTUNE", std::nullopt}});
  CHECK(autotune::enabled_for(Device::cuda(0)));      // by default GPUs tune ...
  CHECK_FALSE(autotune::enabled_for(Device::cpu()));  // ... and the CPU back end uses defaults
}

TEST_CASE("the wall-clock timer returns the median of the repeats", "[autotune]") {
  std::unique_ptr<autotune::Timer> t = autotune::wall_clock_timer();
  int runs = 0, restores = 0;
  const double ms = t->median_ms(
      [&] {
        // The third timed run is slow; the median ignores it.
        if (++runs == 3) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      },
      [&] { ++restores; }, 1, 5);
  CHECK(runs == 6);
  CHECK(restores == 6);
  CHECK(ms < 20.0);
}

TEST_CASE("config text round-trips and rejects malformed text", "[autotune]") {
  CHECK(autotune::parse_config(autotune::config_text(cand(64, 8))) == cand(64, 8));
  CHECK(autotune::parse_config("BLOCK=64,oops").empty());
  CHECK(autotune::parse_config("BLOCK=6x4").empty());
}

// ---------------------------------------------------------------- the ops
namespace {

// The float64 reference: ||W[i,:] + s * (B @ A)[i,:]||.
double dora_reference_norm(const test::TestTensor& W, const test::TestTensor& A,
                           const test::TestTensor& B, double s, int64_t i) {
  const int64_t in = W.shape()[1], r = A.shape()[0];
  double ss = 0;
  for (int64_t j = 0; j < in; ++j) {
    double ba = 0;
    for (int64_t k = 0; k < r; ++k) ba += B.get(i * r + k) * A.get(k * in + j);
    const double v = W.get(i * in + j) + s * ba;
    ss += v * v;
  }
  return std::sqrt(ss);
}

void check_dora_cpu(int64_t out, int64_t in, int64_t r, const ops::Config& cfg) {
  std::mt19937_64 rng(42);
  const Device dev = Device::cpu();
  test::TestTensor W(DType::f32, {out, in}, dev), A(DType::f32, {r, in}, dev),
      B(DType::f32, {out, r}, dev);
  test::TestTensor m(DType::f32, {out}, dev), norm(DType::f32, {out}, dev),
      scale(DType::f32, {out}, dev);
  W.randomize(rng);
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  m.randomize(rng, 0.5, 1.5);
  ops::dora_norm(W.view(), A.view(), B.view(), m.view(), 0.5, norm.view(), scale.view(), 0.0,
                 nullptr, cfg);
  norm.download();
  for (int64_t i = 0; i < out; ++i)
    CHECK(norm.get(i) == Approx(dora_reference_norm(W, A, B, 0.5, i)).epsilon(1e-4));
}

}  // namespace

TEST_CASE("dora_norm tunes on the CPU back end with the wall clock and stays right",
          "[autotune][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  test::ScopedEnv env(
      {{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "info"}});
  test::LogCapture logs;
  check_dora_cpu(96, 80, 8, {});
  CHECK(logs.count("autotune dora_norm [128x128x16] f32,f32,f32,f32") == 1);
  CHECK(logs.count("chose") == 1);
  check_dora_cpu(100, 70, 8, {});  // the same bucket: no second tuning
  CHECK(logs.count("chose") == 1);
  int choices = 0;
  for (const auto& l : cache::DiskCache(dir.path(), cache::DiskMode::readonly).list())
    choices += l.decoded.entry.kind == cache::EntryKind::tune_choice;
  CHECK(choices == 1);
}

TEST_CASE("a repeated op call reuses its plan until the autotune settings or choices change",
          "[autotune][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  {
    test::ScopedEnv off({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "0"}, {"KERF_LOG", "info"}});
    test::LogCapture logs;
    check_dora_cpu(96, 80, 8, {});
    check_dora_cpu(96, 80, 8, {});
    CHECK(logs.count("autotune") == 0);
  }
  // The same call after KERF_AUTOTUNE changed (a settings reload): tuned, not the remembered defaults.
  test::ScopedEnv on({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "info"}});
  test::LogCapture logs;
  check_dora_cpu(96, 80, 8, {});
  CHECK(logs.count("chose") == 1);
  check_dora_cpu(96, 80, 8, {});  // remembered: no lookup, no log line
  CHECK(logs.count("autotune") == 1);
  autotune::forget_choices();  // the next call asks the autotuner again, which finds the stored choice
  check_dora_cpu(96, 80, 8, {});
  CHECK(logs.count("(stored choice)") == 1);
  CHECK(logs.count("chose") == 1);
}

TEST_CASE("an explicit ops::Config overrides the tuner", "[autotune][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  test::ScopedEnv env(
      {{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "info"}});
  test::LogCapture logs;
  ops::Config cfg;
  cfg.block_m = 16;
  check_dora_cpu(64, 64, 4, cfg);
  CHECK(logs.count("autotune") == 0);
}

TEST_CASE("an in-place MoE materialization is restored between tuning runs", "[autotune][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  test::ScopedEnv env(
      {{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "info"}});
  test::LogCapture logs;
  const int64_t E = 2, N = 48, K = 40, r = 4;
  std::mt19937_64 rng(7);
  const Device dev = Device::cpu();
  test::TestTensor W(DType::f32, {E, N, K}, dev), A(DType::f32, {E, r, K}, dev),
      B(DType::f32, {E, N, r}, dev);
  W.randomize(rng);
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  std::vector<double> before(size_t(E * N * K));
  for (size_t i = 0; i < before.size(); ++i) before[i] = W.get(int64_t(i));
  ops::moe_lora_materialize(W.view(), A.view(), B.view(), 0.25, W.view());  // W_eff is W
  CHECK(logs.count("chose") == 1);
  W.download();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        double ba = 0;
        for (int64_t j = 0; j < r; ++j)
          ba += B.get((e * N + n) * r + j) * A.get((e * r + j) * K + k);
        const int64_t i = (e * N + n) * K + k;
        CHECK(W.get(i) ==
              Approx(before[size_t(i)] + 0.25 * ba).epsilon(1e-5).margin(1e-6));  // added once
      }
}

TEST_CASE("tuning an in-place merge of a strided view never writes the memory between its elements",
          "[autotune][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  test::TempDir dir;
  test::ScopedEnv env({{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}});
  // W [64, 256]: one thread tunes lora_merge on its left half W[:, :128] while another
  // merges into the right half with an explicit Config. Restoring the left half's byte span
  // (as before) wrote old values over the right half's rows and lost the other thread's adds.
  const int64_t rows = 64, cols = 256, half = 128, r = 2;
  std::vector<float> W(size_t(rows * cols), 0.0f), A(size_t(r * half)), B(size_t(rows * r));
  for (size_t i = 0; i < A.size(); ++i) A[i] = float((i * 7) % 3 == 0);  // 0/1: every sum is exact
  for (size_t i = 0; i < B.size(); ++i) B[i] = float((i * 5) % 2);
  const TensorView left = TensorView::strided(W.data(), DType::f32, {rows, half}, {cols, 1});
  const TensorView right = TensorView::strided(W.data() + half, DType::f32, {rows, half}, {cols, 1});
  const TensorView a = TensorView::contiguous(A.data(), DType::f32, {r, half});
  const TensorView b = TensorView::contiguous(B.data(), DType::f32, {rows, r});
  ops::Config fixed;
  fixed.block_m = 16;
  fixed.block_k = 32;
  fixed.num_warps = 4;
  fixed.num_stages = 1;
  ops::lora_merge(right, a, b, 1.0, nullptr, fixed);  // compiled before the race starts
  std::atomic<bool> tuning_done{false};
  int right_merges = 1;
  std::thread other([&] {
    while (!tuning_done.load()) {
      ops::lora_merge(right, a, b, 1.0, nullptr, fixed);
      ++right_merges;
    }
  });
  ops::lora_merge(left, a, b, 1.0);  // tunes: many timed runs, each restored
  tuning_done = true;
  other.join();
  INFO("merges into the right half while the left one tuned: " << right_merges);
  int wrong_left = 0, wrong_right = 0;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < half; ++j) {
      double ba = 0;
      for (int64_t k = 0; k < r; ++k) ba += double(B[size_t(i * r + k)]) * A[size_t(k * half + j)];
      wrong_left += W[size_t(i * cols + j)] != float(ba);
      wrong_right += W[size_t(i * cols + half + j)] != float(ba * right_merges);
    }
  CHECK(wrong_left == 0);
  CHECK(wrong_right == 0);
}

// A cache of its own, tuning on the CPU back end too with each choice logged, and no
// choice remembered from earlier in the process.
struct FreshTuning {
  test::TempDir dir;
  test::ScopedEnv env{{{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "1"}, {"KERF_LOG", "info"}}};
  FreshTuning() { autotune::forget_choices(); }
};

TEST_CASE("a column-major weight (W.T) is tuned apart from a row-major one of the same shape",
          "[autotune][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const FreshTuning fresh;
  test::LogCapture logs;
  const int64_t out = 48, in = 80, r = 4;
  std::vector<float> W(size_t(out * in), 1.0f), A(size_t(r * in), 0.5f), B(size_t(out * r), 0.25f);
  const TensorView a = TensorView::contiguous(A.data(), DType::f32, {r, in});
  const TensorView b = TensorView::contiguous(B.data(), DType::f32, {out, r});
  ops::lora_merge(TensorView::contiguous(W.data(), DType::f32, {out, in}), a, b, 1.0);
  CHECK(logs.count("chose") == 1);
  // The same shape over memory laid out [in, out] (PEFT's fan_in_fan_out weight, seen as W.T).
  ops::lora_merge(TensorView::strided(W.data(), DType::f32, {out, in}, {1, out}), a, b, 1.0);
  CHECK(logs.count("chose") == 2);
  CHECK(logs.count("lora_merge [1x64x128x16x-3]") >= 1);  // its bucket says which dims have stride 1 (-1 - bits)
}

TEST_CASE("PEFT's flat expert adapters and gradients are tuned apart from plain [E, d1, r] ones of the same shapes",
          "[autotune][cpu]") {
  KERF_REQUIRE_CPU_BACKEND();
  const FreshTuning fresh;
  test::LogCapture logs;
  const int64_t E = 3, d1 = 40, d2 = 48, r = 4;
  std::vector<float> dW(size_t(E * d1 * d2), 0.5f), A(size_t(E * r * d2), 0.25f), B(size_t(E * d1 * r), 0.75f);
  std::vector<float> dA(A.size()), dB(B.size());
  const auto t = [](std::vector<float>& v, std::vector<int64_t> shape) {
    return TensorView::contiguous(v.data(), DType::f32, shape);
  };
  ops::moe_lora_materialize_backward(t(dW, {E, d1, d2}), t(A, {E, r, d2}), t(B, {E, d1, r}), 1.0, t(dA, {E, r, d2}),
                                     t(dB, {E, d1, r}));
  CHECK(logs.count("chose") == 1);
  // The same shapes through PEFT's flat lora_A [r*E, d2] and lora_B [d1, r*E]: B[e] has
  // its rank columns E apart (unit stride on the expert dim).
  const ops::MoeLoraViews v = ops::peft_moe_lora_views(t(dW, {E, d1, d2}), t(A, {r * E, d2}), t(B, {d1, r * E}));
  const ops::MoeLoraViews g = ops::peft_moe_lora_views(t(dW, {E, d1, d2}), t(dA, {r * E, d2}), t(dB, {d1, r * E}));
  ops::moe_lora_materialize_backward(t(dW, {E, d1, d2}), v.A, v.B, 1.0, g.A, g.B);
  CHECK(logs.count("chose") == 2);
  // A row-major [E, r, d2] (bits 4) beside B's unit stride on dim 0 (bits 1): -65536 - (4 << 8 | 1);
  // the gradients, laid out the same, in the next range down: -131072 - (4 << 8 | 1).
  CHECK(logs.count("moe_lora_materialize_backward [4x64x64x16x-66561x-132097]") >= 1);
  // Plain adapters with PEFT's flat gradients: tuned apart from both.
  ops::moe_lora_materialize_backward(t(dW, {E, d1, d2}), t(A, {E, r, d2}), t(B, {E, d1, r}), 1.0, g.A, g.B);
  CHECK(logs.count("chose") == 3);
  CHECK(logs.count("moe_lora_materialize_backward [4x64x64x16x-132097]") >= 1);
  // Plain adapters again: their choice is kept, not tuned anew.
  ops::moe_lora_materialize_backward(t(dW, {E, d1, d2}), t(A, {E, r, d2}), t(B, {E, d1, r}), 1.0, t(dA, {E, r, d2}),
                                     t(dB, {E, d1, r}));
  CHECK(logs.count("chose") == 3);
  // The forward likewise.
  std::vector<float> out(dW.size());
  ops::moe_lora_materialize(t(dW, {E, d1, d2}), t(A, {E, r, d2}), t(B, {E, d1, r}), 1.0, t(out, {E, d1, d2}));
  ops::moe_lora_materialize(t(dW, {E, d1, d2}), v.A, v.B, 1.0, t(out, {E, d1, d2}));
  CHECK(logs.count("chose") == 5);
  CHECK(logs.count("moe_lora_materialize [4x64x64x16x-66561]") >= 1);
}

TEST_CASE("tuning dora_norm for a new shape on the GPU finishes in under 3 s", "[autotune][gpu]") {
  KERF_REQUIRE_GPU();
  KERF_REQUIRE_NVRTC();
  test::TempDir dir;
  test::ScopedEnv env(
      {{"KERF_CACHE_DIR", dir.path()}, {"KERF_AUTOTUNE", "force"}, {"KERF_LOG", "info"}});
  test::LogCapture logs;
  const Device dev = Device::cuda(0);
  const int64_t out = 4096, in = 4096, r = 16;
  std::mt19937_64 rng(3);
  test::TestTensor W(DType::bf16, {out, in}, dev), A(DType::bf16, {r, in}, dev),
      B(DType::bf16, {out, r}, dev);
  test::TestTensor m(DType::bf16, {out}, dev), norm(DType::f32, {out}, dev),
      scale(DType::f32, {out}, dev);
  W.randomize(rng);
  A.randomize(rng, -0.5, 0.5);
  B.randomize(rng, -0.5, 0.5);
  m.randomize(rng, 0.5, 1.5);
  const auto t0 = std::chrono::steady_clock::now();
  ops::dora_norm(W.view(), A.view(), B.view(), m.view(), 0.5, norm.view(), scale.view());
  cuda::device_synchronize(0);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  for (const std::string& l : logs.lines())
    if (l.find("autotune") != std::string::npos) std::printf("KERF-AUTOTUNE: %s\n", l.c_str());
  CHECK(logs.count("chose") == 1);
  // The goal is 3 s for 16 candidates; dora_norm has more (the log line says how many).
  int candidates = 16;
  for (const std::string& l : logs.lines())
    if (const size_t at = l.find(" from "); at != std::string::npos && l.find("chose") != std::string::npos)
      candidates = std::atoi(l.c_str() + at + 6);
  const double budget_ms = 3000.0 * std::max(1.0, candidates / 16.0);
  std::printf("KERF-AUTOTUNE: first dora_norm call with tuning: %.0f ms for %d candidates (budget %.0f ms)\n",
              ms, candidates, budget_ms);
  if (test::timing_checks_apply()) CHECK(ms < budget_ms);
  // Right with the chosen config.
  norm.download();
  for (int64_t i = 0; i < out; i += 511)
    CHECK(norm.get(i) == Approx(dora_reference_norm(W, A, B, 0.5, i)).epsilon(2e-2));
}
