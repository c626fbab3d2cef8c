// etmlx_decode --image FILE: one PNG or JPEG file as 8-bit RGB, the same pixels the Python side's
// backends.mlx.llm.vision.images.load_image gives for it (its module docstring is the specification).
//
// Checks, in load_image's order: the file's size (max_bytes) before reading it, the format from its leading
// bytes (WebP, GIF and BMP, which the Python side also reads, and other known formats are refused by name),
// the width x height the header declares (max_pixels) before any pixel is decoded, then the decode itself
// (corrupt or truncated data is a one-line error, never a crash). Normalised as load_image: EXIF orientation
// applied, transparency composited onto white, palette / grey / CMYK converted to RGB, 16-bit grey scaled.
// Built without libpng and libjpeg (ETMLX_DECODE_IMAGES off, or the libraries not found), every read is
// refused with a line saying so.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace etmlx {

struct RgbImage {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> pixels;  // row-major, 3 bytes (R, G, B) per pixel
};

struct ImageFileLimits {
  int64_t max_bytes = 20 * 1024 * 1024;  // the file's size
  int64_t max_pixels = 4096 * 4096;      // width x height its header declares
};

// Whether this build reads image files (libpng and libjpeg were found at build time).
bool image_files_supported();

// The file's first frame as 8-bit RGB, or nullopt with a one-line `error` naming the file and the problem.
std::optional<RgbImage> read_image_file(const std::string& path, const ImageFileLimits& limits, std::string* error);

}  // namespace etmlx
