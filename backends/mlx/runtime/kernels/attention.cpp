#include "kernels/attention.h"

#include <string>

#include <mlx/fast.h>
#include <mlx/ops.h>

namespace etmlx::kernels {

namespace mx = mlx::core;

void keep_first_keys(mx::array& k, mx::array& v, std::optional<mx::array>& mask, int key_end) {
  const int keys = k.shape(2);
  if (key_end >= keys) return;
  auto first = [key_end](const mx::array& x, int axis) {
    mx::Shape start(x.ndim(), 0), stop = x.shape();
    stop[axis] = key_end;
    return mx::slice(x, start, stop);
  };
  k = first(k, 2);
  v = first(v, 2);
  if (mask && mask->ndim() >= 1 && mask->shape(-1) == keys) mask = first(*mask, mask->ndim() - 1);
}

mx::array sdpa(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
               const std::optional<mx::array>& mask_in, int key_end) {
  mx::array kk = k, vv = v;
  std::optional<mx::array> mask = mask_in;
  keep_first_keys(kk, vv, mask, key_end);
  const std::string mode = mask ? "array" : (causal ? "causal" : "");
  return mx::fast::scaled_dot_product_attention(q, kk, vv, scale, mode, mask);
}

}  // namespace etmlx::kernels
