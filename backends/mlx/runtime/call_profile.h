// Where a call's host time goes: building the graph (the interpreter), handing it to MLX
// (async_eval of outputs and state), waiting for the outputs, copying them out. Sums over every
// call of every program in the process; `etmlx_bench` prints them, which is how a GPU decode step
// that is slower than its kernels shows whether the host or the device is the bound.
#pragma once

#include <chrono>
#include <cstdint>

namespace etmlx {

enum class CallPhase { Build = 0, Submit = 1, Wait = 2, Copy = 3 };

// Adds `seconds` to `phase`'s total.
void add_call_time(CallPhase phase, double seconds);
// Counts one call.
void count_call();

// Times the phases of one call: mark(phase) adds the time since the previous mark.
class CallTimer {
 public:
  CallTimer() : last_(std::chrono::steady_clock::now()) {}
  void mark(CallPhase phase) {
    const auto now = std::chrono::steady_clock::now();
    add_call_time(phase, std::chrono::duration<double>(now - last_).count());
    last_ = now;
  }

 private:
  std::chrono::steady_clock::time_point last_;
};

}  // namespace etmlx

// Exported from the backend library: the totals (seconds) and the call count since the last reset.
extern "C" void etmlx_call_profile(uint64_t* calls, double* build_s, double* submit_s, double* wait_s, double* copy_s);
extern "C" void etmlx_call_profile_reset();
