#include "kernels/norms.h"

#include <mlx/fast.h>

namespace etmlx::kernels {

namespace mx = mlx::core;

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps) {
  return mx::fast::rms_norm(x, weight, eps);
}

mx::array layer_norm(const mx::array& x, const std::optional<mx::array>& weight, const std::optional<mx::array>& bias,
                     float eps) {
  return mx::fast::layer_norm(x, weight, bias, eps);
}

}  // namespace etmlx::kernels
