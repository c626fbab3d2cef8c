#include "decode_rows.h"

#include <algorithm>
#include <stdexcept>

namespace etmlx {

int64_t common_prefix(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return static_cast<int64_t>(n);
}

std::string failure_message(Failure failure, int64_t detail) {
  switch (failure) {
    case Failure::Forced:
      return "could not force token " + std::to_string(detail);
    case Failure::NoToken:
      return "the grammar allows no token the model can produce here (every allowed token has probability 0)";
    case Failure::Grammar:
      return "the grammar rejected token " + std::to_string(detail);
    case Failure::None:
      break;
  }
  return "";
}

DecodeRows::DecodeRows(DecodeRowsConfig config) : config_(std::move(config)) {
  if (config_.batch < 1) throw std::invalid_argument("a decoder program decodes at least one row per call");
  if (config_.max_seq_len < 1) throw std::invalid_argument("max_seq_len must be >= 1");
  if (config_.draft_tokens < 0) throw std::invalid_argument("draft_tokens must be >= 0");
  // A ring slot is not a position: nothing is copied between ring rows (program_state.cpp).
  if (config_.ring || !config_.prompt_cache) config_.copies = false;
  rows_.resize(static_cast<size_t>(config_.batch));
  ended_.resize(static_cast<size_t>(config_.batch));
  caches_.resize(static_cast<size_t>(config_.batch));
}

namespace {

void check_slot(int64_t slot, int64_t batch) {
  if (slot < 0 || slot >= batch)
    throw std::out_of_range("no row " + std::to_string(slot) + " (the program has " + std::to_string(batch) + ")");
}

}  // namespace

const RowState* DecodeRows::row(int64_t slot) const {
  check_slot(slot, config_.batch);
  const auto& r = rows_[static_cast<size_t>(slot)];
  return r ? &*r : nullptr;
}

const RowState* DecodeRows::ended(int64_t slot) const {
  check_slot(slot, config_.batch);
  const auto& r = ended_[static_cast<size_t>(slot)];
  return r ? &*r : nullptr;
}

RowState* DecodeRows::row(int64_t slot) {
  check_slot(slot, config_.batch);
  auto& r = rows_[static_cast<size_t>(slot)];
  return r ? &*r : nullptr;
}

// ---- the row caches ----

int64_t DecodeRows::reusable(int64_t slot, const std::vector<int64_t>& prompt) const {
  check_slot(slot, config_.batch);
  if (!config_.prompt_cache || prompt.empty()) return 0;
  const auto& held = caches_[static_cast<size_t>(slot)].tokens;
  // At least the prompt's last token is fed again: its logits give the first sampled token.
  const int64_t n = std::min(common_prefix(held, prompt), static_cast<int64_t>(prompt.size()) - 1);
  // A ring holds only the latest position of each slot, and a call assumes it holds the ones just before
  // its start: a ring row is reused only where positions continue.
  if (config_.ring && n != static_cast<int64_t>(held.size())) return 0;
  return n;
}

void DecodeRows::set_held(int64_t slot, std::vector<int64_t> tokens) {
  check_slot(slot, config_.batch);
  if (static_cast<int64_t>(tokens.size()) > config_.max_seq_len)
    throw std::invalid_argument("a row holds at most max_seq_len (" + std::to_string(config_.max_seq_len) +
                                ") positions");
  caches_[static_cast<size_t>(slot)].tokens = std::move(tokens);
}

void DecodeRows::taken(int64_t slot) {
  check_slot(slot, config_.batch);
  caches_[static_cast<size_t>(slot)].used = ++clock_;
}

void DecodeRows::forget() {
  for (auto& cache : caches_) cache.tokens.clear();
}

void DecodeRows::wrote(int64_t slot, int64_t pos, const std::vector<int64_t>& tokens) {
  if (!config_.prompt_cache) return;
  auto& held = caches_[static_cast<size_t>(slot)].tokens;
  held.resize(std::min(held.size(), static_cast<size_t>(std::max<int64_t>(pos, 0))));  // after it is stale
  held.insert(held.end(), tokens.begin(), tokens.end());
}

int64_t DecodeRows::idle_position(int64_t slot, int64_t width) {
  // The first position past what the row holds: a full cache never reads past the prefix it reuses, and a
  // ring row reused there is overwritten at that position before any query could see it.
  if (!config_.prompt_cache) return 0;
  auto& held = caches_[static_cast<size_t>(slot)].tokens;
  if (static_cast<int64_t>(held.size()) + width > config_.max_seq_len) {
    if (config_.ring)
      held.clear();  // a ring row cannot be cut short
    else
      held.resize(static_cast<size_t>(std::max<int64_t>(config_.max_seq_len - width, 0)));
  }
  return static_cast<int64_t>(held.size());
}

// ---- rows come and go ----

int64_t DecodeRows::room() const {
  int64_t room = config_.max_seq_len;
  for (const auto& r : rows_)
    if (r) room = std::min(room, config_.max_seq_len - r->pos);
  return room;
}

std::pair<int64_t, int64_t> DecodeRows::copyable(int64_t slot, const std::vector<int64_t>& prompt) const {
  // A busy row's positions before its next call's never change while it runs, and a copy is ordered after
  // every call before it.
  std::pair<int64_t, int64_t> best{-1, 0};
  if (!config_.copies) return best;
  for (int64_t other = 0; other < config_.batch; ++other) {
    if (other == slot) continue;
    const int64_t n = reusable(other, prompt);
    if (n > best.second) best = {other, n};
  }
  return best;
}

std::pair<int64_t, int64_t> DecodeRows::choose(const std::vector<int64_t>& prompt, int64_t usable,
                                               bool reuse) const {
  int64_t best = -1, best_n = -1;
  uint64_t best_used = 0;
  for (int64_t slot = 0; slot < std::min(usable, config_.batch); ++slot) {
    if (rows_[static_cast<size_t>(slot)]) continue;
    const uint64_t used = caches_[static_cast<size_t>(slot)].used;
    const int64_t n = reuse ? reusable(slot, prompt) : 0;
    // The longest reuse, then the least recently used; the first such slot.
    if (best < 0 || n > best_n || (n == best_n && used < best_used)) {
      best = slot;
      best_n = n;
      best_used = used;
    }
  }
  if (best < 0) return {-1, 0};
  if (!reuse) return {best, 0};
  return {best, std::max(best_n, copyable(best, prompt).second)};
}

std::vector<int64_t> DecodeRows::busy_prefix(const std::vector<int64_t>& prompt) const {
  // A ring row is reused only where positions continue, which depends on the tokens it has yet to write.
  std::vector<int64_t> best{-1, 0, 0};
  if (!config_.prompt_cache || config_.ring || prompt.empty()) return best;
  for (int64_t slot = 0; slot < config_.batch; ++slot) {
    const auto& r = rows_[static_cast<size_t>(slot)];
    if (!r) continue;
    const int64_t n = std::min(common_prefix(r->request.prompt, prompt), static_cast<int64_t>(prompt.size()) - 1);
    if (n > best[1]) {
      // With copies, the prefix can be copied as soon as the row has prefilled it (its prefill calls: one per
      // chunk still to feed).
      const auto rest = static_cast<int64_t>(r->request.prompt.size() - r->rest);
      const int64_t chunk = std::max<int64_t>(r->request.prefill_chunk, 1);
      const int64_t prefill = r->step == 0 ? 1 + (rest + chunk - 1) / chunk : 0;
      const int64_t steps = config_.copies ? std::max<int64_t>(prefill, 1) : r->request.max_tokens - r->produced + prefill;
      best = {slot, n, steps};
    }
  }
  return best;
}

int64_t DecodeRows::start(int64_t slot, RowRequest request, bool reuse, const Copier& copy) {
  check_slot(slot, config_.batch);
  if (rows_[static_cast<size_t>(slot)]) throw std::invalid_argument("row " + std::to_string(slot) + " is busy");
  if (request.prompt.empty()) throw std::invalid_argument("the prompt is empty: give at least one token");
  if (request.max_tokens < 1) throw std::invalid_argument("max_tokens must be >= 1");
  const auto& prompt = request.prompt;
  int64_t n = reuse ? reusable(slot, prompt) : 0;
  if (reuse) {
    const auto [source, copyable_n] = copyable(slot, prompt);
    if (copyable_n > n) {
      caches_[static_cast<size_t>(slot)].tokens.clear();  // overwritten from here on, whatever happens
      // A failed copy: the request still runs, prefilling its whole prompt.
      n = copy && copy(source, slot, copyable_n) ? copyable_n : 0;
      if (n > 0) wrote(slot, 0, std::vector<int64_t>(prompt.begin(), prompt.begin() + n));
    }
  }
  RowState row;
  row.feed.assign(prompt.begin() + n, prompt.end());
  // The one home of the rule for which programs prefill in chunks (RowRequest::prefill_chunk): a verify call
  // feeds drafts beside the prompt, a proposing call returns K tokens for what it was fed.
  const int64_t chunk = config_.draft_tokens || config_.propose_tokens ? 0 : request.prefill_chunk;
  row.rest = prompt.size();
  if (chunk > 0 && static_cast<int64_t>(row.feed.size()) > chunk) {
    row.rest = static_cast<size_t>(n + chunk);
    row.feed.resize(static_cast<size_t>(chunk));
  }
  row.pos = row.cached = n;
  row.request = std::move(request);
  rows_[static_cast<size_t>(slot)] = std::move(row);
  taken(slot);
  ++active_;
  return n;
}

void DecodeRows::end(int64_t slot) {
  check_slot(slot, config_.batch);
  auto& r = rows_[static_cast<size_t>(slot)];
  if (!r) return;
  ended_[static_cast<size_t>(slot)] = std::move(r);  // its final state stays readable
  r.reset();  // its cache keeps what the row wrote
  --active_;
}

void DecodeRows::place(int64_t slot, int64_t pos, int64_t step) {
  RowState* r = row(slot);
  if (!r) throw std::invalid_argument("row " + std::to_string(slot) + " has no request");
  if (pos < 0 || step < 0) throw std::invalid_argument("position and step must be >= 0");
  r->pos = pos;
  r->step = step;
}

// ---- one call ----

int64_t DecodeRows::draft_room(int64_t slot, int64_t limit) const {
  const RowState* r = row(slot);
  if (!r || config_.draft_tokens == 0) return 0;
  // Every row of a call writes `width` positions: a row's tokens plus drafts stay within the call's room.
  const int64_t k = std::min({limit, config_.draft_tokens, r->request.max_tokens - r->produced - 1,
                              room() - static_cast<int64_t>(r->feed.size())});
  return std::max<int64_t>(k, 0);
}

int64_t DecodeRows::ask(int64_t slot, int64_t limit) {
  RowState* r = row(slot);
  if (!r) return 0;
  const int64_t k = draft_room(slot, limit);
  r->asked = k > 0 && !r->pending;
  if (!r->pending) return k;  // (a row is only ever pending in a pipelined draft program)
  // The row's token is in flight: its source could only continue the tokens before it. After `dry` empty
  // answers the row waits 2^(dry - 1) calls (at most kMaxQuiet) before a call delivers to ask again.
  const int64_t wait = r->dry == 0 ? 0 : std::min<int64_t>(int64_t{1} << std::min<int64_t>(r->dry - 1, 30), kMaxQuiet);
  if (k > 0 && r->quiet >= wait) r->deliver = true;
  return 0;
}

void DecodeRows::set_drafts(int64_t slot, std::vector<int64_t> drafts) {
  RowState* r = row(slot);
  if (!r) throw std::invalid_argument("row " + std::to_string(slot) + " has no request");
  if (static_cast<int64_t>(drafts.size()) > draft_room(slot, config_.draft_tokens))
    throw std::invalid_argument("row " + std::to_string(slot) + ": more drafts than the call has room for");
  if (!drafts.empty() && r->pending)
    throw std::invalid_argument("row " + std::to_string(slot) +
                                ": drafts must follow a token the host has seen (its last one is in flight)");
  if (r->asked) {
    r->dry = drafts.empty() ? r->dry + 1 : 0;
    r->quiet = 0;
    r->asked = false;
  }
  r->drafts = std::move(drafts);
}

CallLayout DecodeRows::layout(int64_t only) {
  const auto batch = static_cast<size_t>(config_.batch);
  CallLayout call;
  const auto fed = [&](size_t slot) -> const RowState* {
    const auto& r = rows_[slot];
    return r && (only < 0 || static_cast<int64_t>(slot) == only) ? &*r : nullptr;
  };
  for (size_t slot = 0; slot < batch; ++slot)
    if (const RowState* r = fed(slot))
      call.width = std::max<int64_t>(call.width, static_cast<int64_t>(r->feed.size() + r->drafts.size()));
  call.tokens.assign(batch * static_cast<size_t>(call.width), 0);
  call.start_pos.resize(batch);
  call.lengths.resize(batch);
  call.seeds.resize(batch);
  call.steps.resize(batch);
  call.first.resize(batch);
  call.kinds.resize(batch);
  call.forced.assign(batch, 0);
  call.drafts.resize(batch);
  // A pipelined draft program's call delivers when a row carries drafts or wants its token in flight.
  call.deliver = !pipelined_drafts();
  for (size_t slot = 0; slot < batch; ++slot)
    if (const RowState* r = fed(slot)) call.deliver = call.deliver || !r->drafts.empty() || r->deliver;
  delivered_ = call.deliver;
  for (size_t slot = 0; slot < batch; ++slot) {
    const RowState* r = fed(slot);
    if (!r) {  // a throwaway token, greedy, where it overwrites nothing cached
      call.start_pos[slot] = idle_position(static_cast<int64_t>(slot), call.width);
      call.lengths[slot] = 1;
      call.seeds[slot] = call.steps[slot] = 0;
      call.first[slot] = 1;
      call.kinds[slot] = RowKind::Idle;
      continue;
    }
    auto* out = call.tokens.data() + slot * static_cast<size_t>(call.width);
    std::copy(r->feed.begin(), r->feed.end(), out);
    std::copy(r->drafts.begin(), r->drafts.end(), out + r->feed.size());
    call.start_pos[slot] = r->pos;
    call.lengths[slot] = static_cast<int64_t>(r->feed.size() + r->drafts.size());
    call.steps[slot] = r->step;
    // Every prefill chunk is step 0 and resets the row's penalty counts: after the last chunk they hold only its
    // token, as after a whole prefill (a dropped chunk token is never counted).
    call.first[slot] = r->step == 0;
    call.drafts[slot] = r->drafts;
    int64_t base_seed = 0;  // greedy rows draw with the default knobs
    if (!r->request.forced) {
      call.kinds[slot] = RowKind::Request;
      base_seed = r->request.seed;
    } else if (r->step < static_cast<int64_t>(r->request.forced->size())) {
      call.kinds[slot] = RowKind::Forced;  // greedy with the step's scored token pushed to the top
      call.forced[slot] = (*r->request.forced)[static_cast<size_t>(r->step)];
    } else {
      call.kinds[slot] = RowKind::Greedy;  // a pipelined row's extra step past its last token: dropped
    }
    // The seed schedule: step k draws with seed + k.
    if (__builtin_add_overflow(base_seed, r->step, &call.seeds[slot]))
      throw std::overflow_error("row " + std::to_string(slot) + ": seed " + std::to_string(base_seed) + " + step " +
                                std::to_string(r->step) + " overflows int64");
  }
  return call;
}

bool DecodeRows::check(RowState& row, int64_t slot, RowEvent& event, const Advance& advance) {
  const auto& request = row.request;
  const int64_t token = event.token;
  const auto produced = static_cast<size_t>(row.produced);
  if (request.forced && (produced >= request.forced->size() || token != (*request.forced)[produced])) {
    event.failure = Failure::Forced;
    event.detail = produced < request.forced->size() ? (*request.forced)[produced] : token;
  } else if (token == kNoAllowedToken) {
    event.failure = Failure::NoToken;
  } else if (request.constrained) {
    const int verdict = advance ? advance(slot, token) : 1;
    if (verdict < 0) throw std::runtime_error("the row's matcher failed");
    if (verdict == 0) {
      event.failure = Failure::Grammar;
      event.detail = token;
    }
  }
  if (event.failure != Failure::None) {
    event.finish = Finish::Error;
    return false;
  }
  ++row.produced;
  const auto& eos = config_.eos;
  if (request.stop_at_eos && std::find(eos.begin(), eos.end(), token) != eos.end())
    event.finish = Finish::Stop;
  else if (row.produced >= request.max_tokens)
    event.finish = Finish::Length;
  return event.finish == Finish::None;
}

bool DecodeRows::take_verified(RowState& row, int64_t slot, int64_t accepted, int64_t token, const Advance& advance,
                               std::vector<RowEvent>& events) {
  const int64_t n = std::clamp<int64_t>(accepted, 0, static_cast<int64_t>(row.drafts.size()));
  std::vector<int64_t> fresh(row.drafts.begin(), row.drafts.begin() + n);
  std::vector<int64_t> written = row.feed;  // not the rejected drafts: stale entries
  written.insert(written.end(), fresh.begin(), fresh.end());
  wrote(slot, row.pos, written);
  fresh.push_back(token);
  // Each event counts the drafts up to its own token: an accepted draft is one proposed and accepted, the
  // call's last token settles the rest (rejected). A row that ends early (a stop string, EOS, max_tokens)
  // thus reports only the drafts behind the output it returned.
  const int64_t proposed_before = row.proposed, accepted_before = row.accepted;
  row.proposed += static_cast<int64_t>(row.drafts.size());
  row.accepted += n;
  for (size_t j = 0; j < fresh.size(); ++j) {
    const bool draft = static_cast<int64_t>(j) < n;
    const int64_t so_far = static_cast<int64_t>(j) + 1;
    RowEvent event{slot, fresh[j], Finish::None, Failure::None, 0, row.cached,
                   draft ? proposed_before + so_far : row.proposed, draft ? accepted_before + so_far : row.accepted};
    const bool goes_on = check(row, slot, event, advance);
    events.push_back(event);
    if (!goes_on) {  // the row's totals (DraftStats) end where its output does
      row.proposed = event.proposed, row.accepted = event.accepted;
      return false;
    }
  }
  row.pos += static_cast<int64_t>(row.feed.size()) + n;
  row.output.insert(row.output.end(), fresh.begin(), fresh.end());
  row.feed = {fresh.back()};
  row.drafts.clear();
  row.step += static_cast<int64_t>(fresh.size());  // output token j draws with seed + j, as in the plain loop
  return true;
}

std::vector<RowEvent> DecodeRows::read(const int64_t* tokens, const int64_t* accepted, const Advance& advance,
                                       const int64_t* fed) {
  if (config_.draft_tokens && !accepted)
    throw std::invalid_argument("a draft-verifying program's outputs start with the accepted counts");
  if (pipelined_drafts() && !fed)
    throw std::invalid_argument("a pipelined draft-verifying program also returns the token each row was fed");
  for (auto& r : rows_)
    if (r) ++r->calls;
  std::vector<RowEvent> events;
  for (int64_t slot = 0; slot < config_.batch; ++slot) {
    auto& opt = rows_[static_cast<size_t>(slot)];
    if (!opt) continue;
    RowState& row = *opt;
    const int64_t token = tokens[slot];
    if (pipelined_drafts()) {
      ++row.quiet;
      if (row.pending) {  // the row's last call's token: this call fed it at row.pos
        row.pending = false;
        const int64_t t = fed[slot];
        wrote(slot, row.pos, {t});
        RowEvent event{slot, t, Finish::None, Failure::None, 0, row.cached, row.proposed, row.accepted};
        const bool goes_on = check(row, slot, event, advance);
        events.push_back(event);
        if (!goes_on) {
          end(slot);
          continue;
        }
        row.output.push_back(t);
        row.feed = {t};
      }
      // A row takes a delivered call's outputs only when it asked for them (drafts, or its source wanting
      // the token): a row decodes as it would alone, whatever the rows beside it draft.
      const bool own = delivered_ && (!row.drafts.empty() || row.deliver);
      row.deliver = false;
      if (own) {
        if (!take_verified(row, slot, accepted[slot], token, advance, events)) end(slot);
        continue;
      }
      // Not its delivery: a call without drafts, whose token the next call returns (as `fed`). Its feed is
      // known here (the prompt, or a token the host has seen).
      wrote(slot, row.pos, row.feed);
      row.pos += static_cast<int64_t>(row.feed.size());
      row.feed = {kFedBack};
      row.step += 1;
      row.pending = true;
      continue;
    }
    if (config_.draft_tokens) {
      if (!take_verified(row, slot, accepted[slot], token, advance, events)) end(slot);
      continue;
    }
    // A pipelined row's prefill returns nothing of its own (the outputs are the slot's previous call's);
    // its decode calls feed the device's token, which is the one this call returns.
    const std::vector<int64_t>& prompt = row.request.prompt;
    const bool has_result = !(config_.pipelined && row.step == 0) && row.rest == prompt.size();
    const bool fed_back = row.feed.size() == 1 && row.feed[0] == kFedBack;
    wrote(slot, row.pos, fed_back ? std::vector<int64_t>{token} : row.feed);
    if (row.rest < prompt.size()) {  // a prefill chunk: its token is dropped, the next call feeds the next chunk
      row.pos += static_cast<int64_t>(row.feed.size());
      const size_t take = std::min(static_cast<size_t>(row.request.prefill_chunk), prompt.size() - row.rest);
      row.feed.assign(prompt.begin() + static_cast<std::ptrdiff_t>(row.rest),
                      prompt.begin() + static_cast<std::ptrdiff_t>(row.rest + take));
      row.rest += take;
      continue;
    }
    if (has_result) {
      RowEvent event{slot, token, Finish::None, Failure::None, 0, row.cached, 0, 0};
      const bool goes_on = check(row, slot, event, advance);
      events.push_back(event);
      if (!goes_on) {
        end(slot);
        continue;
      }
    }
    row.pos += static_cast<int64_t>(row.feed.size());
    row.feed = {config_.pipelined ? kFedBack : token};
    row.step += 1;
  }
  return events;
}

}  // namespace etmlx
