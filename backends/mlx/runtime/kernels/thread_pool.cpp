#include "kernels/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ETMLX_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define ETMLX_CPU_RELAX() asm volatile("yield")
#else
#define ETMLX_CPU_RELAX() ((void)0)
#endif

#include "options.h"

namespace etmlx::kernels {

namespace {

// How long an idle worker polls for the next job before it sleeps. Short: a polling thread holds a
// core that MLX's own thread or OpenBLAS's threads may need (on 2 cores, a 100 us poll made a
// quantized prefill 15x slower next to OpenBLAS's busy-waiting workers), while a wake-up costs only
// microseconds next to a linear's work.
constexpr auto kSpin = std::chrono::microseconds(5);

int machine_threads() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

int configured_threads() {
  const int n = options::process().num_threads;  // ETMLX_NUM_THREADS
  return n > 0 ? n : machine_threads();
}

// A job is open from when run() publishes it until the caller has taken its last chunk; a worker
// joins it only while it is open, and the caller then waits only for the workers that joined. So a
// worker still asleep (or descheduled: the machine is shared) when the job is published costs the
// caller nothing: it does the chunks itself instead of waiting for that worker to wake and find
// no work left (measured on 2 shared cores: that wait was a quarter of a 4-bit decode step's CPU
// time, as sched_yield and futex calls).
class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    // Detached and never joined: the pool lives for the whole process (a worker asleep at exit is harmless).
    for (int i = 1; i < threads_; ++i) std::thread([this] { work(); }).detach();
  }

  int threads() const { return threads_; }

  void run(int n, int grain, RangeFn fn, void* ctx) {
    if (n <= 0) return;
    grain = std::max(1, grain);
    const int chunks = (n + grain - 1) / grain;
    if (threads_ == 1 || chunks == 1 || !call_.try_lock()) {
      fn(ctx, 0, n);
      return;
    }
    // No worker is inside the previous job (run() waited for them), so the fields are ours to write.
    fn_ = fn, ctx_ = ctx, n_ = n, grain_ = grain;
    next_.store(0, std::memory_order_relaxed);
    const uint64_t job = (state_.load(std::memory_order_relaxed) >> kJobShift) + 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      state_.store(job << kJobShift, std::memory_order_release);  // open, nobody joined
    }
    cv_.notify_all();
    take_chunks();
    // Every chunk is taken: close the job, then wait for the workers that joined it to finish theirs.
    uint64_t s = state_.fetch_or(kClosed, std::memory_order_acq_rel) | kClosed;
    for (int spins = 0; (s & kJoinedMask) != 0; s = state_.load(std::memory_order_acquire)) {
      if (++spins < 4096) {
        ETMLX_CPU_RELAX();
      } else {
        std::this_thread::yield();
      }
    }
    call_.unlock();
  }

 private:
  // state_: the job's number above kJobShift, kClosed, and how many workers joined it below.
  static constexpr int kJobShift = 32;
  static constexpr uint64_t kClosed = uint64_t{1} << 31;
  static constexpr uint64_t kJoinedMask = kClosed - 1;

  void take_chunks() {
    for (;;) {
      const int begin = next_.fetch_add(grain_, std::memory_order_relaxed);
      if (begin >= n_) return;
      fn_(ctx_, begin, std::min(n_, begin + grain_));
    }
  }

  // Joins job `job` if it is still open: true when joined (the caller then waits for leave()).
  bool join(uint64_t job) {
    uint64_t s = state_.load(std::memory_order_acquire);
    while ((s >> kJobShift) == job && !(s & kClosed)) {
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acquire, std::memory_order_acquire)) return true;
    }
    return false;
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      int spins = 0;
      auto job = [&] { return state_.load(std::memory_order_acquire) >> kJobShift; };
      while (job() == seen) {
        ETMLX_CPU_RELAX();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return job() != seen; });
        }
      }
      seen = job();
      if (join(seen)) {
        take_chunks();
        state_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  const int threads_;
  std::mutex call_;  // held by the one parallel_for using the workers
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> state_{0};
  RangeFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int n_ = 0, grain_ = 1;
  std::atomic<int> next_{0};
};

Pool& pool() {
  static Pool* p = new Pool(configured_threads());  // leaked on purpose: see the constructor
  return *p;
}

}  // namespace

void parallel_for(int n, int grain, RangeFn fn, void* ctx) { pool().run(n, grain, fn, ctx); }

int pool_threads() { return pool().threads(); }

}  // namespace etmlx::kernels
