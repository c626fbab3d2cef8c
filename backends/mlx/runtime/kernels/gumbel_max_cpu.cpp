// gumbel_max_cpu: the steps of gumbel_max.h as one pass over each row in host memory, run as a
// node of the lazy graph (host_kernel.h) once the scores, temperatures and key are computed.
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

#include "kernels/gumbel_max.h"
#include "kernels/host_kernel.h"
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
  // The keys' source, as an operand: the global sequence's next key (uint32 [2]), or the seeds as int64.
  // Operands the host holds (the call's seeds and temperatures) are used as they are; the scores and the threshold
  // are read flat (float_rows), so the views over them never become graph nodes.
  const mx::array keys = seed ? (seed->dtype() == mx::int64 ? contiguous_operand(*seed)
                                                            : mx::contiguous(mx::astype(mx::reshape(*seed, {-1}), mx::int64)))
                              : mx::contiguous(mx::random::KeySequence::default_().next());
  const bool seeded = seed.has_value(), per_row = seed && seed->ndim() == 1, has_floor = threshold.has_value();
  std::vector<mx::array> inputs{flat_source(scores), contiguous_operand(temperature), keys};
  if (has_floor) inputs.push_back(flat_source(*threshold));
  auto loop = [rows, vocab, seeded, per_row, has_floor](const std::vector<mx::array>& in, mx::array& out) {
    std::vector<float> score_copy, floor_copy;
    const float* xs = float_rows(in[0], score_copy);
    const float* ts = in[1].data<float>();
    std::vector<RngKey> keys;
    if (!seeded) {
      const uint32_t* k = in[2].data<uint32_t>();
      keys.push_back(RngKey{k[0], k[1]});
    } else {
      const int64_t* s = in[2].data<int64_t>();
      for (size_t i = 0; i < in[2].size(); ++i) keys.push_back(key_from_seed(static_cast<uint64_t>(s[i])));
    }
    // Without a threshold no token is excluded: a floor of -inf.
    const float* floor = has_floor ? float_rows(in[3], floor_copy) : nullptr;
    int64_t* tokens = out.data<int64_t>();
    for (int r = 0; r < rows; ++r) {
      const float* row = xs + static_cast<size_t>(r) * vocab;
      const float f = floor ? floor[r] : kNegInf;
      if (!(ts[r] > 0.0f)) {
        tokens[r] = greedy_row(row, vocab);
      } else if (per_row) {
        tokens[r] = sampled_row(row, vocab, ts[r], f, keys[r], static_cast<uint64_t>(vocab), 0);
      } else {
        tokens[r] = sampled_row(row, vocab, ts[r], f, keys[0], static_cast<uint64_t>(rows) * vocab,
                                static_cast<uint64_t>(r) * vocab);
      }
    }
  };
  return host_kernel("GumbelMaxCpu", {rows}, mx::int64, std::move(inputs), std::move(loop));
}

}  // namespace etmlx::kernels
