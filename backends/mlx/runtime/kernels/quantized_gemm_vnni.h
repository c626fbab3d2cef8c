// The many-row quantized product (quantized_gemm.h) with integer activations (quantized_activations.h:
// the program's int16 or int8) on AVX-512 VNNI:
//
//   out[m, n] = sum over groups g of scale[n, g] * step[m, g] * (sum_i qw[n, i] * q[m, i])
//                                    + bias[n, g] * (sum_i x[m, i])
//                                    + 2^(bits-1) * scale[n, g] * (sum_i x[m, i] - step[m, g] * q[m, i])
//
// qw the weights' stored integers (0..15 or 0..255), q[m, i] the activations rounded per group by
// quantize_activation_group (int16: q = 256 * hi + lo, two byte passes), the integer sum exact in int32
// (8-bit weights, group 128, int16: |sum| <= 256 * 255 * 127 * 128 + 255 * 128 * 128 < 2^31), the other
// sums in float32 from the activations themselves. The last term (the rounding the integers left, the
// few-row loop's residual: quantized_rows.h) makes the whole scale * ((qw - 2^(bits-1)) . step q) +
// (bias + 2^(bits-1) scale) * sum(x): the rounding meets the centred weights, |qw - 8| <= 8 at 4 bits
// instead of qw <= 15, so the error bound is the few-row loop's (tests/quantized_bounds.py).
//
// Each pool thread unpacks a block of W's rows to bytes (exact, 4x smaller than float32) laid out for
// vpdpbusd with the weights' unsigned bytes in the vector lanes (16 W rows) and 4 bytes of one activation
// row broadcast. A row's result depends only on that row and W (not on m, its place among the rows, or
// the threads).
#pragma once

#include "kernels/quantized_activations.h"
#include "kernels/quantized_rows.h"

namespace etmlx::kernels {

// True when this CPU has AVX-512 F+BW+VNNI and the kernel handles the layout: 4 or 8 bits, groups of
// 32, 64 or 128 (others stay on the float32 GEMM).
bool quantized_gemm_vnni_available(int bits, int group);

// out [m, w.n] row-major = x [m, w.k] row-major . W^T with p's integer activations (int16 or int8);
// needs quantized_gemm_vnni_available(w.bits, w.group).
void quantized_gemm_vnni(const float* x, int m, const QuantizedMatrix& w, ActivationPrecision p, float* out);

}  // namespace etmlx::kernels
