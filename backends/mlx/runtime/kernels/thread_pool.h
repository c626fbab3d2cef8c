// A small pool of worker threads for the cpu kernel set's host loops (quantized_matmul_cpu.cpp).
//
// MLX runs every CPU primitive on one worker thread per stream, so a host loop is single-threaded
// unless it splits its own work. The pool's threads are made once, on first use, and sleep between
// calls (after a short spin, so the back-to-back calls of a decode step do not pay a wake-up each).
// Its size is the CPUs this process may run on (sched affinity), or ETMLX_NUM_THREADS when set
// (1 = no workers: every loop runs on the calling thread).
#pragma once

#include <cstddef>

namespace etmlx::kernels {

// Calls fn(ctx, begin, end) over [0, n) in chunks of `grain` items, on the pool's threads and the
// caller's, and returns once every chunk is done. Safe from several threads: a caller that finds
// the pool busy runs its whole range itself.
using RangeFn = void (*)(void* ctx, int begin, int end);
void parallel_for(int n, int grain, RangeFn fn, void* ctx);

// parallel_for over a callable: fn(begin, end).
template <typename F>
void parallel_for(int n, int grain, F& fn) {
  parallel_for(n, grain, [](void* ctx, int begin, int end) { (*static_cast<F*>(ctx))(begin, end); }, &fn);
}

// Threads a parallel_for may use, the caller included (>= 1).
int pool_threads();

}  // namespace etmlx::kernels
