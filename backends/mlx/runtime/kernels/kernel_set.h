// Which variant of each device-dependent kernel a program runs, chosen once when it is loaded.
//
// Kernels whose best formulation depends on the device have one file per variant
// (gumbel_max_cpu.cpp / gumbel_max_device.cpp, ...) behind one signature; the
// interpreter calls through the set it got at load and never asks the device
// in the middle of an op. "cpu": host loops, each run as a node of the graph once its
// operands are computed (host_kernel.h), BLAS-friendly matmuls, its own quantized matmul. "device": compositions of
// mlx ops, for Metal and CUDA. Both are lazy: nothing is evaluated before the call's one
// evaluation; a node that would like a value the host does not hold yet (known_values.h)
// takes the shape that is right for any value instead.
#pragma once

#include <string>

#include <mlx/device.h>

#include "kernels/allowed_mask.h"
#include "kernels/cpu_gemm.h"
#include "kernels/filter_threshold.h"
#include "kernels/gumbel_max.h"
#include "kernels/norms.h"
#include "kernels/rope.h"
#include "kernels/quantized_matmul.h"
#include "options.h"
#include "kernels/sigmoid.h"
#include "kernels/silu_product.h"
#include "kernels/tanh_erf.h"

namespace etmlx::kernels {

struct KernelSet {
  const char* name;  // "cpu" or "device"
  GumbelMaxFn gumbel_max;
  FilterThresholdFn filter_threshold;
  MatmulFn matmul;
  AddmmFn addmm;
  bool fast_rope;  // mx::fast::rope where the exporter allowed it (rope.h; ETMLX_FAST_ROPE overrides)
  AllowedMaskFn allowed_mask;
  DrawnOrNoneFn drawn_or_none;
  QuantizedMatmulFn quantized_matmul;
  // RMSNorm (norms.h): mx::fast on devices with its kernel, one host loop on the CPU.
  mlx::core::array (*rms_norm)(const mlx::core::array& x, const std::optional<mlx::core::array>& weight, float eps);
  // Rotate-half RoPE from cos/sin tables (rope.h): the graph's ops, or one host loop on the CPU.
  mlx::core::array (*rope_from_tables)(const mlx::core::array& x, const mlx::core::array& cos,
                                       const mlx::core::array& sin);
  SigmoidFn sigmoid;
  // Several quantized linears over one input as one node (quantized_matmul.h); null: each on its own.
  QuantizedMatmulGroupFn quantized_matmul_group;
  // A gated MLP's SiLU(g) * u as one node (silu_product.h); null: the exporter's three instructions.
  SiluProductFn silu_product;
  // GELU's tanh and erf (tanh_erf.h): MLX's ops, or host loops on the CPU.
  UnaryFn tanh;
  UnaryFn erf;
};

const KernelSet& cpu_kernels();
const KernelSet& device_kernels();

// The set for `device`: cpu_kernels() on the CPU, device_kernels() elsewhere, unless `forced`
// (ETMLX_KERNELS=cpu or =device, options.h) names one (device on a CPU build runs the GPU formulation,
// so tests can check it there).
const KernelSet& select_kernels(const mlx::core::Device& device, options::Kernels forced);

}  // namespace etmlx::kernels
