// allocator.h: which malloc serves this process (the C++ tools link mimalloc in: CMakeLists.txt says why).
#pragma once

#include <string>

namespace etmlx {

// "mimalloc X.Y.Z" where a block from calloc() lies in mimalloc's heap, else "system": checked on a live
// allocation, so a build whose override did not take reports it.
std::string allocator_name();

// With mimalloc: transparent huge pages off for this process (prctl), unless MIMALLOC_ALLOW_THP=1. mimalloc
// asks for huge pages on its arenas, and a weight loaded into one then counts 2 MB pages: peak RSS grew ~14%
// at 0.5B (379 -> 433 MB) for ~4% of decode speed, where glibc's malloc used 4 KB pages. Call first in main.
void configure_allocator();

// While one lives, memory freed goes back to the system at once (mimalloc's purge delay 0; by default it waits
// 10 ms, in case the process allocates again). A prefill over an image prompt frees and allocates hundreds of MB
// of buffers within that delay: at the ~0.5B LLaVA shape of `etmlx bench vision` the peak RSS of the first token
// fell from 1.24x to 1.10x the weights. Decode steps keep the delay: on every step it cost ~2.5% of their speed
// (docs/log.md). Nothing changes with the system malloc, or where MIMALLOC_PURGE_DELAY is set.
class PromptPurge {
 public:
  PromptPurge();
  ~PromptPurge();
  PromptPurge(const PromptPurge&) = delete;
  PromptPurge& operator=(const PromptPurge&) = delete;

 private:
  [[maybe_unused]] bool changed_ = false;  // (unused without mimalloc: macOS)
  [[maybe_unused]] long saved_ = 0;  // the delay to restore
};

}  // namespace etmlx
