// exec_rms_norm, exec_layer_norm: normalizations through MLX's fused kernels
// (semantics in schema.fbs). The exporter emits these only where they give
// what the composed graph gives; here every operand is checked again, since
// mlx::core::fast trusts its caller's shapes on some devices.
#include <mlx/fast.h>
#include <mlx/ops.h>

#include "dtypes.h"
#include "interpreter.h"

namespace etmlx {

namespace mx = mlx::core;

bool Interpreter::norm_operand(const fb::Tid* t, const mx::array& x, const char* what,
                               std::optional<mx::array>* out) {
  if (t == nullptr) return true;  // optional operand left out
  const mx::array* a = read(t);
  if (!a) return false;
  if (!mx::issubdtype(a->dtype(), mx::floating)) {
    return fail("%s must be floating, got %s", what, mlx_dtype_name(a->dtype()));
  }
  if (a->ndim() != 1 || a->shape(0) != x.shape(-1)) {
    return fail("%s must be 1-d with %d elements (x's last size)", what, static_cast<int>(x.shape(-1)));
  }
  *out = *a;
  return true;
}

bool Interpreter::norm_input(const fb::Tid* t, const mx::array** x) {
  *x = read(t);
  if (!*x) return false;
  if ((*x)->ndim() == 0) return fail("needs x with at least one dimension");
  if (!mx::issubdtype((*x)->dtype(), mx::floating)) {
    return fail("needs a floating x, got %s", mlx_dtype_name((*x)->dtype()));
  }
  return true;
}

bool Interpreter::exec_rms_norm(const fb::RmsNormNode& n) {
  const mx::array* x = nullptr;
  if (!norm_input(n.x(), &x)) return false;
  std::optional<mx::array> weight;
  if (!norm_operand(n.weight(), *x, "weight", &weight)) return false;
  return write(n.out(), mx::fast::rms_norm(*x, weight, n.eps()));
}

bool Interpreter::exec_layer_norm(const fb::LayerNormNode& n) {
  const mx::array* x = nullptr;
  if (!norm_input(n.x(), &x)) return false;
  std::optional<mx::array> weight, bias;
  if (!norm_operand(n.weight(), *x, "weight", &weight)) return false;
  if (!norm_operand(n.bias(), *x, "bias", &bias)) return false;
  return write(n.out(), mx::fast::layer_norm(*x, weight, bias, n.eps()));
}

}  // namespace etmlx
