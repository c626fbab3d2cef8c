// exec_filter_threshold: the per-row keep threshold of top-k / top-p / min-p
// (semantics in schema.fbs). No full sort in the common case: the CPU device
// partitions each row on the host and sorts only the best `candidates`; other
// devices compose the same steps from mlx::core ops. Either falls back to
// sorting a whole row only when its answer cannot lie among the candidates.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include <mlx/ops.h>
#include <mlx/transforms.h>

#include "interpreter.h"

namespace etmlx {

namespace mx = mlx::core;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Knobs {
  const int64_t* top_k = nullptr;  // host copies, one value per row (nullptr: knob absent)
  const float* top_p = nullptr;
  const float* min_p = nullptr;
};

// Host path for one row; `z` holds the row's scores and is reordered.
float row_threshold(std::vector<float>& z, const std::vector<float>& row, int r, const Knobs& k, int cap) {
  const int vocab = static_cast<int>(z.size());
  const float m = *std::max_element(z.begin(), z.end());
  float thr = kNegInf;
  if (k.min_p && k.min_p[r] > 0.0f) thr = std::max(thr, m + std::log(std::min(k.min_p[r], 1.0f)));
  if (k.top_k || k.top_p) {
    const bool k_active = k.top_k && k.top_k[r] > 0 && k.top_k[r] < vocab;
    const int64_t keep = k_active ? k.top_k[r] : vocab;
    int c = std::min(cap, vocab);
    if (k_active && keep > c) c = vocab;
    auto sort_best = [&](int count) {
      if (count < vocab) std::nth_element(z.begin(), z.begin() + (count - 1), z.end(), std::greater<float>());
      std::sort(z.begin(), z.begin() + count, std::greater<float>());
    };
    sort_best(c);
    const float tau_k = k_active ? z[keep - 1] : kNegInf;
    thr = std::max(thr, tau_k);
    if (k.top_p && k.top_p[r] < 1.0f) {  // NaN compares false: off
      const float p = k.top_p[r];
      // Mass of the top-k-kept set: from the candidates when it lies inside them.
      float sum = 0.0f;
      if (k_active && z[c - 1] < tau_k) {
        for (int i = 0; i < c && z[i] >= tau_k; ++i) sum += std::exp(z[i] - m);
      } else {
        for (float v : row) {
          if (v >= tau_k) sum += std::exp(v - m);
        }
      }
      const float lse = m + std::log(sum);
      auto first_reaching = [&](int count) {
        float cum = 0.0f;
        for (int i = 0; i < count; ++i) {
          cum += std::exp(z[i] - lse);
          if (cum >= p) return i;
        }
        return -1;
      };
      int at = first_reaching(c);
      while (at < 0 && c < vocab) {
        // Not reached among the candidates: take eight times as many (at last the whole row).
        z = row;
        c = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(c) * 8, vocab));
        sort_best(c);
        at = first_reaching(c);
      }
      thr = std::max(thr, z[at < 0 ? c - 1 : at]);
    }
  }
  return std::min(thr, m);
}

// The best `c` scores of each row, sorted descending ([B, c]).
mx::array best_sorted(const mx::array& z, int c) {
  const int v = z.shape(1);
  const mx::array neg = mx::negative(z);
  if (c >= v) return mx::negative(mx::sort(neg, 1));
  const mx::array part = mx::slice(mx::partition(neg, c - 1, 1), {0, 0}, {z.shape(0), c});
  return mx::negative(mx::sort(part, 1));
}

std::optional<mx::array> column(const mx::array* a, int rows, mx::Dtype dtype) {
  if (a == nullptr) return std::nullopt;
  return mx::reshape(mx::broadcast_to(mx::reshape(mx::astype(*a, dtype), {-1}), {rows}), {rows, 1});
}

// Device path: the same steps from mlx ops (z already divided and cleaned).
mx::array threshold_mlx(const mx::array& z, const mx::array* top_k_in, const mx::array* top_p_in,
                        const mx::array* min_p_in, int cap) {
  const int rows = z.shape(0), vocab = z.shape(1);
  const mx::array m = mx::max(z, 1, /*keepdims=*/true);
  const mx::array neg_inf = mx::array(kNegInf);
  mx::array thr = mx::full({rows, 1}, neg_inf);
  if (auto min_p = column(min_p_in, rows, mx::float32)) {
    const mx::array mp = mx::minimum(*min_p, mx::array(1.0f));
    thr = mx::maximum(thr, mx::where(mx::greater(mp, mx::array(0.0f)), mx::add(m, mx::log(mp)), neg_inf));
  }
  auto top_k = column(top_k_in, rows, mx::int32);
  auto top_p = column(top_p_in, rows, mx::float32);
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

bool Interpreter::exec_filter_threshold(const fb::FilterThresholdNode& n) {
  const mx::array* x = read(n.x());
  if (!x) return false;
  const mx::array* temperature = read(n.temperature());
  if (!temperature) return false;
  if (x->ndim() != 2 || x->dtype() != mx::float32) return fail("x must be a [B, V] float32 tensor");
  const int rows = x->shape(0), vocab = x->shape(1);
  if (vocab == 0) return fail("x has an empty vocabulary");
  if (temperature->dtype() != mx::float32 || (temperature->size() != 1 && temperature->size() != static_cast<size_t>(rows))) {
    return fail("temperature must be a float32 scalar or [%d]", rows);
  }
  const mx::array* knobs[3] = {nullptr, nullptr, nullptr};
  const fb::Tid* tids[3] = {n.top_k(), n.top_p(), n.min_p()};
  for (int i = 0; i < 3; ++i) {
    if (tids[i] == nullptr) continue;
    knobs[i] = read(tids[i]);
    if (!knobs[i]) return false;
    if ((knobs[i]->size() != 1 && knobs[i]->size() != static_cast<size_t>(rows)) || knobs[i]->ndim() > 1) {
      return fail("row knob %d must be a scalar or have one value per row (%d)", i, rows);
    }
  }
  if (knobs[0] && !mx::issubdtype(knobs[0]->dtype(), mx::integer)) return fail("top_k must be integer");
  const int cap = n.candidates();
  if (cap < 1) return fail("candidates must be >= 1, got %d", cap);

  const mx::array t = mx::reshape(mx::broadcast_to(mx::reshape(*temperature, {-1}), {rows}), {rows, 1});
  const mx::array safe_t = mx::where(mx::greater(t, mx::array(0.0f)), t, mx::array(1.0f));
  if (mx::default_device() != mx::Device::cpu) {
    const mx::array z = mx::divide(mx::where(mx::isnan(*x), mx::array(kNegInf), *x), safe_t);
    return write(n.out(), threshold_mlx(z, knobs[0], knobs[1], knobs[2], cap));
  }

  // CPU: host copies of the operands, one row at a time.
  auto host_rows = [&](const mx::array* a, mx::Dtype dt) -> std::optional<mx::array> {
    if (a == nullptr) return std::nullopt;
    mx::array h = mx::contiguous(mx::broadcast_to(mx::reshape(mx::astype(*a, dt), {-1}), {rows}));
    mx::eval(h);
    return h;
  };
  const auto top_k = host_rows(knobs[0], mx::int64);
  const auto top_p = host_rows(knobs[1], mx::float32);
  const auto min_p = host_rows(knobs[2], mx::float32);
  const mx::array xs = mx::contiguous(*x);
  const mx::array ts = mx::contiguous(mx::reshape(safe_t, {rows}));
  mx::eval({xs, ts});
  Knobs k;
  if (top_k) k.top_k = top_k->data<int64_t>();
  if (top_p) k.top_p = top_p->data<float>();
  if (min_p) k.min_p = min_p->data<float>();
  std::vector<float> out(rows), row(vocab), z(vocab);
  for (int r = 0; r < rows; ++r) {
    const float* xr = xs.data<float>() + static_cast<size_t>(r) * vocab;
    const float tr = ts.data<float>()[r];
    for (int j = 0; j < vocab; ++j) {
      const float s = xr[j] / tr;
      row[j] = std::isnan(s) ? kNegInf : s;
    }
    z = row;
    out[r] = row_threshold(z, row, r, k, cap);
  }
  return write(n.out(), mx::array(out.begin(), {rows, 1}, mx::float32));
}

}  // namespace etmlx
