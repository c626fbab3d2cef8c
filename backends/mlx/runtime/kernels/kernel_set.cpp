#include "kernels/kernel_set.h"

#include <cstdlib>
#include <cstring>

#include <mlx/ops.h>

namespace etmlx::kernels {

namespace mx = mlx::core;

namespace {

mx::array device_matmul(const mx::array& a, const mx::array& b) { return mx::matmul(a, b); }

mx::array device_addmm(const mx::array& bias, const mx::array& a, const mx::array& b, float alpha, float beta) {
  return mx::addmm(bias, a, b, alpha, beta);
}

mx::array device_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                  const mx::array& biases, int group_size, int bits, ActivationPrecision) {
  // MLX's own kernels: the activations as they are, whatever the program's CPU precision.
  return mx::quantized_matmul(x, w, scales, biases, /*transpose=*/true, group_size, bits, "affine");
}

}  // namespace

const KernelSet& cpu_kernels() {
  static const KernelSet set{"cpu", gumbel_max_cpu, filter_threshold_cpu, cpu_matmul, cpu_addmm,
                             /*fast_rope=*/false, allowed_mask_cpu, drawn_or_none_cpu,
                             quantized_matmul_cpu, rms_norm_cpu, rope_tables_cpu, sigmoid_cpu,
                             quantized_matmul_group_cpu, /*silu_product=*/nullptr, tanh_cpu, erf_cpu};
  return set;
}

const KernelSet& device_kernels() {
  static const KernelSet set{"device", gumbel_max_device, filter_threshold_device, device_matmul, device_addmm,
                             /*fast_rope=*/true, allowed_mask_device, drawn_or_none_device,
                             device_quantized_matmul, rms_norm, rope_from_tables, sigmoid_device,
                             /*quantized_matmul_group=*/nullptr, silu_product_device, tanh_device,
                             erf_device};
  return set;
}

const KernelSet& select_kernels(const mx::Device& device, options::Kernels forced) {
  if (forced == options::Kernels::cpu) return cpu_kernels();
  if (forced == options::Kernels::device) return device_kernels();
  return device == mx::Device::cpu ? cpu_kernels() : device_kernels();
}

}  // namespace etmlx::kernels
