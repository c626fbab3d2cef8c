// The many-row quantized product (quantized_gemm.h) with integer activations on AVX2 CPUs without AVX-512
// VNNI: the formula of quantized_gemm_vnni.h, its integer sums from vpmaddubsw (the weights' unsigned bytes,
// 4 bytes of an activation row broadcast) and vpmaddwd.
//
// 4-bit weights only: a vpmaddubsw pair is at most 2 * 15 * 128 = 3840, so eight of them summed in 16 bits
// (30720) stay exact before vpmaddwd widens them; 8-bit weights would saturate a single pair. The activations
// are the few-row loop's (prepare_integer_avx2: quantize_activation_group's integers, per 64 values the
// even ones then the odd ones), rounded once per call; each pool thread unpacks 8 W rows at a time to bytes
// in a [k / 4][8 W rows][4] layout and multiplies every activation row by them, 4 rows per register tile.
// A row's result depends only on that row and W (not on m, its place among the rows, or the threads).
#pragma once

#include "kernels/quantized_activations.h"
#include "kernels/quantized_rows.h"

namespace etmlx::kernels {

// True when this CPU has AVX2 and FMA and the kernel handles the layout: 4 bits, groups of 64 or 128.
bool quantized_gemm_avx2_available(int bits, int group);

// out [m, w.n] row-major = x [m, w.k] row-major . W^T with p's integer activations (int16 or int8);
// needs quantized_gemm_avx2_available(w.bits, w.group).
void quantized_gemm_avx2(const float* x, int m, const QuantizedMatrix& w, ActivationPrecision p, float* out);

}  // namespace etmlx::kernels
