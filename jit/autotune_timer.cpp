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

// Candidates are timed as the op runs in practice: with its inputs in device memory,
// not left in L2 by the previous run (a 4096x4096 bf16 W fits in an H100's 50 MB
// L2, and the config fastest from L2 need not be fastest from memory). Before each
// timed run, a fill of twice the L2's size, outside the events, evicts them.
class CudaEventTimer final : public Timer {
 public:
  CudaEventTimer(void* stream, int device) : stream_(stream), device_(device) {}

  double median_ms(const std::function<void()>& run, const std::function<void()>& restore,
                   int warmup, int repeats) override {
    for (int i = 0; i < warmup; ++i) {
      if (restore) restore();
      run();
    }
    // One pair of events per run, read after one synchronisation: no host round trip per run.
    std::vector<std::unique_ptr<cuda::Event>> start, stop;
    for (int i = 0; i < repeats; ++i) {
      start.push_back(std::make_unique<cuda::Event>(device_));  // the stream's device, whatever is current
      stop.push_back(std::make_unique<cuda::Event>(device_));
      if (restore) restore();  // queued on the stream before `start`: not timed
      l2_flush().fill_bytes_async(uint8_t(i), stream_);
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

  ~CudaEventTimer() override {
    // The flush buffer may still be in use by queued fills.
    if (flush_) cuda::stream_synchronize(stream_, device_);
  }

 private:
  cuda::DeviceBuffer& l2_flush() {
    if (!flush_) {
      const int64_t l2 = std::max(cuda::device_info(device_).l2_bytes, 8 << 20);
      flush_ = std::make_unique<cuda::DeviceBuffer>(size_t(2 * l2), device_);
    }
    return *flush_;
  }

  void* stream_;
  int device_;
  std::unique_ptr<cuda::DeviceBuffer> flush_;
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

std::unique_ptr<Timer> cuda_event_timer(void* stream, int device) {
  return std::make_unique<CudaEventTimer>(stream, device);
}
std::unique_ptr<Timer> wall_clock_timer() {
  return std::make_unique<WallClockTimer>();
}

}  // namespace kerf::autotune
