// The per-method delegate handle: the loaded program and its mutable state (a decoder's KV cache).
// backend.cpp creates and runs it; program_state.cpp lets the host read and write the state between
// calls, finding the handle by the id registered here.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include <mlx/array.h>
#include <mlx/transforms.h>

#include "loader.h"

namespace etmlx {

struct Handle {
  Program program;
  // Current value of each mutable buffer (parallel to program.mutable_slots). Possibly still being
  // computed: a call waits for its outputs, not for its new state (see backend.cpp's run()).
  std::vector<mlx::core::array> state;
  // Set when evaluating a call's graph failed after the old state was handed to it: the state is
  // then unknown (its buffers may have been updated in place), so later calls are refused.
  bool state_lost = false;
  // Held by a call and by the host's state accesses (program_state.cpp), which may come from
  // another thread than the calls.
  std::mutex mu;
  // Registry id (program_state.cpp); 0 for a program without state, which is not registered.
  uint64_t id = 0;

  ~Handle() {
    // Work still running reads the program's weights (mapped named data) and state buffers:
    // finish it before they go.
    try {
      mlx::core::eval(state);
    } catch (...) {
    }
  }
};

// Give a stateful handle its id and list it under that id; noted as created by this thread, which
// etmlx_state_claim() hands to the code that just loaded the method. No-op for a stateless one.
void register_handle(Handle* h);
// Remove it before it is deleted; waits for any state access in progress.
void unregister_handle(Handle* h);

}  // namespace etmlx
