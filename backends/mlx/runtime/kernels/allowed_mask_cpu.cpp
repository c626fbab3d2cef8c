// allowed_mask_cpu: the words read on the host; all-ones rows cost nothing.
//
// Most rows of a batch are unconstrained (the mask is all ones) and a constrained row
// usually allows a few tokens. When the host already holds the mask (a program input,
// known_values.h) and every row is all ones, the kernel returns x itself: no node, no copy.
// Otherwise a host loop, run as a node of the lazy graph (host_kernel.h), copies x once
// (or takes over its buffer when nothing else holds it) and writes -inf over the tokens of
// each word that is not all ones. drawn_or_none_cpu is a host loop node as well.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include <mlx/ops.h>

#include "kernels/allowed_mask.h"
#include "kernels/host_kernel.h"
#include "kernels/known_values.h"

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

// Whether word i of a row leaves every token it covers allowed (bits past V do not count).
inline bool word_all_allowed(uint32_t w, int i, int vocab) {
  const int covered = vocab - 32 * i;
  const uint32_t need = covered >= 32 ? 0xffffffffu : ((static_cast<uint32_t>(1) << covered) - 1);
  return (w & need) == need;
}

}  // namespace

mx::array allowed_mask_cpu(const mx::array& x, const mx::array& mask) {
  const int rows = x.shape(0), vocab = x.shape(1), words = mask.shape(1);
  // A mask the host already holds (a program input) is read now: all ones is x itself.
  if (const auto known = known_ints(mask)) {
    bool all_ones = true;
    for (size_t k = 0; k < known->size() && all_ones; ++k) {
      all_ones = word_all_allowed(static_cast<uint32_t>((*known)[k]), static_cast<int>(k % words), vocab);
    }
    if (all_ones) return x;
  }
  auto loop = [rows, vocab, words](const std::vector<mx::array>& in, mx::array& out) {
    const uint32_t* ws = reinterpret_cast<const uint32_t*>(in[1].data<int32_t>());
    float* dst = out.data<float>();
    // Out may already be x's buffer (host_kernel.h), then unmasked tokens need no copy at all.
    if (dst != in[0].data<float>()) {
      std::memcpy(dst, in[0].data<float>(), static_cast<size_t>(rows) * vocab * sizeof(float));
    }
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (int r = 0; r < rows; ++r) {
      float* row = dst + static_cast<size_t>(r) * vocab;
      const uint32_t* rw = ws + static_cast<size_t>(r) * words;
      for (int i = 0; i < words; ++i) {
        const uint32_t w = rw[i];
        if (word_all_allowed(w, i, vocab)) continue;
        const int end = std::min(32, vocab - 32 * i);
        float* base = row + 32 * i;
        if (w == 0) {
          for (int j = 0; j < end; ++j) base[j] = kNegInf;
          continue;
        }
        for (int j = 0; j < end; ++j) {
          if (!((w >> j) & 1u)) base[j] = kNegInf;
        }
      }
    }
  };
  return host_kernel("AllowedMaskCpu", {rows, vocab}, mx::float32, {mx::contiguous(x), mx::contiguous(mask)},
                     std::move(loop), /*may_reuse_input0=*/true);
}

mx::array drawn_or_none_cpu(const mx::array& tokens, const mx::array& x) {
  const int rows = x.shape(0), vocab = x.shape(1);
  auto loop = [rows, vocab](const std::vector<mx::array>& in, mx::array& out) {
    const int64_t* ids = in[0].data<int64_t>();
    const float* xs = in[1].data<float>();
    int64_t* drawn = out.data<int64_t>();
    for (int r = 0; r < rows; ++r) {
      const int64_t id = ids[r];
      const bool ok = id >= 0 && id < vocab &&
                      xs[static_cast<size_t>(r) * vocab + id] > -std::numeric_limits<float>::infinity();
      drawn[r] = ok ? id : -1;
    }
  };
  return host_kernel("DrawnOrNoneCpu", {rows}, mx::int64,
                     {mx::contiguous(mx::astype(tokens, mx::int64)), mx::contiguous(x)}, std::move(loop));
}

}  // namespace etmlx::kernels
