// MLX's counter-based random bits, one word at a time on the host.
//
// mlx::core::random::bits fills an n-word draw so that words i and
// i + ceil(n/2) are the two halves of Threefry-2x32(key, (i, ceil(n/2) + i)),
// and, for odd n, the middle word is the first half of the hash of
// (floor(n/2), 0). word_at() returns any single word of that draw, so a sampler
// can draw noise only for the tokens it looks at and still match the full draw.
#pragma once

#include <cstdint>

namespace etmlx::kernels {

struct RngKey {
  uint32_t hi = 0;
  uint32_t lo = 0;
};

// The key MLX makes from a seed: (seed >> 32, seed & 0xffffffff) of it as uint64.
RngKey key_from_seed(uint64_t seed);

// Word `index` (< n) of the n-word draw from `key`.
uint32_t word_at(RngKey key, uint64_t n, uint64_t index);

// Both halves of the hash behind word pair i (< n / 2): words i and ceil(n/2) + i.
void word_pair(RngKey key, uint64_t n, uint64_t i, uint32_t* first, uint32_t* second);

// Up to kWordBlock hashes at once, in SIMD lanes (the hash is most of a sampler's work):
// word_pairs: pairs [i, i + count) (i + count <= n / 2) into first[] and second[];
// words: words [index, index + count) (<= n) into out[].
constexpr int kWordBlock = 64;
void word_pairs(RngKey key, uint64_t n, uint64_t i, int count, uint32_t* first, uint32_t* second);
void words(RngKey key, uint64_t n, uint64_t index, int count, uint32_t* out);

// MLX's uniform from one word: float32(word) / float32(2^32 - 1), clamped below 1.
float uniform_from_word(uint32_t word);

}  // namespace etmlx::kernels
