// How the activations enter the cpu kernel set's quantized products (quantized_rows.h, quantized_gemm.h).
//
//   float32  each activation as it is: every product in float32, as mx::quantized_matmul.
//   int16    (default) each group of `group` activations (the weights' quantization group) rounded to 16-bit
//            integers with one float32 step per group: x ~ step * q, |q| <= 32512 = 127 * 256, so that
//            |x - step * q| <= step / 2 = max|x_g| / 65024. The products with the 4- or 8-bit weights are
//            then exact integer sums (AVX-512 VNNI: q's high and low bytes, two vpdpbusd per 64 values),
//            one float32 multiply-add per group. A product then differs from float32's by at most
//            sum_g |scale_g| * step_g / 2 * sum_i |q_i - 2^(bits-1)| (the rounding meets centred weights:
//            PreparedRows::residuals in quantized_rows.h): ~5e-5 of a random 896-input product's size, more
//            where one group's values span a wide range (its step follows its largest value).
//   int8     the same with |q| <= 127 (one vpdpbusd per 64 values): max|x_g| / 254 per activation, the
//            trade llama.cpp makes with its Q8_0 activations, for the most speed.
//
// The bias term of MLX's affine layout, bias_g * sum(x_g), always uses the float32 sum of x itself.
// int16 is the default: on a core of this project's AVX-512 EPYC the float32 loop converts every 4-bit
// weight to a float and decodes at ~16 GB/s of weights, under the ~23 GB/s one core can read; the integer
// loop reads at that bandwidth, with the same greedy tokens on the benchmark model. (mlx-lm runs a bf16
// checkpoint's activations in bf16: 2^-9 of each value, far coarser than this.)
// A program carries its choice (schema.fbs Graph.qmm_activations, set at export: export_to_pte(qmm_activations=),
// `etmlx export --qmm-activations`), since it changes the program's results; a kernel that has no integer variant
// on this CPU (the few-row loop: AVX-512 VNNI, or AVX2 at 4 bits, whose vpmaddubsw would saturate on 8-bit
// weights; the many-row GEMM: AVX-512 VNNI only; or a group size it does not handle) computes in float32, and
// kernels_info() says what the few-row loop and the GEMM run.
#pragma once

#include <cstdint>

namespace etmlx::kernels {

enum class ActivationPrecision : uint8_t { float32, int16, int8 };

const char* activation_precision_name(ActivationPrecision p);

// The largest |q| of a precision's integers: 32512 (int16) or 127 (int8).
constexpr int kInt16Max = 127 * 256;
constexpr int kInt8Max = 127;

// Rounds x[0..count) to integers q[i] = nearbyint(x[i] * (qmax / max|x|)), |q| <= qmax, and returns the
// step (max|x| / qmax; 0 with every q 0 when x is all zeros). Non-finite x gives step NaN: the products are
// then NaN, as the float32 ones would be. For int16 each q is split into bytes hi[i] in [-127, 127] and
// lo[i] in [-128, 127] with q = 256 * hi + lo; for int8 hi[i] = q and lo is not written (may be null).
float quantize_activation_group(const float* x, int count, ActivationPrecision p, int8_t* hi, int8_t* lo);

}  // namespace etmlx::kernels
