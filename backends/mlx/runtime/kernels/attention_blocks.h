// A long prefill chunk's attention a block of query rows at a time, so that its scores stay bounded whatever the
// context: 512 queries over 32k keys with 32 heads hold [32, 512, 32768] float32 scores, 2 GiB, where blocks of 16
// rows hold 64 MiB. Each query row's scores, softmax and output depend only on that row, so the rows come out as
// the unblocked attention's (the same products, row by row).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <mlx/array.h>

namespace etmlx::kernels {

// The most bytes one attention's scores may take before it is split into query blocks (float32 scores, one
// [B, H, rows, keys] block); a process-wide setting, read at each call (etmlx_attention_score_limit).
constexpr uint64_t kDefaultAttentionScoreLimit = uint64_t{64} << 20;
uint64_t attention_score_limit();
uint64_t set_attention_score_limit(uint64_t bytes);  // returns the limit it replaces
// The query blocks computed since the library loaded (a test's evidence that the blocked path ran).
uint64_t attention_query_blocks();

// attend(q, mask) over query blocks of at least `min_rows` rows when q [B, H, L, D]'s scores over `keys` keys
// exceed the limit: q and a mask with L rows (its axis -2) sliced per block, each block made to wait for the one
// before (mx::depends, so MLX's evaluation frees a block's scores before it computes the next), the outputs
// [B, H, rows, Dv] joined along the rows. One call of attend when the scores fit or L < 2 * min_rows.
using QueryAttention = std::function<mlx::core::array(const mlx::core::array& q,
                                                      const std::optional<mlx::core::array>& mask)>;
mlx::core::array attend_in_query_blocks(const mlx::core::array& q, const std::optional<mlx::core::array>& mask,
                                        int keys, int min_rows, const QueryAttention& attend);

// A quantized cache's attention (q [B, H, L, D] over `cache`: its six [B, Hkv, S, .] operands, packed keys,
// scales, biases, packed values, scales, biases) one key/value head at a time when the dequantized keys and values
// (float32, [B, Hkv, S, dim] each) would exceed the score limit: attend(q's heads of that key/value head, the
// mask's (a mask with H heads sliced on its axis -3), the head's six operands) per head, each head's operands made
// to wait for the head before, the outputs joined along the heads. One call over all heads otherwise.
using HeadAttention = std::function<mlx::core::array(const mlx::core::array& q,
                                                     const std::optional<mlx::core::array>& mask,
                                                     const mlx::core::array* cache)>;
mlx::core::array attend_per_kv_head(const mlx::core::array& q, const std::optional<mlx::core::array>& mask,
                                    const std::vector<mlx::core::array>& cache, int dim, const HeadAttention& attend);

}  // namespace etmlx::kernels
