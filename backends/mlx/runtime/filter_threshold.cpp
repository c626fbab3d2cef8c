// exec_filter_threshold: the per-row keep threshold of top-k / top-p / min-p
// (semantics in schema.fbs). The common case sorts only the best `candidates`
// scores after an O(V) partition; it falls back to sorting the whole row only
// when a row's answer cannot lie among them, which it checks on the values.
#include <cmath>
#include <limits>

#include <mlx/ops.h>
#include <mlx/transforms.h>

#include "interpreter.h"

namespace etmlx {

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

// Row knob as [B, 1] of `dtype`, or nullopt when absent.
std::optional<mx::array> column(const mx::array* a, int rows, mx::Dtype dtype) {
  if (a == nullptr) return std::nullopt;
  return mx::reshape(mx::astype(*a, dtype), {rows, 1});
}

}  // namespace

bool Interpreter::exec_filter_threshold(const fb::FilterThresholdNode& n) {
  const mx::array* z = read(n.z());
  if (!z) return false;
  if (z->ndim() != 2 || z->dtype() != mx::float32) return fail("z must be a [B, V] float32 tensor");
  const int rows = z->shape(0), vocab = z->shape(1);
  if (vocab == 0) return fail("z has an empty vocabulary");
  const mx::array* knobs[3] = {nullptr, nullptr, nullptr};
  const fb::Tid* tids[3] = {n.top_k(), n.top_p(), n.min_p()};
  for (int i = 0; i < 3; ++i) {
    if (tids[i] == nullptr) continue;
    knobs[i] = read(tids[i]);
    if (!knobs[i]) return false;
    if (knobs[i]->size() != static_cast<size_t>(rows) || knobs[i]->ndim() > 1) {
      return fail("row knob %d must have one value per row (%d)", i, rows);
    }
  }
  if (knobs[0] && !mx::issubdtype(knobs[0]->dtype(), mx::integer)) return fail("top_k must be integer");
  const int cap = n.candidates();
  if (cap < 1) return fail("candidates must be >= 1, got %d", cap);

  const mx::array m = mx::max(*z, 1, /*keepdims=*/true);
  const mx::array neg_inf = mx::array(kNegInf);
  mx::array thr = mx::full({rows, 1}, neg_inf);

  if (auto min_p = column(knobs[2], rows, mx::float32)) {
    const mx::array mp = mx::clip(*min_p, mx::array(0.0f), mx::array(1.0f));
    thr = mx::maximum(thr, mx::where(mx::greater(mp, mx::array(0.0f)), mx::add(m, mx::log(mp)), neg_inf));
  }

  auto top_k = column(knobs[0], rows, mx::int32);
  auto top_p = column(knobs[1], rows, mx::float32);
  if (top_k || top_p) {
    int c = std::min(cap, vocab);
    std::optional<mx::array> k_active, k_eff;
    if (top_k) {
      k_active = mx::logical_and(mx::greater(*top_k, mx::array(0)), mx::less(*top_k, mx::array(vocab)));
      k_eff = mx::where(*k_active, *top_k, mx::array(vocab));
      const int largest = mx::max(mx::where(*k_active, *top_k, mx::array(0))).item<int>();
      if (largest > c) c = vocab;
    }
    mx::array vals = best_sorted(*z, c);
    mx::array tau_k = mx::full({rows, 1}, neg_inf);
    auto kth_value = [&](const mx::array& sorted, int width) {
      const mx::array idx = mx::clip(mx::subtract(*k_eff, mx::array(1)), mx::array(0), mx::array(width - 1));
      return mx::where(*k_active, mx::take_along_axis(sorted, idx, 1), neg_inf);
    };
    if (top_k) tau_k = kth_value(vals, c);
    thr = mx::maximum(thr, tau_k);
    if (top_p) {
      const mx::array p_active = mx::less(*top_p, mx::array(1.0f));  // NaN compares false: off
      const mx::array kept_by_k = mx::where(mx::greater_equal(*z, tau_k), *z, neg_inf);
      const mx::array lse = mx::logsumexp(kept_by_k, 1, /*keepdims=*/true);
      auto running = [&](const mx::array& sorted) { return mx::cumsum(mx::exp(mx::subtract(sorted, lse)), 1); };
      mx::array cum = running(vals);
      if (c < vocab) {
        // The nucleus must be reached inside the candidates, or the whole row is sorted.
        const mx::array last = mx::slice(cum, {0, c - 1}, {rows, c});
        const bool short_of_p = mx::any(mx::logical_and(p_active, mx::less(last, *top_p))).item<bool>();
        if (short_of_p) {
          c = vocab;
          vals = best_sorted(*z, c);
          if (top_k) tau_k = kth_value(vals, c);
          cum = running(vals);
        }
      }
      // First position whose running sum reaches p (clamped to the row).
      const mx::array first = mx::clip(mx::sum(mx::less(cum, *top_p), 1, /*keepdims=*/true), mx::array(0),
                                       mx::array(c - 1));
      const mx::array tau_p = mx::take_along_axis(vals, mx::astype(first, mx::int32), 1);
      thr = mx::maximum(thr, mx::where(p_active, tau_p, neg_inf));
    }
  }
  return write(n.out(), mx::minimum(thr, m));
}

}  // namespace etmlx
