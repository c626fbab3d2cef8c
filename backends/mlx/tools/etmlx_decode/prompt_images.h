// A vision-language program's images for etmlx_decode: each image file read (image_file.h), made into the vision
// method's pixels (pixel_steps.h), encoded by the program's vision method, and its embeddings placed at the
// prompt's image positions, which the prefill call's image_embeds input carries (step_inputs.h). The Python side
// is llm/decoder/image_encoder.py and image_prompt.py; tests/test_decode_images.py checks both give one answer.
//
// Families whose image takes a varying number of tiles or positions (LLaVA-NeXT, LLaVA-OneVision, Idefics3 /
// SmolVLM, Mistral 3), whose pixels are patches (Qwen2-VL) or whose processor is not one fixed pipeline are refused
// by name: `etmlx generate` takes their images.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>

#include "decoder_meta.h"

namespace etmlx {

struct PromptImages {
  std::vector<int64_t> positions;  // prompt positions of the image embeddings, ascending
  std::vector<float> embeds;       // [positions.size(), dim]
  int64_t dim = 0;
};

// Whether etmlx_decode can give `pte`'s program images; false with a one-line `error` naming why.
bool images_supported(const DecoderMeta& meta, const std::string& pte, std::string* error);

// `text` with each image mark of a family that names images in text (DecoderMeta.image_text, Gemma 3) replaced by
// the image's full text, as the checkpoint's processor does before tokenizing (encode_images then checks the
// count). Other programs' text is returned as it is (their image tokens are expanded in ids).
std::string expand_image_text(const DecoderMeta& meta, const std::string& text);

// `ids` with each image token expanded to the image's positions (a family without image text), as
// llm/decoder/image_prompt.py expand_images.
std::vector<int64_t> expand_image_ids(const DecoderMeta& meta, const std::vector<int64_t>& ids);

// The preprocessed pixels [images, 3, H, W] of `files` (float32), for --dump-pixels and encode_images.
bool image_pixels(const DecoderMeta& meta, const std::vector<std::string>& files, std::vector<float>* pixels,
                  std::string* error);

// The embeddings of `files` at the image positions of `prompt` (which must hold image_tokens of them per image, in
// order); the vision method runs once per image.
bool encode_images(executorch::extension::module::Module& module, const DecoderMeta& meta,
                   const std::vector<std::string>& files, const std::vector<int64_t>& prompt, PromptImages* out,
                   std::string* error);

}  // namespace etmlx
