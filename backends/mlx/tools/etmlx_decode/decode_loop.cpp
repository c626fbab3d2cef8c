#include "decode_loop.h"

#include <chrono>
#include <cstdio>

namespace etmlx {

const char kPipelinedMaskHint[] =
    "structured output needs an unpipelined program (each step's mask depends on the token before it): "
    "export with --sampler ...,mask (unpipelined by default) or --no-pipeline";

namespace {

DecodeRowsConfig config_for(int64_t batch, int64_t max_seq_len, bool pipelined) {
  DecodeRowsConfig config;
  config.batch = batch;
  config.max_seq_len = max_seq_len;
  config.pipelined = pipelined;
  config.prompt_cache = false;  // one sequence per start(): the idle rows write at position 0
  return config;
}

}  // namespace

DecodeLoop::DecodeLoop(executorch::extension::module::Module& module, std::string method, StepInputs& inputs,
                       bool pipelined, int64_t max_seq_len)
    : module_(module),
      method_(std::move(method)),
      inputs_(inputs),
      pipelined_(pipelined),
      rows_(config_for(inputs.batch(), max_seq_len, pipelined)) {}

bool DecodeLoop::start(const Sequence& sequence, std::string* error) {
  RowRequest request;
  request.prompt = sequence.prompt;
  request.max_tokens = sequence.max_tokens;
  request.seed = sequence.seed;
  request.stop_at_eos = !sequence.eos.empty();
  DecodeRowsConfig config = rows_.config();
  config.eos = sequence.eos;
  try {
    rows_ = DecodeRows(config);  // a fresh sequence: nothing of the last one carries over
    rows_.start(0, std::move(request), /*reuse=*/false, nullptr);
  } catch (const std::exception& e) {
    *error = e.what();
    return false;
  }
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

bool DecodeLoop::next(const std::vector<int32_t>* mask_row, int64_t* token, std::string* error) {
  calls_.clear();
  if (!rows_.row(0)) {
    *error = "the sequence has ended";
    return false;
  }
  if (pipelined_ && mask_row) {
    *error = kPipelinedMaskHint;
    return false;
  }
  for (;;) {  // a pipelined program's prefill returns no token of its own: one more call
    if (!call(mask_row, error)) return false;
    if (outputs_.empty() || !outputs_[0].isTensor()) {
      *error = "the program's first output is not a tensor of token ids";
      return false;
    }
    const auto& ids = outputs_[0].toTensor();
    if (ids.scalar_type() != executorch::aten::ScalarType::Long || ids.numel() < inputs_.batch()) {
      *error = "the program's first output is not int64 token ids, one per row";
      return false;
    }
    const auto events = rows_.read(ids.const_data_ptr<int64_t>(), nullptr, nullptr);
    if (events.empty()) continue;
    const RowEvent& event = events.front();  // row 0 is the only request
    *token = event.token;
    finish_ = event.finish;
    failure_ = event.failure;
    return true;
  }
}

}  // namespace etmlx
