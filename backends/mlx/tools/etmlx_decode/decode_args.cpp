#include "decode_args.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace etmlx {

const char kDecodeUsage[] =
    "usage: etmlx_decode FILE.pte (--prompt TEXT | --prompt-file FILE | --prompt-ids 1,2,3)\n"
    "                    [--max-tokens N]\n"
    "                    [--temperature T] [--seed S] [--KNOB VALUE ...] [--eos ID[,ID...]]\n"
    "                    [--mask-file FILE | --choice-ids 1,2;3] [--weights FILE.ptd]\n"
    "                    [--draft ngram | --prediction TEXT|@FILE | --prediction-ids 1,2,3 |\n"
    "                     --draft-model SMALL.pte [--draft-model-cost C]] [--num-draft-tokens K]\n"
    "                    [--adapter-name NAME] [--image FILE ...] [--dump-pixels FILE]\n"
    "                    [--prefill-step-size N] [--json]\n"
    "\n"
    "Runs the decode loop of a .pte written by `etmlx export` on the etmlx (MLX)\n"
    "backend: prefill calls of up to --prefill-step-size tokens, then one call per token with\n"
    "seed S + step.\n"
    "  --prompt       prompt text, tokenized with the tokenizer inside FILE.pte (plus the\n"
    "                 special tokens it adds, e.g. BOS); the output is then text\n"
    "  --prompt-file  the prompt text read from FILE (for text longer than a command line takes)\n"
    "  --prompt-ids   comma-separated prompt token ids (this or --prompt is required)\n"
    "  --max-tokens   tokens to generate, >= 1 (default 64)\n"
    "  --temperature  >= 0; 0 = greedy (default 0)\n"
    "  --seed         base seed; step k uses S + k (default 0; seeded programs)\n"
    "  --KNOB         a sampler knob the program's metadata lists (--top-k, --top-p,\n"
    "                 --min-p, --presence-penalty, ...: the table in llm/sampler/knobs.py);\n"
    "                 off by default, refused if the program was exported without it\n"
    "  --eos          stop ids, replacing the program's eos_token_ids; repeatable\n"
    "  --mask-file    allowed-token masks, one text row per step (ceil(V/32) int32 words,\n"
    "                 decimal or 0x hex; bit j of word i = token 32 i + j); needs a program\n"
    "                 exported with --sampler ...,mask; steps past the last row are unconstrained\n"
    "  --choice-ids   the output is one of these token-id sequences (ids by ',', choices by\n"
    "                 ';'), then a stop id; masked on the device (a program with the mask input)\n"
    "  --weights      the .ptd of a program exported with --external-weights (default:\n"
    "                 FILE.ptd beside FILE.pte, if there is one)\n"
    "  --draft        programs exported with --draft-tokens K: ngram (prompt lookup over the\n"
    "                 prompt and output proposes drafts; the default) or none\n"
    "  --prediction   the expected output (Predicted Outputs), as text (@FILE: a file's text),\n"
    "                 tokenized like the prompt without its special tokens; --prediction-ids: as ids\n"
    "  --draft-model  a small plain program with the same vocabulary proposes the drafts\n"
    "                 (greedy; as many as pay for its calls, from their measured time)\n"
    "  --draft-model-cost  a draft call's time over a target call's, fixed (reproducible counts)\n"
    "  --num-draft-tokens  most drafts per call (default the program's K)\n"
    "  --adapter-name one of the LoRA adapters a program exported with --adapters NAME=DIR,... keeps\n"
    "                 switchable (default: none, the base model)\n"
    "  --image        a PNG or JPEG file for a vision-language program's prompt; repeatable, in\n"
    "                 the order of the prompt's image marks (its image token, e.g. <image>, or\n"
    "                 Gemma 3's <start_of_image>), each mark becoming the image's positions\n"
    "  --prefill-step-size  prompt tokens per prefill call (default 512; 0: the whole prompt in\n"
    "                 one call): a long prompt's activations stay a chunk's (programs with drafts\n"
    "                 or proposals, and image prompts, prefill whole)\n"
    "  --dump-pixels  write the images' preprocessed pixels (float32 [N, 3, H, W], raw) to FILE\n"
    "                 and exit: a check of the preprocessing against the checkpoint's processor\n"
    "  --json         print {\"tokens\", \"finish_reason\", timings, \"draft\"} instead of streaming ids\n";

namespace {

std::string trim(const std::string& s) {
  const char* space = " \t\r\n";
  const size_t a = s.find_first_not_of(space);
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(space) - a + 1);
}

bool parse_int(const std::string& text, int64_t* out) {
  const std::string t = trim(text);
  if (t.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(t.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  *out = static_cast<int64_t>(v);
  return true;
}

}  // namespace

bool parse_id_list(const std::string& text, const char* what, std::vector<int64_t>* out,
                   std::string* error) {
  size_t start = 0;
  for (;;) {
    const size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    // Blank items are skipped (a trailing comma), as `etmlx generate` does.
    if (!trim(item).empty()) {
      int64_t id = 0;
      if (!parse_int(item, &id)) {
        *error = std::string(what) + ": '" + trim(item) + "' is not an integer token id";
        return false;
      }
      out->push_back(id);
    }
    if (comma == std::string::npos) return true;
    start = comma + 1;
  }
}

bool parse_decode_args(int argc, char** argv, DecodeArgs* out, std::string* error) {
  bool have_prompt = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      out->help = true;
      return true;
    }
    if (arg == "--json") {
      out->json = true;
      continue;
    }
    if (arg.rfind("--", 0) == 0) {
      // Every other option takes a value, as "--opt VALUE" or "--opt=VALUE".
      std::string name = arg;
      std::string value;
      const size_t eq = arg.find('=');
      if (eq != std::string::npos) {
        name = arg.substr(0, eq);
        value = arg.substr(eq + 1);
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        *error = name + " needs a value";
        return false;
      }
      if (name == "--prompt-ids") {
        out->prompt_ids.clear();
        if (!parse_id_list(value, "--prompt-ids", &out->prompt_ids, error)) return false;
        have_prompt = true;
      } else if (name == "--prompt") {
        out->prompt_text = value;
      } else if (name == "--prompt-file") {
        std::error_code ec;
        std::ifstream in(value, std::ios::binary);
        if (!std::filesystem::is_regular_file(value, ec) || !in) {
          *error = "--prompt-file: cannot read '" + value + "'";
          return false;
        }
        std::stringstream text;
        text << in.rdbuf();  // (an empty file sets only `text`'s failbit)
        out->prompt_text = text.str();
      } else if (name == "--max-tokens") {
        if (!parse_int(value, &out->max_tokens) || out->max_tokens < 1) {
          *error = "--max-tokens must be an integer >= 1, got '" + value + "'";
          return false;
        }
      } else if (name == "--eos") {
        if (!out->eos_ids) out->eos_ids.emplace();
        if (!parse_id_list(value, "--eos", &*out->eos_ids, error)) return false;
      } else if (name == "--image") {
        if (value.empty()) {
          *error = "--image needs a FILE";
          return false;
        }
        out->images.push_back(value);
      } else if (name == "--dump-pixels") {
        out->dump_pixels = value;
      } else if (name == "--mask-file") {
        out->mask_file = value;
      } else if (name == "--choice-ids") {
        out->choice_ids = value;
      } else if (name == "--weights") {
        if (value.empty()) {
          *error = "--weights needs a FILE.ptd";
          return false;
        }
        out->weights = value;
      } else if (name == "--draft") {
        if (value != "ngram" && value != "none") {
          *error = "--draft must be ngram or none, got '" + value + "'";
          return false;
        }
        out->draft = value;
      } else if (name == "--prediction") {
        out->prediction_text = value;
      } else if (name == "--prediction-ids") {
        out->prediction_ids.emplace();
        if (!parse_id_list(value, "--prediction-ids", &*out->prediction_ids, error)) return false;
        for (int64_t id : *out->prediction_ids) {
          if (id < 0) {
            *error = "--prediction-ids must be token ids >= 0, got " + std::to_string(id);
            return false;
          }
        }
      } else if (name == "--draft-model") {
        if (value.empty()) {
          *error = "--draft-model needs a SMALL.pte";
          return false;
        }
        out->draft_model = value;
      } else if (name == "--draft-model-cost") {
        char* end = nullptr;
        const std::string t = trim(value);
        const double c = t.empty() ? -1.0 : std::strtod(t.c_str(), &end);
        if (t.empty() || *end != '\0' || !(c >= 0.0) || c > 1e9) {
          *error = "--draft-model-cost must be a number >= 0, got '" + value + "'";
          return false;
        }
        out->draft_model_cost = c;
      } else if (name == "--adapter-name") {
        if (value.empty()) {
          *error = "--adapter-name needs a NAME";
          return false;
        }
        out->adapter_name = value;
      } else if (name == "--prefill-step-size") {
        int64_t n = 0;
        if (!parse_int(value, &n) || n < 0) {
          *error = "--prefill-step-size must be an integer >= 0, got '" + value + "'";
          return false;
        }
        out->prefill_chunk = n;
      } else if (name == "--num-draft-tokens") {
        int64_t k = 0;
        if (!parse_int(value, &k) || k < 0) {
          *error = "--num-draft-tokens must be an integer >= 0, got '" + value + "'";
          return false;
        }
        out->num_draft_tokens = k;
      } else {
        out->knob_flags.emplace_back(name, value);
      }
      continue;
    }
    if (!out->pte.empty()) {
      *error = "unexpected argument '" + arg + "' (one FILE.pte only)";
      return false;
    }
    out->pte = arg;
  }
  if (out->pte.empty()) {
    *error = "FILE.pte is required";
    return false;
  }
  if (have_prompt && out->prompt_text) {
    *error = "give --prompt or --prompt-ids, not both";
    return false;
  }
  if (!have_prompt && !out->prompt_text && !out->dump_pixels) {
    *error = "--prompt or --prompt-ids is required";
    return false;
  }

  if (have_prompt && out->prompt_ids.empty()) {
    *error = "--prompt-ids is empty";
    return false;
  }
  const int sources = !out->draft.empty() + out->prediction_text.has_value() + out->prediction_ids.has_value() +
                      out->draft_model.has_value();
  if (sources > 1) {
    *error = "give one draft source: --draft ngram, --prediction, --prediction-ids or --draft-model";
    return false;
  }
  if (out->draft_model_cost && !out->draft_model) {
    *error = "--draft-model-cost needs --draft-model";
    return false;
  }
  return true;
}

}  // namespace etmlx
