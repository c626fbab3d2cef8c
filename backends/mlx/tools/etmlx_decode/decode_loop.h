// One sequence decoded on a decoder program, for etmlx_decode and etmlx_bench: a thin driver over the
// decode-step rules (runtime/decode_rows.h), the same rules the Python engine and the server run. The
// sequence is row 0; a program's other rows idle.
//
// Unpipelined program: call 0 is the prefill (the prompt at position 0, step 0) and returns token 0;
// call k > 0 feeds token k-1 at position len(prompt) + k - 1 (step k) and returns token k.
//
// Pipelined program (metadata "pipelined": true; backends/mlx/llm/decoder/pipelined.py): each call
// returns the PREVIOUS call's outputs, and a token input < 0 feeds the token the row sampled at the
// previous call, kept on the device. The prefill returns nothing meaningful; token k comes from call
// k + 1. Step k samples with seed S + k either way, so both programs give the same tokens; the runtime
// waits only for a call's outputs, so the device computes step k + 1 while the host handles token k.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/runtime/core/evalue.h>

#include "decode_rows.h"
#include "step_inputs.h"

namespace etmlx {

class DecodeLoop {
 public:
  struct Call {
    bool prefill;    // the call over the prompt
    double seconds;  // wall clock, until its outputs are on the host
  };
  struct Sequence {
    std::vector<int64_t> prompt;
    float temperature = 0;
    int64_t seed = 0;          // step k samples with seed + k
    int64_t max_tokens = 1;    // the token that reaches it ends the sequence ("length")
    std::vector<int64_t> eos;  // a token among them ends it ("stop"); empty: none does
  };

  DecodeLoop(executorch::extension::module::Module& module, std::string method, StepInputs& inputs,
             bool pipelined, int64_t max_seq_len);

  bool pipelined() const { return pipelined_; }

  // Starts a sequence. Makes no call. False (with `error`) for a sequence the rules refuse.
  bool start(const Sequence& sequence, std::string* error);

  // Makes the calls that bring the sequence's next token to the host: one call, or two for a pipelined
  // program's token 0 (the prefill, then the call that returns its token). `mask_row`: row 0's
  // allowed_mask words for that token's step (unpipelined programs only; see kPipelinedMaskHint).
  // Returns the token (output 0, row 0; finish() says whether it ended the sequence); the program's
  // outputs (outputs()) stay valid until the next call. On failure returns false with `error` set.
  bool next(const std::vector<int32_t>* mask_row, int64_t* token, std::string* error);

  // How the last token ended the sequence (Finish::None: it goes on), and why when Finish::Error.
  Finish finish() const { return finish_; }
  Failure failure() const { return failure_; }

  // The outputs of the call that returned the last token.
  const std::vector<executorch::runtime::EValue>& outputs() const { return outputs_; }
  // The calls the last next() made, in order.
  const std::vector<Call>& calls() const { return calls_; }

 private:
  bool call(const std::vector<int32_t>* mask_row, std::string* error);

  executorch::extension::module::Module& module_;
  std::string method_;
  StepInputs& inputs_;
  bool pipelined_;
  DecodeRows rows_;
  float temperature_ = 0;
  Finish finish_ = Finish::None;
  Failure failure_ = Failure::None;
  std::vector<executorch::runtime::EValue> outputs_;
  std::vector<Call> calls_;
};

// Why a pipelined program cannot take per-step masks, and the fix (meta.py PIPELINED_HINT).
extern const char kPipelinedMaskHint[];

}  // namespace etmlx
