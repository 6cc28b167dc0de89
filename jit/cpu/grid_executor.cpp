// The CPU back end's grid executor: a pool of persistent worker threads that
// run the programs of a launch, handing out chunks of program ids through an
// atomic counter. Several threads may launch at once; their grids queue and
// each runs on all workers in turn.
//
// Workers get large stacks (tiles live on the stack: see CpuKernel::stack_bytes),
// so the calling thread, whose stack size kerf does not know, runs a program
// itself only for one-program grids with small frames.
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "jit/cpu/stack_budget.h"
#include "kerf/error.h"
#include "common/env_switch.h"
#include "kerf/jit/cpu_backend.h"

namespace kerf::jit::cpu {
namespace {

constexpr uint64_t kChunksPerWorker = 4;  // more chunks than workers balance uneven programs

int configured_threads() {
  const char* env = std::getenv("KERF_CPU_THREADS");
  // Blanks around the number dropped, and set empty (or blank): as unset, like kerf's other switches.
  if (const std::string word = env ? kerf::detail::switch_word(env) : std::string(); !word.empty()) {
    char* end = nullptr;
    const long n = std::strtol(word.c_str(), &end, 10);
    if (end == word.c_str() || *end != '\0' || n < 1 || n > 4096)
      throw InvalidArgument(
          std::string("KERF_CPU_THREADS must be a whole number from 1 to 4096, got '") + env + "'");
    return int(n);
  }
  return std::max(1, int(std::thread::hardware_concurrency()));
}

// One launch: programs [0, total) of `grid`, x fastest.
struct GridJob {
  CpuKernel::Entry entry = nullptr;
  const Slot* args = nullptr;
  Grid grid;
  uint64_t total = 0;
  uint64_t chunk = 1;
  std::atomic<uint64_t> next{0};  // first program id not yet handed out
  std::atomic<uint64_t> done{0};  // programs finished

  bool exhausted() const { return next.load(std::memory_order_relaxed) >= total; }

  // Runs chunks of programs until none is left.
  void work() {
    const int32_t nprog[3] = {int32_t(grid.x), int32_t(grid.y), int32_t(grid.z)};
    const uint64_t plane = uint64_t(grid.x) * grid.y;
    for (;;) {
      const uint64_t begin = next.fetch_add(chunk, std::memory_order_relaxed);
      if (begin >= total) return;
      const uint64_t end = std::min(total, begin + chunk);
      for (uint64_t id = begin; id < end; ++id) {
        const int32_t pid[3] = {int32_t(id % grid.x), int32_t((id / grid.x) % grid.y),
                                int32_t(id / plane)};
        entry(args, pid, nprog);
      }
      // Release: the programs' writes are visible to whoever sees the count complete.
      if (done.fetch_add(end - begin, std::memory_order_acq_rel) + (end - begin) == total)
        done.notify_all();
    }
  }

  void wait() const {
    for (uint64_t seen = done.load(std::memory_order_acquire); seen != total;
         seen = done.load(std::memory_order_acquire))
      done.wait(seen, std::memory_order_acquire);
  }
};

class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool pool(configured_threads());
    return pool;
  }

  explicit ThreadPool(int threads) : owner_(getpid()), size_(threads) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, kWorkerStackBytes);
    for (int i = 0; i < threads; ++i) {
      pthread_t t;
      if (pthread_create(&t, &attr, &ThreadPool::worker_main, this) != 0) break;
      threads_.push_back(t);
    }
    pthread_attr_destroy(&attr);
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (pthread_t t : threads_) pthread_join(t, nullptr);
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return size_; }

  // Runs the job to completion on the workers. `big_stack`: its programs need more stack
  // than the caller's thread is known to have.
  void run(const std::shared_ptr<GridJob>& job, bool big_stack) {
    // After fork() the workers exist only in the parent (and none may have started): run
    // everything in this process, on a thread with a worker's stack where the programs need it.
    if (threads_.empty() || getpid() != owner_) {
      if (big_stack)
        run_on_own_thread(*job);
      else
        job->work();
      return;
    }
    job->chunk = std::max<uint64_t>(1, job->total / (uint64_t(threads_.size()) * kChunksPerWorker));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(job);
    }
    wake_.notify_all();
    job->wait();
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.erase(std::remove(jobs_.begin(), jobs_.end(), job), jobs_.end());
  }

 private:
  static void run_on_own_thread(GridJob& job) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, kWorkerStackBytes);
    pthread_t t;
    const int rc = pthread_create(
        &t, &attr,
        [](void* j) -> void* {
          static_cast<GridJob*>(j)->work();
          return nullptr;
        },
        &job);
    pthread_attr_destroy(&attr);
    if (rc != 0)
      throw NotAvailable("the CPU back end could not start a thread with a " +
                         std::to_string(kWorkerStackBytes >> 20) +
                         " MiB stack for a kernel whose programs need more than the caller's");
    pthread_join(t, nullptr);
  }

  static void* worker_main(void* self) {
    static_cast<ThreadPool*>(self)->worker_loop();
    return nullptr;
  }

  void worker_loop() {
    for (;;) {
      std::shared_ptr<GridJob> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (stopping_) return;
        job = jobs_.front();
        if (job->exhausted()) {  // all handed out: the next launch may start
          jobs_.pop_front();
          continue;
        }
      }
      job->work();
    }
  }

  const pid_t owner_;
  const int size_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<GridJob>> jobs_;
  bool stopping_ = false;
  std::vector<pthread_t> threads_;
};

}  // namespace

void run_grid(const CpuKernel& k, Grid grid, const Slot* args) {
  auto job = std::make_shared<GridJob>();
  job->entry = k.entry();
  job->args = args;
  job->grid = grid;
  job->total = grid.count();
  if (job->total == 0) return;
  if (job->total == 1 && k.stack_bytes <= kCallerStackBytes) {
    job->work();  // one small program: no hand-off
    return;
  }
  ThreadPool::instance().run(job, k.stack_bytes > kCallerStackBytes);
}

int thread_count() {
  return ThreadPool::instance().size();
}

}  // namespace kerf::jit::cpu
