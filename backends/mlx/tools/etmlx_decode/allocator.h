// allocator.h: which malloc serves this process (the C++ tools link mimalloc in: CMakeLists.txt says why).
#pragma once

#include <string>

namespace etmlx {

// "mimalloc X.Y.Z" where a block from calloc() lies in mimalloc's heap, else "system": checked on a live
// allocation, so a build whose override did not take reports it.
std::string allocator_name();

}  // namespace etmlx
