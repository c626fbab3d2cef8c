// A draft model as the draft source of etmlx_decode and etmlx_bench (`--draft-model D.pte`): the C++ twin of
// the Python API's DraftModel (llm/decoder/draft_model.py). D.pte is a plain decoder program with the target's
// vocabulary; it proposes the next k tokens greedily, on row 0 of its own DecodeLoop with the prompt cache on,
// so each proposal feeds only the tokens its cache does not hold yet (the target's accepted drafts beyond the
// last ones it fed, and its correction or bonus token); the entries of rejected drafts are overwritten. How
// many drafts to make is the core's DraftModelPacing (runtime/draft_sources.h), as in Python. A program exported
// with `--propose-tokens K` (llm/decoder/proposer.py) returns K greedy tokens per call: a proposal is one call.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>

#include "decode_loop.h"
#include "draft_sources.h"
#include "step_inputs.h"

namespace etmlx {

class ModelDraft final : public DraftSource {
 public:
  // Loads `pte` for a target with `target_vocab` tokens taking up to `max_drafts` per call; `cost`: a draft
  // call's time over a target call's, fixed (nullopt: measured). nullptr with a one-line `error` for a program
  // that cannot draft: not a loadable decoder program, a draft-verifying one, another vocabulary.
  static std::unique_ptr<ModelDraft> load(const std::string& pte, std::optional<int64_t> target_vocab,
                                          int64_t max_drafts, std::optional<double> cost, std::string* error);

  // Throws std::runtime_error when a draft program call fails.
  std::vector<int64_t> propose(const std::vector<int64_t>& prompt, const std::vector<int64_t>& output,
                               int64_t k) override;

  const DraftModelPacing& pacing() const { return pacing_; }

 private:
  ModelDraft(std::unique_ptr<executorch::extension::module::Module> module, std::string method,
             std::unique_ptr<StepInputs> inputs, bool pipelined, bool ring, int64_t max_seq_len,
             std::vector<int64_t> eos, int64_t max_drafts, std::optional<double> cost, int64_t propose_tokens);
  // One call of a --propose-tokens program: its first k tokens (fewer at the cache's end or an eos).
  std::vector<int64_t> propose_in_one_call(const std::vector<int64_t>& seq, int64_t k);

  std::unique_ptr<executorch::extension::module::Module> module_;
  std::unique_ptr<StepInputs> inputs_;
  int64_t max_seq_len_;
  std::vector<int64_t> eos_;  // the draft program's end-of-sequence ids: a proposal ends at one
  bool pipelined_;
  int64_t propose_tokens_;  // K of a --propose-tokens program, 0 for a plain one
  DecodeLoop loop_;
  DraftModelPacing pacing_;
};

}  // namespace etmlx
