// filter_threshold_device: the steps of filter_threshold.h composed from mlx ops.
#include <algorithm>
#include <limits>

#include <mlx/ops.h>

#include "kernels/filter_threshold.h"

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
    int c = std::min(cap, vocab);
    std::optional<mx::array> k_active, k_eff;
    if (top_k) {
      k_active = mx::logical_and(mx::greater(*top_k, mx::array(0)), mx::less(*top_k, mx::array(vocab)));
      k_eff = mx::where(*k_active, *top_k, mx::array(vocab));
      if (mx::max(mx::where(*k_active, *top_k, mx::array(0))).item<int>() > c) c = vocab;
    }
    mx::array vals = best_sorted(z, c);
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
      mx::array cum = running(vals);
      if (c < vocab) {
        const mx::array last = mx::slice(cum, {0, c - 1}, {rows, c});
        if (mx::any(mx::logical_and(p_active, mx::less(last, *top_p))).item<bool>()) {
          c = vocab;
          vals = best_sorted(z, c);
          cum = running(vals);
        }
      }
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
