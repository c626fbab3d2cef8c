// gumbel_max_cpu: the steps of gumbel_max.h as one pass over each row in host memory.
//
// Noise is drawn per token from MLX's counter layout (threefry.h), so the result
// equals the full-draw composition, and a token whose score plus the largest
// possible noise cannot beat the current best is skipped without hashing
// (filtered tokens, at -inf, cost nothing).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <mlx/ops.h>
#include <mlx/random.h>
#include <mlx/transforms.h>

#include "kernels/gumbel_max.h"
#include "kernels/threefry.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float clean(float s) { return std::isnan(s) ? kNegInf : s; }

// First index of the largest score (NaN counts as -inf; all -inf gives 0).
int64_t greedy_row(const float* x, int vocab) {
  int64_t best_i = 0;
  float best = kNegInf;
  for (int j = 0; j < vocab; ++j) {
    const float s = clean(x[j]);
    if (s > best) best = s, best_i = j;
  }
  return best_i;
}

// The largest noise a float32 uniform can give, nudged up so rounding can never make skipping wrong.
const float kMaxNoise = std::nextafter(-std::log(-std::log(0.99999994f)), 1e30f);

// Running argmax where equal scores go to the lower index (tokens are visited out of order).
struct Best {
  float score = kNegInf;
  int64_t index = 0;
  bool hopeless(float s) const { return s == kNegInf || s + kMaxNoise < score; }
  void offer(float s, uint32_t word, int64_t j) {
    const float u = uniform_from_word(word);
    // A log-free test that rules out almost every token before its two logs are computed:
    // it can win only if g = -log(-log u) >= d = best - s, and as -log u >= 1 - u that needs
    // 1 - u <= exp(-d) <= 1 / (1 + d + d^2/2 + d^3/6 + d^4/24) (d > 0). d is taken smaller by a
    // margin far above float32 rounding, so a token that could tie is never ruled out.
    const double d = (static_cast<double>(score) - static_cast<double>(s)) -
                     1e-4 * (1.0 + std::fabs(static_cast<double>(score)) + std::fabs(static_cast<double>(s)));
    if (d > 0.0) {
      const double taylor = 1.0 + d * (1.0 + d * (0.5 + d * (1.0 / 6.0 + d / 24.0)));
      if ((1.0 - static_cast<double>(u)) * taylor > 1.0) return;
    }
    const float total = clean(s + (-std::log(-std::log(u))));
    if (total > score || (total == score && j < index)) score = total, index = j;
  }
};

// The row's draw: word base + j of an n-word draw from `key` is token j's noise.
int64_t sampled_row(const float* x, int vocab, float t, float floor, RngKey key, uint64_t n, uint64_t base) {
  Best best;
  // Tokens below the row's keep threshold are excluded like -inf ones.
  auto score_of = [&](float v) {
    const float s = clean(v / t);
    return s < floor ? kNegInf : s;
  };
  float sa[kWordBlock], sb[kWordBlock];
  uint32_t wa[kWordBlock], wb[kWordBlock];
  // Whether any of the block's tokens could still win (best only rises, so a block found
  // hopeless here stays so); only then are its words hashed, all together.
  auto any_hope = [&](const float* s, int count) {
    for (int k = 0; k < count; ++k) {
      if (!best.hopeless(s[k])) return true;
    }
    return false;
  };
  if (base == 0 && n == static_cast<uint64_t>(vocab)) {
    // The row is the whole draw: one hash serves the two tokens of each word pair.
    const uint64_t half = n / 2, offset = n / 2 + n % 2;
    for (uint64_t i = 0; i < half; i += kWordBlock) {
      const int count = static_cast<int>(std::min<uint64_t>(kWordBlock, half - i));
      for (int k = 0; k < count; ++k) sa[k] = score_of(x[i + k]), sb[k] = score_of(x[offset + i + k]);
      if (!any_hope(sa, count) && !any_hope(sb, count)) continue;
      word_pairs(key, n, i, count, wa, wb);
      for (int k = 0; k < count; ++k) {
        if (!best.hopeless(sa[k])) best.offer(sa[k], wa[k], static_cast<int64_t>(i + k));
        if (!best.hopeless(sb[k])) best.offer(sb[k], wb[k], static_cast<int64_t>(offset + i + k));
      }
    }
    if (n % 2) {
      const float m = score_of(x[half]);
      if (!best.hopeless(m)) best.offer(m, word_at(key, n, half), static_cast<int64_t>(half));
    }
    return best.index;
  }
  for (int j = 0; j < vocab; j += kWordBlock) {
    const int count = std::min(kWordBlock, vocab - j);
    for (int k = 0; k < count; ++k) sa[k] = score_of(x[j + k]);
    if (!any_hope(sa, count)) continue;
    words(key, n, base + static_cast<uint64_t>(j), count, wa);
    for (int k = 0; k < count; ++k) {
      if (!best.hopeless(sa[k])) best.offer(sa[k], wa[k], j + k);
    }
  }
  return best.index;
}

}  // namespace

mx::array gumbel_max_cpu(const mx::array& scores, const mx::array& temperature, const std::optional<mx::array>& seed,
                         const std::optional<mx::array>& threshold) {
  const int rows = scores.shape(0), vocab = scores.shape(1);
  // The keys and operands, on the host.
  std::vector<RngKey> keys;
  if (!seed) {
    mx::array k = mx::random::KeySequence::default_().next();
    mx::eval(k);
    keys.push_back(RngKey{k.data<uint32_t>()[0], k.data<uint32_t>()[1]});
  } else {
    const mx::array s = mx::astype(mx::reshape(*seed, {-1}), mx::int64);
    mx::eval(s);
    for (size_t i = 0; i < s.size(); ++i) keys.push_back(key_from_seed(static_cast<uint64_t>(s.data<int64_t>()[i])));
  }
  const bool per_row = seed && seed->ndim() == 1;
  const mx::array x = mx::contiguous(scores);
  const mx::array t = mx::contiguous(temperature);
  const mx::array floor = threshold ? mx::contiguous(mx::reshape(*threshold, {rows}))
                                    : mx::full({rows}, mx::array(kNegInf));
  mx::eval({x, t, floor});
  const float* xs = x.data<float>();
  const float* ts = t.data<float>();
  std::vector<int64_t> out(rows);
  for (int r = 0; r < rows; ++r) {
    const float* row = xs + static_cast<size_t>(r) * vocab;
    if (!(ts[r] > 0.0f)) {
      out[r] = greedy_row(row, vocab);
    } else if (per_row) {
      out[r] = sampled_row(row, vocab, ts[r], floor.data<float>()[r], keys[r], static_cast<uint64_t>(vocab), 0);
    } else {
      out[r] = sampled_row(row, vocab, ts[r], floor.data<float>()[r], keys[0], static_cast<uint64_t>(rows) * vocab,
                           static_cast<uint64_t>(r) * vocab);
    }
  }
  return mx::array(out.begin(), {rows}, mx::int64);
}

}  // namespace etmlx::kernels
