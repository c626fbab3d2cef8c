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

#include "kernels/filter_threshold.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct RowKnobs {
  const int64_t* top_k = nullptr;  // host copies, one value per row (nullptr: knob absent)
  const float* top_p = nullptr;
  const float* min_p = nullptr;
};

// Host path for one row; `z` holds the row's scores and is reordered.
float row_threshold(std::vector<float>& z, const std::vector<float>& row, int r, const RowKnobs& k, int cap) {
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

}  // namespace

mx::array filter_threshold_cpu(const mx::array& x, const mx::array& temperature, const FilterKnobs& knobs,
                               int cap) {
  const int rows = x.shape(0), vocab = x.shape(1);
  const mx::array safe_t = mx::where(mx::greater(temperature, mx::array(0.0f)), temperature, mx::array(1.0f));
  // Host copies of the operands, one row at a time.
  auto host_rows = [&](const std::optional<mx::array>& a, mx::Dtype dt) -> std::optional<mx::array> {
    if (!a) return std::nullopt;
    mx::array h = mx::contiguous(mx::broadcast_to(mx::reshape(mx::astype(*a, dt), {-1}), {rows}));
    mx::eval(h);
    return h;
  };
  const auto top_k = host_rows(knobs.top_k, mx::int64);
  const auto top_p = host_rows(knobs.top_p, mx::float32);
  const auto min_p = host_rows(knobs.min_p, mx::float32);
  const mx::array xs = mx::contiguous(x);
  const mx::array ts = mx::contiguous(safe_t);
  mx::eval({xs, ts});
  RowKnobs k;
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
  return mx::array(out.begin(), {rows, 1}, mx::float32);
}

}  // namespace etmlx::kernels
