// Which MLX device a process's programs run on: ETMLX_DEVICE=cpu|gpu, else MLX's default (the GPU
// where the MLX build has one). Lets one CUDA/Metal build compare CPU and GPU on the same machine.
#pragma once

#include <string>

namespace etmlx {

// Applies ETMLX_DEVICE to MLX's default device. False, with *error set, when the value is not
// "cpu"/"gpu" or names a device this MLX build lacks.
bool apply_device_choice(std::string* error);

}  // namespace etmlx
