// The calls that decode one sequence on a decoder program, shared by
// etmlx_decode and etmlx_bench so both follow the same protocol.
//
// Unpipelined program: call 0 is the prefill (the prompt at position 0, step
// 0) and returns token 0; call k > 0 feeds token k-1 at position
// len(prompt) + k - 1 (step k) and returns token k.
//
// Pipelined program (metadata "pipelined": true; backends/mlx/llm/decoder/
// pipelined.py): each call returns the PREVIOUS call's outputs, and a token
// input < 0 feeds the token the row sampled at the previous call, kept on the
// device. The prefill (call 0, step 0) returns nothing meaningful; token k
// comes from call k + 1, which feeds -1 at position len(prompt) + k (step
// k + 1). Step k samples with seed S + k either way, so both programs give the
// same tokens; the runtime waits only for a call's outputs, so the device
// computes step k + 1 while the host handles token k.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/runtime/core/evalue.h>

#include "step_inputs.h"

namespace etmlx {

// The token input of a pipelined program that means "the token this row sampled last" (meta.py FED_BACK).
constexpr int64_t kFedBack = -1;

class DecodeLoop {
 public:
  struct Call {
    bool prefill;    // the call over the prompt
    double seconds;  // wall clock, until its outputs are on the host
  };

  DecodeLoop(executorch::extension::module::Module& module, std::string method, StepInputs& inputs,
             bool pipelined)
      : module_(module), method_(std::move(method)), inputs_(inputs), pipelined_(pipelined) {}

  bool pipelined() const { return pipelined_; }

  // Starts a sequence over `prompt`, step k sampled at `temperature` with seed `seed` + k. Makes no call.
  void start(std::vector<int64_t> prompt, float temperature, int64_t seed);

  // Makes the calls that bring the sequence's next token to the host (token k at the k-th next()
  // since start()): one call, or two for a pipelined program's token 0 (the prefill, then the call
  // that returns its token). `mask_row`: row 0's allowed_mask words for that token's step
  // (unpipelined programs only; see kPipelinedMaskHint). Returns the token (output 0, row 0); the
  // program's outputs (outputs()) stay valid until the next call. On failure returns false with
  // `error` set.
  bool next(const std::vector<int32_t>* mask_row, int64_t* token, std::string* error);

  // The outputs of the call that returned the last token.
  const std::vector<executorch::runtime::EValue>& outputs() const { return outputs_; }
  // The calls the last next() made, in order.
  const std::vector<Call>& calls() const { return calls_; }

 private:
  bool call(const std::vector<int64_t>& tokens, int64_t position, int64_t step, const std::vector<int32_t>* mask_row,
            std::string* error);

  executorch::extension::module::Module& module_;
  std::string method_;
  StepInputs& inputs_;
  bool pipelined_;
  std::vector<int64_t> prompt_;
  float temperature_ = 0;
  int64_t seed_ = 0;
  int64_t produced_ = 0;  // tokens returned since start()
  int64_t last_token_ = 0;
  std::vector<executorch::runtime::EValue> outputs_;
  std::vector<Call> calls_;
};

// Why a pipelined program cannot take per-step masks, and the fix (meta.py PIPELINED_HINT).
extern const char kPipelinedMaskHint[];

}  // namespace etmlx
