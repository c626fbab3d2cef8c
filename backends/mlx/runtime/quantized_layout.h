// The one check of an MLX affine-quantized weight triple (w, scales, biases) and
// its bits / group size, shared by the loader (constant operands, before the
// first call) and the interpreter (every call): mlx::core's quantized kernels
// read `w` by the sizes the scales imply, so a mismatch must never reach them.
#pragma once

#include <string>

#include <mlx/array.h>

namespace etmlx {

// The bit widths (4, 8) and group sizes (32, 64, 128) the delegate accepts (MLX affine
// mode): true, or false with `*error` set to one line naming the bad value.
bool check_quantized_params(int group_size, int bits, std::string* error);

// Checks the params, then returns true when w is uint32 [N, K * bits / 32], scales and biases are the
// same floating dtype and shape [N, K / group_size]; else false with `*error`
// set to one line naming the problem. `*in_features` gets K. `ndim` 3: a stack of such
// matrices (MoE experts), w [E, N, K * bits / 32] and scales [E, N, K / group_size].
bool check_quantized_layout(const mlx::core::array& w, const mlx::core::array& scales,
                            const mlx::core::array& biases, int group_size, int bits,
                            int* in_features, std::string* error, int ndim = 2);

}  // namespace etmlx
