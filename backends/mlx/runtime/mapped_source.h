// A weight's source bytes, when they lie in a file mapping: its pages can be given back as they are copied.
//
// Loading a program copies each weight out of ExecuTorch's mapping of the .pte/.ptd (named_constant.cpp) and
// unmaps it after. ExecuTorch's loader maps a segment whole (and may mlock it, which faults every page in),
// so until the copy ends the process holds the weight twice: at 8B the 262 MB head made the load's peak one
// head above what it settles at, and that peak was the export's (issue 51). Pages of a file mapping can be
// dropped as soon as they are copied: a later read would fetch them from the file again. Anonymous memory
// (a program loaded from a buffer the caller owns) must never be dropped: it would read back as zeros.
#pragma once

#include <cstddef>
#include <cstdint>

namespace etmlx {

class MappedSource {
 public:
  // Looks `data` up in /proc/self/maps (Linux; elsewhere nothing is ever dropped).
  MappedSource(const void* data, size_t size);
  // Gives back the whole pages inside [data, data + upto) not given back yet: unlocked, then
  // madvise(MADV_DONTNEED). A no-op outside a file mapping.
  void drop_copied(size_t upto);

 private:
  const unsigned char* data_;
  size_t size_;
  uintptr_t next_ = 0;  // the first page not given back yet (0: none given back)
  bool file_backed_ = false;
};

}  // namespace etmlx
