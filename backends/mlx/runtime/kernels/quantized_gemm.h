// Many-row quantized products on the CPU (prefill): out [m, n] = x [m, k] . W^T, W in MLX's affine
// layout (quantized_rows.h), without a float32 copy of the whole of W.
//
// Each pool thread takes a range of W's rows, dequantizes them a block of k at a time into a buffer
// that stays in its own cache, and multiplies every activation row by that block with an AVX-512
// register-tile kernel; the activations are packed once per call, 32 rows side by side. All float32,
// each output summed in k order with one fused multiply-add per product: a row's result depends only
// on that row and W (not on m, nor on the threads).
#pragma once

#include "kernels/quantized_rows.h"

namespace etmlx::kernels {

// True when this CPU runs the tiled kernel (AVX-512F) and ETMLX_QMM_ISA (the variant tests) did not
// force a few-row loop other than avx512.
bool quantized_gemm_available();

// True when an integer-activation GEMM (quantized_gemm_vnni.h on AVX-512 VNNI, quantized_gemm_avx2.h where the
// few-row loop is AVX2's) computes quantized_gemm() for W's bits and group at precision `p` (not float32).
bool quantized_gemm_integer(int bits, int group, ActivationPrecision p);

// out [m, w.n] row-major = x [m, w.k] row-major . W^T; needs quantized_gemm_available() or
// quantized_gemm_integer(w.bits, w.group, p). At p = int16 or int8 (the program's), an integer-activation kernel
// where one handles the layout; else the float32 tiles above.
void quantized_gemm(const float* x, int m, const QuantizedMatrix& w, ActivationPrecision p, float* out);

}  // namespace etmlx::kernels
