// etmlx_decode: the on-device decode loop as a standalone program, the shape
// of an app on a phone or a Mac with no Python in the loop.
//
//   etmlx_decode FILE.pte (--prompt TEXT | --prompt-ids 1,2,3) [--max-tokens N] [--temperature T]
//                [--seed S] [--top-k K] [--top-p P] [--min-p M] [--eos ID[,ID...]] ...
//                (etmlx_decode --help lists every option; the knob flags come
//                from the metadata's "knobs", the table in llm/sampler/knobs.py)
//
// It loads FILE.pte with ExecuTorch's Module, prefills the prompt in calls of up
// to 512 tokens (--prefill-step-size) and then runs one call per generated token; step k samples with seed
// S + k on the device, so only token ids cross to the host. A pipelined
// program returns each token one call later, while the device runs the next
// step (decode_loop.h). The metadata and
// tokenizer come from inside the .pte (program_metadata.h). The generated text
// (token ids when the program has no tokenizer) goes to stdout; errors print one "etmlx_decode: error: ..." line to stderr and exit
// with 2 (bad input) or 1 (the program failed to load or run).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/platform/runtime.h>

#include "allocator.h"
#include "decode_args.h"
#include "decode_loop.h"
#include "model_draft.h"
#include "program_metadata.h"
#include "choice_mask.h"
#include "mask_file.h"
#include "prompt_images.h"
#include "step_inputs.h"
#include "text_tokenizer.h"

// Defined in libetmlx_backend.so. Calling it also keeps the library (and the
// static registration of its backend) linked into this program.
extern "C" const char* etmlx_backend_id();

namespace {

using executorch::extension::module::Module;
using executorch::runtime::Error;

constexpr int kBadInput = 2;
constexpr int kRunFailed = 1;

// Prompt tokens per prefill call: `requested` (default kPrefillChunk), or 0 (the whole prompt in one call) for an
// image prompt (as the Python loop's DecodeRows.start). The rules ignore it for programs with drafts or
// proposals (decode_rows.cpp start()).
int64_t prefill_chunk_for(std::optional<int64_t> requested, bool images) {
  return images ? 0 : requested.value_or(etmlx::kPrefillChunk);
}

int fail(int code, const std::string& message) {
  std::fprintf(stderr, "etmlx_decode: error: %s\n", message.c_str());
  return code;
}

std::string error_name(Error e) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%x", static_cast<unsigned>(e));
  return buf;
}

std::string method_to_run(Module& module, std::string* error) {
  const auto names = module.method_names();
  if (!names.ok()) {
    *error = "could not list the program's methods (error " + error_name(names.error()) + ")";
    return "";
  }
  if (names->count("forward")) return "forward";
  if (names->size() == 1) return *names->begin();
  *error = "the program has no 'forward' method";
  return "";
}

struct Timings {
  double first_token_s = 0;
  double decode_tokens_per_s = 0;
};

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// The draft source the flags ask for on a program with draft_tokens K (nullptr: calls without drafts).
// A plain program refuses every draft flag.
bool draft_source(const etmlx::DecodeArgs& args, int64_t draft_tokens, const etmlx::TextTokenizer* tokenizer,
                  int64_t vocab, std::shared_ptr<etmlx::DraftSource>* out, std::string* error) {
  const bool asked = !args.draft.empty() || args.prediction_text || args.prediction_ids ||
                     args.num_draft_tokens.has_value() || args.draft_model;
  if (draft_tokens == 0) {
    if (asked) *error = args.pte + " does not verify drafts: export it with --draft-tokens K";
    return !asked;
  }
  if (args.num_draft_tokens && *args.num_draft_tokens > draft_tokens) {
    *error = "--num-draft-tokens must be 0.." + std::to_string(draft_tokens) + " (the program's K), got " +
             std::to_string(*args.num_draft_tokens);
    return false;
  }
  if (args.draft_model) {
    auto model = etmlx::ModelDraft::load(*args.draft_model, vocab, draft_tokens, args.draft_model_cost, error);
    if (!model) return false;
    *out = std::move(model);
    return true;
  }
  std::vector<int64_t> prediction;
  if (args.prediction_ids) {
    prediction = *args.prediction_ids;
  } else if (args.prediction_text) {
    std::string text = *args.prediction_text;
    if (!text.empty() && text[0] == '@') {
      std::ifstream in(text.substr(1), std::ios::binary);
      if (!in) {
        *error = "--prediction: cannot read " + text.substr(1);
        return false;
      }
      std::stringstream buf;
      buf << in.rdbuf();
      text = buf.str();
    }
    if (!tokenizer) {
      *error = "--prediction TEXT needs the program's tokenizer: give --prediction-ids";
      return false;
    }
    if (!tokenizer->encode(text, &prediction, error)) return false;  // no special tokens: it is output
  }
  if (args.prediction_ids || args.prediction_text) {
    for (int64_t id : prediction) {
      if (id >= vocab) {
        *error = "prediction token ids must be in [0, " + std::to_string(vocab) + "), got " + std::to_string(id);
        return false;
      }
    }
    *out = std::make_shared<etmlx::PredictionDraft>(std::move(prediction));
  } else if (args.draft != "none") {
    *out = std::make_shared<etmlx::NgramDraft>();
  }
  return true;
}

void print_json(const std::vector<int64_t>& prompt, const std::vector<int64_t>& tokens, const std::string* text,
                const char* finish, const Timings& t, const etmlx::DecodeLoop::DraftStats* drafts,
                const etmlx::DraftModelPacing* draft_model) {
  const auto ids = [](const std::vector<int64_t>& list) {
    std::string out = "[";
    for (size_t i = 0; i < list.size(); ++i) out += (i ? ", " : "") + std::to_string(list[i]);
    return out + "]";
  };
  std::printf("{\"prompt_ids\": %s, \"tokens\": %s, ", ids(prompt).c_str(), ids(tokens).c_str());
  if (text) std::printf("\"text\": %s, ", json_string(*text).c_str());
  std::printf("\"finish_reason\": \"%s\", \"time_to_first_token_s\": %.6f, \"decode_tokens_per_s\": %.3f",
              finish, t.first_token_s, t.decode_tokens_per_s);
  if (drafts)
    std::printf(", \"draft\": {\"proposed\": %lld, \"accepted\": %lld, \"calls\": %lld}",
                static_cast<long long>(drafts->proposed), static_cast<long long>(drafts->accepted),
                static_cast<long long>(drafts->calls));
  if (draft_model)  // the draft program's own calls, every proposal together
    std::printf(", \"draft_model\": {\"calls\": %lld, \"seconds\": %.6f}",
                static_cast<long long>(draft_model->calls()), draft_model->seconds());
  std::printf("}\n");
}

// --dump-pixels: the images' preprocessed pixels, float32 [N, 3, H, W] in native byte order, to a file.
int dump_pixels(const etmlx::DecoderMeta& decoder, const etmlx::DecodeArgs& args) {
  std::string error;
  if (args.images.empty()) return fail(kBadInput, "--dump-pixels needs --image FILE");
  std::vector<float> pixels;
  if (!etmlx::image_pixels(decoder, args.images, &pixels, &error)) return fail(kBadInput, error);
  std::ofstream out(*args.dump_pixels, std::ios::binary);
  out.write(reinterpret_cast<const char*>(pixels.data()), static_cast<std::streamsize>(pixels.size() * sizeof(float)));
  if (!out) return fail(kBadInput, "--dump-pixels: cannot write " + *args.dump_pixels);
  return 0;
}

int run(const etmlx::DecodeArgs& args) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(args.pte, ec))
    return fail(kBadInput, args.pte + ": no such file");

  std::string error;
  executorch::runtime::runtime_init();
  if (!executorch::runtime::get_backend_class(etmlx_backend_id()))
    return fail(kRunFailed, std::string("backend ") + etmlx_backend_id() + " is not registered");

  // External weights: --weights, else FILE.ptd beside FILE.pte when present. Both files are
  // memory-mapped; the backend wraps the weights' pages as MLX arrays without copying them.
  std::string weights = args.weights.value_or("");
  if (!args.weights) {
    const auto beside = std::filesystem::path(args.pte).replace_extension(".ptd");
    if (std::filesystem::is_regular_file(beside, ec)) weights = beside.string();
  } else if (!std::filesystem::is_regular_file(weights, ec)) {
    return fail(kBadInput, weights + ": no such file (--weights)");
  }
  Module module = weights.empty() ? Module(args.pte, Module::LoadMode::Mmap)
                                  : Module(args.pte, weights, Module::LoadMode::Mmap);
  if (const Error e = module.load(); e != Error::Ok)
    return fail(kRunFailed, args.pte + (weights.empty() ? "" : " with " + weights) +
                                " is not a loadable ExecuTorch program (error " + error_name(e) + ")");
  const auto metadata = etmlx::read_program_metadata(module, args.pte, &error);
  if (!metadata) return fail(kBadInput, error);
  const etmlx::DecoderMeta& decoder = metadata->meta;
  std::unique_ptr<etmlx::TextTokenizer> tokenizer;
  if (!metadata->tokenizer_files.empty() && (args.prompt_text || etmlx::TextTokenizer::available())) {
    tokenizer = etmlx::TextTokenizer::load(metadata->tokenizer_files, &error);
    if (!tokenizer && args.prompt_text) return fail(kBadInput, args.pte + ": " + error);
    // Given ids, the text is only a decoration of the output: a tokenizer this build cannot read
    // (e.g. a word-level one) leaves the ids, with a note, instead of refusing to decode.
    if (!tokenizer)
      std::fprintf(stderr, "etmlx_decode: note: %s: %s; printing token ids\n", args.pte.c_str(), error.c_str());
  }
  const bool with_images = !args.images.empty();
  if ((with_images || args.dump_pixels) && !etmlx::images_supported(decoder, args.pte, &error))
    return fail(kBadInput, error);
  if (args.dump_pixels) return dump_pixels(decoder, args);
  const bool takes_images = !decoder.vision_method.empty();
  std::vector<int64_t> prompt = args.prompt_ids;
  if (takes_images && !args.prompt_text) {  // one image token per image: expanded to the image's positions
    const auto marks = std::count(prompt.begin(), prompt.end(), decoder.image_token_id);
    if (marks > 0 && marks == static_cast<int64_t>(args.images.size())) prompt = etmlx::expand_image_ids(decoder, prompt);
  }
  if (args.prompt_text) {
    if (!tokenizer)
      return fail(kBadInput, args.pte + " has no tokenizer: give --prompt-ids, or re-export from a checkpoint with one");
    std::vector<int64_t> text_ids;
    const std::string text = takes_images ? etmlx::expand_image_text(decoder, *args.prompt_text) : *args.prompt_text;
    if (!tokenizer->encode(text, &text_ids, &error)) return fail(kBadInput, error);
    if (takes_images && decoder.image_text.empty()) text_ids = etmlx::expand_image_ids(decoder, text_ids);
    // The special tokens the Python tokenizer adds (recorded at export): the same ids as `etmlx generate`.
    prompt = decoder.prompt_prefix_ids;
    prompt.insert(prompt.end(), text_ids.begin(), text_ids.end());
    prompt.insert(prompt.end(), decoder.prompt_suffix_ids.begin(), decoder.prompt_suffix_ids.end());
    if (prompt.empty()) return fail(kBadInput, "--prompt is empty");
  }
  if (takes_images && !with_images && std::count(prompt.begin(), prompt.end(), decoder.image_token_id) > 0)
    return fail(kBadInput, "the prompt has image positions but no --image was given");
  const std::string method = method_to_run(module, &error);
  if (method.empty()) return fail(kRunFailed, error);
  const auto meta = module.method_meta(method);
  if (!meta.ok()) return fail(kRunFailed, "no metadata for method " + method);
  // The knob flags, checked against the program's knob list before the method loads.
  const auto& specs = decoder.knobs;
  std::map<std::string, etmlx::KnobValue> knobs;
  if (!etmlx::resolve_knob_flags(specs, args.knob_flags, "", &knobs, &error)) return fail(kBadInput, error);
  auto inputs = etmlx::StepInputs::plan(meta.get(), decoder.inputs, specs, knobs, &error);
  if (!inputs) return fail(kBadInput, args.pte + ": " + error);
  if (args.adapter_name) {
    const auto& names = decoder.adapters;
    const auto found = std::find(names.begin(), names.end(), *args.adapter_name);
    if (found == names.end()) {
      std::string known;
      for (const auto& name : names) known += (known.empty() ? "" : ", ") + name;
      return fail(kBadInput, "--adapter-name " + *args.adapter_name + ": " +
                                 (names.empty() ? "the program has no switchable adapters (export with --adapters "
                                                  "NAME=DIR,...)"
                                                : "not one of the program's adapters (" + known + ")"));
    }
    if (!inputs->set_adapter(found - names.begin() + 1, &error)) return fail(kBadInput, args.pte + ": " + error);
  }
  const float temperature = static_cast<float>(knobs["temperature"].f);
  const int64_t seed = knobs["seed"].i;
  // A batched program runs one sequence in row 0 (StepInputs idles the rest).
  if (decoder.batch != inputs->batch())
    return fail(kBadInput, metadata->origin + " says batch " + std::to_string(decoder.batch) + " but the program "
                "decodes " + std::to_string(inputs->batch()) + " rows per call: they come from different exports");
  if (decoder.max_seq_len != inputs->max_call_length())
    return fail(kBadInput, metadata->origin + " says max_seq_len " + std::to_string(decoder.max_seq_len) +
                " but the program's tokens input holds " + std::to_string(inputs->max_call_length()) +
                ": they come from different exports");

  const int64_t max_seq_len = decoder.max_seq_len;
  const int64_t vocab = decoder.vocab_size;
  // The mask input's width is the program's own vocabulary bound (ceil(V/32) words): a vocab_size
  // beyond it would let ids the program cannot sample pass as valid prompt ids and mask rows.
  if (inputs->mask_words() > 0 && (vocab + 31) / 32 != inputs->mask_words())
    return fail(kBadInput, metadata->origin + " says vocab_size " + std::to_string(vocab) +
                               " but the program's allowed_mask input has " + std::to_string(inputs->mask_words()) +
                               " words (ceil(V/32)): they come from different exports");
  const std::vector<int64_t>& eos = args.eos_ids ? *args.eos_ids : decoder.eos_token_ids;
  const auto n = static_cast<int64_t>(prompt.size());
  for (int64_t id : prompt) {
    if (id < 0 || id >= vocab)
      return fail(kBadInput, "--prompt-ids must be token ids in [0, " + std::to_string(vocab) + "), got " +
                                 std::to_string(id));
  }
  if (n > inputs->max_call_length())
    return fail(kBadInput, "prompt (" + std::to_string(n) + " tokens) is longer than the program's " +
                               std::to_string(inputs->max_call_length()) + "-token input");
  if (n + args.max_tokens > max_seq_len)
    return fail(kBadInput, "prompt (" + std::to_string(n) + ") + max_tokens (" + std::to_string(args.max_tokens) +
                               ") exceeds max_seq_len " + std::to_string(max_seq_len));
  std::vector<std::vector<int32_t>> mask_rows;
  std::optional<etmlx::ChoiceMask> choice;
  if (args.mask_file && args.choice_ids) return fail(kBadInput, "give --mask-file or --choice-ids, not both");
  // A pipelined program samples step k + 1 before the host sees token k, so no mask can depend on it.
  const char* structured = args.mask_file ? "--mask-file" : args.choice_ids ? "--choice-ids" : nullptr;
  if (structured && inputs->mask_words() > 0 && decoder.pipelined)
    return fail(kBadInput, std::string(structured) + ": " + args.pte + " is pipelined, and " +
                               etmlx::kPipelinedMaskHint);
  if (args.choice_ids) {
    if (inputs->mask_words() == 0)
      return fail(kBadInput, "--choice-ids needs a program exported with --sampler ...,mask (" + args.pte +
                                 " has no allowed_mask input)");
    const int64_t v = vocab;
    std::vector<std::vector<int64_t>> choices;
    if (!etmlx::ChoiceMask::parse(*args.choice_ids, v, &choices, &error)) return fail(kBadInput, error);
    choice.emplace(std::move(choices), eos, v);
  }
  if (args.mask_file) {
    if (inputs->mask_words() == 0)
      return fail(kBadInput, "--mask-file needs a program exported with --sampler ...,mask (" + args.pte +
                                 " has no allowed_mask input)");
    if (!etmlx::read_mask_file(*args.mask_file, inputs->mask_words(), &mask_rows, &error))
      return fail(kBadInput, error);
  }
  if (!inputs->set_verify(decoder.draft_tokens, decoder.verify_min_width, &error))
    return fail(kBadInput, metadata->origin + " " + error);
  std::shared_ptr<etmlx::DraftSource> drafts;
  if (!draft_source(args, decoder.draft_tokens, tokenizer.get(), vocab, &drafts, &error)) return fail(kBadInput, error);
  if (decoder.draft_tokens > 0 && structured)
    return fail(kBadInput, std::string(structured) + ": etmlx_decode does not constrain draft-verifying programs "
                "(use `etmlx generate`, or a program exported without --draft-tokens)");
  if (const Error e = module.load_method(method); e != Error::Ok)
    return fail(kRunFailed, "could not load method " + method + " (error " + error_name(e) + ")");

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  Clock::time_point first_token_at = start;
  std::vector<int64_t> generated;
  std::string text;
  etmlx::Utf8Stream utf8;
  auto prompt_purge = std::make_unique<etmlx::PromptPurge>();  // until the first token (allocator.h)
  etmlx::PromptImages prompt_images;  // encoded after `start`: the image's cost is part of the first token's
  if (with_images) {
    if (!etmlx::encode_images(module, decoder, args.images, prompt, &prompt_images, &error))
      return fail(kBadInput, error);
    if (!inputs->set_images(&prompt_images, &error)) return fail(kBadInput, metadata->origin + " " + error);
  }
  etmlx::DecodeLoop loop(module, method, *inputs, decoder.pipelined, max_seq_len, decoder.draft_tokens,
                         /*prompt_cache=*/false, /*ring=*/true, decoder.propose_tokens);
  // The decode-step rules (runtime/decode_rows.h) end the sequence at a stop id or at max_tokens.
  if (!loop.start({prompt, temperature, seed, args.max_tokens, eos, drafts, args.num_draft_tokens.value_or(-1),
                   prefill_chunk_for(args.prefill_chunk, with_images)},
                  &error))
    return fail(kBadInput, error);
  int64_t first_call_tokens = 1;  // tokens the first call brought (accepted drafts too): the rate counts the rest
  const char* finish = "length";
  for (int64_t step = 0; step < args.max_tokens; ++step) {
    // Token `step` (step 0: the prefill's; a pipelined program's comes back one call later, decode_loop.h).
    std::vector<int32_t> choice_row;
    if (choice) choice_row = choice->row(generated);
    const auto* mask_row = choice ? &choice_row
                           : step < static_cast<int64_t>(mask_rows.size()) ? &mask_rows[static_cast<size_t>(step)] : nullptr;
    int64_t token = 0;
    if (!loop.next(mask_row, &token, &error)) return fail(kRunFailed, error);
    if (loop.failure() == etmlx::Failure::NoToken)  // the sampler's answer for a row whose mask allows no token
      return fail(kBadInput, "step " + std::to_string(step) + ": the mask allows no token the model can produce");
    if (step == 0) {
      prompt_purge.reset();
      first_token_at = Clock::now();  // token 0 is on the host
      first_call_tokens = 1 + loop.pending();
    }
    generated.push_back(token);
    if (loop.finish() == etmlx::Finish::Stop) {
      finish = "stop";
      break;
    }
    // The stop token is not part of the text, as in `etmlx generate`.
    const std::string chunk = tokenizer ? utf8.feed(tokenizer->piece(token))
                                        : std::to_string(token) + " ";
    text += chunk;
    if (!args.json) {
      std::fputs(chunk.c_str(), stdout);
      std::fflush(stdout);
    }
    if (choice && choice->finished(generated)) {  // a whole choice that nothing extends (and no stop id to draw)
      if (eos.empty()) {
        finish = "stop";
        break;
      }
    }
  }
  const auto end = Clock::now();

  Timings t;
  t.first_token_s = std::chrono::duration<double>(first_token_at - start).count();
  const double decode_s = std::chrono::duration<double>(end - first_token_at).count();
  const auto later = static_cast<int64_t>(generated.size()) - first_call_tokens;
  if (later > 0 && decode_s > 0) t.decode_tokens_per_s = static_cast<double>(later) / decode_s;
  const std::string tail = utf8.flush();
  text += tail;
  if (args.json) {
    const auto stats = loop.draft_stats();
    const auto model = std::dynamic_pointer_cast<etmlx::ModelDraft>(drafts);
    print_json(prompt, generated, tokenizer ? &text : nullptr, finish, t, decoder.draft_tokens > 0 ? &stats : nullptr,
               model ? &model->pacing() : nullptr);
  } else {
    std::printf("%s\n", tail.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  etmlx::configure_allocator();
  etmlx::DecodeArgs args;
  std::string error;
  if (!etmlx::parse_decode_args(argc, argv, &args, &error)) {
    fail(kBadInput, error);
    std::fprintf(stderr, "(etmlx_decode --help shows the usage)\n");
    return kBadInput;
  }
  if (args.help) {
    std::printf("%s", etmlx::kDecodeUsage);
    return 0;
  }
  try {
    return run(args);
  } catch (const std::exception& e) {
    // Module and the standard containers may throw (e.g. bad_alloc).
    return fail(kRunFailed, e.what());
  }
}
