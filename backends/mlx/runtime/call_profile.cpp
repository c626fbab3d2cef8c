#include "call_profile.h"

#include <atomic>

namespace etmlx {
namespace {

// Nanoseconds as integers: atomics a program's calls on several threads can add to without a lock.
std::atomic<uint64_t> g_calls{0};
std::atomic<uint64_t> g_ns[4] = {0, 0, 0, 0};

}  // namespace

void add_call_time(CallPhase phase, double seconds) {
  g_ns[static_cast<int>(phase)].fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
}

void count_call() { g_calls.fetch_add(1, std::memory_order_relaxed); }

}  // namespace etmlx

extern "C" __attribute__((visibility("default"))) void etmlx_call_profile(uint64_t* calls, double* build_s,
                                                                          double* submit_s, double* wait_s,
                                                                          double* copy_s) {
  using etmlx::g_calls;
  using etmlx::g_ns;
  *calls = g_calls.load();
  double* out[4] = {build_s, submit_s, wait_s, copy_s};
  for (int i = 0; i < 4; ++i) *out[i] = static_cast<double>(g_ns[i].load()) * 1e-9;
}

extern "C" __attribute__((visibility("default"))) void etmlx_call_profile_reset() {
  etmlx::g_calls.store(0);
  for (auto& ns : etmlx::g_ns) ns.store(0);
}
