#include "prompt_images.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include <executorch/extension/tensor/tensor_ptr.h>

#include "image_file.h"

namespace etmlx {

namespace {

using executorch::aten::ScalarType;

// The vision method's output [1, T, D] as float32 values, or false with `error`.
bool embeddings_of(const executorch::aten::Tensor& t, const DecoderMeta& meta, std::vector<float>* out,
                   std::string* error) {
  if (t.dim() != 3 || t.size(0) != 1 || t.size(1) != meta.image_tokens || t.size(2) != meta.image_embed_dim) {
    *error = "the vision method returned a tensor that is not [1, " + std::to_string(meta.image_tokens) + ", " +
             std::to_string(meta.image_embed_dim) + "] (its metadata's image_tokens and image_embed_dim)";
    return false;
  }
  const auto n = static_cast<size_t>(t.numel());
  const size_t at = out->size();
  out->resize(at + n);
  float* dst = out->data() + at;
  switch (t.scalar_type()) {
    case ScalarType::Float:
      std::memcpy(dst, t.const_data_ptr<float>(), n * sizeof(float));
      return true;
    case ScalarType::BFloat16:
      std::copy_n(t.const_data_ptr<executorch::aten::BFloat16>(), n, dst);  // each converted to float
      return true;
    case ScalarType::Half:
      std::copy_n(t.const_data_ptr<executorch::aten::Half>(), n, dst);
      return true;
    default:
      *error = "the vision method returned embeddings that are not float32, bfloat16 or float16";
      return false;
  }
}

}  // namespace

bool images_supported(const DecoderMeta& meta, const std::string& pte, std::string* error) {
  const std::string family = meta.model_type.empty() ? "this family" : "a " + meta.model_type + " program";
  if (meta.vision_method.empty()) {
    *error = pte + " takes no images: it was exported from a text-only model";
    return false;
  }
  if (!meta.image_prompt.empty() || meta.image_size.size() != 3) {
    *error = "etmlx_decode does not give images to " + family + " (its images take a varying number of positions "
             "or patches): use `etmlx generate --image`";
    return false;
  }
  if (!meta.pixel_steps) {
    *error = "etmlx_decode cannot preprocess the images of " + family + " (its image processor is not one fixed "
             "pipeline, or the program predates etmlx_decode's images: re-export it): use `etmlx generate --image`";
    return false;
  }
  if (!check_pixel_steps(*meta.pixel_steps, error)) {
    *error = pte + ": " + *error;
    return false;
  }
  if (meta.image_tokens < 1 || meta.image_embed_dim < 1 || meta.image_token_id < 0) {
    *error = pte + ": its metadata's image_tokens, image_embed_dim or image_token_id is invalid";
    return false;
  }
  return true;
}

std::string expand_image_text(const DecoderMeta& meta, const std::string& text) {
  if (meta.image_text.size() != 4 || meta.image_text[0].empty()) return text;
  const std::string& mark = meta.image_text[0];
  std::string image = meta.image_text[1];
  for (int64_t i = 0; i < meta.image_tokens; ++i) image += meta.image_text[2];
  image += meta.image_text[3];
  std::string out;
  size_t from = 0;
  for (size_t at = text.find(mark); at != std::string::npos; at = text.find(mark, from)) {
    out.append(text, from, at - from);
    out += image;
    from = at + mark.size();
  }
  out.append(text, from, std::string::npos);
  return out;
}

std::vector<int64_t> expand_image_ids(const DecoderMeta& meta, const std::vector<int64_t>& ids) {
  std::vector<int64_t> out;
  for (int64_t id : ids) {
    if (id == meta.image_token_id)
      out.insert(out.end(), static_cast<size_t>(meta.image_tokens), id);
    else
      out.push_back(id);
  }
  return out;
}

bool image_pixels(const DecoderMeta& meta, const std::vector<std::string>& files, std::vector<float>* pixels,
                  std::string* error) {
  const std::vector<int64_t>& size = meta.image_size;  // [C, H, W]
  for (const std::string& file : files) {
    auto image = read_image_file(file, ImageFileLimits{}, error);
    if (!image) return false;
    auto made = make_pixels(image->pixels.data(), image->width, image->height, *meta.pixel_steps, error);
    if (!made) {
      *error = file + ": " + *error;
      return false;
    }
    if (size[0] != 3 || made->height != size[1] || made->width != size[2]) {
      *error = file + ": the image processor made pixels [3, " + std::to_string(made->height) + ", " +
               std::to_string(made->width) + "], the vision method takes [" + std::to_string(size[0]) + ", " +
               std::to_string(size[1]) + ", " + std::to_string(size[2]) + "]";
      return false;
    }
    pixels->insert(pixels->end(), made->values.begin(), made->values.end());
  }
  return true;
}

bool encode_images(executorch::extension::module::Module& module, const DecoderMeta& meta,
                   const std::vector<std::string>& files, const std::vector<int64_t>& prompt, PromptImages* out,
                   std::string* error) {
  out->positions.clear();
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] == meta.image_token_id) out->positions.push_back(static_cast<int64_t>(i));
  const auto wanted = static_cast<int64_t>(files.size()) * meta.image_tokens;
  if (static_cast<int64_t>(out->positions.size()) != wanted) {
    *error = "the prompt has " + std::to_string(out->positions.size()) + " image positions; " +
             std::to_string(files.size()) + " image(s) take " + std::to_string(wanted);
    return false;
  }
  out->dim = meta.image_embed_dim;
  out->embeds.clear();
  const std::vector<int64_t>& size = meta.image_size;
  for (const std::string& file : files) {
    std::vector<float> pixels;
    if (!image_pixels(meta, {file}, &pixels, error)) return false;
    auto input = executorch::extension::make_tensor_ptr(
        {1, static_cast<int32_t>(size[0]), static_cast<int32_t>(size[1]), static_cast<int32_t>(size[2])},
        std::move(pixels));
    const auto result = module.execute(meta.vision_method, {executorch::runtime::EValue(*input)});
    if (!result.ok() || result->empty() || !(*result)[0].isTensor()) {
      char code[16];
      std::snprintf(code, sizeof(code), "0x%x", result.ok() ? 0u : static_cast<unsigned>(result.error()));
      *error = file + ": the vision method '" + meta.vision_method + "' failed (error " + code + ")";
      return false;
    }
    if (!embeddings_of((*result)[0].toTensor(), meta, &out->embeds, error)) return false;
  }
  return true;
}

}  // namespace etmlx
