// gumbel_max_device: the steps of gumbel_max.h composed from mlx ops, nothing evaluated.
#include <limits>
#include <stdexcept>

#include <mlx/ops.h>

#include "kernels/gumbel_max.h"
#include "kernels/random_bits.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

mx::array gumbel_max_device(const mx::array& scores, const mx::array& temperature,
                            const std::optional<mx::array>& seed, const std::optional<mx::array>& threshold) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int rows = scores.shape(0);
  const mx::array neg_inf(kNegInf);
  const mx::array x = mx::where(mx::isnan(scores), neg_inf, scores);
  const mx::array t = mx::reshape(temperature, {rows, 1});
  const mx::array sampled = mx::greater(t, mx::array(0.0f));
  auto bits = random_bits(scores.shape(), 4, seed);
  if (!bits) throw std::invalid_argument("gumbel_max: per-row seeds do not match the batch");
  const mx::array u =
      mx::minimum(mx::divide(mx::astype(*bits, mx::float32), mx::array(4294967295.0f)), mx::array(0.99999994f));
  const mx::array g = mx::negative(mx::log(mx::negative(mx::log(u))));
  mx::array z = mx::divide(x, mx::where(sampled, t, mx::array(1.0f)));
  if (threshold) z = mx::where(mx::greater_equal(z, mx::reshape(*threshold, {rows, 1})), z, neg_inf);
  mx::array s = mx::add(z, g);
  s = mx::where(mx::isnan(s), neg_inf, s);
  const mx::array pick = mx::where(mx::reshape(sampled, {rows}), mx::argmax(s, 1), mx::argmax(x, 1));
  return mx::astype(pick, mx::int64);
}

mx::array greedy_pick(const mx::array& scores) {
  const mx::array x = mx::where(mx::isnan(scores), mx::array(-std::numeric_limits<float>::infinity()), scores);
  return mx::astype(mx::argmax(x, 1), mx::int64);
}

}  // namespace etmlx::kernels
