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

// threefry2x32 over `count` (<= kWordBlock) counter pairs, written so that the compiler
// runs the lanes in SIMD registers. On x86-64 the AVX2 clone is picked once, when the
// library is loaded, on CPUs that have it (8 lanes instead of SSE2's 4).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void threefry_block(RngKey key, const uint32_t* c0, const uint32_t* c1, int count, uint32_t* out0, uint32_t* out1) {
  const uint32_t ks[3] = {key.hi, key.lo, key.hi ^ key.lo ^ 0x1BD11BDAu};
  uint32_t x0[kWordBlock], x1[kWordBlock];
  for (int j = 0; j < kWordBlock; ++j) {
    x0[j] = (j < count ? c0[j] : 0u) + ks[0];
    x1[j] = (j < count ? c1[j] : 0u) + ks[1];
  }
  // The rounds of threefry2x32 above, unrolled by hand so every rotation is a constant.
  auto mix = [&](int r) {
    for (int j = 0; j < kWordBlock; ++j) {
      x0[j] += x1[j];
      x1[j] = rotl(x1[j], r) ^ x0[j];
    }
  };
  auto inject = [&](int i) {
    for (int j = 0; j < kWordBlock; ++j) {
      x0[j] += ks[(i + 1) % 3];
      x1[j] += ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
    }
  };
  for (int i = 0; i < 5; i += 2) {
    mix(13), mix(15), mix(26), mix(6), inject(i);
    if (i == 4) break;
    mix(17), mix(29), mix(16), mix(24), inject(i + 1);
  }
  for (int j = 0; j < count; ++j) out0[j] = x0[j], out1[j] = x1[j];
}

}  // namespace

void word_pairs(RngKey key, uint64_t n, uint64_t i, int count, uint32_t* first, uint32_t* second) {
  const uint32_t offset = static_cast<uint32_t>(n / 2 + n % 2);
  uint32_t c0[kWordBlock] = {}, c1[kWordBlock] = {};
  for (int j = 0; j < count; ++j) {
    c0[j] = static_cast<uint32_t>(i) + static_cast<uint32_t>(j);
    c1[j] = offset + c0[j];
  }
  threefry_block(key, c0, c1, count, first, second);
}

void words(RngKey key, uint64_t n, uint64_t index, int count, uint32_t* out) {
  const uint64_t half = n / 2, odd = n % 2;
  const uint32_t offset = static_cast<uint32_t>(half + odd);
  uint32_t c0[kWordBlock] = {}, c1[kWordBlock] = {}, o0[kWordBlock], o1[kWordBlock];
  bool second[kWordBlock] = {};
  for (int j = 0; j < count; ++j) {
    const uint64_t w = index + static_cast<uint64_t>(j);
    second[j] = w >= half + odd;
    const uint64_t p = second[j] ? w - half - odd : w;
    c0[j] = static_cast<uint32_t>(p);
    c1[j] = (odd && w == half) ? 0u : offset + static_cast<uint32_t>(p);  // the odd middle word: (half, 0)
  }
  threefry_block(key, c0, c1, count, o0, o1);
  for (int j = 0; j < count; ++j) out[j] = second[j] ? o1[j] : o0[j];
}

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
