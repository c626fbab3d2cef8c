// allowed_mask_cpu: the words read on the host; all-ones rows cost nothing.
//
// Most rows of a batch are unconstrained (the mask is all ones) and a constrained row
// usually allows a few tokens, so the kernel looks at the W = V/32 words first: if every
// row is all ones it returns x itself (no evaluation of x, no copy); otherwise it copies x
// once and writes -inf over the tokens of each word that is not all ones.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <mlx/ops.h>
#include <mlx/transforms.h>

#include "kernels/allowed_mask.h"

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
  const mx::array m = mx::contiguous(mask);
  mx::eval(m);
  const uint32_t* ws = reinterpret_cast<const uint32_t*>(m.data<int32_t>());
  bool all_ones = true;
  for (int r = 0; r < rows && all_ones; ++r) {
    for (int i = 0; i < words; ++i) {
      if (!word_all_allowed(ws[static_cast<size_t>(r) * words + i], i, vocab)) {
        all_ones = false;
        break;
      }
    }
  }
  if (all_ones) return x;

  const mx::array xc = mx::contiguous(x);
  mx::eval(xc);
  const size_t n = static_cast<size_t>(rows) * vocab;
  std::vector<float> out(n);
  std::memcpy(out.data(), xc.data<float>(), n * sizeof(float));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < rows; ++r) {
    float* row = out.data() + static_cast<size_t>(r) * vocab;
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
  return mx::array(out.begin(), {rows, vocab}, mx::float32);
}

mx::array drawn_or_none_cpu(const mx::array& tokens, const mx::array& x) {
  const int rows = x.shape(0), vocab = x.shape(1);
  const mx::array t = mx::contiguous(mx::astype(tokens, mx::int64));
  const mx::array xc = mx::contiguous(x);
  mx::eval({t, xc});
  std::vector<int64_t> out(rows);
  for (int r = 0; r < rows; ++r) {
    const int64_t id = t.data<int64_t>()[r];
    const bool ok = id >= 0 && id < vocab && xc.data<float>()[static_cast<size_t>(r) * vocab + id] > -std::numeric_limits<float>::infinity();
    out[r] = ok ? id : -1;
  }
  return mx::array(out.begin(), {rows}, mx::int64);
}

}  // namespace etmlx::kernels
