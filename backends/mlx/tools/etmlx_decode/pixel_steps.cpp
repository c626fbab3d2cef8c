#include "pixel_steps.h"

#include <algorithm>
#include <cmath>

namespace etmlx {

namespace {

constexpr int64_t kBilinear = 2, kBicubic = 3;  // PIL's Image.Resampling numbers
// PIL's 8-bit resampling keeps coefficients as ints with 22 fraction bits (32 bits less 8 for the pixel and
// 2 for the sums of negative lobes), rounds half away from zero, and adds half before shifting back.
constexpr int kPrecisionBits = 32 - 8 - 2;

struct Image {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgb;  // row-major, 3 bytes per pixel
};

double filter_weight(int64_t filter, double x) {
  x = std::fabs(x);
  if (filter == kBilinear) return x < 1.0 ? 1.0 - x : 0.0;
  constexpr double a = -0.5;  // PIL's bicubic
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

double filter_support(int64_t filter) { return filter == kBilinear ? 1.0 : 2.0; }

// One output index's taps over the input axis: the first input index and its integer weights.
struct Taps {
  int first = 0;
  std::vector<int32_t> weights;
};

// PIL's coefficients for resizing an axis of `in_size` to `out_size` (the whole axis as the box): a filter
// widened by the downscale factor, normalised to sum 1, then rounded to fixed point.
std::vector<Taps> axis_taps(int64_t in_size, int64_t out_size, int64_t filter) {
  const double scale = static_cast<double>(static_cast<float>(in_size)) / static_cast<double>(out_size);
  const double filterscale = std::max(scale, 1.0);
  const double support = filter_support(filter) * filterscale;
  std::vector<Taps> out(static_cast<size_t>(out_size));
  for (int64_t xx = 0; xx < out_size; ++xx) {
    const double center = (static_cast<double>(xx) + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);  // C's truncation, as PIL
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = static_cast<int>(in_size);
    xmax -= xmin;
    std::vector<double> k(static_cast<size_t>(std::max(xmax, 0)));
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      k[static_cast<size_t>(x)] = filter_weight(filter, (x + xmin - center + 0.5) * ss);
      ww += k[static_cast<size_t>(x)];
    }
    Taps& taps = out[static_cast<size_t>(xx)];
    taps.first = xmin;
    for (double w : k) {
      if (ww != 0.0) w /= ww;
      const double fixed = w * (1 << kPrecisionBits);
      taps.weights.push_back(static_cast<int32_t>(w < 0 ? -0.5 + fixed : 0.5 + fixed));
    }
  }
  return out;
}

uint8_t clip8(int32_t sum) {
  return static_cast<uint8_t>(std::clamp<int32_t>(sum >> kPrecisionBits, 0, 255));
}

// Rows [row0, row0 + rows) of `in`, resized horizontally to `taps.size()` columns.
Image resize_rows(const Image& in, const std::vector<Taps>& taps, int64_t row0, int64_t rows) {
  Image out{static_cast<int64_t>(taps.size()), rows, {}};
  out.rgb.resize(static_cast<size_t>(out.width * rows * 3));
  for (int64_t y = 0; y < rows; ++y) {
    const uint8_t* line = in.rgb.data() + (row0 + y) * in.width * 3;
    for (int64_t x = 0; x < out.width; ++x) {
      const Taps& t = taps[static_cast<size_t>(x)];
      for (int c = 0; c < 3; ++c) {
        int32_t sum = 1 << (kPrecisionBits - 1);
        for (size_t i = 0; i < t.weights.size(); ++i) sum += line[(t.first + static_cast<int64_t>(i)) * 3 + c] * t.weights[i];
        out.rgb[static_cast<size_t>((y * out.width + x) * 3 + c)] = clip8(sum);
      }
    }
  }
  return out;
}

// `in` resized vertically to `taps.size()` rows; `shift` is subtracted from each tap's first row (the rows the
// horizontal pass skipped).
Image resize_columns(const Image& in, const std::vector<Taps>& taps, int64_t shift) {
  Image out{in.width, static_cast<int64_t>(taps.size()), {}};
  out.rgb.resize(static_cast<size_t>(out.width * out.height * 3));
  for (int64_t y = 0; y < out.height; ++y) {
    const Taps& t = taps[static_cast<size_t>(y)];
    for (int64_t x = 0; x < out.width; ++x) {
      for (int c = 0; c < 3; ++c) {
        int32_t sum = 1 << (kPrecisionBits - 1);
        for (size_t i = 0; i < t.weights.size(); ++i)
          sum += in.rgb[static_cast<size_t>(((t.first - shift + static_cast<int64_t>(i)) * in.width + x) * 3 + c)] *
                 t.weights[i];
        out.rgb[static_cast<size_t>((y * out.width + x) * 3 + c)] = clip8(sum);
      }
    }
  }
  return out;
}

// PIL's Image.resize of an RGB image (Pillow 13's ImagingResampleInner): two passes, each rounding to 8 bits, an
// axis already at its size not resampled. The horizontal pass comes first, over only the rows the vertical pass
// reads, unless the height shrinks by more than twice as many pixels as the width does: then the vertical pass
// does (Pillow's speed rule; the order changes the rounding, so it is followed exactly).
Image resize(const Image& in, int64_t height, int64_t width, int64_t filter) {
  const bool horizontal = width != in.width, vertical = height != in.height;
  if (!horizontal && !vertical) return in;
  const auto rows = axis_taps(in.height, height, filter);
  const bool horizontal_first = !(in.height - height > 0 && in.height - height > (in.width - width) * 2);
  if (!horizontal) return resize_columns(in, rows, 0);
  const auto columns = axis_taps(in.width, width, filter);
  if (!horizontal_first) return resize_rows(vertical ? resize_columns(in, rows, 0) : in, columns, 0, height);
  const int64_t first_row = rows.front().first;
  const int64_t last_row = rows.back().first + static_cast<int64_t>(rows.back().weights.size());
  Image wide = resize_rows(in, columns, first_row, last_row - first_row);
  return vertical ? resize_columns(wide, rows, first_row) : wide;
}

Image pad_square(const Image& in, const std::vector<int64_t>& colour) {
  const int64_t side = std::max(in.width, in.height);
  if (in.width == in.height) return in;
  Image out{side, side, std::vector<uint8_t>(static_cast<size_t>(side * side * 3))};
  for (size_t i = 0; i < out.rgb.size(); ++i) out.rgb[i] = static_cast<uint8_t>(colour[i % 3]);
  const int64_t left = (side - in.width) / 2, top = (side - in.height) / 2;
  for (int64_t y = 0; y < in.height; ++y)
    std::copy_n(in.rgb.data() + y * in.width * 3, in.width * 3, out.rgb.data() + ((top + y) * side + left) * 3);
  return out;
}

// The centre `height` x `width` of `in`; a side shorter than the crop is first padded with zeros around it
// (the larger half before it, as transformers' center_crop).
Image center_crop(const Image& in, int64_t height, int64_t width) {
  const int64_t ph = std::max(in.height, height), pw = std::max(in.width, width);
  const int64_t pad_top = (ph - in.height + 1) / 2, pad_left = (pw - in.width + 1) / 2;
  const int64_t top = (ph - height) / 2 - pad_top, left = (pw - width) / 2 - pad_left;
  Image out{width, height, std::vector<uint8_t>(static_cast<size_t>(width * height * 3), 0)};
  for (int64_t y = 0; y < height; ++y) {
    const int64_t sy = top + y;
    if (sy < 0 || sy >= in.height) continue;
    for (int64_t x = 0; x < width; ++x) {
      const int64_t sx = left + x;
      if (sx < 0 || sx >= in.width) continue;
      std::copy_n(in.rgb.data() + (sy * in.width + sx) * 3, 3, out.rgb.data() + (y * width + x) * 3);
    }
  }
  return out;
}

}  // namespace

bool check_pixel_steps(const PixelSteps& s, std::string* error) {
  const auto positive = [](const std::vector<int64_t>& v) {
    return std::all_of(v.begin(), v.end(), [](int64_t x) { return x >= 1 && x <= 65536; });
  };
  if (!s.pad_colour.empty() && (s.pad_colour.size() != 3 ||
                                std::any_of(s.pad_colour.begin(), s.pad_colour.end(),
                                            [](int64_t c) { return c < 0 || c > 255; }))) {
    *error = "its pixel steps' pad colour is not 3 values in 0..255";
    return false;
  }
  if (!s.resize.empty()) {
    const size_t want = s.resize == "shortest_edge" ? 1 : s.resize == "fixed" ? 2 : 0;
    if (want == 0 || s.size.size() != want || !positive(s.size)) {
      *error = "its pixel steps' resize (\"" + s.resize + "\") has no valid size";
      return false;
    }
    if (s.resample != kBilinear && s.resample != kBicubic) {
      *error = "its pixel steps resize with PIL filter " + std::to_string(s.resample) +
               " (etmlx_decode implements bilinear and bicubic)";
      return false;
    }
  }
  if (!s.crop.empty() && (s.crop.size() != 2 || !positive(s.crop))) {
    *error = "its pixel steps' crop is not [height, width]";
    return false;
  }
  if (s.mean.size() != s.std.size() || (!s.mean.empty() && s.mean.size() != 3) ||
      std::any_of(s.std.begin(), s.std.end(), [](float v) { return !(v != 0.0f) || !std::isfinite(v); })) {
    *error = "its pixel steps' mean and std are not 3 values each (std non-zero)";
    return false;
  }
  return true;
}

std::optional<Pixels> make_pixels(const uint8_t* rgb, int64_t width, int64_t height, const PixelSteps& steps,
                                  std::string* error) {
  Image image{width, height, std::vector<uint8_t>(rgb, rgb + width * height * 3)};
  if (!steps.pad_colour.empty()) image = pad_square(image, steps.pad_colour);
  if (!steps.resize.empty()) {
    int64_t h = 0, w = 0;
    if (steps.resize == "fixed") {
      h = steps.size[0];
      w = steps.size[1];
    } else {  // the shorter side to the edge, the other scaled and truncated (transformers' rule)
      const int64_t edge = steps.size[0];
      const bool portrait = image.width <= image.height;
      const int64_t shorter = portrait ? image.width : image.height, longer = portrait ? image.height : image.width;
      const auto scaled = static_cast<int64_t>(static_cast<double>(edge * longer) / static_cast<double>(shorter));
      h = portrait ? scaled : edge;
      w = portrait ? edge : scaled;
    }
    if (h < 1 || w < 1) {
      *error = "the image (" + std::to_string(image.width) + " x " + std::to_string(image.height) +
               ") would be resized to " + std::to_string(w) + " x " + std::to_string(h);
      return std::nullopt;
    }
    image = resize(image, h, w, steps.resample);
  }
  if (!steps.crop.empty()) image = center_crop(image, steps.crop[0], steps.crop[1]);
  Pixels out{image.height, image.width, std::vector<float>(static_cast<size_t>(3 * image.height * image.width))};
  const size_t plane = static_cast<size_t>(image.height * image.width);
  for (size_t i = 0; i < plane; ++i) {
    for (size_t c = 0; c < 3; ++c) {
      const uint8_t u = image.rgb[i * 3 + c];
      float v = steps.rescale != 0 ? static_cast<float>(static_cast<double>(u) * steps.rescale) : static_cast<float>(u);
      if (!steps.mean.empty()) v = (v - steps.mean[c]) / steps.std[c];
      out.values[c * plane + i] = v;
    }
  }
  return out;
}

}  // namespace etmlx
