// Half-precision matmul weights on the CPU, widened once at load.
#pragma once

#include "loader.h"

namespace etmlx {

// On the CPU kernel set, half-precision products run in float32 (kernels/cpu_gemm.cpp: MLX's CPU
// half GEMM is far slower), which converted each linear's weight matrix on every call. This
// replaces each float16/bfloat16 constant that is used only as a linear's weight (a 2-d constant
// read only by a [1, 0] TransposeNode whose output is read only as the `b` of MatmulNode /
// AddmmNode) by its float32 value, computed once here; cpu_gemm then multiplies it as it is. The
// numbers are those of the per-call conversion (widening is exact). Costs the weights at float32
// size in memory. Returns the number of constants widened; does nothing on other kernel sets or
// with ETMLX_CPU_WIDEN=0 (with ETMLX_CPU_WIDEN set to anything else the loader logs the count).
size_t widen_cpu_matmul_weights(Program& p);

}  // namespace etmlx
