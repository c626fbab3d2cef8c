#include "kernels/attention_blocks.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include <mlx/ops.h>

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

std::atomic<uint64_t> g_score_limit{kDefaultAttentionScoreLimit};
std::atomic<uint64_t> g_query_blocks{0};

// Indices [r0, r1) of x's axis `axis`.
mx::array part_of(const mx::array& x, int axis, int r0, int r1) {
  mx::Shape start(x.ndim(), 0), stop = x.shape();
  start[axis] = r0;
  stop[axis] = r1;
  return mx::slice(x, start, stop);
}

}  // namespace

uint64_t attention_score_limit() { return g_score_limit.load(std::memory_order_relaxed); }

uint64_t set_attention_score_limit(uint64_t bytes) { return g_score_limit.exchange(bytes); }

uint64_t attention_query_blocks() { return g_query_blocks.load(std::memory_order_relaxed); }

mx::array attend_in_query_blocks(const mx::array& q, const std::optional<mx::array>& mask, int keys, int min_rows,
                                 const QueryAttention& attend) {
  const int rows = q.shape(2);
  // float32 scores: the CPU softmax's, and MLX's precise softmax of half scores.
  const uint64_t row_bytes = uint64_t{4} * static_cast<uint64_t>(q.shape(0)) * static_cast<uint64_t>(q.shape(1)) *
                             static_cast<uint64_t>(std::max(keys, 1));
  const uint64_t limit = attention_score_limit();
  min_rows = std::max(min_rows, 1);
  if (rows < 2 * min_rows || row_bytes * static_cast<uint64_t>(rows) <= limit) return attend(q, mask);
  // Blocks of at least min_rows rows (fewer would take another code path, e.g. the CPU set's decode loop), as even
  // as rows allow: n blocks of rows / n or one more.
  const uint64_t fit = std::max<uint64_t>(static_cast<uint64_t>(min_rows), limit / row_bytes);
  const int n = static_cast<int>(std::max<uint64_t>(1, static_cast<uint64_t>(rows) / fit));
  if (n == 1) return attend(q, mask);
  const bool mask_rows = mask && mask->ndim() >= 2 && mask->shape(-2) == rows;
  std::vector<mx::array> outs;
  outs.reserve(n);
  for (int b = 0, r0 = 0; b < n; ++b) {
    const int r1 = r0 + rows / n + (b < rows % n ? 1 : 0);
    mx::array qb = part_of(q, 2, r0, r1);
    if (!outs.empty()) qb = mx::depends({qb}, {outs.back()})[0];
    std::optional<mx::array> mb = mask;
    if (mask_rows) mb = part_of(*mask, mask->ndim() - 2, r0, r1);
    outs.push_back(attend(qb, mb));
    r0 = r1;
  }
  g_query_blocks.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
  return mx::concatenate(outs, 2);
}

mx::array attend_per_kv_head(const mx::array& q, const std::optional<mx::array>& mask,
                             const std::vector<mx::array>& cache, int dim, const HeadAttention& attend) {
  const int heads = q.shape(1), kv_heads = cache[0].shape(1);
  const uint64_t kv_bytes = uint64_t{2} * 4 * static_cast<uint64_t>(cache[0].shape(0)) *
                            static_cast<uint64_t>(kv_heads) * static_cast<uint64_t>(cache[0].shape(2)) *
                            static_cast<uint64_t>(dim);
  if (kv_heads < 2 || kv_bytes <= attention_score_limit()) return attend(q, mask, cache.data());
  const int group = heads / kv_heads;
  const bool mask_heads = mask && mask->ndim() >= 3 && mask->shape(-3) == heads;
  std::vector<mx::array> outs;
  outs.reserve(kv_heads);
  for (int h = 0; h < kv_heads; ++h) {
    std::vector<mx::array> own;
    for (const mx::array& a : cache) own.push_back(part_of(a, 1, h, h + 1));
    if (!outs.empty()) own = mx::depends(own, {outs.back()});
    std::optional<mx::array> mh = mask;
    if (mask_heads) mh = part_of(*mask, mask->ndim() - 3, h * group, (h + 1) * group);
    outs.push_back(attend(part_of(q, 1, h * group, (h + 1) * group), mh, own.data()));
  }
  return mx::concatenate(outs, 1);
}

}  // namespace etmlx::kernels

// Sets the score limit (bytes, at least 1) and returns the one it replaces; 0 only reads it. Process-wide: a test
// lowers it to force the blocked path on a small model, the default bounds a 32k-token prefill's chunk.
extern "C" __attribute__((visibility("default"))) uint64_t etmlx_attention_score_limit(uint64_t bytes) {
  if (bytes == 0) return etmlx::kernels::attention_score_limit();
  return etmlx::kernels::set_attention_score_limit(bytes);
}

extern "C" __attribute__((visibility("default"))) uint64_t etmlx_attention_query_blocks() {
  return etmlx::kernels::attention_query_blocks();
}
