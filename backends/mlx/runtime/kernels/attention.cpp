#include "kernels/attention.h"

#include <string>

#include <mlx/fast.h>
#include <mlx/ops.h>

namespace etmlx::kernels {

namespace mx = mlx::core;

mx::array sdpa(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
               const std::optional<mx::array>& mask_in, int key_end) {
  const int keys = k.shape(2);
  mx::array kk = k, vv = v;
  std::optional<mx::array> mask = mask_in;
  if (key_end < keys) {
    auto first = [key_end](const mx::array& x, int axis) {
      mx::Shape start(x.ndim(), 0), stop = x.shape();
      stop[axis] = key_end;
      return mx::slice(x, start, stop);
    };
    kk = first(kk, 2);
    vv = first(vv, 2);
    if (mask && mask->ndim() >= 1 && mask->shape(-1) == keys) mask = first(*mask, mask->ndim() - 1);
  }
  const std::string mode = mask ? "array" : (causal ? "causal" : "");
  return mx::fast::scaled_dot_product_attention(q, kk, vv, scale, mode, mask);
}

}  // namespace etmlx::kernels
