// etmlx_image_read FILE [--max-pixels N] [--max-bytes N] [--meta META]: the RGB pixels etmlx_decode --image would
// take from FILE (image_file.h), for tests (tests/test_image_file_cpp.py compares them with the Python reader) and
// for looking at one file. Writes "W H\n" then W * H * 3 bytes (R, G, B, row-major) to stdout and exits 0, or
// one line "etmlx_image_read: error: ..." to stderr and exits 2. With --meta (a DecoderMeta flatbuffer file, as
// `etmlx export` stores in a program): the vision method's pixels its pixel steps make (pixel_steps.h) instead,
// "3 H W\n" then 3 * H * W float32 values (native byte order), as tests/test_decode_images.py checks them.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "decoder_meta.h"
#include "image_file.h"
#include "pixel_steps.h"

namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "etmlx_image_read: error: %s\n", message.c_str());
  return 2;
}

// A positive decimal count; false for anything else.
bool parse_count(const char* text, int64_t* value) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0 || v < 1) return false;
  *value = v;
  return true;
}

// --meta: the pixels of `image` by the pixel steps of the DecoderMeta flatbuffer in `meta_file`.
int write_pixels(const etmlx::RgbImage& image, const std::string& meta_file) {
  std::ifstream in(meta_file, std::ios::binary);
  const std::string blob((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in && !in.eof()) return fail("cannot read " + meta_file);
  std::string error;
  const auto meta = etmlx::parse_decoder_meta(blob.data(), blob.size(), meta_file, &error);
  if (!meta) return fail(error);
  if (!meta->pixel_steps) return fail(meta_file + " has no pixel steps");
  if (!etmlx::check_pixel_steps(*meta->pixel_steps, &error)) return fail(meta_file + ": " + error);
  const auto pixels = etmlx::make_pixels(image.pixels.data(), image.width, image.height, *meta->pixel_steps, &error);
  if (!pixels) return fail(error);
  std::printf("3 %lld %lld\n", static_cast<long long>(pixels->height), static_cast<long long>(pixels->width));
  const size_t n = pixels->values.size();
  if (std::fwrite(pixels->values.data(), sizeof(float), n, stdout) != n || std::fflush(stdout) != 0)
    return fail("cannot write the pixels to stdout");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage = "usage: etmlx_image_read FILE [--max-pixels N] [--max-bytes N] [--meta META]";
  std::string path, meta_file;
  etmlx::ImageFileLimits limits;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--max-pixels" || arg == "--max-bytes") {
      if (i + 1 >= argc) return fail(arg + " needs a value; " + usage);
      int64_t* target = arg == "--max-pixels" ? &limits.max_pixels : &limits.max_bytes;
      if (!parse_count(argv[++i], target)) return fail(arg + " takes an integer >= 1, not '" + argv[i] + "'");
    } else if (arg == "--meta") {
      if (i + 1 >= argc) return fail(arg + " needs a file; " + usage);
      meta_file = argv[++i];
    } else if (arg == "-h" || arg == "--help") {
      std::printf("%s\n", usage.c_str());
      return 0;
    } else if (path.empty() && !arg.empty() && (arg[0] != '-' || arg == "-")) {
      path = arg;
    } else {
      return fail("unexpected argument '" + arg + "'; " + usage);
    }
  }
  if (path.empty()) return fail(usage);
  std::string error;
  const std::optional<etmlx::RgbImage> image = etmlx::read_image_file(path, limits, &error);
  if (!image) return fail(error);
  if (!meta_file.empty()) return write_pixels(*image, meta_file);
  std::printf("%lld %lld\n", static_cast<long long>(image->width), static_cast<long long>(image->height));
  if (std::fwrite(image->pixels.data(), 1, image->pixels.size(), stdout) != image->pixels.size() ||
      std::fflush(stdout) != 0)
    return fail("cannot write the pixels to stdout");
  return 0;
}
