#include "model_draft.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <stdexcept>

#include "program_metadata.h"

namespace etmlx {

namespace {

using executorch::extension::module::Module;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::unique_ptr<ModelDraft> ModelDraft::load(const std::string& pte, std::optional<int64_t> target_vocab,
                                             int64_t max_drafts, std::optional<double> cost, std::string* error) {
  const std::string what = "--draft-model " + pte;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(pte, ec)) {
    *error = what + ": no such file";
    return nullptr;
  }
  auto module = std::make_unique<Module>(pte, Module::LoadMode::Mmap);
  if (module->load() != executorch::runtime::Error::Ok) {
    *error = what + " is not a loadable ExecuTorch program";
    return nullptr;
  }
  const auto metadata = read_program_metadata(*module, pte, error);
  if (!metadata) return nullptr;
  const DecoderMeta& meta = metadata->meta;
  if (meta.draft_tokens > 0) {
    *error = what + " verifies drafts itself (--draft-tokens " + std::to_string(meta.draft_tokens) +
             "): a draft model is a plain decoder program";
    return nullptr;
  }
  if (target_vocab && meta.vocab_size != *target_vocab) {
    *error = what + " has a vocabulary of " + std::to_string(meta.vocab_size) + " tokens but the program has " +
             std::to_string(*target_vocab) + ": a draft model must use the program's tokenizer";
    return nullptr;
  }
  const auto names = module->method_names();
  if (!names.ok() || !names->count("forward")) {
    *error = what + " has no 'forward' method";
    return nullptr;
  }
  const auto method_meta = module->method_meta("forward");
  if (!method_meta.ok()) {
    *error = what + ": no metadata for its method forward";
    return nullptr;
  }
  // Greedy, every knob off: a draft is the draft model's most likely token.
  auto inputs = StepInputs::plan_defaults(method_meta.get(), meta, error);
  if (!inputs) {
    *error = what + ": " + *error;
    return nullptr;
  }
  if (module->load_method("forward") != executorch::runtime::Error::Ok) {
    *error = what + ": could not load its method forward";
    return nullptr;
  }
  const int64_t max_seq_len = meta.max_seq_len;
  try {
    return std::unique_ptr<ModelDraft>(new ModelDraft(std::move(module), "forward",
                                                      std::make_unique<StepInputs>(std::move(*inputs)),
                                                      meta.pipelined, meta.ring_cache.value_or(true), max_seq_len,
                                                      meta.eos_token_ids,
                                                      meta.propose_tokens > 0 ? std::min(max_drafts, meta.propose_tokens)
                                                                              : max_drafts,
                                                      cost, meta.propose_tokens));
  } catch (const std::exception& e) {  // DraftModelPacing's refusal of a negative cost or max_drafts
    *error = what + ": " + e.what();
    return nullptr;
  }
}

ModelDraft::ModelDraft(std::unique_ptr<Module> module, std::string method, std::unique_ptr<StepInputs> inputs,
                       bool pipelined, bool ring, int64_t max_seq_len, std::vector<int64_t> eos, int64_t max_drafts,
                       std::optional<double> cost, int64_t propose_tokens)
    : module_(std::move(module)),
      inputs_(std::move(inputs)),
      max_seq_len_(max_seq_len),
      eos_(std::move(eos)),
      pipelined_(pipelined),
      propose_tokens_(propose_tokens),
      loop_(*module_, std::move(method), *inputs_, pipelined, max_seq_len, 0, /*prompt_cache=*/true, ring),
      pacing_(max_drafts, cost, /*one_call=*/propose_tokens > 0) {}

std::vector<int64_t> ModelDraft::propose_in_one_call(const std::vector<int64_t>& seq, int64_t k) {
  std::string error;
  if (!loop_.start({seq, 0.0f, 0, 1, {}, nullptr, -1}, &error))
    throw std::runtime_error("the draft model refused the sequence: " + error);
  int64_t first = 0;
  if (!loop_.next(nullptr, &first, &error)) throw std::runtime_error("the draft model failed: " + error);
  const auto& out = loop_.outputs();
  if (out.empty() || !out[0].isTensor() || out[0].toTensor().scalar_type() != executorch::aten::ScalarType::Long ||
      out[0].toTensor().numel() < propose_tokens_)
    throw std::runtime_error("the draft model's output 0 is not its " + std::to_string(propose_tokens_) +
                             " proposed token ids");
  const int64_t* row = out[0].toTensor().const_data_ptr<int64_t>();  // row 0: the loop's only row
  std::vector<int64_t> drafts;
  for (int64_t i = 0; i < std::min(k, propose_tokens_); ++i) {
    drafts.push_back(row[i]);
    if (std::find(eos_.begin(), eos_.end(), row[i]) != eos_.end()) break;  // an eos is the last draft
  }
  return drafts;
}

std::vector<int64_t> ModelDraft::propose(const std::vector<int64_t>& prompt, const std::vector<int64_t>& output,
                                         int64_t k) {
  const double started = now_s();
  std::vector<int64_t> seq(prompt);
  seq.insert(seq.end(), output.begin(), output.end());
  // The draft cache holds no more than max_seq_len positions.
  k = std::min({k, pacing_.begin(seq, started), max_seq_len_ - static_cast<int64_t>(seq.size())});
  std::vector<int64_t> drafts;
  if (k > 0 && propose_tokens_ > 0) {
    drafts = propose_in_one_call(seq, k);
  } else if (k > 0) {
    std::string error;
    if (!loop_.start({seq, 0.0f, 0, k, eos_, nullptr, -1}, &error))
      throw std::runtime_error("the draft model refused the sequence: " + error);
    for (int64_t i = 0; i < k; ++i) {
      int64_t token = 0;
      if (!loop_.next(nullptr, &token, &error)) throw std::runtime_error("the draft model failed: " + error);
      drafts.push_back(token);
      if (loop_.finish() != Finish::None) break;  // an end-of-sequence token is the last draft (as in Python)
    }
  }
  // k drafts took k calls, and one more for a pipelined program (its calls return the call before's token).
  // A --propose-tokens program made them in one call.
  const int64_t calls = propose_tokens_ > 0 ? (drafts.empty() ? 0 : 1)
                                            : static_cast<int64_t>(drafts.size()) + (!drafts.empty() && pipelined_ ? 1 : 0);
  const double done = now_s();
  pacing_.end(seq, !output.empty(), drafts, calls, done - started, done);
  return drafts;
}

}  // namespace etmlx
