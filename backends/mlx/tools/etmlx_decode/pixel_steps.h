// An RGB image to the pixels a vision-language program's vision method takes, without Python: the steps the
// exporter resolved from the checkpoint's image processor (DecoderMeta.pixel_steps, serialization/decoder_meta.fbs
// PixelSteps; llm/vision/preprocess.py pixel_steps), done as transformers' PIL backend does them, so the pixels
// equal llm/vision/preprocess.py's bit for bit (tests/test_decode_images.py): pad to a square, resize (PIL's
// 8-bit two-pass filter, bilinear or bicubic), centre crop, rescale (double, then float32), normalise (float32).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace etmlx {

struct PixelSteps {
  std::vector<int64_t> pad_colour;  // [r, g, b]: pad to a centred square first; empty: no pad
  std::string resize;               // "shortest_edge", "fixed" or "" (none)
  std::vector<int64_t> size;        // [edge] or [height, width]
  int64_t resample = 0;             // PIL filter number: 2 bilinear, 3 bicubic
  std::vector<int64_t> crop;        // [height, width]; empty: none
  double rescale = 0;               // 0: none
  std::vector<float> mean, std;     // empty: not normalised
};

// Checks the steps' values (a resize has a size and a filter this file implements, ...); false with `error`.
bool check_pixel_steps(const PixelSteps& steps, std::string* error);

// [3, H, W] float32 pixels of a `width` x `height` RGB image (`rgb`: row-major, 3 bytes per pixel), with H and W;
// nullopt with `error` when a step cannot apply (a resize to an empty image).
struct Pixels {
  int64_t height = 0, width = 0;
  std::vector<float> values;  // [3, height, width]
};
std::optional<Pixels> make_pixels(const uint8_t* rgb, int64_t width, int64_t height, const PixelSteps& steps,
                                  std::string* error);

}  // namespace etmlx
