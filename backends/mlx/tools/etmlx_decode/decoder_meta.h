// The decoder metadata `etmlx export` stores in a .pte's named data (program_metadata.h finds it): what the
// decode loop needs to know that the program's tensors do not say (vocabulary size, end-of-sequence ids, input
// names, the sampler knobs). Its layout is the flatbuffer table DecoderMeta of
// backends/mlx/serialization/decoder_meta.fbs, read here with flatc's generated header; the Python side is
// backends/mlx/llm/decoder/meta.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "knobs.h"
#include "pixel_steps.h"

namespace etmlx {

// The "format" the metadata declares (meta.py FORMAT).
extern const char kDecoderMetaFormat[];

struct DecoderMeta {
  int64_t max_seq_len = 0;
  int64_t vocab_size = 0;
  int64_t batch = 0;
  std::vector<int64_t> eos_token_ids;
  std::vector<std::string> inputs;  // input names in call order
  std::vector<std::string> adapters;  // switchable LoRA adapters: the `adapter` input's value i picks the i-th (1-based)
  std::vector<KnobSpec> knobs;      // the knob table (knobs.h)
  // Ids the tokenizer adds around a text prompt (BOS, ...).
  std::vector<int64_t> prompt_prefix_ids, prompt_suffix_ids;
  // Each call returns the previous call's outputs; a token input < 0 is the row's last sampled token
  // (decode_loop.h).
  bool pipelined = false;
  // A draft-verifying program (`etmlx export --draft-tokens K`): K, and the fewest verify columns a call
  // carries. 0 for a plain program.
  int64_t draft_tokens = 0;
  int64_t verify_min_width = 1;
  // A draft model's program that returns K tokens per row per call (`--propose-tokens K`; output 0 is
  // [batch, K], column 0 the plain token): K, or 0 for a plain [batch] output.
  int64_t propose_tokens = 0;
  // Whether some layer keeps a sliding-window ring cache (a row is then reused only where positions continue,
  // decode_rows.h); nullopt when the exporter did not say, treated as a ring.
  std::optional<bool> ring_cache;
  // A vision-language program (llm/decoder/meta.py's fields of the same names): the token an image's positions
  // carry, how many positions one image takes, the image_embeds input's width, the method that encodes one
  // image's pixels [1, *image_size] into [1, image_tokens, image_embed_dim]; image_token_id -1: text only.
  std::string model_type;  // the checkpoint's (for messages)
  int64_t image_token_id = -1;
  int64_t image_tokens = 0;
  int64_t image_embed_dim = 0;
  std::string vision_method;
  std::vector<int64_t> image_size;
  std::vector<std::string> image_text;  // [mark, before, image token, after]: how prompt text names an image
  std::string image_prompt;             // a tiled family's image prompt (JSON); "": fixed count
  std::optional<PixelSteps> pixel_steps;  // absent: etmlx_decode cannot make this family's pixels
};

// Verifies and reads the DecoderMeta flatbuffer of `size` bytes at `data`; `where` names its origin in errors.
// Returns nullopt with `error` set when it is not one, declares another format, or a value is out of range.
std::optional<DecoderMeta> parse_decoder_meta(const void* data, size_t size, const std::string& where,
                                              std::string* error);

}  // namespace etmlx
