// Size limits every exec_ applies to shapes that come from an untrusted blob.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>

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


}  // namespace etmlx
