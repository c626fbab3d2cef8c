#include "decode_loop.h"

#include <chrono>
#include <cstdio>

namespace etmlx {

const char kPipelinedMaskHint[] =
    "structured output needs an unpipelined program (each step's mask depends on the token before it): "
    "export with --sampler ...,mask (unpipelined by default) or --no-pipeline";

namespace {

DecodeRowsConfig config_for(int64_t batch, int64_t max_seq_len, bool pipelined, int64_t draft_tokens,
                            bool prompt_cache, bool ring, int64_t propose_tokens) {
  DecodeRowsConfig config;
  config.batch = batch;
  config.max_seq_len = max_seq_len;
  config.pipelined = pipelined;
  config.draft_tokens = draft_tokens;
  config.propose_tokens = propose_tokens;
  config.ring = ring && draft_tokens == 0;  // draft-verifying programs keep full-length caches
  config.prompt_cache = prompt_cache;  // the idle rows write at position 0 either way: only row 0 is reused
  return config;
}

}  // namespace

DecodeLoop::DecodeLoop(executorch::extension::module::Module& module, std::string method, StepInputs& inputs,
                       bool pipelined, int64_t max_seq_len, int64_t draft_tokens, bool prompt_cache, bool ring,
                       int64_t propose_tokens)
    : module_(module),
      method_(std::move(method)),
      inputs_(inputs),
      pipelined_(pipelined),
      draft_tokens_(draft_tokens),
      prompt_cache_(prompt_cache),
      rows_(config_for(inputs.batch(), max_seq_len, pipelined, draft_tokens, prompt_cache, ring, propose_tokens)) {}

bool DecodeLoop::start(const Sequence& sequence, std::string* error) {
  RowRequest request;
  request.prompt = sequence.prompt;
  request.max_tokens = sequence.max_tokens;
  request.seed = sequence.seed;
  request.stop_at_eos = !sequence.eos.empty();
  request.prefill_chunk = sequence.prefill_chunk;
  DecodeRowsConfig config = rows_.config();
  config.eos = sequence.eos;
  try {
    if (prompt_cache_ && config.eos == rows_.config().eos) {
      if (rows_.row(0)) rows_.end(0);  // a sequence left unfinished: its row's cache keeps what it wrote
      cached_ = rows_.start(0, std::move(request), /*reuse=*/true, nullptr);
    } else {
      rows_ = DecodeRows(config);  // a fresh sequence: nothing of the last one carries over
      cached_ = rows_.start(0, std::move(request), /*reuse=*/false, nullptr);
    }
  } catch (const std::exception& e) {
    *error = e.what();
    return false;
  }
  if (sequence.draft && draft_tokens_ == 0) {
    *error = "drafts need a draft-verifying program (etmlx export --draft-tokens K)";
    return false;
  }
  if (sequence.max_drafts > draft_tokens_) {
    *error = "at most " + std::to_string(draft_tokens_) + " drafts per call (the program's K), not " +
             std::to_string(sequence.max_drafts);
    return false;
  }
  source_ = sequence.draft;
  budget_.reset();
  if (draft_tokens_ > 0)
    budget_.emplace(sequence.max_drafts >= 0 ? sequence.max_drafts : draft_tokens_);
  pending_.clear();
  stats_ = {};
  temperature_ = sequence.temperature;
  finish_ = Finish::None;
  failure_ = Failure::None;
  outputs_.clear();
  calls_.clear();
  return true;
}

bool DecodeLoop::call(const std::vector<int32_t>* mask_row, std::string* error) {
  using Clock = std::chrono::steady_clock;
  const CallLayout layout = rows_.layout();
  auto values = inputs_.build(layout, temperature_, mask_row);
  const auto t0 = Clock::now();
  auto out = module_.execute(method_, values);
  if (!out.ok()) {
    char code[16];
    std::snprintf(code, sizeof(code), "0x%x", static_cast<unsigned>(out.error()));
    *error = "step " + std::to_string(layout.steps[0]) + " failed (error " + code + ")";
    return false;
  }
  calls_.push_back({layout.first[0] != 0, std::chrono::duration<double>(Clock::now() - t0).count()});
  outputs_ = std::move(*out);
  return true;
}

const int64_t* DecodeLoop::output_ids(size_t index, const char* what, std::string* error) const {
  if (outputs_.size() <= index || !outputs_[index].isTensor()) {
    *error = std::string("the program's output ") + std::to_string(index) + " is not a tensor of " + what;
    return nullptr;
  }
  const auto& ids = outputs_[index].toTensor();
  if (ids.scalar_type() != executorch::aten::ScalarType::Long || ids.numel() < inputs_.batch()) {
    *error = std::string("the program's output ") + std::to_string(index) + " is not int64 " + what + ", one per row";
    return nullptr;
  }
  return ids.const_data_ptr<int64_t>();
}

bool DecodeLoop::next(const std::vector<int32_t>* mask_row, int64_t* token, std::string* error) {
  calls_.clear();
  if (pending_.empty() && !rows_.row(0)) {
    *error = "the sequence has ended";
    return false;
  }
  if (pipelined_ && mask_row) {
    *error = kPipelinedMaskHint;
    return false;
  }
  while (pending_.empty()) {  // a pipelined program's prefill returns no token of its own: one more call
    std::vector<int64_t> drafts;
    try {
      if (source_ && budget_) {
        const RowState& row = *rows_.row(0);
        const int64_t k = rows_.ask(0, budget_->size());  // 0 while the row's token is in flight
        if (k > 0) drafts = source_->propose(row.request.prompt, row.output, k);
        if (static_cast<int64_t>(drafts.size()) > k) drafts.resize(static_cast<size_t>(k));
      }
      if (draft_tokens_ > 0) rows_.set_drafts(0, drafts);
    } catch (const std::exception& e) {
      *error = std::string("drafting failed: ") + e.what();
      return false;
    }
    if (!call(mask_row, error)) return false;
    ++stats_.calls;
    const int64_t* accepted = nullptr;
    if (draft_tokens_ > 0 && !(accepted = output_ids(0, "accepted draft counts", error))) return false;
    const int64_t* ids = output_ids(draft_tokens_ > 0 ? 1 : 0, "token ids", error);
    if (!ids) return false;
    const int64_t* fed = nullptr;  // a pipelined draft program's third output
    if (rows_.pipelined_drafts() && !(fed = output_ids(2, "fed tokens", error))) return false;
    if (budget_) budget_->update(static_cast<int64_t>(drafts.size()), accepted[0]);
    for (const RowEvent& event : rows_.read(ids, accepted, nullptr, fed)) {
      pending_.push_back(event);  // row 0 is the only request
      stats_.proposed = event.proposed;
      stats_.accepted = event.accepted;
    }
  }
  const RowEvent event = pending_.front();
  pending_.pop_front();
  *token = event.token;
  finish_ = event.finish;
  failure_ = event.failure;
  return true;
}

}  // namespace etmlx
