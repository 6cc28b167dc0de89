// Helpers for the cache and autotune tests: a private cache directory per
// test, environment changes undone at the end of a test, captured log lines,
// and child processes (this test binary running one hidden test case, or
// kerf-cache) to check what another process sees.
#pragma once

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kerf/cache/log.h"
#include "kerf/cache/store.h"
#include "kerf/error.h"
#include "kerf/jit/autotune.h"
#include "kerf/jit/launch.h"

extern char** environ;

namespace kerf::test {

// A fresh directory under the test cache directory (or /tmp), removed at the end.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("KERF_CACHE_DIR");
    std::string root = base && *base ? std::string(base) + "/tmp" : "/tmp";
    std::filesystem::create_directories(root);
    std::string pattern = root + "/kerf-test-XXXXXX";
    if (!::mkdtemp(pattern.data())) throw InternalError("mkdtemp failed in " + root);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Sets variables for one test and puts the old values back; the cache, the
// log and the autotuner's memory start over both times.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<std::string, std::optional<std::string>>> vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name.c_str());
      saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
      set(name, value);
    }
    restart();
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) set(name, value);
    cache::unmount_bundles();
    restart();
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  static void set(const std::string& name, const std::optional<std::string>& value) {
    if (value)
      ::setenv(name.c_str(), value->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
  static void restart() {
    log::reload();
    cache::reload_settings();
    autotune::forget_choices();
    clear_kernel_cache();
  }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// Collects log lines (all levels the environment enables) while alive.
class LogCapture {
 public:
  LogCapture() {
    log::set_sink([this](log::Level, const std::string& m) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.push_back(m);
    });
  }
  ~LogCapture() { log::set_sink({}); }
  std::vector<std::string> lines() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_;
  }
  int count(const std::string& needle) {
    int n = 0;
    for (const std::string& l : lines())
      if (l.find(needle) != std::string::npos) ++n;
    return n;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// A child process with its stdout on a pipe.
class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
    std::vector<std::string> envs;
    for (char** e = environ; *e; ++e) {
      const std::string kv = *e;
      if (!env.count(kv.substr(0, kv.find('=')))) envs.push_back(kv);
    }
    for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
    std::vector<char*> cargv, cenv;
    for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
    for (const std::string& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
    cargv.push_back(nullptr);
    cenv.push_back(nullptr);
    int fds[2];
    if (::pipe(fds) != 0) throw InternalError("pipe failed");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    const int rc = ::posix_spawn(&pid_, cargv[0], &actions, nullptr, cargv.data(), cenv.data());
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    if (rc != 0) {
      ::close(fds[0]);
      throw InternalError("posix_spawn failed for " + argv[0]);
    }
    out_fd_ = fds[0];
  }
  ~Child() {
    if (pid_ > 0 && !waited_) {
      ::kill(pid_, SIGKILL);
      wait();
    }
    if (out_fd_ >= 0) ::close(out_fd_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  // Waits for the exit; returns the exit status (128 + signal when killed).
  int wait() {
    drain();
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    waited_ = true;
    drain();
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  const std::string& output() const { return output_; }
  // The value of a "NAME=value" line the child printed ("" when none).
  std::string value(const std::string& name) const {
    const std::string tag = name + "=";
    size_t at = 0;
    while ((at = output_.find(tag, at)) != std::string::npos) {
      if (at == 0 || output_[at - 1] == '\n') {
        const size_t end = output_.find('\n', at);
        return output_.substr(at + tag.size(),
                              end == std::string::npos ? std::string::npos : end - at - tag.size());
      }
      at += tag.size();
    }
    return "";
  }

 private:
  void drain() {
    char buf[4096];
    for (ssize_t n; (n = ::read(out_fd_, buf, sizeof buf)) > 0;) output_.append(buf, size_t(n));
  }
  pid_t pid_ = -1;
  int out_fd_ = -1;
  bool waited_ = false;
  std::string output_;
};

// Under compute-sanitizer (or with KERF_NO_TIMING_CHECKS set) kernels run many
// times slower: timing limits are printed but not checked.
inline bool timing_checks_apply() {
  return !std::getenv("CUDA_INJECTION64_PATH") && !std::getenv("KERF_NO_TIMING_CHECKS");
}

// This test binary running the hidden test case tagged `tag` (e.g. "[.cache-child-launch]").
inline std::vector<std::string> self_test(const std::string& tag) {
  return {std::filesystem::read_symlink("/proc/self/exe").string(), tag};
}

}  // namespace kerf::test
