// How the autotuner measures a candidate: CUDA events on the GPU, the wall
// clock for the (synchronous) CPU back end; both the median of the repeats.
#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "kerf/error.h"
#include "kerf/jit/autotune.h"
#include "kerf/runtime/cuda.h"

namespace kerf::autotune {
namespace {

double median(std::vector<double> v) {
  if (v.empty()) throw InvalidArgument("autotune: a timer needs at least one repeat");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

class CudaEventTimer final : public Timer {
 public:
  explicit CudaEventTimer(void* stream) : stream_(stream) {}

  double median_ms(const std::function<void()>& run, const std::function<void()>& restore,
                   int warmup, int repeats) override {
    for (int i = 0; i < warmup; ++i) {
      if (restore) restore();
      run();
    }
    // One pair of events per run, read after one synchronisation: no host round trip per run.
    std::vector<std::unique_ptr<cuda::Event>> start, stop;
    for (int i = 0; i < repeats; ++i) {
      start.push_back(std::make_unique<cuda::Event>());
      stop.push_back(std::make_unique<cuda::Event>());
      if (restore) restore();  // queued on the stream before `start`: not timed
      start.back()->record(stream_);
      run();
      stop.back()->record(stream_);
    }
    std::vector<double> ms;
    for (int i = 0; i < repeats; ++i) {
      stop[size_t(i)]->synchronize();
      ms.push_back(cuda::Event::elapsed_ms(*start[size_t(i)], *stop[size_t(i)]));
    }
    return median(std::move(ms));
  }

 private:
  void* stream_;
};

class WallClockTimer final : public Timer {
 public:
  double median_ms(const std::function<void()>& run, const std::function<void()>& restore,
                   int warmup, int repeats) override {
    for (int i = 0; i < warmup; ++i) {
      if (restore) restore();
      run();
    }
    std::vector<double> ms;
    for (int i = 0; i < repeats; ++i) {
      if (restore) restore();
      const auto t0 = std::chrono::steady_clock::now();
      run();
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    return median(std::move(ms));
  }
};

}  // namespace

std::unique_ptr<Timer> cuda_event_timer(void* stream) {
  return std::make_unique<CudaEventTimer>(stream);
}
std::unique_ptr<Timer> wall_clock_timer() {
  return std::make_unique<WallClockTimer>();
}

}  // namespace kerf::autotune
