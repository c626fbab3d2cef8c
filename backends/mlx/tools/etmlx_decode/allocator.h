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

}  // namespace etmlx
