// Size limits every exec_ applies to shapes that come from an untrusted blob.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

#include "options.h"

namespace etmlx {

// No single intermediate may exceed this many bytes (logical size, so a
// broadcast view counts at its full size). It keeps a corrupted shape literal
// from asking the allocator for terabytes; real graphs stay far below it.
inline constexpr uint64_t kMaxArrayBytes = uint64_t{1} << 36;
inline constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();

// Element count of `shape` if every entry is >= 0 and the product stays within
// kMaxArrayBytes (so it cannot wrap); std::nullopt otherwise. Entries equal
// to -1 are skipped when `skip_minus_one` (reshape's inferred dimension).
template <typename Dims>
std::optional<uint64_t> checked_numel(const Dims& shape, bool skip_minus_one = false) {
  uint64_t n = 1;
  for (const auto d64 : shape) {
    const int64_t d = static_cast<int64_t>(d64);
    if (skip_minus_one && d == -1) continue;
    if (d < 0) return std::nullopt;
    if (d != 0 && n > kMaxArrayBytes / static_cast<uint64_t>(d)) return std::nullopt;
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

// The largest array the runtime may create (bytes): the machine's physical memory, or the
// address-space limit (RLIMIT_AS) if lower, or ETMLX_MAX_ARRAY_BYTES if set; never more than
// kMaxArrayBytes. Larger arrays are refused before they are allocated: MLX turns a failed
// allocation into a write through a null pointer (SIGSEGV), so it must never be asked.
inline uint64_t max_array_bytes() {
  static const uint64_t limit = [] {
    uint64_t bytes = kMaxArrayBytes;
    if (const uint64_t asked = options::process().max_array_bytes; asked != 0) return std::min(asked, bytes);
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0 && static_cast<uint64_t>(pages) < bytes / static_cast<uint64_t>(page)) {
      bytes = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page);
    }
    rlimit as{};
    if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY && as.rlim_cur < bytes) {
      bytes = as.rlim_cur;
    }
    return bytes;
  }();
  return limit;
}

}  // namespace etmlx
