// quantized_activations.h
#include "kernels/quantized_activations.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace etmlx::kernels {

const char* activation_precision_name(ActivationPrecision p) {
  switch (p) {
    case ActivationPrecision::float32: return "float32";
    case ActivationPrecision::int16: return "int16";
    case ActivationPrecision::int8: return "int8";
  }
  return "float32";
}

float quantize_activation_group(const float* x, int count, ActivationPrecision p, int8_t* hi, int8_t* lo) {
  const int qmax = p == ActivationPrecision::int16 ? kInt16Max : kInt8Max;
  float largest = 0.0f;
  bool finite = true;
  for (int i = 0; i < count; ++i) {
    finite = finite && std::isfinite(x[i]);
    largest = std::max(largest, std::fabs(x[i]));
  }
  if (!finite || largest == 0.0f) {
    std::memset(hi, 0, count);
    if (lo != nullptr && p == ActivationPrecision::int16) std::memset(lo, 0, count);
    return finite ? 0.0f : std::nanf("");
  }
  const float inverse = static_cast<float>(qmax) / largest;
  for (int i = 0; i < count; ++i) {
    // x * inverse is within one rounding of qmax at the largest value: the clamp keeps |q| <= qmax.
    const int q = std::clamp(static_cast<int>(std::nearbyint(x[i] * inverse)), -qmax, qmax);
    if (p == ActivationPrecision::int16) {
      const int low = ((q + 128) & 255) - 128;
      lo[i] = static_cast<int8_t>(low);
      hi[i] = static_cast<int8_t>((q - low) / 256);
    } else {
      hi[i] = static_cast<int8_t>(q);
    }
  }
  return largest / static_cast<float>(qmax);
}

}  // namespace etmlx::kernels
