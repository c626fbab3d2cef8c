#include "decode_loop.h"

#include <chrono>
#include <cstdio>

namespace etmlx {

const char kPipelinedMaskHint[] =
    "structured output needs an unpipelined program (each step's mask depends on the token before it): "
    "export with --sampler ...,mask (unpipelined by default) or --no-pipeline";

void DecodeLoop::start(std::vector<int64_t> prompt, float temperature, int64_t seed) {
  prompt_ = std::move(prompt);
  temperature_ = temperature;
  seed_ = seed;
  produced_ = 0;
  outputs_.clear();
  calls_.clear();
}

bool DecodeLoop::call(const std::vector<int64_t>& tokens, int64_t position, int64_t step,
                      const std::vector<int32_t>* mask_row, std::string* error) {
  using Clock = std::chrono::steady_clock;
  auto values = inputs_.build(tokens, position, temperature_, seed_ + step, step == 0, mask_row);
  const auto t0 = Clock::now();
  auto out = module_.execute(method_, values);
  if (!out.ok()) {
    char code[16];
    std::snprintf(code, sizeof(code), "0x%x", static_cast<unsigned>(out.error()));
    *error = "step " + std::to_string(step) + " failed (error " + code + ")";
    return false;
  }
  calls_.push_back({step == 0, std::chrono::duration<double>(Clock::now() - t0).count()});
  outputs_ = std::move(*out);
  return true;
}

bool DecodeLoop::next(const std::vector<int32_t>* mask_row, int64_t* token, std::string* error) {
  calls_.clear();
  const auto n = static_cast<int64_t>(prompt_.size());
  const int64_t k = produced_;
  if (pipelined_) {
    if (mask_row) {
      *error = kPipelinedMaskHint;
      return false;
    }
    // The prefill's outputs are the (empty) previous call's; token k comes back from step k + 1.
    if (k == 0 && !call(prompt_, 0, 0, nullptr, error)) return false;
    if (!call({kFedBack}, n + k, k + 1, nullptr, error)) return false;
  } else if (k == 0) {
    if (!call(prompt_, 0, 0, mask_row, error)) return false;
  } else if (!call({last_token_}, n + k - 1, k, mask_row, error)) {
    return false;
  }
  if (outputs_.empty() || !outputs_[0].isTensor()) {
    *error = "the program's first output is not a tensor of token ids";
    return false;
  }
  const auto& ids = outputs_[0].toTensor();
  if (ids.scalar_type() != executorch::aten::ScalarType::Long || ids.numel() < 1) {
    *error = "the program's first output is not int64 token ids";
    return false;
  }
  *token = last_token_ = ids.const_data_ptr<int64_t>()[0];
  ++produced_;
  return true;
}

}  // namespace etmlx
