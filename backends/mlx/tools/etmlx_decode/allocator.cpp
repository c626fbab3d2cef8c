// allocator.h
#include "allocator.h"

#include <cstdlib>

#ifdef ETMLX_MIMALLOC
#include <mimalloc.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif
#endif

namespace etmlx {

std::string allocator_name() {
#ifdef ETMLX_MIMALLOC
  void* block = std::calloc(1, 64);  // calloc: GCC warns of malloc's uninitialized bytes behind a const void*
  const bool ours = mi_is_in_heap_region(block);
  std::free(block);
  if (ours) {
    const int v = mi_version();  // as MI_MALLOC_VERSION: major, then two digits of minor and two of patch
    return "mimalloc " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
  }
#endif
  return "system";
}

void configure_allocator() {
#if defined(ETMLX_MIMALLOC) && defined(__linux__)
  const char* thp = std::getenv("MIMALLOC_ALLOW_THP");
  if (thp == nullptr || std::string(thp) != "1") prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
#endif
}

PromptPurge::PromptPurge() {
#ifdef ETMLX_MIMALLOC
  if (std::getenv("MIMALLOC_PURGE_DELAY") == nullptr) {
    saved_ = mi_option_get(mi_option_purge_delay);
    mi_option_set(mi_option_purge_delay, 0);
    changed_ = true;
  }
#endif
}

PromptPurge::~PromptPurge() {
#ifdef ETMLX_MIMALLOC
  if (changed_) mi_option_set(mi_option_purge_delay, saved_);
#endif
}

}  // namespace etmlx
