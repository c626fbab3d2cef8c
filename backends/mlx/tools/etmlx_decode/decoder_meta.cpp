#include "decoder_meta.h"

#include "decoder_meta_generated.h"

namespace etmlx {

const char kDecoderMetaFormat[] = "etmlx-decoder/1";

namespace {

namespace fb = backends::mlx::serialization::generated::fb;

std::vector<int64_t> ids(const flatbuffers::Vector<int64_t>* list) {
  return list ? std::vector<int64_t>(list->begin(), list->end()) : std::vector<int64_t>{};
}

std::string text(const flatbuffers::String* s) { return s ? s->str() : std::string(); }

PixelSteps pixel_steps(const fb::PixelSteps& t) {
  PixelSteps s;
  s.pad_colour = ids(t.pad_colour());
  s.resize = text(t.resize());
  s.size = ids(t.size());
  s.resample = t.resample();
  s.crop = ids(t.crop());
  s.rescale = t.rescale();
  if (t.mean()) s.mean.assign(t.mean()->begin(), t.mean()->end());
  if (t.std()) s.std.assign(t.std()->begin(), t.std()->end());
  return s;
}

}  // namespace

std::optional<DecoderMeta> parse_decoder_meta(const void* data, size_t size, const std::string& where,
                                              std::string* error) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  flatbuffers::Verifier verifier(bytes, size);
  if (!fb::VerifyDecoderMetaBuffer(verifier)) {
    *error = where + " is not etmlx decoder metadata (a DecoderMeta flatbuffer, identifier " +
             fb::DecoderMetaIdentifier() + "): re-export it with `etmlx export`";
    return std::nullopt;
  }
  const fb::DecoderMeta* root = fb::GetDecoderMeta(bytes);
  if (!root->format() || root->format()->str() != kDecoderMetaFormat) {
    *error = where + " is not etmlx decoder metadata (format \"" + kDecoderMetaFormat + "\" expected)";
    return std::nullopt;
  }
  DecoderMeta meta;
  meta.max_seq_len = root->max_seq_len();
  meta.vocab_size = root->vocab_size();
  meta.batch = root->batch();
  meta.draft_tokens = root->draft_tokens();
  meta.verify_min_width = root->verify_min_width();
  meta.propose_tokens = root->propose_tokens();
  if (meta.max_seq_len < 1 || meta.vocab_size < 1 || meta.batch < 1 || meta.draft_tokens < 0 ||
      meta.propose_tokens < 0 || meta.verify_min_width < 1) {
    *error = where + ": max_seq_len, vocab_size, batch and verify_min_width must be >= 1, draft_tokens and "
             "propose_tokens >= 0";
    return std::nullopt;
  }
  meta.eos_token_ids = ids(root->eos_token_ids());
  meta.prompt_prefix_ids = ids(root->prompt_prefix_ids());
  meta.prompt_suffix_ids = ids(root->prompt_suffix_ids());
  meta.pipelined = root->pipelined();
  if (const auto ring = root->ring_cache(); ring.has_value()) meta.ring_cache = *ring;
  if (root->inputs())
    for (const auto* name : *root->inputs()) meta.inputs.push_back(name->str());
  if (root->adapters())
    for (const auto* name : *root->adapters()) meta.adapters.push_back(name->str());
  meta.model_type = text(root->model_type());
  meta.image_token_id = root->image_token_id();
  meta.image_tokens = root->image_tokens();
  meta.image_embed_dim = root->image_embed_dim();
  meta.vision_method = text(root->vision_method());
  meta.image_size = ids(root->image_size());
  if (root->image_text())
    for (const auto* part : *root->image_text()) meta.image_text.push_back(part->str());
  meta.image_prompt = text(root->image_prompt());
  if (root->pixel_steps()) meta.pixel_steps = pixel_steps(*root->pixel_steps());
  std::string why;
  if (!read_knobs(root->knobs(), &meta.knobs, &why)) {
    *error = where + ": " + why;
    return std::nullopt;
  }
  return meta;
}

}  // namespace etmlx
