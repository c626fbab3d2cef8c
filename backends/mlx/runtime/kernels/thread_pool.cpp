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
  const char* env = std::getenv("ETMLX_NUM_THREADS");
  if (env != nullptr && env[0] != '\0') {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1 && n <= 1024) return static_cast<int>(n);
    std::fprintf(stderr, "etmlx: ETMLX_NUM_THREADS=%s is not a thread count from 1 to 1024; using %d\n", env,
                 machine_threads());
  }
  return machine_threads();
}

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
    fn_ = fn, ctx_ = ctx, n_ = n, grain_ = grain;
    next_.store(0, std::memory_order_relaxed);
    busy_.store(threads_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    take_chunks();
    for (int spins = 0; busy_.load(std::memory_order_acquire) != 0; ++spins) {
      if (spins < 4096) {
        ETMLX_CPU_RELAX();
      } else {
        std::this_thread::yield();
      }
    }
    call_.unlock();
  }

 private:
  void take_chunks() {
    for (;;) {
      const int begin = next_.fetch_add(grain_, std::memory_order_relaxed);
      if (begin >= n_) return;
      fn_(ctx_, begin, std::min(n_, begin + grain_));
    }
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      int spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        ETMLX_CPU_RELAX();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      take_chunks();
      busy_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int threads_;
  std::mutex call_;  // held by the one parallel_for using the workers
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  RangeFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int n_ = 0, grain_ = 1;
  std::atomic<int> next_{0};
  std::atomic<int> busy_{0};  // workers not yet done with the current job
};

Pool& pool() {
  static Pool* p = new Pool(configured_threads());  // leaked on purpose: see the constructor
  return *p;
}

}  // namespace

void parallel_for(int n, int grain, RangeFn fn, void* ctx) { pool().run(n, grain, fn, ctx); }

int pool_threads() { return pool().threads(); }

}  // namespace etmlx::kernels
