#include "device_choice.h"

#include <mlx/device.h>

#include "options.h"

namespace mx = mlx::core;

namespace etmlx {

bool apply_device_choice(std::string* error) {
  const options::ProcessOptions& o = options::process();
  if (!o.device_error.empty()) {
    *error = o.device_error;
    return false;
  }
  if (o.device == options::Device::mlx_default) return true;
  const mx::Device device = o.device == options::Device::gpu ? mx::Device::gpu : mx::Device::cpu;
  if (!mx::is_available(device)) {
    *error = "ETMLX_DEVICE=gpu, but this MLX build has no GPU (a CUDA or Metal build of MLX has one)";
    return false;
  }
  // Set before the program's kernels are chosen (they follow the default device) and before any
  // of its arrays are made; the process-wide default is what ETMLX_DEVICE means.
  if (mx::default_device() != device) mx::set_default_device(device);
  return true;
}

}  // namespace etmlx
