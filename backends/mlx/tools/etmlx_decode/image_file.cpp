#include "image_file.h"

#if ETMLX_IMAGE_FILES
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csetjmp>
#include <cstdio>  // before jpeglib.h, which uses FILE and size_t without including it
#include <cstring>
#include <iterator>
#include <memory>
#include <string_view>

#include <jpeglib.h>
#include <jerror.h>  // after jpeglib.h: the JERR_ codes
#include <png.h>
#include <zlib.h>
#endif

namespace etmlx {

#if !ETMLX_IMAGE_FILES

bool image_files_supported() { return false; }

std::optional<RgbImage> read_image_file(const std::string& path, const ImageFileLimits&, std::string* error) {
  *error = "cannot read " + path + ": this build reads no image files (built without libpng and libjpeg: "
           "ETMLX_DECODE_IMAGES off, or the libraries not found)";
  return std::nullopt;
}

#else

namespace {

using Bytes = std::vector<uint8_t>;
using namespace std::literals;

constexpr const char* kOnlyPngJpeg = "; etmlx_decode reads PNG and JPEG (convert it, or use `etmlx generate`)";

// ---------------------------------------------------------------------------------------------------------
// The file: its size is checked before it is read (images.py `_file_bytes`).

std::optional<Bytes> file_bytes(const std::string& path, int64_t max_bytes, std::string* error) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    *error = "cannot read " + path + ": " + std::strerror(errno);
    return std::nullopt;
  }
  if (!S_ISREG(st.st_mode)) {
    *error = path + " is not a file";
    return std::nullopt;
  }
  if (st.st_size > max_bytes) {
    *error = path + " is " + std::to_string(st.st_size) + " bytes; at most " + std::to_string(max_bytes) +
             " are taken";
    return std::nullopt;
  }
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) {
    *error = "cannot read " + path + ": " + std::strerror(errno);
    return std::nullopt;
  }
  // At most max_bytes + 1 bytes: a file that grew since stat() is still refused without reading all of it.
  Bytes data(static_cast<size_t>(st.st_size) + 1);
  size_t got = 0;
  while (true) {
    if (got == data.size()) {
      if (static_cast<int64_t>(got) > max_bytes) break;
      data.resize(std::min<size_t>(data.size() * 2, static_cast<size_t>(max_bytes) + 1));
    }
    const size_t n = std::fread(data.data() + got, 1, data.size() - got, file.get());
    got += n;
    if (n == 0) break;
  }
  if (std::ferror(file.get())) {
    *error = "cannot read " + path + ": " + std::strerror(errno);
    return std::nullopt;
  }
  data.resize(got);
  if (static_cast<int64_t>(got) > max_bytes) {
    *error = path + " is more than " + std::to_string(max_bytes) + " bytes; at most " + std::to_string(max_bytes) +
             " are taken";
    return std::nullopt;
  }
  if (data.empty()) {
    *error = path + " is empty (0 bytes)";
    return std::nullopt;
  }
  return data;
}

// ---------------------------------------------------------------------------------------------------------
// The format, from the leading bytes as Pillow's plugins and images.py `_other_format` sniff it.

enum class Format { kPng, kJpeg, kRefused };

bool starts_with(const Bytes& data, size_t offset, std::string_view magic) {
  return data.size() >= offset + magic.size() && std::memcmp(data.data() + offset, magic.data(), magic.size()) == 0;
}

std::string with_article(const std::string& name) {
  const bool vowel = std::string_view("AEIOU").find(name[0]) != std::string_view::npos;
  return (vowel ? "an " : "a ") + name + " image";
}

// What a file etmlx_decode does not read is ("a GIF image", "an ISO media file"), or "" where unknown.
std::string refused_format(const Bytes& data) {
  if (starts_with(data, 0, "RIFF"sv) && starts_with(data, 8, "WEBP"sv)) return with_article("WebP");
  if (starts_with(data, 0, "GIF87a"sv) || starts_with(data, 0, "GIF89a"sv)) return with_article("GIF");
  if (starts_with(data, 0, "BM"sv)) return with_article("BMP");
  // images.py looks at the first 16 bytes after leading ASCII whitespace (bytes.lstrip) of the first 64.
  size_t start = 0;
  const size_t scan = std::min<size_t>(data.size(), 64);
  while (start < scan && std::string_view(" \t\n\r\v\f").find(static_cast<char>(data[start])) != std::string_view::npos)
    ++start;
  const Bytes head(data.begin() + start, data.begin() + std::min(scan, start + 16));
  static constexpr std::pair<std::string_view, const char*> kKnownOthers[] = {
      {"II*\0"sv, "TIFF"},     {"MM\0*"sv, "TIFF"},          {"8BPS"sv, "PSD"},     {"%PDF"sv, "PDF"},
      {"\0\0\1\0"sv, "ICO"},   {"\xff\x0a"sv, "JPEG XL"},    {"\0\0\0\x0cJXL "sv, "JPEG XL"},
      {"<svg"sv, "SVG"},       {"<?xml"sv, "SVG/XML"},       {"qoif"sv, "QOI"}};
  for (const auto& [magic, name] : kKnownOthers)
    if (starts_with(head, 0, magic)) return with_article(name);
  if (starts_with(head, 4, "ftyp"sv)) {
    static constexpr std::pair<std::string_view, const char*> kBrands[] = {
        {"heic"sv, "HEIC"}, {"heix"sv, "HEIC"}, {"mif1"sv, "HEIF"},
        {"msf1"sv, "HEIF"}, {"avif"sv, "AVIF"}, {"avis"sv, "AVIF"}};
    for (const auto& [brand, name] : kBrands)
      if (starts_with(head, 8, brand)) return with_article(name);
    return "an ISO media file";
  }
  return "";
}

std::optional<Format> sniff(const std::string& path, const Bytes& data, std::string* error) {
  if (starts_with(data, 0, "\x89PNG\r\n\x1a\n"sv)) return Format::kPng;
  if (starts_with(data, 0, "\xff\xd8\xff"sv)) return Format::kJpeg;
  const std::string other = refused_format(data);
  *error = other.empty() ? path + " is not an image etmlx_decode reads (it reads PNG and JPEG)"
                         : path + " is " + other + kOnlyPngJpeg;
  return std::nullopt;
}

// The declared size, checked before any pixel is decoded (images.py `_check_pixels`).
bool pixels_allowed(const std::string& path, int64_t width, int64_t height, const ImageFileLimits& limits,
                    std::string* error) {
  const std::string size = std::to_string(width) + " x " + std::to_string(height) + " pixels";
  if (width < 1 || height < 1) {
    *error = path + " is " + size + ": nothing to see";
    return false;
  }
  if (width * height > limits.max_pixels) {
    *error = path + " is " + size + "; at most " + std::to_string(limits.max_pixels) +
             " pixels are taken (a decompression bomb, or an image to scale down first)";
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------
// EXIF orientation, as Pillow's Image.getexif() finds tag 0x0112 (read by images.py `_orientation`).

enum : int { kOrientationAbsent = -1, kOrientationUnreadable = -2 };

uint32_t read_uint(const Bytes& data, size_t at, int size, bool big_endian) {
  uint32_t value = 0;
  for (int i = 0; i < size; ++i) {
    const uint32_t byte = data[at + i];
    value |= big_endian ? byte << (8 * (size - 1 - i)) : byte << (8 * i);
  }
  return value;
}

// The orientation tag of IFD0 in an EXIF block (a TIFF header and IFD after any "Exif\0\0" prefixes), as
// Pillow's ImageFileDirectory_v2 reads it: a header that is not TIFF makes the whole EXIF unreadable (Pillow
// raises; images.py takes orientation 1); an IFD cut short keeps the entries read so far; the last entry for a
// tag wins; a tag with several values gives its first (Orientation is declared with one). Only integer types
// (SHORT, LONG, SSHORT, SLONG) are taken; another type counts as unreadable.
int exif_orientation(Bytes exif) {
  static constexpr std::string_view kPrefix = "Exif\0\0"sv;
  size_t start = 0;
  while (starts_with(exif, start, kPrefix)) start += kPrefix.size();
  exif.erase(exif.begin(), exif.begin() + start);
  if (exif.empty()) return kOrientationAbsent;
  if (exif.size() < 8) return kOrientationUnreadable;
  bool big_endian;
  if (starts_with(exif, 0, "II*\0"sv)) {
    big_endian = false;
  } else if (starts_with(exif, 0, "MM\0*"sv)) {
    big_endian = true;
  } else {
    return kOrientationUnreadable;
  }
  const size_t ifd = read_uint(exif, 4, 4, big_endian);
  if (ifd > exif.size() || exif.size() - ifd < 2) return kOrientationAbsent;
  const uint32_t entries = read_uint(exif, ifd, 2, big_endian);
  int orientation = kOrientationAbsent;
  for (uint32_t i = 0; i < entries; ++i) {
    const size_t at = ifd + 2 + 12 * static_cast<size_t>(i);
    if (at + 12 > exif.size()) break;
    const uint32_t tag = read_uint(exif, at, 2, big_endian);
    const uint32_t type = read_uint(exif, at + 2, 2, big_endian);
    const uint32_t count = read_uint(exif, at + 4, 4, big_endian);
    static constexpr int kUnitSize[] = {0, 1, 1, 2, 4, 8, 1, 1, 2, 4, 8, 4, 8, 4};  // by TIFF type 0..13
    if (type == 0 || type >= std::size(kUnitSize) || count == 0) continue;  // Pillow skips these
    const uint64_t size = static_cast<uint64_t>(count) * kUnitSize[type];
    size_t value_at = at + 8;
    if (size > 4) {  // the values are elsewhere; one past the end stops Pillow's reading of the IFD
      value_at = read_uint(exif, at + 8, 4, big_endian);
      if (value_at > exif.size() || exif.size() - value_at < size) break;
    }
    if (tag != 0x0112) continue;
    if (type == 3 || type == 8) {
      const uint32_t v = read_uint(exif, value_at, 2, big_endian);
      orientation = type == 8 ? static_cast<int16_t>(v) : static_cast<int>(v);
    } else if (type == 4 || type == 9) {
      const uint32_t v = read_uint(exif, value_at, 4, big_endian);
      orientation = type == 9 ? static_cast<int32_t>(v) : static_cast<int>(std::min<uint32_t>(v, 1u << 30));
    } else {
      orientation = kOrientationUnreadable;
    }
  }
  return orientation;
}

// Pillow's fallback when the EXIF has no orientation: the first match of tiff:Orientation(="|>)([0-9]) in XMP.
int xmp_orientation(std::string_view xmp) {
  static constexpr std::string_view kName = "tiff:Orientation";
  for (size_t at = xmp.find(kName); at != std::string_view::npos; at = xmp.find(kName, at + 1)) {
    std::string_view rest = xmp.substr(at + kName.size());
    if (rest.substr(0, 2) == "=\"") {
      rest.remove_prefix(2);
    } else if (rest.substr(0, 1) == ">") {
      rest.remove_prefix(1);
    } else {
      continue;
    }
    if (!rest.empty() && rest[0] >= '0' && rest[0] <= '9') return rest[0] - '0';
  }
  return kOrientationAbsent;
}

// What images.py `_orientation` returns: 1 when there is none or it cannot be read.
int orientation_of(const std::optional<Bytes>& exif, const std::optional<std::string>& xmp) {
  int orientation = exif ? exif_orientation(*exif) : kOrientationAbsent;
  if (orientation == kOrientationAbsent && xmp) orientation = xmp_orientation(*xmp);
  return orientation < 0 ? 1 : orientation;
}

// Pillow's ImageOps.exif_transpose: orientations 2..8 flip / rotate; any other value leaves the image.
void apply_orientation(RgbImage* image, int orientation) {
  if (orientation < 2 || orientation > 8) return;
  const int64_t w = image->width, h = image->height;
  const bool swaps = orientation >= 5;  // 5..8 exchange width and height
  const int64_t out_w = swaps ? h : w, out_h = swaps ? w : h;
  Bytes out(image->pixels.size());
  for (int64_t y = 0; y < out_h; ++y) {
    for (int64_t x = 0; x < out_w; ++x) {
      int64_t sx = 0, sy = 0;  // the source pixel of output (x, y)
      switch (orientation) {
        case 2: sx = w - 1 - x; sy = y; break;          // FLIP_LEFT_RIGHT
        case 3: sx = w - 1 - x; sy = h - 1 - y; break;  // ROTATE_180
        case 4: sx = x; sy = h - 1 - y; break;          // FLIP_TOP_BOTTOM
        case 5: sx = y; sy = x; break;                  // TRANSPOSE
        case 6: sx = y; sy = h - 1 - x; break;          // ROTATE_270 (90 clockwise)
        case 7: sx = w - 1 - y; sy = h - 1 - x; break;  // TRANSVERSE
        case 8: sx = w - 1 - y; sy = x; break;          // ROTATE_90 (90 counter-clockwise)
      }
      std::memcpy(&out[3 * (y * out_w + x)], &image->pixels[3 * (sy * w + sx)], 3);
    }
  }
  image->pixels.swap(out);
  image->width = out_w;
  image->height = out_h;
}

// ---------------------------------------------------------------------------------------------------------
// Pixel arithmetic, bit for bit Pillow's (images.py `to_rgb` and `_grey16_to_rgb`).

// Pillow's DIV255: a / 255 rounded, for 0 <= a <= 255 * 255.
inline uint8_t div255(uint32_t a) {
  const uint32_t t = a + 128;
  return static_cast<uint8_t>(((t >> 8) + t) >> 8);
}

// `value` pasted onto white through `alpha` (Image.paste with the alpha band as mask, onto (255, 255, 255)).
inline uint8_t on_white(uint8_t value, uint8_t alpha) { return div255(255u * (255u - alpha) + value * alpha); }

// _grey16_to_rgb: 0..65535 to 0..255, rounded.
inline uint8_t grey16_to_8(uint32_t v) { return static_cast<uint8_t>((v * 255 + 32767) / 65535); }

// Pillow's CMYK -> RGB of a JPEG's CMYK, which it reads as Adobe-inverted (rawmode "CMYK;I").
inline uint8_t cmyk_channel(uint8_t stored, uint8_t stored_k) {
  const uint32_t ink = 255u - stored, not_black = stored_k;  // Pillow's c and 255 - k after the inversion
  return static_cast<uint8_t>(not_black - div255(ink * not_black));
}

// ---------------------------------------------------------------------------------------------------------
// PNG (libpng). libpng reports errors by longjmp: the functions that call it hold no object with a destructor
// (a longjmp would skip it), and PngDecoder's destructor frees libpng's state on every path.

struct PngSource {
  const uint8_t* data = nullptr;
  size_t size = 0, pos = 0;
};

struct PngDecoder {
  png_structp png = nullptr;
  png_infop info = nullptr;
  png_infop end_info = nullptr;
  PngSource source;
  char message[256] = "";  // libpng's error, copied before the longjmp
  bool ended = false;      // the read callback ran out of file
  bool bad_checksum = false;  // zlib found the image data's Adler-32 wrong (libpng only warns)
  size_t rows_decoded = 0;  // rows (of all interlace passes) inflated and unfiltered so far
  ~PngDecoder() {
    if (png) png_destroy_read_struct(&png, &info, &end_info);
  }
};

struct PngHeader {
  png_uint_32 width = 0, height = 0;
  int bit_depth = 0, color_type = 0, interlace = 0;
  size_t rowbytes = 0;
};

[[noreturn]] void png_fail(png_structp png, png_const_charp message) {
  auto* decoder = static_cast<PngDecoder*>(png_get_error_ptr(png));
  std::snprintf(decoder->message, sizeof decoder->message, "%s", message);
  png_longjmp(png, 1);
}

// libpng's warnings are not the caller's business, but one: a wrong Adler-32 at the end of the image data is
// only a warning to libpng, while Pillow's zlib refuses the image.
void png_warned(png_structp png, png_const_charp message) {
  if (std::strstr(message, "incorrect data check"))
    static_cast<PngDecoder*>(png_get_error_ptr(png))->bad_checksum = true;
}

// A user transform that only counts the rows libpng has fully decoded (see png_read_rows).
void png_count_row(png_structp png, png_row_infop, png_bytep) {
  ++static_cast<PngDecoder*>(png_get_error_ptr(png))->rows_decoded;
}

// The rows libpng decodes: each pass's rows (the passes of an interlaced image that have pixels).
size_t png_row_count(const PngHeader& h) {
  if (h.interlace == PNG_INTERLACE_NONE) return h.height;
  size_t rows = 0;
  for (int pass = 0; pass < 7; ++pass)
    if (PNG_PASS_COLS(h.width, pass) > 0) rows += PNG_PASS_ROWS(h.height, pass);
  return rows;
}

void png_read_memory(png_structp png, png_bytep out, size_t n) {
  auto* source = static_cast<PngSource*>(png_get_io_ptr(png));
  if (n > source->size - source->pos) {
    static_cast<PngDecoder*>(png_get_error_ptr(png))->ended = true;
    png_error(png, "the file ends early (truncated)");
  }
  std::memcpy(out, source->data + source->pos, n);
  source->pos += n;
}

// Pillow checks the CRC of every chunk before the first IDAT and of none after (it skips IDAT's), while libpng
// by default checks IDAT's too; so the chunks before IDAT are checked here and libpng is told to use the rest.
bool png_header_crcs_ok(const Bytes& data, std::string* bad_chunk) {
  size_t at = 8;
  while (at + 12 <= data.size()) {
    const uint32_t length = read_uint(data, at, 4, true);
    const std::string type(reinterpret_cast<const char*>(&data[at + 4]), 4);
    if (type == "IDAT" || length > data.size() - at - 12) return true;  // the rest is libpng's to judge
    const uint32_t stored = read_uint(data, at + 8 + length, 4, true);
    if (crc32(0, &data[at + 4], length + 4) != stored) {
      *bad_chunk = type;
      return false;
    }
    at += 12 + static_cast<size_t>(length);
  }
  return true;
}

// Where a file cut inside an IDAT chunk's data has that chunk's length field (0: not so cut). Pillow inflates
// what there is of it, and reads the image if the rows are all there; libpng asks for the whole chunk at once
// and would fail before inflating any of it, so the caller shortens the chunk to what the file holds.
size_t png_cut_idat(const Bytes& data) {
  size_t at = 8;
  while (at + 8 <= data.size()) {
    const uint64_t length = read_uint(data, at, 4, true);
    if (at + 8 + length > data.size()) return starts_with(data, at + 4, "IDAT"sv) ? at : 0;
    at += 12 + length;
  }
  return 0;
}

// The chunks up to the first IDAT (no pixel is decoded); the read transformations are set here.
bool png_read_header(PngDecoder* d, PngHeader* h) {
  if (setjmp(png_jmpbuf(d->png))) return false;
  png_set_read_fn(d->png, &d->source, png_read_memory);
  png_set_user_limits(d->png, PNG_UINT_31_MAX, PNG_UINT_31_MAX);  // max_pixels is the limit, not libpng's 1e6
  png_set_benign_errors(d->png, 1);
  png_set_crc_action(d->png, PNG_CRC_QUIET_USE, PNG_CRC_QUIET_USE);  // see png_header_crcs_ok
  png_read_info(d->png, d->info);
  png_get_IHDR(d->png, d->info, &h->width, &h->height, &h->bit_depth, &h->color_type, &h->interlace, nullptr,
               nullptr);
  png_set_read_user_transform_fn(d->png, png_count_row);
  if (h->bit_depth < 8) png_set_packing(d->png);  // one byte per sample, unscaled (grey is scaled below)
  png_set_interlace_handling(d->png);
  png_read_update_info(d->png, d->info);
  h->rowbytes = png_get_rowbytes(d->png, d->info);
  return true;
}

// Pillow stops reading at the last row: a file cut after it (in the image data's Adler-32 or CRC) is read. libpng
// reads on to the end of the data, so the end of file is forgiven once every row is decoded (the row counter
// runs just before libpng copies a row out, and nothing in between reads the file).
bool png_read_rows(PngDecoder* d, const PngHeader& h, png_bytepp rows) {
  if (setjmp(png_jmpbuf(d->png))) return d->ended && d->rows_decoded == png_row_count(h);
  png_read_image(d->png, rows);
  return true;
}

// The chunks after the image (an eXIf there counts, as in Pillow). Pillow ignores what is wrong there (a
// missing IEND, a cut chunk), so a failure here only ends the reading.
void png_read_trailer(PngDecoder* d) {
  if (setjmp(png_jmpbuf(d->png))) return;
  png_read_end(d->png, d->end_info);
}

// Pillow's getexif() sources in a PNG: the eXIf chunk, else ImageMagick's "Raw profile type exif" text (hex
// after three lines); XMP from the "XML:com.adobe.xmp" text. A later chunk replaces an earlier one.
void png_metadata(PngDecoder* d, std::optional<Bytes>* exif, std::optional<std::string>* xmp) {
  std::optional<Bytes> raw_profile;
  bool raw_profile_bad = false;
  for (png_infop info : {d->info, d->end_info}) {
    png_bytep exif_data = nullptr;
    png_uint_32 exif_size = 0;
    if (png_get_eXIf_1(d->png, info, &exif_size, &exif_data) != 0 && exif_data)
      *exif = Bytes(exif_data, exif_data + exif_size);
    png_textp texts = nullptr;
    int count = 0;
    png_get_text(d->png, info, &texts, &count);
    for (int i = 0; i < count; ++i) {
      const std::string key = texts[i].key;
      const size_t length = texts[i].compression > 0 ? texts[i].itxt_length : texts[i].text_length;
      const std::string text(texts[i].text ? texts[i].text : "", texts[i].text ? length : 0);
      if (key == "XML:com.adobe.xmp") *xmp = text;
      if (key != "Raw profile type exif") continue;
      // bytes.fromhex("".join(text.split("\n")[3:])): pairs of hex digits, ASCII whitespace between pairs.
      raw_profile = Bytes();
      raw_profile_bad = false;
      size_t at = 0;
      for (int line = 0; line < 3 && at != std::string::npos; ++line) {
        at = text.find('\n', at);
        if (at != std::string::npos) ++at;
      }
      std::string hex;
      for (size_t k = at == std::string::npos ? text.size() : at; k < text.size(); ++k)
        if (text[k] != '\n') hex += text[k];
      for (size_t k = 0; k < hex.size() && !raw_profile_bad;) {
        if (std::isspace(static_cast<unsigned char>(hex[k]))) {
          ++k;
        } else if (k + 1 < hex.size() && std::isxdigit(static_cast<unsigned char>(hex[k])) &&
                   std::isxdigit(static_cast<unsigned char>(hex[k + 1]))) {
          raw_profile->push_back(static_cast<uint8_t>(std::stoi(hex.substr(k, 2), nullptr, 16)));
          k += 2;
        } else {
          raw_profile_bad = true;
        }
      }
    }
  }
  if (!*exif && raw_profile) *exif = raw_profile_bad ? Bytes{'?'} : *raw_profile;  // '?': not TIFF, unreadable
}

// The sample of row `row` at `index`: 8-bit as stored, 16-bit as Pillow keeps it (its high byte).
inline uint8_t sample8(const uint8_t* row, size_t index, bool sixteen) {
  return sixteen ? row[2 * index] : row[index];
}

// One decoded PNG row (after packing: one or two bytes per sample) to RGB, as images.py `to_rgb` converts the
// mode Pillow opened the file in (PngImagePlugin._MODES).
void png_row_to_rgb(const PngDecoder& d, const PngHeader& h, const uint8_t* row, uint8_t* out) {
  const bool sixteen = h.bit_depth == 16;
  png_bytep trans_alpha = nullptr;
  int num_trans = 0;
  png_color_16p trans_color = nullptr;
  const bool has_trns = png_get_tRNS(d.png, d.info, &trans_alpha, &num_trans, &trans_color) != 0;
  const png_uint_32 width = h.width;
  switch (h.color_type) {
    case PNG_COLOR_TYPE_GRAY: {
      if (sixteen) {  // Pillow mode I;16: _grey16_to_rgb, which ignores a tRNS colour
        for (png_uint_32 x = 0; x < width; ++x)
          std::memset(out + 3 * x, grey16_to_8((row[2 * x] << 8) | row[2 * x + 1]), 3);
        return;
      }
      // Pillow scales 1/2/4-bit grey to 0..255 (mode 1 or L) but compares an L image's tRNS value unscaled
      // (and only its low byte); mode 1's is 0 or 255.
      const int scale = h.bit_depth == 1 ? 255 : h.bit_depth == 2 ? 85 : h.bit_depth == 4 ? 17 : 1;
      int transparent = -1;
      if (has_trns && trans_color)
        transparent = h.bit_depth == 1 ? (trans_color->gray ? 255 : 0) : (trans_color->gray & 0xff);
      for (png_uint_32 x = 0; x < width; ++x) {
        const int grey = row[x] * scale;
        std::memset(out + 3 * x, grey == transparent ? 255 : grey, 3);
      }
      return;
    }
    case PNG_COLOR_TYPE_RGB: {
      // A tRNS colour is compared (its low bytes) with the 8-bit pixel, also for 16-bit (Pillow's rgbT2rgba).
      const bool keyed = has_trns && trans_color;
      for (png_uint_32 x = 0; x < width; ++x) {
        const uint8_t r = sample8(row, 3 * x, sixteen), g = sample8(row, 3 * x + 1, sixteen),
                      b = sample8(row, 3 * x + 2, sixteen);
        const bool clear = keyed && r == (trans_color->red & 0xff) && g == (trans_color->green & 0xff) &&
                           b == (trans_color->blue & 0xff);
        out[3 * x] = clear ? 255 : r;
        out[3 * x + 1] = clear ? 255 : g;
        out[3 * x + 2] = clear ? 255 : b;
      }
      return;
    }
    case PNG_COLOR_TYPE_PALETTE: {
      png_colorp palette = nullptr;
      int num_palette = 0;
      png_get_PLTE(d.png, d.info, &palette, &num_palette);
      for (png_uint_32 x = 0; x < width; ++x) {
        const int index = row[x];
        png_color colour{0, 0, 0};  // an index past the palette: black (libpng warns of it)
        if (palette && index < num_palette) colour = palette[index];
        const uint8_t alpha = has_trns && trans_alpha && index < num_trans ? trans_alpha[index] : 255;
        const bool blend = has_trns && trans_alpha && num_trans > 0;  // Pillow converts via RGBA only then
        out[3 * x] = blend ? on_white(colour.red, alpha) : colour.red;
        out[3 * x + 1] = blend ? on_white(colour.green, alpha) : colour.green;
        out[3 * x + 2] = blend ? on_white(colour.blue, alpha) : colour.blue;
      }
      return;
    }
    case PNG_COLOR_TYPE_GRAY_ALPHA:
      for (png_uint_32 x = 0; x < width; ++x)
        std::memset(out + 3 * x, on_white(sample8(row, 2 * x, sixteen), sample8(row, 2 * x + 1, sixteen)), 3);
      return;
    case PNG_COLOR_TYPE_RGB_ALPHA:
      for (png_uint_32 x = 0; x < width; ++x) {
        const uint8_t alpha = sample8(row, 4 * x + 3, sixteen);
        for (int c = 0; c < 3; ++c) out[3 * x + c] = on_white(sample8(row, 4 * x + c, sixteen), alpha);
      }
      return;
  }
}

std::optional<RgbImage> read_png(const std::string& path, const Bytes& data, const ImageFileLimits& limits,
                                 std::string* error) {
  const std::string corrupt = path + ": the PNG image is corrupt or truncated: ";
  // The declared size straight from IHDR (the first chunk), before libpng parses anything else.
  if (data.size() >= 24 && starts_with(data, 12, "IHDR"sv) &&
      !pixels_allowed(path, read_uint(data, 16, 4, true), read_uint(data, 20, 4, true), limits, error))
    return std::nullopt;
  std::string bad_chunk;
  if (!png_header_crcs_ok(data, &bad_chunk)) {
    *error = corrupt + "bad checksum in the " + bad_chunk + " chunk";
    return std::nullopt;
  }
  Bytes shortened;  // a copy only for a file cut inside its image data (png_cut_idat)
  const Bytes* source = &data;
  if (const size_t cut = png_cut_idat(data)) {
    shortened = data;
    const uint32_t length = static_cast<uint32_t>(data.size() - cut - 8);
    for (int i = 0; i < 4; ++i) shortened[cut + i] = static_cast<uint8_t>(length >> (24 - 8 * i));
    source = &shortened;
  }
  PngDecoder d;
  d.source = PngSource{source->data(), source->size(), 0};
  d.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &d, png_fail, png_warned);
  if (d.png) d.info = png_create_info_struct(d.png);
  if (d.png) d.end_info = png_create_info_struct(d.png);
  if (!d.png || !d.info || !d.end_info) {
    *error = path + ": out of memory for libpng";
    return std::nullopt;
  }
  PngHeader h;
  if (!png_read_header(&d, &h)) {
    *error = corrupt + d.message;
    return std::nullopt;
  }
  if (!pixels_allowed(path, h.width, h.height, limits, error)) return std::nullopt;
  // The whole decoded image (an interlaced one arrives in passes), at most 8 bytes a pixel (16-bit RGBA).
  Bytes decoded(h.rowbytes * h.height);
  std::vector<png_bytep> rows(h.height);
  for (png_uint_32 y = 0; y < h.height; ++y) rows[y] = decoded.data() + y * h.rowbytes;
  if (!png_read_rows(&d, h, rows.data())) {
    *error = corrupt + d.message;
    return std::nullopt;
  }
  if (!d.ended) png_read_trailer(&d);
  if (d.bad_checksum) {
    *error = corrupt + "the image data's checksum (Adler-32) is wrong";
    return std::nullopt;
  }
  RgbImage image;
  image.width = h.width;
  image.height = h.height;
  image.pixels.resize(3 * static_cast<size_t>(h.width) * h.height);
  for (png_uint_32 y = 0; y < h.height; ++y)
    png_row_to_rgb(d, h, rows[y], image.pixels.data() + 3 * static_cast<size_t>(y) * h.width);
  decoded = Bytes();  // freed before the rotation's copy
  std::optional<Bytes> exif;
  std::optional<std::string> xmp;
  png_metadata(&d, &exif, &xmp);
  apply_orientation(&image, orientation_of(exif, xmp));
  return image;
}

// ---------------------------------------------------------------------------------------------------------
// JPEG (libjpeg). Its default error handler calls exit(); this one longjmps back, with the same care as PNG's.

struct JpegErrors {
  jpeg_error_mgr manager;  // first: libjpeg's pointer to it is this struct's
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = "";
};

struct JpegDecoder {
  jpeg_decompress_struct cinfo;
  jpeg_source_mgr source;
  JpegErrors errors;
  bool created = false;
  bool rows_done = false;  // every row decoded: what follows is jpeg_finish_decompress's reading to the end
  ~JpegDecoder() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
};

[[noreturn]] void jpeg_fail(j_common_ptr cinfo) {
  auto* errors = reinterpret_cast<JpegErrors*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, errors->message);
  std::longjmp(errors->jump, 1);
}

void jpeg_quiet(j_common_ptr) {}  // warnings (corrupt data libjpeg recovers from) are ignored, as Pillow does

void jpeg_source_noop(j_decompress_ptr) {}

// The whole file is in the buffer from the start, so needing more is a truncated file: an error. (libjpeg's
// jpeg_mem_src would invent an end-of-image marker and return grey rows; Pillow refuses a truncated file.)
boolean jpeg_source_ended(j_decompress_ptr cinfo) {
  cinfo->err->msg_code = JERR_INPUT_EOF;
  (*cinfo->err->error_exit)(reinterpret_cast<j_common_ptr>(cinfo));
  return FALSE;
}

void jpeg_source_skip(j_decompress_ptr cinfo, long count) {
  if (count <= 0) return;
  if (static_cast<size_t>(count) > cinfo->src->bytes_in_buffer) jpeg_source_ended(cinfo);
  cinfo->src->next_input_byte += count;
  cinfo->src->bytes_in_buffer -= count;
}

bool jpeg_read_header_of(JpegDecoder* d, const Bytes& data) {
  d->cinfo.err = jpeg_std_error(&d->errors.manager);
  d->errors.manager.error_exit = jpeg_fail;
  d->errors.manager.output_message = jpeg_quiet;
  if (setjmp(d->errors.jump)) return false;
  jpeg_create_decompress(&d->cinfo);
  d->created = true;
  d->source.next_input_byte = data.data();
  d->source.bytes_in_buffer = data.size();
  d->source.init_source = jpeg_source_noop;
  d->source.fill_input_buffer = jpeg_source_ended;
  d->source.skip_input_data = jpeg_source_skip;
  d->source.resync_to_restart = jpeg_resync_to_restart;
  d->source.term_source = jpeg_source_noop;
  d->cinfo.src = &d->source;
  jpeg_save_markers(&d->cinfo, JPEG_APP0 + 1, 0xffff);  // EXIF and XMP
  jpeg_read_header(&d->cinfo, TRUE);
  return true;
}

// One decoded JPEG row (grey, RGB or CMYK) to RGB.
void jpeg_row_to_rgb(int components, JDIMENSION width, const uint8_t* row, uint8_t* out) {
  for (JDIMENSION x = 0; x < width; ++x) {
    if (components == 1) {
      std::memset(out + 3 * x, row[x], 3);
    } else if (components == 3) {
      std::memcpy(out + 3 * x, row + 3 * x, 3);
    } else {
      const uint8_t* cmyk = row + 4 * x;
      for (int c = 0; c < 3; ++c) out[3 * x + c] = cmyk_channel(cmyk[c], cmyk[3]);
    }
  }
}

// Decodes into `image` (sized by the caller); `row` holds one decoded row.
// Pillow's decoder stops when the file runs out after the last row (its jpeg_finish_decompress suspends, and it
// takes the image), so the end of file is forgiven there; any other error after the last row is not.
bool jpeg_read_pixels(JpegDecoder* d, RgbImage* image, uint8_t* row) {
  if (setjmp(d->errors.jump)) return d->rows_done && d->errors.manager.msg_code == JERR_INPUT_EOF;
  jpeg_start_decompress(&d->cinfo);
  const int components = d->cinfo.output_components;
  while (d->cinfo.output_scanline < d->cinfo.output_height) {
    const JDIMENSION y = d->cinfo.output_scanline;
    JSAMPROW rows[1] = {row};
    if (jpeg_read_scanlines(&d->cinfo, rows, 1) != 1) {
      std::snprintf(d->errors.message, sizeof d->errors.message, "no row decoded");
      return false;
    }
    jpeg_row_to_rgb(components, d->cinfo.output_width, row, image->pixels.data() + 3 * static_cast<size_t>(y) *
                                                                                       d->cinfo.output_width);
  }
  d->rows_done = true;
  jpeg_finish_decompress(&d->cinfo);  // reads on to the end-of-image marker
  return true;
}

// The EXIF and XMP of the APP1 markers as Pillow's JpegImagePlugin keeps them: EXIF markers concatenated (the
// later ones without their "Exif\0\0"), the last XMP after its namespace's NUL.
void jpeg_metadata(const JpegDecoder& d, std::optional<Bytes>* exif, std::optional<std::string>* xmp) {
  static constexpr std::string_view kExif = "Exif\0\0"sv, kXmp = "http://ns.adobe.com/xap/1.0/\0"sv;
  for (jpeg_saved_marker_ptr m = d.cinfo.marker_list; m; m = m->next) {
    if (m->marker != JPEG_APP0 + 1) continue;
    const std::string_view body(reinterpret_cast<const char*>(m->data), m->data_length);
    if (body.substr(0, kExif.size()) == kExif) {
      if (!*exif) *exif = Bytes();
      const size_t skip = (*exif)->empty() ? 0 : kExif.size();
      (*exif)->insert((*exif)->end(), m->data + skip, m->data + m->data_length);
    } else if (body.substr(0, kXmp.size()) == kXmp) {
      *xmp = std::string(body.substr(kXmp.size()));
    }
  }
}

std::optional<RgbImage> read_jpeg(const std::string& path, const Bytes& data, const ImageFileLimits& limits,
                                  std::string* error) {
  const std::string corrupt = path + ": the JPEG image is corrupt or truncated: ";
  auto d = std::make_unique<JpegDecoder>();  // large (jmp_buf, libjpeg structs): on the heap
  if (!jpeg_read_header_of(d.get(), data)) {
    *error = corrupt + d->errors.message;
    return std::nullopt;
  }
  jpeg_decompress_struct& cinfo = d->cinfo;
  // Copied now: jpeg_finish_decompress drops the saved markers.
  std::optional<Bytes> exif;
  std::optional<std::string> xmp;
  jpeg_metadata(*d, &exif, &xmp);
  if (!pixels_allowed(path, cinfo.image_width, cinfo.image_height, limits, error)) return std::nullopt;
  // Pillow's JPEG modes: 1 component L, 3 RGB, 4 CMYK (YCCK is converted to CMYK by libjpeg); no other.
  if (cinfo.num_components == 1) {
    cinfo.out_color_space = JCS_GRAYSCALE;
  } else if (cinfo.num_components == 3) {
    cinfo.out_color_space = JCS_RGB;
  } else if (cinfo.num_components == 4) {
    cinfo.out_color_space = JCS_CMYK;
  } else {
    *error = path + ": a JPEG image with " + std::to_string(cinfo.num_components) +
             " components; etmlx_decode reads grey, colour and CMYK JPEGs";
    return std::nullopt;
  }
  cinfo.dct_method = JDCT_ISLOW;  // libjpeg's default, and Pillow's (it changes it only in draft mode)
  RgbImage image;
  image.width = cinfo.image_width;
  image.height = cinfo.image_height;
  image.pixels.resize(3 * static_cast<size_t>(image.width) * image.height);
  Bytes row(static_cast<size_t>(cinfo.image_width) * cinfo.num_components);
  if (!jpeg_read_pixels(d.get(), &image, row.data())) {
    *error = corrupt + d->errors.message;
    return std::nullopt;
  }
  d.reset();
  apply_orientation(&image, orientation_of(exif, xmp));
  return image;
}

// A message on one line (a file name may hold a newline).
std::string one_line(std::string text) {
  for (char& c : text)
    if (c == '\n' || c == '\r') c = ' ';
  return text;
}

}  // namespace

bool image_files_supported() { return true; }

std::optional<RgbImage> read_image_file(const std::string& path, const ImageFileLimits& limits, std::string* error) {
  std::string problem;
  std::optional<RgbImage> image;
  if (limits.max_bytes < 1 || limits.max_pixels < 1) {
    problem = "cannot read " + path + ": the image limits (max_bytes, max_pixels) must be >= 1";
  } else if (std::optional<Bytes> data = file_bytes(path, limits.max_bytes, &problem)) {
    if (std::optional<Format> format = sniff(path, *data, &problem))
      image = *format == Format::kPng ? read_png(path, *data, limits, &problem)
                                      : read_jpeg(path, *data, limits, &problem);
  }
  if (!image) *error = one_line(problem);
  return image;
}

#endif  // ETMLX_IMAGE_FILES

}  // namespace etmlx
