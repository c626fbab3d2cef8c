// etmlx_bench: times a .pte on the etmlx backend and prints one JSON object. No Python, no torch:
// a GPU host needs only the built binaries, libexecutorch*.so and libmlx (docs/cpp-tools.md, "Carrying binaries to a GPU host").
//
// A decoder program (one with etmlx metadata: input names and knobs) runs --runs sequences of a
// --prompt-len-token prefill and --decode-steps decode calls, each feeding back the sampled token,
// with etmlx_decode's loop (decode_loop.h; a pipelined program makes one more call per sequence,
// since each call returns the previous one's token). The first prefill of the process is reported apart (cold_first_token_s): it
// pays for loading and, on a GPU, kernel compilation; the later sequences' first tokens are the warm
// figure. Any other program (a sampler-only head, ...) is called --calls times with zero-filled
// inputs of its static shapes, or with the bytes of DIR/input_<i>.bin (--inputs DIR): zeros are a
// poor timing input for a sampler (every logit ties). Times are per call, wall clock, outputs copied to the host.
//
// A draft-verifying program (`etmlx export --draft-tokens K`) runs the same sequences with drafts from --drafts:
// "prediction" (default: Predicted Outputs whose prediction is the program's own greedy continuation, taken
// from the first, cold run, which drafts nothing), "ngram" (prompt lookup), "none", or with --draft-model SMALL.pte
// a draft model (model_draft.h: one for every warm run, its row cache carried over; --draft-model-cost fixes its
// cost instead of measuring it; its own calls are reported, and counted in decode_host). A call then brings
// several tokens: "decode" times the decode calls, and decode_tokens_per_s counts every token after the first
// call's over the wall-clock time after it, drafting included (the median of the warm runs), as `etmlx bench
// speculative` does.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor_ptr_maker.h>
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/platform/runtime.h>

#include "allocator.h"
#include "decode_loop.h"
#include "model_draft.h"
#include "program_metadata.h"
#include "step_inputs.h"

extern "C" const char* etmlx_backend_id();
extern "C" void etmlx_call_profile(uint64_t* calls, double* build_s, double* submit_s, double* wait_s, double* copy_s);

namespace {

using executorch::extension::module::Module;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using Clock = std::chrono::steady_clock;

constexpr const char kUsage[] =
    "usage: etmlx_bench FILE.pte [--prompt-len N] [--decode-steps N] [--runs N] [--calls N] [--warmup N]\n"
    "                   [--temperature T] [--seed S] [--inputs DIR] [--drafts prediction|ngram|none]\n"
    "                   [--draft-model SMALL.pte [--draft-model-cost C]] [--prompt-ids 1,2,3]\n"
    "Times FILE.pte on the etmlx backend and prints JSON (milliseconds per call: median, p90).\n"
    "  decoder programs: --runs sequences (default 3; the first is the cold one, the others warm) of a --prompt-len prefill (default 16;\n"
    "                    synthetic ids, or the --prompt-ids given)\n"
    "                    and --decode-steps decode calls (default 32), sampling at --temperature\n"
    "                    (default 0, greedy) with --seed (default 0); a --draft-tokens program takes\n"
    "                    --drafts (default prediction: its own greedy continuation, from the cold run),\n"
    "                    or --draft-model (a small plain program with its vocabulary drafts greedily)\n"
    "  other programs:   --warmup calls (default 2), then --calls timed calls (default 20) on\n"
    "                    zero-filled inputs, or the raw bytes of DIR/input_<i>.bin (--inputs DIR; each file\n"
    "                    exactly input i's size); prints the integer values of output 0's last call\n";

int fail(const std::string& message) {
  std::fprintf(stderr, "etmlx_bench: error: %s\n", message.c_str());
  return 2;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Stats {
  size_t n = 0;
  double median_ms = 0, p90_ms = 0, mean_ms = 0;
};

Stats stats_of(std::vector<double> s) {
  Stats st;
  st.n = s.size();
  if (s.empty()) return st;
  std::sort(s.begin(), s.end());
  double sum = 0;
  for (double v : s) sum += v;
  st.median_ms = 1e3 * (s.size() % 2 ? s[s.size() / 2] : (s[s.size() / 2 - 1] + s[s.size() / 2]) / 2);
  st.p90_ms = 1e3 * s[std::min(s.size() - 1, static_cast<size_t>(0.9 * static_cast<double>(s.size() - 1) + 0.5))];
  st.mean_ms = 1e3 * sum / static_cast<double>(s.size());
  return st;
}

// The backend's host-time totals (runtime/call_profile.h): build, submit, wait, copy seconds.
struct HostTimes {
  uint64_t calls = 0;
  double s[4] = {0, 0, 0, 0};
  static HostTimes now() {
    HostTimes t;
    etmlx_call_profile(&t.calls, &t.s[0], &t.s[1], &t.s[2], &t.s[3]);
    return t;
  }
  void add_since(const HostTimes& before, const HostTimes& after) {
    calls += after.calls - before.calls;
    for (int i = 0; i < 4; ++i) s[i] += after.s[i] - before.s[i];
  }
  // Mean milliseconds per backend call, by phase.
  std::string json() const {
    const double n = calls ? static_cast<double>(calls) : 1.0;
    char buf[200];
    std::snprintf(buf, sizeof(buf),
                  "{\"calls\": %llu, \"build_ms\": %.4f, \"submit_ms\": %.4f, \"wait_ms\": %.4f, \"copy_ms\": %.4f}",
                  static_cast<unsigned long long>(calls), 1e3 * s[0] / n, 1e3 * s[1] / n, 1e3 * s[2] / n,
                  1e3 * s[3] / n);
    return buf;
  }
};

std::string json_stats(const Stats& s) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "{\"n\": %zu, \"median_ms\": %.4f, \"p90_ms\": %.4f, \"mean_ms\": %.4f}", s.n,
                s.median_ms, s.p90_ms, s.mean_ms);
  return buf;
}

struct Args {
  std::string pte, inputs_dir, drafts = "prediction", draft_model;
  double draft_model_cost = -1;  // < 0: measured
  std::vector<int64_t> prompt_ids;  // --prompt-ids: this prompt instead of --prompt-len synthetic ids
  long prompt_len = 16, decode_steps = 32, runs = 3, calls = 20, warmup = 2, seed = 0;
  double temperature = 0;
};

bool parse(int argc, char** argv, Args* a, std::string* error, bool* help) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      *help = true;
      return true;
    }
    if (flag.rfind("--", 0) != 0) {
      if (!a->pte.empty()) return *error = "more than one program given", false;
      a->pte = flag;
      continue;
    }
    if (i + 1 >= argc) return *error = flag + " needs a value", false;
    const std::string value = argv[++i];
    char* end = nullptr;
    if (flag == "--inputs") {
      a->inputs_dir = value;
      continue;
    }
    if (flag == "--drafts") {
      if (value != "prediction" && value != "ngram" && value != "none")
        return *error = "--drafts must be prediction, ngram or none", false;
      a->drafts = value;
      continue;
    }
    if (flag == "--prompt-ids") {
      std::string item;
      a->prompt_ids.clear();
      for (size_t at = 0; at <= value.size(); ++at) {
        if (at < value.size() && value[at] != ',') {
          item += value[at];
          continue;
        }
        char* stop = nullptr;
        const long long id = std::strtoll(item.c_str(), &stop, 10);
        if (item.empty() || *stop || id < 0) return *error = "--prompt-ids must be token ids >= 0, comma-separated", false;
        a->prompt_ids.push_back(static_cast<int64_t>(id));
        item.clear();
      }
      a->prompt_len = static_cast<long>(a->prompt_ids.size());
      continue;
    }
    if (flag == "--draft-model") {
      a->draft_model = value;
      continue;
    }
    if (flag == "--draft-model-cost") {
      a->draft_model_cost = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end || !(a->draft_model_cost >= 0))
        return *error = "--draft-model-cost must be a number >= 0", false;
      continue;
    }
    if (flag == "--temperature") {
      a->temperature = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end || !(a->temperature >= 0))
        return *error = "--temperature must be a number >= 0", false;
      continue;
    }
    const long v = std::strtol(value.c_str(), &end, 10);
    const bool integer = end != value.c_str() && *end == '\0';
    long* slot = flag == "--prompt-len" ? &a->prompt_len : flag == "--decode-steps" ? &a->decode_steps
               : flag == "--runs" ? &a->runs : flag == "--calls" ? &a->calls : flag == "--warmup" ? &a->warmup
               : flag == "--seed" ? &a->seed : nullptr;
    if (!slot) return *error = "unknown option " + flag, false;
    const long least = (flag == "--warmup" || flag == "--seed" || flag == "--decode-steps") ? 0 : 1;
    if (!integer || v < least) return *error = flag + " must be an integer >= " + std::to_string(least), false;
    *slot = v;
  }
  if (a->pte.empty()) return *error = "no program given", false;
  if (a->draft_model_cost >= 0 && a->draft_model.empty()) return *error = "--draft-model-cost needs --draft-model", false;
  if (!a->draft_model.empty()) a->drafts = "draft-model";  // the source, whatever --drafts said
  return true;
}

int bench_decoder(Module& module, const std::string& method, const etmlx::ProgramMetadata& md, const Args& a,
                  double load_s) {
  std::string error;
  auto inputs = etmlx::StepInputs::plan_defaults(module.method_meta(method).get(), md.meta, &error);
  if (!inputs) return fail(a.pte + ": " + error);
  const int64_t max_seq = md.meta.max_seq_len;
  const int64_t draft_tokens = md.meta.draft_tokens;
  std::shared_ptr<etmlx::ModelDraft> draft_model;
  if (!a.draft_model.empty()) {
    if (draft_tokens == 0) return fail(a.pte + " does not verify drafts: --draft-model needs a --draft-tokens program");
    const auto cost = a.draft_model_cost >= 0 ? std::optional<double>(a.draft_model_cost) : std::nullopt;
    draft_model = etmlx::ModelDraft::load(a.draft_model, md.meta.vocab_size, draft_tokens, cost, &error);
    if (!draft_model) return fail(error);
  }
  if (a.prompt_len > inputs->max_call_length() || a.prompt_len + a.decode_steps > max_seq)
    return fail("--prompt-len + --decode-steps must fit the program's " + std::to_string(max_seq) + " positions");
  const int64_t vocab = md.meta.vocab_size;
  std::vector<int64_t> prompt = a.prompt_ids;
  if (prompt.empty())  // --prompt-len synthetic ids
    for (long i = 0; i < a.prompt_len; ++i) prompt.push_back((7 * i + 1) % vocab);
  for (int64_t id : prompt)
    if (id < 0 || id >= vocab) return fail("--prompt-ids must be below the vocabulary size " + std::to_string(vocab));

  // "prefill": the time until token 0 is on the host (a pipelined program's prefill call returns
  // nothing, so that is the prefill call plus the first decode call); "decode": the calls that
  // return tokens 1..decode_steps, one each (decode_loop.h).
  std::vector<double> prefill, decode;
  double cold = 0;
  int64_t tokens_checksum = 0;
  HostTimes decode_host;  // the warm runs' decode calls
  etmlx::DecodeLoop loop(module, method, *inputs, md.meta.pipelined, max_seq, draft_tokens);
  std::vector<int64_t> reference;  // the cold run's tokens: a draft program's prediction, and every run's tokens
  std::vector<double> run_rates;   // tokens after the first call's per second, warm runs
  etmlx::DecodeLoop::DraftStats drafted;  // the last run's
  for (long run = 0; run < a.runs; ++run) {
    std::shared_ptr<etmlx::DraftSource> source;
    if (draft_tokens > 0 && run > 0 && a.drafts == "prediction") source = std::make_shared<etmlx::PredictionDraft>(reference);
    if (draft_tokens > 0 && run > 0 && a.drafts == "ngram") source = std::make_shared<etmlx::NgramDraft>();
    if (draft_tokens > 0 && run > 0 && draft_model) source = draft_model;
    // Every step is timed: no stop id ends a run early.
    if (!loop.start({prompt, static_cast<float>(a.temperature), a.seed, a.decode_steps + 1, {}, source}, &error))
      return fail(error);
    std::vector<int64_t> tokens;
    double after_first = 0;  // wall clock after token 0: the calls and everything around them (a draft model's calls)
    int64_t first_call_tokens = 1;
    for (long step = 0; step <= a.decode_steps; ++step) {
      int64_t token = 0;
      const HostTimes before = HostTimes::now();
      const auto wall0 = Clock::now();
      if (!loop.next(nullptr, &token, &error))
        return fail("token " + std::to_string(step) + " of run " + std::to_string(run) + ": " + error);
      if (step > 0) after_first += std::chrono::duration<double>(Clock::now() - wall0).count();
      double s = 0;
      for (const auto& call : loop.calls()) s += call.seconds;
      if (step == 0) {
        // The first run's first token is the cold figure, the others warm.
        if (run == 0) cold = s;
        else prefill.push_back(s);
        first_call_tokens = 1 + loop.pending();
      } else if (!loop.calls().empty()) {  // a token an earlier call brought costs no call
        if (run > 0 || draft_tokens == 0) decode.push_back(s);  // a draft program's cold run drafts nothing
        if (run > 0) decode_host.add_since(before, HostTimes::now());
      }
      tokens.push_back(token);
      tokens_checksum += token;
    }
    if (run == 0) reference = tokens;
    else if (draft_tokens > 0 && tokens != reference)
      return fail("run " + std::to_string(run) + " decoded other tokens than the cold run (drafts must not change them)");
    if (run > 0 && after_first > 0)
      run_rates.push_back(static_cast<double>(static_cast<int64_t>(tokens.size()) - first_call_tokens) / after_first);
    drafted = loop.draft_stats();
  }
  const Stats p = stats_of(prefill), d = stats_of(decode);
  std::sort(run_rates.begin(), run_rates.end());
  // A plain program's rate is per call (the median call); a draft program's calls bring several tokens, so its
  // rate is per sequence. sequence_tokens_per_s is the per-sequence rate of either kind: compare programs by it.
  const double sequence_rate = run_rates.empty() ? 0.0 : run_rates[run_rates.size() / 2];
  const double rate = draft_tokens == 0 ? (d.median_ms > 0 ? 1e3 / d.median_ms : 0.0) : sequence_rate;
  std::string draft_json;
  if (draft_tokens > 0) {
    char buf[200];
    std::snprintf(buf, sizeof(buf), ", \"draft\": {\"draft_tokens\": %lld, \"source\": \"%s\", \"proposed\": %lld, "
                  "\"accepted\": %lld, \"calls\": %lld}", static_cast<long long>(draft_tokens), a.drafts.c_str(),
                  static_cast<long long>(drafted.proposed), static_cast<long long>(drafted.accepted),
                  static_cast<long long>(drafted.calls));
    draft_json = buf;
    if (draft_model) {
      const etmlx::DraftModelPacing& pacing = draft_model->pacing();
      std::snprintf(buf, sizeof(buf), ", \"draft_model\": {\"calls\": %lld, \"ms_per_call\": %.4f}",
                    static_cast<long long>(pacing.calls()),
                    pacing.calls() > 0 ? 1e3 * pacing.seconds() / static_cast<double>(pacing.calls()) : 0.0);
      draft_json += buf;
    }
  }
  std::printf("{\"program\": \"%s\", \"kind\": \"decoder\", \"method\": \"%s\", \"pipelined\": %s, "
              "\"allocator\": \"%s\", \"load_s\": %.6f, \"prompt_len\": %ld, \"decode_steps\": %ld, \"runs\": %ld, \"temperature\": %g, "
              "\"cold_first_token_s\": %.6f, \"warm_first_token_s\": %.6f, \"prefill\": %s, \"decode\": %s, "
              "\"prefill_tokens_per_s\": %.3f, \"decode_tokens_per_s\": %.3f, \"sequence_tokens_per_s\": %.3f, \"token_sum\": %lld, \"decode_host\": %s%s}\n",
              a.pte.c_str(), method.c_str(), md.meta.pipelined ? "true" : "false", etmlx::allocator_name().c_str(),
              load_s, a.prompt_len,
              a.decode_steps, a.runs, a.temperature, cold,
              p.median_ms / 1e3, json_stats(p).c_str(), json_stats(d).c_str(),
              p.median_ms > 0 ? 1e3 * static_cast<double>(a.prompt_len) / p.median_ms : 0.0,
              rate, sequence_rate, static_cast<long long>(tokens_checksum), decode_host.json().c_str(), draft_json.c_str());
  return 0;
}

int bench_generic(Module& module, const std::string& method, const Args& a, double load_s) {
  const auto meta = module.method_meta(method);
  std::vector<executorch::extension::TensorPtr> alive;
  std::vector<EValue> values;
  for (size_t i = 0; i < meta->num_inputs(); ++i) {
    const auto tag = meta->input_tag(i);
    if (!tag.ok() || *tag != executorch::runtime::Tag::Tensor)
      return fail(a.pte + ": input " + std::to_string(i) + " is not a tensor (etmlx_bench fills tensors only)");
    const auto tm = meta->input_tensor_meta(i);
    std::vector<executorch::aten::SizesType> sizes(tm->sizes().begin(), tm->sizes().end());
    alive.push_back(executorch::extension::zeros(sizes, tm->scalar_type()));
    values.emplace_back(alive.back());
    if (!a.inputs_dir.empty()) {
      const std::string path = a.inputs_dir + "/input_" + std::to_string(i) + ".bin";
      std::ifstream f(path, std::ios::binary | std::ios::ate);
      if (!f) return fail(path + ": cannot read it (--inputs DIR needs one file per input)");
      const auto bytes = static_cast<size_t>(f.tellg());
      if (bytes != alive.back()->nbytes())
        return fail(path + " has " + std::to_string(bytes) + " bytes; input " + std::to_string(i) + " takes " +
                    std::to_string(alive.back()->nbytes()));
      f.seekg(0);
      f.read(static_cast<char*>(alive.back()->mutable_data_ptr()), static_cast<std::streamsize>(bytes));
    }
  }
  std::vector<double> times;
  double first = 0;
  std::string output0 = "[]";
  for (long c = 0; c < a.warmup + a.calls; ++c) {
    const auto t0 = Clock::now();
    const auto out = module.execute(method, values);
    if (!out.ok()) return fail("call " + std::to_string(c) + " failed");
    const double s = seconds_since(t0);
    if (c == 0) first = s;
    if (c >= a.warmup) times.push_back(s);
    // Output 0's integers (a sampler's tokens), to compare devices on the same inputs.
    if (!out->empty() && (*out)[0].isTensor() &&
        (*out)[0].toTensor().scalar_type() == executorch::aten::ScalarType::Long) {
      const auto& t = (*out)[0].toTensor();
      output0 = "[";
      for (ssize_t k = 0; k < std::min<ssize_t>(t.numel(), 64); ++k)
        output0 += (k ? ", " : "") + std::to_string(t.const_data_ptr<int64_t>()[k]);
      output0 += "]";
    }
  }
  const Stats s = stats_of(times);
  std::printf("{\"program\": \"%s\", \"kind\": \"generic\", \"method\": \"%s\", \"allocator\": \"%s\", \"load_s\": %.6f, "
              "\"inputs\": %zu, \"first_call_s\": %.6f, \"call\": %s, \"calls_per_s\": %.3f, \"output0\": %s}\n",
              a.pte.c_str(), method.c_str(), etmlx::allocator_name().c_str(), load_s, values.size(), first,
              json_stats(s).c_str(),
              s.median_ms > 0 ? 1e3 / s.median_ms : 0.0, output0.c_str());
  return 0;
}

int run(const Args& a) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(a.pte, ec)) return fail(a.pte + ": no such file");
  executorch::runtime::runtime_init();
  if (!executorch::runtime::get_backend_class(etmlx_backend_id())) return fail("the etmlx backend is not registered");
  const auto t0 = Clock::now();
  Module module(a.pte, Module::LoadMode::Mmap);
  if (module.load() != Error::Ok) return fail(a.pte + " is not a loadable ExecuTorch program");
  const auto names = module.method_names();
  if (!names.ok() || names->empty()) return fail(a.pte + " has no methods");
  const std::string method = names->count("forward") ? "forward" : *names->begin();
  if (module.load_method(method) != Error::Ok) return fail("could not load method " + method);
  const double load_s = seconds_since(t0);
  // A program without decoder metadata is timed as a plain program; a decoder's must be this etmlx's.
  if (!etmlx::has_decoder_metadata(module)) return bench_generic(module, method, a, load_s);
  std::string error;
  const auto md = etmlx::read_program_metadata(module, a.pte, &error);
  if (!md) return fail(error);
  return bench_decoder(module, method, *md, a, load_s);
}

}  // namespace

int main(int argc, char** argv) {
  etmlx::configure_allocator();
  Args args;
  std::string error;
  bool help = false;
  if (!parse(argc, argv, &args, &error, &help)) {
    fail(error);
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  if (help) {
    std::printf("%s", kUsage);
    return 0;
  }
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "etmlx_bench: error: %s\n", e.what());
    return 1;
  }
}
