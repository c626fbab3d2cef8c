// The per-row keep threshold of top-k / top-p / min-p (FilterThresholdNode; semantics in schema.fbs).
//
// The one definition, on z = (T > 0 ? x / T : x) with NaN -> -inf, per row (m = max z):
//   min-p:  m + log(min(min_p, 1))                     when min_p > 0
//   top-k:  the k-th largest z                         when 0 < k < V
//   top-p:  the first z, in descending order, at which the running sum of exp(z - lse) reaches p,
//           lse = logsumexp of the top-k-kept z (the last z if none does)      when p < 1 (NaN: off)
//   threshold = min(max of the active ones (-inf if none), m)
// No full sort in the common case: only the best `candidates` scores are sorted, and a row falls
// back to sorting its whole row only when its answer cannot lie among them. Two variants, chosen
// once per program by kernel_set.h: filter_threshold_cpu partitions each row on the host
// (a lazy graph node, host_kernel.h);
// filter_threshold_device composes the same steps from mlx ops.
#pragma once

#include <optional>

#include <mlx/array.h>

namespace etmlx::kernels {

// Knobs as the program passes them: absent, a scalar, or one value per row (top_k integer,
// top_p and min_p float32).
struct FilterKnobs {
  std::optional<mlx::core::array> top_k, top_p, min_p;
};

// x [B, V] float32 (V > 0); temperature [B] float32; candidates >= 1. Returns [B, 1] float32.
using FilterThresholdFn = mlx::core::array (*)(const mlx::core::array& x, const mlx::core::array& temperature,
                                               const FilterKnobs& knobs, int candidates);

// Evaluates nothing: the host loop runs in the call's evaluation (host_kernel.h).
mlx::core::array filter_threshold_cpu(const mlx::core::array& x, const mlx::core::array& temperature,
                                      const FilterKnobs& knobs, int candidates);

// Evaluates nothing: sorts `candidates` scores per row only when the program's top-k, already on
// the host, proves that enough; otherwise the whole row (filter_threshold_device.cpp).
mlx::core::array filter_threshold_device(const mlx::core::array& x, const mlx::core::array& temperature,
                                         const FilterKnobs& knobs, int candidates);

}  // namespace etmlx::kernels
