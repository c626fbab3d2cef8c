// filter_threshold_device: the steps of filter_threshold.h composed from mlx ops, nothing evaluated.
//
// The sort width is a shape, so it must be fixed while the graph is built. The CPU variant
// looks at the scores to decide; here the width comes only from what the host already holds
// (known_values.h): `candidates` when every row's top-k is a known k <= candidates (then
// top-p's answer also lies among them, since its mass is taken over the top-k-kept scores),
// else the whole row. On a GPU a whole-row sort costs less than the round trip that looking
// would take, and a round trip stalls the pipelined decode loop.
#include <algorithm>
#include <limits>

#include <mlx/ops.h>

#include "kernels/filter_threshold.h"
#include "kernels/known_values.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The best `c` scores of each row, sorted descending ([B, c]).
mx::array best_sorted(const mx::array& z, int c) {
  const int v = z.shape(1);
  const mx::array neg = mx::negative(z);
  if (c >= v) return mx::negative(mx::sort(neg, 1));
  const mx::array part = mx::slice(mx::partition(neg, c - 1, 1), {0, 0}, {z.shape(0), c});
  return mx::negative(mx::sort(part, 1));
}

std::optional<mx::array> column(const std::optional<mx::array>& a, int rows, mx::Dtype dtype) {
  if (!a) return std::nullopt;
  return mx::reshape(mx::broadcast_to(mx::reshape(mx::astype(*a, dtype), {-1}), {rows}), {rows, 1});
}

// z already divided and cleaned.
// The sort width: `cap` when the host already knows every row's top-k and no row needs more
// (an active k > cap needs the whole row; with top-p, so does a row whose top-k is off).
int sort_width(const FilterKnobs& knobs, int cap, int vocab) {
  if (cap >= vocab || !knobs.top_k) return vocab;
  const auto ks = known_ints(*knobs.top_k);
  if (!ks) return vocab;
  for (int64_t k : *ks) {
    const bool active = k > 0 && k < vocab;
    if (active && k > cap) return vocab;
    if (!active && knobs.top_p) return vocab;
  }
  return cap;
}

mx::array threshold_of(const mx::array& z, const FilterKnobs& knobs, int cap) {
  const int rows = z.shape(0), vocab = z.shape(1);
  const mx::array m = mx::max(z, 1, /*keepdims=*/true);
  const mx::array neg_inf = mx::array(kNegInf);
  mx::array thr = mx::full({rows, 1}, neg_inf);
  if (auto min_p = column(knobs.min_p, rows, mx::float32)) {
    const mx::array mp = mx::minimum(*min_p, mx::array(1.0f));
    thr = mx::maximum(thr, mx::where(mx::greater(mp, mx::array(0.0f)), mx::add(m, mx::log(mp)), neg_inf));
  }
  auto top_k = column(knobs.top_k, rows, mx::int32);
  auto top_p = column(knobs.top_p, rows, mx::float32);
  if (top_k || top_p) {
    const int c = sort_width(knobs, cap, vocab);
    std::optional<mx::array> k_active, k_eff;
    if (top_k) {
      k_active = mx::logical_and(mx::greater(*top_k, mx::array(0)), mx::less(*top_k, mx::array(vocab)));
      k_eff = mx::where(*k_active, *top_k, mx::array(vocab));
    }
    const mx::array vals = best_sorted(z, c);
    auto kth_value = [&](const mx::array& sorted, int width) {
      const mx::array idx = mx::clip(mx::subtract(*k_eff, mx::array(1)), mx::array(0), mx::array(width - 1));
      return mx::where(*k_active, mx::take_along_axis(sorted, idx, 1), neg_inf);
    };
    mx::array tau_k = top_k ? kth_value(vals, c) : mx::full({rows, 1}, neg_inf);
    thr = mx::maximum(thr, tau_k);
    if (top_p) {
      const mx::array p_active = mx::less(*top_p, mx::array(1.0f));
      const mx::array lse = mx::logsumexp(mx::where(mx::greater_equal(z, tau_k), z, neg_inf), 1, true);
      auto running = [&](const mx::array& sorted) { return mx::cumsum(mx::exp(mx::subtract(sorted, lse)), 1); };
      const mx::array cum = running(vals);
      const mx::array first =
          mx::clip(mx::sum(mx::less(cum, *top_p), 1, true), mx::array(0), mx::array(c - 1));
      const mx::array tau_p = mx::take_along_axis(vals, mx::astype(first, mx::int32), 1);
      thr = mx::maximum(thr, mx::where(p_active, tau_p, neg_inf));
    }
  }
  return mx::minimum(thr, m);
}

}  // namespace

mx::array filter_threshold_device(const mx::array& x, const mx::array& temperature, const FilterKnobs& knobs,
                                  int candidates) {
  const mx::array t = mx::reshape(temperature, {-1, 1});
  const mx::array safe_t = mx::where(mx::greater(t, mx::array(0.0f)), t, mx::array(1.0f));
  const mx::array z = mx::divide(mx::where(mx::isnan(x), mx::array(kNegInf), x), safe_t);
  return threshold_of(z, knobs, candidates);
}

}  // namespace etmlx::kernels
