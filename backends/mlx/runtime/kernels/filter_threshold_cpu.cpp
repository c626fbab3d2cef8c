// filter_threshold_cpu: the per-row keep threshold of top-k / top-p / min-p (filter_threshold.h)
// as a host loop over each row, run as a node of the lazy graph (host_kernel.h). No full sort in
// the common case: each row is partitioned and only the best `candidates` are sorted; a row falls
// back to sorting more only when its answer cannot lie among them.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include <mlx/ops.h>

#include "kernels/filter_threshold.h"
#include "kernels/host_kernel.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct RowKnobs {
  const int64_t* top_k = nullptr;  // host copies, one value per row (nullptr: knob absent)
  const float* top_p = nullptr;
  const float* min_p = nullptr;
};

// Whether any knob filters row r. When none does, the threshold is min(-inf, m) = -inf whatever the
// scores are, so the row needs no pass at all: with the knobs at their off values (a greedy or plain
// sampled decode of a program exported with them) this skips a partial sort of the whole vocabulary.
bool any_active(const RowKnobs& k, int r, int vocab) {
  const bool k_active = k.top_k && k.top_k[r] > 0 && k.top_k[r] < vocab;
  const bool p_active = k.top_p && k.top_p[r] < 1.0f;  // NaN compares false: off
  const bool min_p_active = k.min_p && k.min_p[r] > 0.0f;
  return k_active || p_active || min_p_active;
}

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
  // Knobs the host holds (the call's inputs) become operands without graph nodes; lazy ones go through MLX.
  std::optional<mx::array> safe_t = host_rows(temperature, rows);
  if (safe_t && safe_t->dtype() == mx::float32) {
    float* t = safe_t->data<float>();
    for (int r = 0; r < rows; ++r) t[r] = t[r] > 0.0f ? t[r] : 1.0f;  // as the where below
  } else {
    safe_t = mx::contiguous(mx::where(mx::greater(temperature, mx::array(0.0f)), temperature, mx::array(1.0f)));
  }
  std::vector<mx::array> inputs{flat_source(x), *safe_t};
  // Each present knob as one value per row; its operand index (0: absent).
  auto knob_rows = [&](const std::optional<mx::array>& a, mx::Dtype dt) -> size_t {
    if (!a) return 0;
    std::optional<mx::array> held = a->dtype() == dt ? host_rows(*a, rows) : std::nullopt;
    inputs.push_back(held ? *held : mx::contiguous(mx::broadcast_to(mx::reshape(mx::astype(*a, dt), {-1}), {rows})));
    return inputs.size() - 1;
  };
  const size_t top_k = knob_rows(knobs.top_k, mx::int64);
  const size_t top_p = knob_rows(knobs.top_p, mx::float32);
  const size_t min_p = knob_rows(knobs.min_p, mx::float32);
  auto loop = [rows, vocab, cap, top_k, top_p, min_p](const std::vector<mx::array>& in, mx::array& out) {
    RowKnobs k;
    if (top_k) k.top_k = in[top_k].data<int64_t>();
    if (top_p) k.top_p = in[top_p].data<float>();
    if (min_p) k.min_p = in[min_p].data<float>();
    std::vector<float> copy;
    const float* xs = float_rows(in[0], copy);
    const float* ts = in[1].data<float>();
    float* thresholds = out.data<float>();
    std::vector<float> row, z;
    for (int r = 0; r < rows; ++r) {
      if (!any_active(k, r, vocab)) {
        thresholds[r] = kNegInf;
        continue;
      }
      row.resize(vocab);
      const float* xr = xs + static_cast<size_t>(r) * vocab;
      const float tr = ts[r];
      for (int j = 0; j < vocab; ++j) {
        const float s = xr[j] / tr;
        row[j] = std::isnan(s) ? kNegInf : s;
      }
      z = row;
      thresholds[r] = row_threshold(z, row, r, k, cap);
    }
  };
  return host_kernel("FilterThresholdCpu", {rows, 1}, mx::float32, std::move(inputs), std::move(loop));
}

}  // namespace etmlx::kernels
