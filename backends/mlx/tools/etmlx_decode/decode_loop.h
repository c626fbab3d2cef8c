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
//
// Draft-verifying program (metadata "draft_tokens": K; llm/decoder/speculative_head.py): before each
// call the sequence's draft source (runtime/draft_sources.h) proposes as many drafts as its budget asks
// for and the call has room for; the call returns how many it accepted (output 0) and the next token
// (output 1), so it brings n + 1 tokens, which next() hands out one at a time. The tokens are the plain
// program's, whatever the source proposes.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/runtime/core/evalue.h>

#include "decode_rows.h"
#include "draft_sources.h"
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
    // A draft-verifying program: where drafts come from (none: calls without drafts), and at most how
    // many per call (-1: the program's K).
    std::shared_ptr<DraftSource> draft;
    int64_t max_drafts = -1;
    // > 0: the prompt is prefilled in calls of at most this many tokens (decode_rows.h RowRequest: not for a
    // program with drafts or proposals; the caller leaves it 0 for image prompts).
    int64_t prefill_chunk = 0;
  };
  struct DraftStats {
    int64_t calls = 0;     // program calls, the prefill included
    int64_t proposed = 0;  // drafts sent for verification
    int64_t accepted = 0;  // of those, accepted
  };

  // `draft_tokens`: K of a draft-verifying program (0 for a plain one); `propose_tokens`: K of a proposing one.
  // With `prompt_cache`, row 0's KV cache
  // outlives its sequence: a sequence that starts with tokens it holds prefills only the rest (decode_rows.h's
  // row caches; `ring`: some layer keeps a sliding-window ring, whose row is reused only where positions
  // continue). A draft model's loop (model_draft.h) runs so; without it each sequence prefills its prompt.
  DecodeLoop(executorch::extension::module::Module& module, std::string method, StepInputs& inputs,
             bool pipelined, int64_t max_seq_len, int64_t draft_tokens = 0, bool prompt_cache = false,
             bool ring = true, int64_t propose_tokens = 0);

  bool pipelined() const { return pipelined_; }

  // Starts a sequence (ending the last one, if it still runs). Makes no call. False (with `error`) for a
  // sequence the rules refuse.
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
  // The calls the last next() made, in order (none when it handed out a token an earlier call brought).
  const std::vector<Call>& calls() const { return calls_; }
  // Tokens the calls so far brought that next() has not handed out yet (accepted drafts).
  int64_t pending() const { return static_cast<int64_t>(pending_.size()); }
  DraftStats draft_stats() const { return stats_; }
  // Prompt tokens the sequence did not prefill: row 0's cache held them (with prompt_cache).
  int64_t cached() const { return cached_; }

 private:
  bool call(const std::vector<int32_t>* mask_row, std::string* error);
  // The token ids (and accepted counts) of the last call's outputs, checked; nullptr with `error` set.
  const int64_t* output_ids(size_t index, const char* what, std::string* error) const;

  executorch::extension::module::Module& module_;
  std::string method_;
  StepInputs& inputs_;
  bool pipelined_;
  int64_t draft_tokens_;
  bool prompt_cache_;
  DecodeRows rows_;
  std::shared_ptr<DraftSource> source_;
  std::optional<DraftBudget> budget_;
  std::deque<RowEvent> pending_;
  DraftStats stats_;
  int64_t cached_ = 0;
  float temperature_ = 0;
  Finish finish_ = Finish::None;
  Failure failure_ = Failure::None;
  std::vector<executorch::runtime::EValue> outputs_;
  std::vector<Call> calls_;
};

// Why a pipelined program cannot take per-step masks, and the fix (meta.py PIPELINED_HINT).
extern const char kPipelinedMaskHint[];

}  // namespace etmlx
