#include "kernels/threefry.h"

#include <algorithm>

namespace etmlx::kernels {

namespace {

inline uint32_t rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
void threefry2x32(RngKey key, uint32_t c0, uint32_t c1, uint32_t* out0, uint32_t* out1) {
  static constexpr int kRotations[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  const uint32_t ks[3] = {key.hi, key.lo, key.hi ^ key.lo ^ 0x1BD11BDAu};
  uint32_t x0 = c0 + ks[0];
  uint32_t x1 = c1 + ks[1];
  for (int i = 0; i < 5; ++i) {
    for (int r : kRotations[i % 2]) {
      x0 += x1;
      x1 = rotl(x1, r) ^ x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
  }
  *out0 = x0;
  *out1 = x1;
}

}  // namespace

RngKey key_from_seed(uint64_t seed) {
  return RngKey{static_cast<uint32_t>(seed >> 32), static_cast<uint32_t>(seed & 0xffffffffu)};
}

uint32_t word_at(RngKey key, uint64_t n, uint64_t index) {
  const uint64_t half = n / 2;
  const uint64_t odd = n % 2;
  uint32_t first = 0, second = 0;
  if (index < half) {
    threefry2x32(key, static_cast<uint32_t>(index), static_cast<uint32_t>(half + odd + index), &first, &second);
    return first;
  }
  if (odd && index == half) {
    threefry2x32(key, static_cast<uint32_t>(half), 0u, &first, &second);
    return first;
  }
  const uint64_t i = index - half - odd;
  threefry2x32(key, static_cast<uint32_t>(i), static_cast<uint32_t>(half + odd + i), &first, &second);
  return second;
}

void word_pair(RngKey key, uint64_t n, uint64_t i, uint32_t* first, uint32_t* second) {
  const uint64_t offset = n / 2 + n % 2;
  threefry2x32(key, static_cast<uint32_t>(i), static_cast<uint32_t>(offset + i), first, second);
}

float uniform_from_word(uint32_t word) {
  const float u = static_cast<float>(word) / 4294967296.0f;  // float32(2^32 - 1) rounds to 2^32
  return std::min(u, 0.99999994f);                          // nextafter(1, 0)
}

}  // namespace etmlx::kernels
