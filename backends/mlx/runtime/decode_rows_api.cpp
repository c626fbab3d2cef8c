// The decode-step rules (decode_rows.h) and the draft sources and budget (draft_sources.h) as C functions,
// called through ctypes by the Python engine (backends/mlx/runtime/decode_rows_lib.py, driven by
// llm/decoder/decode_rows.py and llm/decoder/draft_sources.py).
//
// A handle is a DecodeRows plus the layout of its last call. Every function returns >= 0 on success and
// -1 on failure, with one line in etmlx_rows_error(); nothing lets an exception out. A callback that
// returns -1 (the Python side raised) makes the function fail; the Python side re-raises its exception.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_rows.h"
#include "draft_sources.h"

namespace etmlx {
namespace {

thread_local std::string t_error;

struct Handle {
  explicit Handle(DecodeRowsConfig config) : rows(std::move(config)) {}
  DecodeRows rows;
  CallLayout call;
};

// Per-row fields of etmlx_rows_row, in order.
constexpr int kRowFields = 8;
// Fields of one event of etmlx_rows_read, in order (RowEvent).
constexpr int kEventFields = 8;
// Per-row arrays of etmlx_rows_layout_copy, in order.
constexpr int kLayoutArrays = 8;

template <typename F>
int64_t guarded(F&& f) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    t_error = "out of memory";
  } catch (const std::exception& e) {
    t_error = e.what();
  } catch (...) {
    t_error = "unknown error";
  }
  return -1;
}

// `make()`'s object, or null with the error recorded (what the core refuses: a bad argument).
template <typename Make>
void* made(Make make) {
  void* out = nullptr;
  guarded([&]() -> int64_t {
    out = make();
    return 0;
  });
  return out;
}

// The object behind a handle; a null handle is an error naming `what`.
template <typename T>
T& object_of(void* handle, const char* what) {
  if (!handle) throw std::invalid_argument(std::string("no ") + what + " (a null handle)");
  return *static_cast<T*>(handle);
}

std::vector<int64_t> ids(const int64_t* data, int64_t n) {
  if (n < 0 || (n > 0 && !data)) throw std::invalid_argument("a token list with a bad length");
  return std::vector<int64_t>(data, data + n);
}

Handle& handle(void* h) {
  if (!h) throw std::invalid_argument("no decode rows (a null handle)");
  return *static_cast<Handle*>(h);
}

}  // namespace
}  // namespace etmlx

using etmlx::guarded;
using etmlx::handle;
using etmlx::ids;
using etmlx::made;
using etmlx::object_of;

#define ETMLX_EXPORT extern "C" __attribute__((visibility("default")))

extern "C" {
typedef int (*etmlx_rows_copy_fn)(void* ctx, int64_t src, int64_t dst, int64_t n);
typedef int (*etmlx_rows_advance_fn)(void* ctx, int64_t slot, int64_t token);
}

ETMLX_EXPORT const char* etmlx_rows_error() { return etmlx::t_error.c_str(); }

ETMLX_EXPORT int64_t etmlx_rows_fields(int64_t which) {
  return which == 0 ? etmlx::kRowFields : which == 1 ? etmlx::kEventFields : which == 2 ? etmlx::kLayoutArrays
                                                                                     : etmlx::kPrefillChunk;
}

ETMLX_EXPORT void* etmlx_rows_new(int64_t batch, int64_t max_seq_len, int ring, int prompt_cache, int pipelined,
                                  int64_t draft_tokens, int64_t propose_tokens, const int64_t* eos, int64_t n_eos,
                                  int copies) {
  void* out = nullptr;
  guarded([&]() -> int64_t {
    etmlx::DecodeRowsConfig config;
    config.batch = batch;
    config.max_seq_len = max_seq_len;
    config.ring = ring != 0;
    config.prompt_cache = prompt_cache != 0;
    config.pipelined = pipelined != 0;
    config.draft_tokens = draft_tokens;
    config.propose_tokens = propose_tokens;
    config.eos = ids(eos, n_eos);
    config.copies = copies != 0;
    out = new etmlx::Handle(std::move(config));
    return 0;
  });
  return out;
}

ETMLX_EXPORT void etmlx_rows_free(void* h) { delete static_cast<etmlx::Handle*>(h); }

ETMLX_EXPORT int64_t etmlx_rows_active(void* h) {
  return guarded([&] { return handle(h).rows.active(); });
}

ETMLX_EXPORT int64_t etmlx_rows_copies(void* h) {
  return guarded([&]() -> int64_t { return handle(h).rows.config().copies ? 1 : 0; });
}

// out[kRowFields]: pos, cached, step, produced, calls, proposed, accepted, feed length. 1: a row; 0: free.
// `ended`: the last row that ended in the slot instead of the running one.
ETMLX_EXPORT int64_t etmlx_rows_row(void* h, int64_t slot, int ended, int64_t* out) {
  return guarded([&]() -> int64_t {
    auto& rows = handle(h).rows;
    const etmlx::RowState* r = ended ? rows.ended(slot) : rows.row(slot);
    if (!r) return 0;
    const int64_t v[etmlx::kRowFields] = {r->pos,      r->cached,   r->step,     r->produced,
                                          r->calls,    r->proposed, r->accepted, static_cast<int64_t>(r->feed.size())};
    std::copy(v, v + etmlx::kRowFields, out);
    return 1;
  });
}

// which: 0 the row's next feed, 1 its drafts, 2 its output so far (draft-verifying programs), 3 what its
// cache holds, 4 its prompt (`ended`: of the last row that ended in the slot). Copies up to `cap` ids;
// returns the full length.
ETMLX_EXPORT int64_t etmlx_rows_tokens(void* h, int64_t slot, int64_t which, int ended, int64_t* out, int64_t cap) {
  return guarded([&]() -> int64_t {
    auto& rows = handle(h).rows;
    const std::vector<int64_t>* v = nullptr;
    if (which == 3) {
      rows.row(slot);  // checks the slot
      v = &rows.held(slot);
    } else {
      const etmlx::RowState* r = ended ? rows.ended(slot) : rows.row(slot);
      if (!r) throw std::invalid_argument("row " + std::to_string(slot) + " has no request");
      v = which == 0 ? &r->feed : which == 1 ? &r->drafts : which == 2 ? &r->output : &r->request.prompt;
    }
    const int64_t n = static_cast<int64_t>(v->size());
    std::copy(v->begin(), v->begin() + std::min(n, std::max<int64_t>(cap, 0)), out);
    return n;
  });
}

ETMLX_EXPORT int64_t etmlx_rows_reusable(void* h, int64_t slot, const int64_t* prompt, int64_t n) {
  return guarded([&] { return handle(h).rows.reusable(slot, ids(prompt, n)); });
}

ETMLX_EXPORT int64_t etmlx_rows_set_held(void* h, int64_t slot, const int64_t* tokens, int64_t n) {
  return guarded([&]() -> int64_t {
    handle(h).rows.set_held(slot, ids(tokens, n));
    return 0;
  });
}

ETMLX_EXPORT int64_t etmlx_rows_taken(void* h, int64_t slot) {
  return guarded([&]() -> int64_t {
    handle(h).rows.taken(slot);
    return 0;
  });
}

ETMLX_EXPORT int64_t etmlx_rows_used(void* h, int64_t slot) {
  return guarded([&]() -> int64_t {
    auto& rows = handle(h).rows;
    rows.row(slot);  // checks the slot
    return static_cast<int64_t>(rows.used(slot));
  });
}

ETMLX_EXPORT int64_t etmlx_rows_forget(void* h) {
  return guarded([&]() -> int64_t {
    handle(h).rows.forget();
    return 0;
  });
}

ETMLX_EXPORT int64_t etmlx_rows_room(void* h) {
  return guarded([&] { return handle(h).rows.room(); });
}

// out[2]: slot (-1: none free), prompt tokens it holds.
ETMLX_EXPORT int64_t etmlx_rows_choose(void* h, const int64_t* prompt, int64_t n, int64_t usable, int reuse,
                                       int64_t* out) {
  return guarded([&]() -> int64_t {
    const auto [slot, held] = handle(h).rows.choose(ids(prompt, n), usable, reuse != 0);
    out[0] = slot;
    out[1] = held;
    return 0;
  });
}

// out[3]: slot (-1: none), shared prefix, steps it has left at most.
ETMLX_EXPORT int64_t etmlx_rows_busy_prefix(void* h, const int64_t* prompt, int64_t n, int64_t* out) {
  return guarded([&]() -> int64_t {
    const auto best = handle(h).rows.busy_prefix(ids(prompt, n));
    std::copy(best.begin(), best.end(), out);
    return 0;
  });
}

// n_forced < 0: no scoring. prefill_chunk > 0: the prompt in calls of at most that many tokens (RowRequest).
// Returns the prompt tokens the row did not need to prefill.
ETMLX_EXPORT int64_t etmlx_rows_start(void* h, int64_t slot, const int64_t* prompt, int64_t n, int64_t max_tokens,
                                      int stop_at_eos, const int64_t* forced, int64_t n_forced, int64_t seed,
                                      int constrained, int reuse, int64_t prefill_chunk, etmlx_rows_copy_fn copy,
                                      void* ctx) {
  return guarded([&]() -> int64_t {
    etmlx::RowRequest request;
    request.prompt = ids(prompt, n);
    request.max_tokens = max_tokens;
    request.stop_at_eos = stop_at_eos != 0;
    if (n_forced >= 0) request.forced = ids(forced, n_forced);
    request.seed = seed;
    request.constrained = constrained != 0;
    request.prefill_chunk = prefill_chunk;
    // A failed copy is the caller's to report (it returns 0); the request then prefills its whole prompt.
    etmlx::DecodeRows::Copier copier;
    if (copy) copier = [&](int64_t src, int64_t dst, int64_t count) { return copy(ctx, src, dst, count) > 0; };
    return handle(h).rows.start(slot, std::move(request), reuse != 0, copier);
  });
}

ETMLX_EXPORT int64_t etmlx_rows_end(void* h, int64_t slot) {
  return guarded([&]() -> int64_t {
    handle(h).rows.end(slot);
    return 0;
  });
}

ETMLX_EXPORT int64_t etmlx_rows_place(void* h, int64_t slot, int64_t pos, int64_t step) {
  return guarded([&]() -> int64_t {
    handle(h).rows.place(slot, pos, step);
    return 0;
  });
}

ETMLX_EXPORT int64_t etmlx_rows_draft_room(void* h, int64_t slot, int64_t limit) {
  return guarded([&] { return handle(h).rows.draft_room(slot, limit); });
}

ETMLX_EXPORT int64_t etmlx_rows_ask(void* h, int64_t slot, int64_t limit) {
  return guarded([&] { return handle(h).rows.ask(slot, limit); });
}

ETMLX_EXPORT int64_t etmlx_rows_set_drafts(void* h, int64_t slot, const int64_t* drafts, int64_t n) {
  return guarded([&]() -> int64_t {
    handle(h).rows.set_drafts(slot, ids(drafts, n));
    return 0;
  });
}

// Lays out the next call (`only` >= 0: that row alone) and keeps it; returns its width.
ETMLX_EXPORT int64_t etmlx_rows_layout(void* h, int64_t only) {
  return guarded([&]() -> int64_t {
    auto& hd = handle(h);
    if (only >= 0) hd.rows.row(only);  // checks the slot
    hd.call = hd.rows.layout(only);
    return hd.call.width;
  });
}

// The kept layout: tokens [batch * width]; per_row [kLayoutArrays * batch]: start_pos, lengths, seeds, steps,
// first, kinds, forced, deliver (the call's, in every row).
ETMLX_EXPORT int64_t etmlx_rows_layout_copy(void* h, int64_t* tokens, int64_t* per_row) {
  return guarded([&]() -> int64_t {
    const auto& call = handle(h).call;
    std::copy(call.tokens.begin(), call.tokens.end(), tokens);
    const size_t b = call.start_pos.size();
    for (size_t i = 0; i < b; ++i) {
      per_row[i] = call.start_pos[i];
      per_row[b + i] = call.lengths[i];
      per_row[2 * b + i] = call.seeds[i];
      per_row[3 * b + i] = call.steps[i];
      per_row[4 * b + i] = call.first[i];
      per_row[5 * b + i] = static_cast<int64_t>(call.kinds[i]);
      per_row[6 * b + i] = call.forced[i];
      per_row[7 * b + i] = call.deliver ? 1 : 0;
    }
    return 0;
  });
}

// tokens [batch]; accepted [batch] or null (plain programs); fed [batch] or null (all but pipelined draft
// programs). events [cap * kEventFields]. Returns the count.
ETMLX_EXPORT int64_t etmlx_rows_read(void* h, const int64_t* tokens, const int64_t* accepted, const int64_t* fed,
                                     etmlx_rows_advance_fn advance, void* ctx, int64_t* events, int64_t cap) {
  return guarded([&]() -> int64_t {
    etmlx::DecodeRows::Advance step;
    if (advance) step = [&](int64_t slot, int64_t token) { return advance(ctx, slot, token); };
    const auto out = handle(h).rows.read(tokens, accepted, step, fed);
    if (static_cast<int64_t>(out.size()) > cap) throw std::length_error("more events than room for them");
    int64_t* e = events;
    for (const auto& event : out) {
      const int64_t v[etmlx::kEventFields] = {event.slot,   event.token,
                                              static_cast<int64_t>(event.finish),
                                              static_cast<int64_t>(event.failure),
                                              event.detail, event.cached,
                                              event.proposed, event.accepted};
      e = std::copy(v, v + etmlx::kEventFields, e);
    }
    return static_cast<int64_t>(out.size());
  });
}

// The one-line error of a failed event.
ETMLX_EXPORT int64_t etmlx_rows_failure_message(int64_t failure, int64_t detail, char* out, int64_t cap) {
  return guarded([&]() -> int64_t {
    const std::string text = etmlx::failure_message(static_cast<etmlx::Failure>(failure), detail);
    if (cap > 0) {
      const size_t n = std::min(text.size(), static_cast<size_t>(cap - 1));
      std::copy(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(n), out);
      out[n] = '\0';
    }
    return static_cast<int64_t>(text.size());
  });
}

// ---- draft sources and the draft budget (draft_sources.h) ----

ETMLX_EXPORT void* etmlx_draft_ngram_new(int64_t max_ngram, int64_t min_ngram) {
  return made([&] { return static_cast<etmlx::DraftSource*>(new etmlx::NgramDraft(max_ngram, min_ngram)); });
}

// NgramDraft's default max_ngram (which 0) or min_ngram (1).
ETMLX_EXPORT int64_t etmlx_draft_ngram_default(int64_t which) {
  return which == 0 ? etmlx::NgramDraft::kMaxNgram : etmlx::NgramDraft::kMinNgram;
}

ETMLX_EXPORT void* etmlx_draft_prediction_new(const int64_t* prediction, int64_t n) {
  return made([&] { return static_cast<etmlx::DraftSource*>(new etmlx::PredictionDraft(ids(prediction, n))); });
}

ETMLX_EXPORT void etmlx_draft_free(void* source) { delete static_cast<etmlx::DraftSource*>(source); }

// Up to k drafts after prompt + output into out[cap]; returns how many.
ETMLX_EXPORT int64_t etmlx_draft_propose(void* source, const int64_t* prompt, int64_t n_prompt, const int64_t* output,
                                         int64_t n_output, int64_t k, int64_t* out, int64_t cap) {
  return guarded([&]() -> int64_t {
    if (!source) throw std::invalid_argument("no draft source (a null handle)");
    const auto drafts = static_cast<etmlx::DraftSource*>(source)->propose(ids(prompt, n_prompt), ids(output, n_output),
                                                                          std::min(k, cap));
    std::copy(drafts.begin(), drafts.end(), out);
    return static_cast<int64_t>(drafts.size());
  });
}

ETMLX_EXPORT void* etmlx_budget_new(int64_t max_drafts, double draft_cost) {
  return made([&] { return new etmlx::DraftBudget(max_drafts, draft_cost); });
}

ETMLX_EXPORT void etmlx_budget_free(void* budget) { delete static_cast<etmlx::DraftBudget*>(budget); }

namespace {
etmlx::DraftBudget& budget_of(void* b) { return object_of<etmlx::DraftBudget>(b, "draft budget"); }
}  // namespace

ETMLX_EXPORT int64_t etmlx_budget_size(void* b) {
  return guarded([&] { return budget_of(b).size(); });
}

ETMLX_EXPORT int64_t etmlx_budget_update(void* b, int64_t proposed, int64_t accepted) {
  return guarded([&]() -> int64_t {
    budget_of(b).update(proposed, accepted);
    return 0;
  });
}

// out[2]: the acceptance estimate and the cost per draft.
ETMLX_EXPORT int64_t etmlx_budget_get(void* b, double* out) {
  return guarded([&]() -> int64_t {
    out[0] = budget_of(b).rate();
    out[1] = budget_of(b).draft_cost();
    return 0;
  });
}

ETMLX_EXPORT int64_t etmlx_budget_set_cost(void* b, double cost) {
  return guarded([&]() -> int64_t {
    budget_of(b).set_draft_cost(cost);
    return 0;
  });
}

// The budget's constants: 0 the default cost per draft, 1 the decay, 2 the calls between probes.
ETMLX_EXPORT double etmlx_budget_constant(int64_t which) {
  using B = etmlx::DraftBudget;
  return which == 0 ? B::kDraftCost : which == 1 ? B::kDecay : static_cast<double>(B::kProbeEvery);
}

// ---- a draft model's pacing (draft_sources.h DraftModelPacing) ----

// `cost` < 0: measured as it runs.
ETMLX_EXPORT void* etmlx_pacing_new(int64_t max_drafts, double cost, int one_call) {
  return made([&] {
    return new etmlx::DraftModelPacing(max_drafts, cost < 0 ? std::nullopt : std::optional<double>(cost),
                                       one_call != 0);
  });
}

ETMLX_EXPORT void etmlx_pacing_free(void* pacing) { delete static_cast<etmlx::DraftModelPacing*>(pacing); }

namespace {
etmlx::DraftModelPacing& pacing_of(void* p) { return object_of<etmlx::DraftModelPacing>(p, "draft model pacing"); }
}  // namespace

// The most drafts to make after seq[n] at time `now`.
ETMLX_EXPORT int64_t etmlx_pacing_begin(void* p, const int64_t* seq, int64_t n, double now) {
  return guarded([&] { return pacing_of(p).begin(ids(seq, n), now); });
}

ETMLX_EXPORT int64_t etmlx_pacing_end(void* p, const int64_t* seq, int64_t n, int has_output, const int64_t* drafts,
                                      int64_t n_drafts, int64_t calls, double seconds, double now) {
  return guarded([&]() -> int64_t {
    pacing_of(p).end(ids(seq, n), has_output != 0, ids(drafts, n_drafts), calls, seconds, now);
    return 0;
  });
}

// out[5]: draft program calls, their seconds, the budget's acceptance estimate, cost per draft and per proposal.
ETMLX_EXPORT int64_t etmlx_pacing_get(void* p, double* out) {
  return guarded([&]() -> int64_t {
    const etmlx::DraftModelPacing& pacing = pacing_of(p);
    out[0] = static_cast<double>(pacing.calls());
    out[1] = pacing.seconds();
    out[2] = pacing.budget().rate();
    out[3] = pacing.budget().draft_cost();
    out[4] = pacing.budget().proposal_cost();
    return 0;
  });
}
