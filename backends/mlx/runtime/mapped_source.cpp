#include "mapped_source.h"

#include <cstdint>
#include <cstdio>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace etmlx {

namespace {

#if defined(__linux__)
// True when [begin, end) lies inside read-only mappings of one file (maps lines with its inode and a path,
// each starting where the one before ends: a segment's mapping can be listed as several).
bool inside_file_mapping(uintptr_t begin, uintptr_t end) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return false;
  char line[4096];
  uintptr_t covered = begin;  // [begin, covered) is known to be in the file's mappings
  unsigned long file = 0;
  bool ok = false;
  while (std::fgets(line, sizeof line, maps) != nullptr) {
    unsigned long lo = 0, hi = 0, inode = 0;
    char perms[8] = {0};
    int path_at = 0;
    // start-end perms offset dev inode path
    if (std::sscanf(line, "%lx-%lx %7s %*s %*s %lu %n", &lo, &hi, perms, &inode, &path_at) < 4) continue;
    if (covered < lo || covered >= hi) {
      if (file != 0) break;  // the run of mappings ended before `end`
      continue;
    }
    // Read-only: a writable private mapping may hold modified pages, which dropping would lose.
    if (inode == 0 || line[path_at] != '/' || perms[1] == 'w' || (file != 0 && inode != file)) break;
    file = inode;
    covered = hi;
    if (covered >= end) {
      ok = true;
      break;
    }
  }
  std::fclose(maps);
  return ok;
}
#endif

}  // namespace

MappedSource::MappedSource(const void* data, size_t size)
    : data_(static_cast<const unsigned char*>(data)), size_(size) {
#if defined(__linux__)
  const auto begin = reinterpret_cast<uintptr_t>(data_);
  file_backed_ = size_ > 0 && inside_file_mapping(begin, begin + size_);
#endif
}

void MappedSource::drop_copied(size_t upto) {
#if defined(__linux__)
  if (!file_backed_) return;
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto base = reinterpret_cast<uintptr_t>(data_);
  // Whole pages only: a page shared with bytes not copied yet (or with another segment) stays.
  const uintptr_t from = next_ != 0 ? next_ : (base + page - 1) & ~(page - 1);
  const uintptr_t to = (base + (upto < size_ ? upto : size_)) & ~(page - 1);
  if (to <= from) return;
  next_ = to;
  void* at = reinterpret_cast<void*>(from);
  munlock(at, to - from);  // locked pages cannot be dropped; unlocking a page not locked is harmless
  madvise(at, to - from, MADV_DONTNEED);
#else
  (void)upto;
#endif
}

}  // namespace etmlx
