#include "cpu_gemm.h"

namespace mx = mlx::core;

namespace etmlx {
namespace {

bool half_on_cpu(const mx::array& a, const mx::array& b) {
  auto half = [](mx::Dtype t) { return t == mx::float16 || t == mx::bfloat16; };
  return mx::default_device() == mx::Device::cpu && a.dtype() == b.dtype() && half(a.dtype());
}

}  // namespace

mx::array device_matmul(const mx::array& a, const mx::array& b) {
  if (!half_on_cpu(a, b)) return mx::matmul(a, b);
  return mx::astype(mx::matmul(mx::astype(a, mx::float32), mx::astype(b, mx::float32)), a.dtype());
}

mx::array device_addmm(const mx::array& bias, const mx::array& a, const mx::array& b, float alpha,
                       float beta) {
  if (!half_on_cpu(a, b) || bias.dtype() != a.dtype()) return mx::addmm(bias, a, b, alpha, beta);
  return mx::astype(mx::addmm(mx::astype(bias, mx::float32), mx::astype(a, mx::float32),
                              mx::astype(b, mx::float32), alpha, beta),
                    a.dtype());
}

}  // namespace etmlx
