#include "draft_sources.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "decode_rows.h"  // common_prefix

namespace etmlx {

namespace {

// The largest j <= end - n where haystack[j, j + n) equals haystack's last n tokens; -1: none.
int64_t last_match(const std::vector<int64_t>& haystack, int64_t n, int64_t end) {
  const auto needle = haystack.end() - n;
  for (int64_t j = end - n; j >= 0; --j) {
    if (std::equal(needle, haystack.end(), haystack.begin() + j)) return j;
  }
  return -1;
}

}  // namespace

NgramDraft::NgramDraft(int64_t max_ngram, int64_t min_ngram) : max_ngram_(max_ngram), min_ngram_(min_ngram) {
  if (max_ngram < 1) throw std::invalid_argument("max_ngram must be an int >= 1, got " + std::to_string(max_ngram));
  if (min_ngram < 1) throw std::invalid_argument("min_ngram must be an int >= 1, got " + std::to_string(min_ngram));
  if (min_ngram > max_ngram)
    throw std::invalid_argument("min_ngram " + std::to_string(min_ngram) + " exceeds max_ngram " +
                                std::to_string(max_ngram));
}

std::vector<int64_t> NgramDraft::propose(const std::vector<int64_t>& prompt, const std::vector<int64_t>& output,
                                         int64_t k) {
  if (k < 1) return {};
  std::vector<int64_t> seq(prompt);
  seq.insert(seq.end(), output.begin(), output.end());
  const auto size = static_cast<int64_t>(seq.size());
  for (int64_t n = std::min(max_ngram_, size - 1); n >= min_ngram_; --n) {
    // An earlier occurrence of the last n tokens (not the suffix itself), with something after it.
    const int64_t j = last_match(seq, n, size - 1);
    if (j >= 0) return {seq.begin() + j + n, seq.begin() + std::min(j + n + k, size)};
  }
  return {};
}

PredictionDraft::PredictionDraft(std::vector<int64_t> prediction) : prediction_(std::move(prediction)) {
  for (int64_t t : prediction_)
    if (t < 0) throw std::invalid_argument("the prediction must be token ids (ints >= 0)");
}

int64_t PredictionDraft::next_match(const std::vector<int64_t>& output, size_t from, size_t to) const {
  const auto n = static_cast<int64_t>(to - from);
  const auto size = static_cast<int64_t>(prediction_.size());
  for (int64_t start : {anchor_, int64_t{0}}) {
    for (int64_t j = start; j + n <= size; ++j) {
      if (std::equal(output.begin() + static_cast<std::ptrdiff_t>(from), output.begin() + static_cast<std::ptrdiff_t>(to),
                     prediction_.begin() + j))
        return j;
    }
  }
  return -1;
}

void PredictionDraft::advance(const std::vector<int64_t>& output) {
  const auto size = static_cast<int64_t>(prediction_.size());
  for (size_t i = seen_; i < output.size(); ++i) {
    if (cursor_ >= 0 && cursor_ < size && prediction_[static_cast<size_t>(cursor_)] == output[i]) {
      anchor_ = ++cursor_;
    } else {
      cursor_ = -1;
    }
  }
  seen_ = output.size();
  if (cursor_ < 0 && !output.empty()) {
    for (auto n = std::min<size_t>(kAlign, output.size()); n > 0; --n) {
      const int64_t j = next_match(output, output.size() - n, output.size());
      if (j >= 0) {
        cursor_ = j + static_cast<int64_t>(n);
        break;
      }
    }
  }
}

std::vector<int64_t> PredictionDraft::propose(const std::vector<int64_t>& prompt, const std::vector<int64_t>& output,
                                              int64_t k) {
  (void)prompt;
  advance(output);
  if (k < 1 || cursor_ < 0) return {};
  const auto begin = std::min(static_cast<size_t>(cursor_), prediction_.size());
  const auto end = std::min(begin + static_cast<size_t>(k), prediction_.size());
  return {prediction_.begin() + static_cast<std::ptrdiff_t>(begin), prediction_.begin() + static_cast<std::ptrdiff_t>(end)};
}

DraftBudget::DraftBudget(int64_t max_drafts, double draft_cost) : max_drafts_(max_drafts), draft_cost_(kDraftCost) {
  if (max_drafts < 0) throw std::invalid_argument("max_drafts must be >= 0, got " + std::to_string(max_drafts));
  set_draft_cost(draft_cost);
}

void DraftBudget::set_draft_cost(double cost) {
  if (!(cost >= 0.0) || std::isinf(cost)) throw std::invalid_argument("a draft's cost must be a finite number >= 0");
  draft_cost_ = cost;
}

void DraftBudget::set_proposal_cost(double cost) {
  if (!(cost >= 0.0) || std::isinf(cost)) throw std::invalid_argument("a proposal's cost must be a finite number >= 0");
  proposal_cost_ = cost;
}

int64_t DraftBudget::size() const {
  const double a = rate();
  int64_t best = 0;
  double best_value = 1.0, expected = 1.0;
  for (int64_t k = 1; k <= max_drafts_; ++k) {
    expected += std::pow(a, static_cast<double>(k));
    const double value = expected / (1.0 + proposal_cost_ + draft_cost_ * static_cast<double>(k));
    if (value > best_value) {
      best = k;
      best_value = value;
    }
  }
  probing_ = best == 0 && calls_without_ + 1 >= probe_every();
  return probing_ ? std::min<int64_t>(1, max_drafts_) : best;
}

int64_t DraftBudget::probe_every() const {
  // A probe costs one proposal and one draft, in calls' time; a plain call costs 1.
  const double probe = proposal_cost_ + draft_cost_;
  const int64_t every = std::max<int64_t>(kProbeEvery, static_cast<int64_t>(std::ceil(probe / kProbeShare)));
  return every << std::min<int64_t>(failed_probes_, kMostDoublings);
}

void DraftBudget::update(int64_t proposed, int64_t accepted) {
  if (proposed <= 0) {
    ++calls_without_;
    probing_ = false;  // a probe the source had nothing for: no fate to learn
    return;
  }
  accepted = std::clamp<int64_t>(accepted, 0, proposed);
  calls_without_ = 0;
  if (accepted > 0) failed_probes_ = 0;
  else if (probing_) ++failed_probes_;
  probing_ = false;
  hits_ = kDecay * hits_ + static_cast<double>(accepted);
  trials_ = kDecay * trials_ + static_cast<double>(accepted) + (accepted < proposed ? 1.0 : 0.0);
}


namespace {
double averaged(const std::optional<double>& mean, double value) {
  return mean ? DraftModelPacing::kSmoothing * *mean + (1 - DraftModelPacing::kSmoothing) * value : value;
}
}  // namespace

DraftModelPacing::DraftModelPacing(int64_t max_drafts, std::optional<double> cost, bool one_call)
    : budget_(max_drafts), cost_(cost), one_call_(one_call) {
  if (cost_ && one_call_) budget_.set_proposal_cost(*cost_);  // these throw for a negative cost
  else if (cost_) budget_.set_draft_cost(DraftBudget::kDraftCost + *cost_);
}

int64_t DraftModelPacing::begin(const std::vector<int64_t>& seq, double now) {
  const auto held = static_cast<int64_t>(last_seq_.size());
  if (has_last_ && static_cast<int64_t>(seq.size()) > held && common_prefix(last_seq_, seq) == held) {
    // The drafts the target accepted: how far the sequence went on along them.
    const std::vector<int64_t> after(seq.begin() + held, seq.end());
    budget_.update(static_cast<int64_t>(last_drafts_.size()), common_prefix(after, last_drafts_));
    const double interval = now - last_at_;  // the target's calls since the last proposal, and the loop's work
    if (last_drafts_.empty()) {
      // Plain calls (the prompt's prefill aside): the unit. Their number varies (a source with nothing to
      // propose is asked less often), so per token.
      if (last_had_output_) plain_token_s_ = averaged(plain_token_s_, interval / static_cast<double>(after.size()));
    } else {
      target_s_ = averaged(target_s_, interval);
      if (plain_token_s_) {
        // A verifying call's cost per draft beyond a plain call's, in plain calls.
        const double extra = interval / *plain_token_s_ - 1.0;
        verify_cost_ = averaged(verify_cost_, std::max(0.0, extra) / static_cast<double>(last_drafts_.size()));
      }
    }
    // A draft costs its share of the verifying call and its draft call; a one-call proposal costs its call
    // whatever its size.
    if (!cost_ && draft_s_) {
      const double unit = std::max(plain_token_s_ ? *plain_token_s_ : target_s_.value_or(interval), 1e-9);
      const double share = *draft_s_ / unit;
      const double verify = std::max(DraftBudget::kDraftCost, verify_cost_.value_or(0.0));
      if (one_call_) {
        budget_.set_proposal_cost(share);
        budget_.set_draft_cost(verify);
      } else {
        budget_.set_draft_cost(verify + share);
      }
      // The unit is not known yet: one proposal of no drafts times a plain call (one call's cost, once), so
      // that a draft model that hits often but costs more than it saves still learns to stop.
      if (!plain_token_s_ && last_had_output_ && !last_drafts_.empty()) return 0;
    }
  }
  return budget_.size();
}

void DraftModelPacing::end(const std::vector<int64_t>& seq, bool has_output, const std::vector<int64_t>& drafts,
                           int64_t calls, double seconds, double now) {
  calls_ += calls;
  seconds_ += seconds;
  if (has_output && calls > 0) draft_s_ = averaged(draft_s_, seconds / static_cast<double>(calls));
  last_seq_ = seq;
  last_drafts_ = drafts;
  last_at_ = now;
  has_last_ = true;
  last_had_output_ = has_output;
}

}  // namespace etmlx
