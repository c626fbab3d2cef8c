// Where drafted tokens come from, for draft-verifying programs (`etmlx export --draft-tokens K`), and how
// many to ask for: one implementation for every decode loop. The C++ etmlx_decode / etmlx_bench use it
// directly, the Python engine through ctypes (decode_rows_api.cpp, llm/decoder/draft_sources.py).
// A source proposes up to k tokens that it expects to follow prompt + output; the program verifies them
// (sampler/draft_verification.py), so a wrong guess costs speed, never correctness.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace etmlx {

class DraftSource {
 public:
  virtual ~DraftSource() = default;
  // Up to k tokens expected after prompt + output (none for k < 1).
  virtual std::vector<int64_t> propose(const std::vector<int64_t>& prompt, const std::vector<int64_t>& output,
                                       int64_t k) = 0;
};

// Prompt lookup (llama.cpp's lookup decoding, vLLM's n-gram proposer): the last n tokens of the sequence
// found earlier in it (n from max_ngram down to min_ngram, the most recent match), and what followed them
// there. Hits on text that repeats its context: code edits, quotes, extraction, summaries.
class NgramDraft final : public DraftSource {
 public:
  // The defaults, read by the Python NgramDraft (llm/decoder/draft_sources.py) through the C API, so
  // `etmlx generate --draft ngram` and `etmlx_decode --draft ngram` look up the same n-grams.
  static constexpr int64_t kMaxNgram = 3, kMinNgram = 1;
  // Throws std::invalid_argument unless 1 <= min_ngram <= max_ngram.
  explicit NgramDraft(int64_t max_ngram = kMaxNgram, int64_t min_ngram = kMinNgram);
  std::vector<int64_t> propose(const std::vector<int64_t>& prompt, const std::vector<int64_t>& output,
                               int64_t k) override;

 private:
  int64_t max_ngram_, min_ngram_;
};

// Predicted Outputs (OpenAI's `prediction`): the caller's expected output. A cursor follows the output
// through the prediction; where they diverge, it re-aligns on the prediction's next match of the output's
// last tokens (an edited line in an otherwise unchanged file), or waits until one appears.
class PredictionDraft final : public DraftSource {
 public:
  static constexpr int64_t kAlign = 3;  // output tokens matched to re-align (fewer where the output is shorter)
  // Throws std::invalid_argument for a negative token id.
  explicit PredictionDraft(std::vector<int64_t> prediction);
  std::vector<int64_t> propose(const std::vector<int64_t>& prompt, const std::vector<int64_t>& output,
                               int64_t k) override;

 private:
  void advance(const std::vector<int64_t>& output);
  // The prediction's first occurrence of output[from, to) at or after the anchor, else its first anywhere; -1: none.
  int64_t next_match(const std::vector<int64_t>& output, size_t from, size_t to) const;

  std::vector<int64_t> prediction_;
  int64_t cursor_ = 0;  // where the next output token should be in the prediction; -1: lost
  int64_t anchor_ = 0;  // the last place the cursor was aligned: re-alignment looks after it first
  size_t seen_ = 0;     // output tokens the cursor has accounted for
};

// How many drafts to ask for next, from the acceptance seen so far.
//
// Drafts are Bernoulli trials until the first rejection: a call accepting n of k drafts saw n successes and,
// when n < k, one failure. With a (decayed) acceptance estimate a, k drafts yield 1 + a + ... + a^k tokens
// per call at a cost of about 1 + draft_cost * k calls' time; the budget takes the k <= K that maximises
// their ratio. When that is 0 (a source that does not hit), it still probes one draft every kProbeEvery
// calls, so a source that starts hitting is noticed; each probe in a row that finds nothing doubles that
// interval (up to kProbeEvery << kMostDoublings calls), and an accepted draft resets it: a probe is a verifying
// call, which on a small model costs up to two plain calls, so probing a source that never hits every 16 calls
// would take 3-6% of the time by itself. A probe that costs more (a draft model's call: proposal_cost) also
// comes rarer, so that probing stays under kProbeShare.
class DraftBudget {
 public:
  // One more drafted token's share of a decode call's time (the per-call overhead dominates).
  static constexpr double kDraftCost = 0.1;
  static constexpr double kDecay = 0.8;
  static constexpr int64_t kProbeEvery = 16;
  static constexpr double kProbeShare = 0.02;  // the most of the calls' time that probing may take
  static constexpr int kMostDoublings = 4;     // a dead source is probed at least every 256 calls

  // Throws std::invalid_argument for max_drafts < 0 or a negative (or NaN) draft_cost.
  explicit DraftBudget(int64_t max_drafts, double draft_cost = kDraftCost);

  double rate() const { return trials_ > 0 ? hits_ / trials_ : 0.0; }
  int64_t max_drafts() const { return max_drafts_; }
  double draft_cost() const { return draft_cost_; }
  void set_draft_cost(double cost);  // a draft model's measured cost per draft (llm/decoder/draft_model.py)
  // A cost per proposal, whatever its size, in the same unit (a draft model whose program proposes all its
  // drafts in one call: llm/decoder/proposer.py); 0 by default. Throws as set_draft_cost does.
  void set_proposal_cost(double cost);
  double proposal_cost() const { return proposal_cost_; }
  int64_t size() const;
  // Calls without drafts between two probes: kProbeEvery, or more where one probe costs more than
  // kProbeShare of that many calls; doubled for each probe in a row that found nothing.
  int64_t probe_every() const;
  // A call carried `proposed` drafts and `accepted` of them were taken (clamped into [0, proposed]).
  void update(int64_t proposed, int64_t accepted);

 private:
  int64_t max_drafts_;
  double draft_cost_;
  double proposal_cost_ = 0.0;
  double hits_ = 2.0, trials_ = 2.0;  // optimistic start: a fresh source gets the full budget at once
  int64_t calls_without_ = 0;
  int64_t failed_probes_ = 0;     // probes in a row whose drafts were all rejected
  mutable bool probing_ = false;  // the last size() asked for a probe (update() then learns its fate)
};

// A draft model's proposals (a small decoder program with the target's vocabulary, run greedily: the Python
// llm/decoder/draft_model.py, the C++ tools/etmlx_decode/model_draft.h): how many drafts to make, learned from
// what became of the last proposal. A draft costs its draft program call besides its share of the verifying
// call, both in the budget's unit, the time a plain call (no drafts) takes per token: the budget's cost per draft
// is the verifying call's cost per draft (DraftBudget::kDraftCost until a verifying call and a plain one have been
// timed) plus a draft call's time over that unit (running averages), or plus a fixed `cost` given up front.
// Until a plain call is timed, the unit is the time between two proposals (the verifying call: a draft then
// looks cheaper than it is, so a draft model starts out drafting; once it stops, the plain calls it then sees
// set the unit right). The acceptance it feeds the budget is read off the sequence: how many of the last drafts
// the next proposal's sequence continues with. A draft program that proposes all its drafts in one call
// (`one_call`: `etmlx export --propose-tokens K`) costs that call's share per proposal instead
// (DraftBudget::set_proposal_cost), plus the verifying call's cost per draft.
class DraftModelPacing {
 public:
  static constexpr double kSmoothing = 0.8;  // weight of the earlier calls in the running averages

  // `cost`: a draft call's time over a target call's, fixed (>= 0); nullopt: measured as it runs.
  DraftModelPacing(int64_t max_drafts, std::optional<double> cost, bool one_call = false);

  // Before proposing after `seq` (the whole sequence so far) at time `now` (seconds, any steady clock):
  // learns from the last proposal when `seq` continues its sequence; returns the most drafts to make.
  int64_t begin(const std::vector<int64_t>& seq, double now);
  // After: the proposal's drafts, the draft program calls and seconds they took (`has_output`: false for a
  // sequence's first proposal, whose calls prefill its prompt and are not timed as draft calls).
  void end(const std::vector<int64_t>& seq, bool has_output, const std::vector<int64_t>& drafts, int64_t calls,
           double seconds, double now);

  const DraftBudget& budget() const { return budget_; }
  int64_t calls() const { return calls_; }      // draft program calls, every proposal together
  double seconds() const { return seconds_; }   // their time

 private:
  DraftBudget budget_;
  std::optional<double> cost_;
  bool one_call_;
  std::optional<double> draft_s_, target_s_;  // one draft call; the time between two proposals
  std::optional<double> plain_token_s_;       // after a proposal of no drafts: that time per token it brought
  std::optional<double> verify_cost_;         // a verifying call's time per draft beyond a plain call, in units
  std::vector<int64_t> last_seq_, last_drafts_;
  double last_at_ = 0;
  bool has_last_ = false;
  bool last_had_output_ = false;  // the last proposal came after the prompt's prefill
  int64_t calls_ = 0;
  double seconds_ = 0;
};

}  // namespace etmlx
