// exec_gumbel_max: one Gumbel-max draw per row (semantics in schema.fbs).
//
// On the CPU device the whole row is one pass over host memory: noise is drawn
// per token from MLX's counter layout (threefry.h), so the result equals the
// full-draw composition, and a token whose score plus the largest possible
// noise cannot beat the current best is skipped without hashing (filtered
// tokens, at -inf, cost nothing). Other devices compose mlx::core ops.
#include <cmath>
#include <limits>
#include <vector>

#include <mlx/ops.h>
#include <mlx/random.h>
#include <mlx/transforms.h>

#include "interpreter.h"
#include "random_keys.h"
#include "threefry.h"

namespace etmlx {

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
    // -log(-log u) <= -log(1 - u) <= u / (1 - u): a log-free bound (with slack for float32
    // rounding) that rules out most tokens before their two logs are computed.
    const double bound = static_cast<double>(u) / (1.0 - static_cast<double>(u)) * (1.0 + 1e-6) + 1e-6;
    if (static_cast<double>(s) + bound < static_cast<double>(score)) return;
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
  if (base == 0 && n == static_cast<uint64_t>(vocab)) {
    // The row is the whole draw: one hash serves the two tokens of each word pair.
    const uint64_t half = n / 2, offset = n / 2 + n % 2;
    for (uint64_t i = 0; i < half; ++i) {
      const float a = score_of(x[i]), b = score_of(x[offset + i]);
      const bool skip_a = best.hopeless(a), skip_b = best.hopeless(b);
      if (skip_a && skip_b) continue;
      uint32_t wa = 0, wb = 0;
      word_pair(key, n, i, &wa, &wb);
      if (!skip_a) best.offer(a, wa, static_cast<int64_t>(i));
      if (!skip_b) best.offer(b, wb, static_cast<int64_t>(offset + i));
    }
    if (n % 2) {
      const float m = score_of(x[half]);
      if (!best.hopeless(m)) best.offer(m, word_at(key, n, half), static_cast<int64_t>(half));
    }
    return best.index;
  }
  for (int j = 0; j < vocab; ++j) {
    const float s = score_of(x[j]);
    if (best.hopeless(s)) continue;
    best.offer(s, word_at(key, n, base + static_cast<uint64_t>(j)), j);
  }
  return best.index;
}

}  // namespace

bool Interpreter::exec_gumbel_max(const fb::GumbelMaxNode& n) {
  const mx::array* scores = read(n.x());
  if (!scores) return false;
  const mx::array* temperature = read(n.temperature());
  if (!temperature) return false;
  if (scores->ndim() != 2 || scores->dtype() != mx::float32) return fail("x must be a [B, V] float32 tensor");
  const int rows = scores->shape(0), vocab = scores->shape(1);
  if (temperature->dtype() != mx::float32 || temperature->ndim() > 1 ||
      (temperature->ndim() == 1 && temperature->shape(0) != rows)) {
    return fail("temperature must be a float32 scalar or [%d]", rows);
  }
  const mx::array* seed = nullptr;
  if (n.seed() != nullptr) {
    seed = read(n.seed());
    if (!seed) return false;
    if (!mx::issubdtype(seed->dtype(), mx::integer) || seed->ndim() > 1 ||
        (seed->ndim() == 1 && seed->shape(0) != rows)) {
      return fail("seed must be an integer scalar or [%d]", rows);
    }
  }
  if (vocab == 0) return fail("x has an empty vocabulary");
  const mx::array* threshold = nullptr;
  if (n.threshold() != nullptr) {
    threshold = read(n.threshold());
    if (!threshold) return false;
    if (threshold->dtype() != mx::float32 || threshold->size() != static_cast<size_t>(rows)) {
      return fail("threshold must be [%d, 1] float32", rows);
    }
  }
  const mx::array t_rows = mx::broadcast_to(mx::reshape(*temperature, {-1}), {rows});

  if (mx::default_device() != mx::Device::cpu) {
    // Same semantics from mlx ops, so the logits never leave the device.
    const mx::array x = mx::where(mx::isnan(*scores), mx::array(kNegInf), *scores);
    const mx::array t = mx::reshape(t_rows, {rows, 1});
    const mx::array sampled = mx::greater(t, mx::array(0.0f));
    auto bits = draw_bits(scores->shape(), 4, seed);
    if (!bits) return fail("per-row seeds do not match the batch");
    const mx::array u = mx::minimum(mx::divide(mx::astype(*bits, mx::float32), mx::array(4294967295.0f)),
                                    mx::array(0.99999994f));
    const mx::array g = mx::negative(mx::log(mx::negative(mx::log(u))));
    mx::array z = mx::divide(x, mx::where(sampled, t, mx::array(1.0f)));
    if (threshold) z = mx::where(mx::greater_equal(z, mx::reshape(*threshold, {rows, 1})), z, mx::array(kNegInf));
    mx::array s = mx::add(z, g);
    s = mx::where(mx::isnan(s), mx::array(kNegInf), s);
    const mx::array pick = mx::where(mx::reshape(sampled, {rows}), mx::argmax(s, 1), mx::argmax(x, 1));
    return write(n.out(), mx::astype(pick, mx::int64));
  }

  // CPU: read the operands on the host and draw each row in one pass.
  std::vector<RngKey> keys;
  if (seed == nullptr) {
    mx::array k = mx::random::KeySequence::default_().next();
    mx::eval(k);
    keys.push_back(RngKey{k.data<uint32_t>()[0], k.data<uint32_t>()[1]});
  } else {
    const mx::array s = mx::astype(mx::reshape(*seed, {-1}), mx::int64);
    mx::eval(s);
    for (size_t i = 0; i < s.size(); ++i) keys.push_back(key_from_seed(static_cast<uint64_t>(s.data<int64_t>()[i])));
  }
  const bool per_row = seed != nullptr && seed->ndim() == 1;
  const mx::array x = mx::contiguous(*scores);
  const mx::array t = mx::contiguous(t_rows);
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
  return write(n.out(), mx::array(out.begin(), {rows}, mx::int64));
}

}  // namespace etmlx
