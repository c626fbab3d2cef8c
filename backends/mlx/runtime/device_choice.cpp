#include "device_choice.h"

#include <cstdlib>

#include <mlx/device.h>

namespace mx = mlx::core;

namespace etmlx {

bool apply_device_choice(std::string* error) {
  const char* choice = std::getenv("ETMLX_DEVICE");
  if (choice == nullptr || *choice == '\0') return true;
  const std::string name = choice;
  if (name != "cpu" && name != "gpu") {
    *error = "ETMLX_DEVICE=" + name + " is not \"cpu\" or \"gpu\"";
    return false;
  }
  const mx::Device device = name == "gpu" ? mx::Device::gpu : mx::Device::cpu;
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
