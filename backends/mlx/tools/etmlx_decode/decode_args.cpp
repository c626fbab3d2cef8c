#include "decode_args.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace etmlx {

const char kDecodeUsage[] =
    "usage: etmlx_decode FILE.pte (--prompt TEXT | --prompt-ids 1,2,3) [--max-tokens N] [--temperature T]\n"
    "                    [--seed S] [--top-k K] [--top-p P] [--min-p M] [--presence-penalty X]\n"
    "                    [--frequency-penalty X] [--repetition-penalty R] [--eos ID[,ID...]]\n"
    "                    [--vocab-size V] [--json]\n"
    "\n"
    "Runs the decode loop of a .pte written by `etmlx export` on the etmlx (MLX)\n"
    "backend: one prefill call, then one call per token with seed S + step.\n"
    "  --prompt       prompt text, tokenized with the tokenizer inside FILE.pte (plus the\n"
    "                 special tokens it adds, e.g. BOS); the output is then text\n"
    "  --prompt-ids   comma-separated prompt token ids (this or --prompt is required)\n"
    "  --max-tokens   tokens to generate, >= 1 (default 64)\n"
    "  --temperature  >= 0; 0 = greedy (default 0)\n"
    "  --seed         base seed; step k uses S + k (default 0; seeded programs)\n"
    "  --top-k, --top-p, --min-p, --presence-penalty, --frequency-penalty,\n"
    "  --repetition-penalty\n"
    "                 sampler knobs, for programs exported with them (off by default)\n"
    "  --eos          stop ids, replacing the program's eos_token_ids; repeatable\n"
    "  --vocab-size   for range-checking prompt ids of a program without etmlx metadata\n"
    "  --json         print {\"tokens\", \"finish_reason\", timings} instead of streaming ids\n";

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

bool parse_float(const std::string& text, float* out) {
  const std::string t = trim(text);
  if (t.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const float v = std::strtof(t.c_str(), &end);
  // ERANGE on underflow still gives a usable (tiny or zero) value.
  if (*end != '\0' || (errno == ERANGE && std::isinf(v))) return false;
  *out = v;
  return true;
}

struct KnobOption {
  const char* flag;
  const char* input;  // the program input it fills
  double lo, hi;      // allowed range
  bool lo_open;       // lo itself excluded
  bool integer;
  const char* range_text;
};

// The ranges `etmlx generate` accepts (backends/mlx/llm/decoder/step_inputs.py).
constexpr KnobOption kKnobOptions[] = {
    {"--top-k", "top_k", 0, 1e15, false, true, "an integer >= 0 (0 = off)"},
    {"--top-p", "top_p", 0, 1, true, false, "in (0, 1] (1 = off)"},
    {"--min-p", "min_p", 0, 1, false, false, "in [0, 1] (0 = off)"},
    {"--presence-penalty", "presence_penalty", -2, 2, false, false, "in [-2, 2] (0 = off)"},
    {"--frequency-penalty", "frequency_penalty", -2, 2, false, false, "in [-2, 2] (0 = off)"},
    {"--repetition-penalty", "repetition_penalty", 0, HUGE_VAL, true, false, "> 0 (1 = off)"},
};

bool parse_knob(const KnobOption& k, const std::string& value, double* out) {
  double v = 0;
  if (k.integer) {
    int64_t i = 0;
    if (!parse_int(value, &i)) return false;
    v = static_cast<double>(i);
  } else {
    float f = 0;
    if (!parse_float(value, &f)) return false;
    v = f;
  }
  if (std::isnan(v) || v < k.lo || v > k.hi || (k.lo_open && v == k.lo)) return false;
  *out = v;
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
      } else if (name == "--max-tokens") {
        if (!parse_int(value, &out->max_tokens) || out->max_tokens < 1) {
          *error = "--max-tokens must be an integer >= 1, got '" + value + "'";
          return false;
        }
      } else if (name == "--temperature") {
        if (!parse_float(value, &out->temperature) || std::isnan(out->temperature) ||
            out->temperature < 0) {
          *error = "--temperature must be a number >= 0 (0 = greedy), got '" + value + "'";
          return false;
        }
      } else if (name == "--seed") {
        if (!parse_int(value, &out->seed)) {
          *error = "--seed must be a 64-bit integer, got '" + value + "'";
          return false;
        }
      } else if (name == "--eos") {
        if (!out->eos_ids) out->eos_ids.emplace();
        if (!parse_id_list(value, "--eos", &*out->eos_ids, error)) return false;
      } else if (name == "--vocab-size") {
        int64_t v = 0;
        if (!parse_int(value, &v) || v < 1) {
          *error = "--vocab-size must be an integer >= 1, got '" + value + "'";
          return false;
        }
        out->vocab_size = v;
      } else {
        const KnobOption* knob = nullptr;
        for (const auto& k : kKnobOptions)
          if (name == k.flag) knob = &k;
        if (!knob) {
          *error = "unknown option " + name;
          return false;
        }
        double v = 0;
        if (!parse_knob(*knob, value, &v)) {
          *error = name + " must be " + knob->range_text + ", got '" + value + "'";
          return false;
        }
        out->knobs[knob->input] = v;
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
  if (have_prompt == out->prompt_text.has_value()) {
    *error = have_prompt ? "give --prompt or --prompt-ids, not both" : "--prompt or --prompt-ids is required";
    return false;
  }
  if (have_prompt && out->prompt_ids.empty()) {
    *error = "--prompt-ids is empty";
    return false;
  }
  return true;
}

}  // namespace etmlx
