// The decode-step rules, in one place: the rows of a decoder program, what its next call feeds each row,
// and what a call's outputs mean for each row. Every decode loop runs these rules: the Python API, the
// CLI and the server through decode_rows_api.cpp (ctypes; llm/decoder/decode_rows.py), and the C++
// etmlx_decode / etmlx_bench (tools/etmlx_decode/decode_loop.cpp) directly.
//
// The rules:
// - Step 0 of a row prefills its prompt (only the part its row's cache does not already hold) in one
//   call, or with the request's prefill_chunk in calls of at most that many tokens (each chunk's token is
//   dropped, as a pipelined prefill's outputs are: the row takes the last chunk's); step k > 0 feeds the
//   previous token at the next position.
// - A row draws with seed = its base seed + step, so a generation is reproducible from one base seed;
//   step 0 is also the call that resets the row's penalty state ("first").
// - Pipelined programs get the same calls, except that step k > 0 feeds kFedBack (the token the device
//   sampled for the row) and each call returns the previous call's results: a row's prefill returns
//   nothing of its own, and its first token arrives with step 1.
// - Structured output: the driver's matcher checks each token (the `advance` callback of read()).
// - Scoring (`forced`): step k is greedy with forced[k] pushed up (RowKind::Forced); a mismatch fails the row.
// - A row with no request writes a throwaway token where nothing cached depends on it (the row caches).
// - Rows share nothing but the call: each has its own position, step, seed, reset and mask.
// - Draft-verifying programs (draft_tokens K > 0): each call may carry a row's drafts after its tokens;
//   the call returns how many it accepted (n) and the next token, so the row gets n + 1 tokens (each
//   checked for eos / max_tokens), advances n + 1 steps (seed + step stays the plain schedule) and n + 1
//   positions past its fed tokens. A rejected draft's KV entry is overwritten by the next call before
//   anything attends to it.
// - Pipelined draft-verifying programs (the `deliver` input, llm/decoder/pipelined_verify.py): a call
//   either delivers (returns its own accepted count and token, and the host waits for them) or not
//   (returns the row's previous call's token, so the host never waits for the step it has just started).
//   A call delivers when some row carries drafts or must learn its last token (deliver); a call without
//   drafts after an undelivered one feeds kFedBack, one position on. A row takes a delivered call's own
//   outputs only when it asked for them, so it decodes as it would alone. Every call also returns `fed`, the
//   token its column 0 used in place of kFedBack: that is a pending row's token, whichever way the call
//   went. A row's source can only continue the tokens the host has seen, so a pending row whose budget
//   wants drafts asks for one delivered call without drafts first (ask()); a source that answered with
//   none is asked again only after 1, 2, 4 .. 16 undelivered calls (kMaxQuiet), so a source that never
//   hits delivers about one call in 17.
//
// The prompt cache (the row caches): a row's KV cache keeps what its requests wrote; a new prompt that
// starts with tokens a row holds (the longest common prefix, at least its last token fed again) starts
// there. A sliding-window ring row is reused only where positions continue. Choosing a row: the free row
// with the longest reusable prefix, then the least recently used. With cross-row copies (a copier given
// to start()), a request also reuses the longest prefix any other row holds, busy or free.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace etmlx {

// The token input of a pipelined program that means "the token this row sampled last" (meta.py FED_BACK).
constexpr int64_t kFedBack = -1;
// The prefill chunk the decode loops use by default (RowRequest::prefill_chunk; llama.cpp's micro-batch, where
// mlx-lm takes 2,048): a 32k prompt's activations are a 512-token prompt's. On the CPU it is also the fastest
// measured (one 8B-shaped layer, 4,096-token prompt: first token 6.1 s against 6.5 s at 2,048 and 7.6 s in one
// call; peak 528 / 828 / 1,169 MiB); on a GPU, unmeasured.
constexpr int64_t kPrefillChunk = 512;
// The sampler's token for a row whose mask allows no token it can draw (allowed_mask.py NO_ALLOWED_TOKEN).
constexpr int64_t kNoAllowedToken = -1;

struct DecodeRowsConfig {
  int64_t batch = 1;
  int64_t max_seq_len = 0;
  bool ring = true;  // a sliding-window ring cache (or unknown): reuse only where positions continue
  bool prompt_cache = true;
  bool pipelined = false;
  int64_t draft_tokens = 0;  // K of a draft-verifying program, 0 for a plain one
  int64_t propose_tokens = 0;  // K of a draft model's program returning K tokens a call (proposer.py), else 0
  std::vector<int64_t> eos;
  bool copies = false;  // the driver copies rows (cross-row reuse; start()'s copier). Never for ring programs.
};

struct RowRequest {
  std::vector<int64_t> prompt;
  int64_t max_tokens = 1;
  bool stop_at_eos = true;
  std::optional<std::vector<int64_t>> forced;  // scoring: the token to force at each step
  int64_t seed = 0;                            // the base seed: step k draws with seed + k
  bool constrained = false;                    // the driver checks each token (read()'s advance)
  // > 0: prefill in calls of at most this many tokens, bounding a long prompt's working set (activations grow
  // with the tokens of a call). Each chunk is a step-0 call (its seed, its penalty reset). start() ignores it for
  // the programs a chunk would change (drafts ride in a verify call; a proposing call returns K tokens); the
  // drivers leave it 0 for image prompts (an image's positions may attend to each other both ways, as Gemma 3's
  // do: a chunk boundary inside one would cut that).
  int64_t prefill_chunk = 0;
};

// Whose sampling knobs a row's next call uses.
enum class RowKind : int64_t {
  Idle = 0,     // no request: greedy, knobs off, a throwaway token
  Request = 1,  // the request's own knobs
  Forced = 2,   // greedy with `forced` pushed to the top (scoring)
  Greedy = 3,   // greedy, knobs off (a pipelined scored row's extra step past its last token)
};

enum class Finish : int64_t { None = 0, Stop = 1, Length = 2, Error = 3 };
enum class Failure : int64_t { None = 0, Forced = 1, NoToken = 2, Grammar = 3 };

struct RowEvent {
  int64_t slot = 0;
  int64_t token = 0;  // meaningless when finish == Error
  Finish finish = Finish::None;
  Failure failure = Failure::None;
  int64_t detail = 0;  // Forced: the token that was to be forced; Grammar: the rejected token
  int64_t cached = 0;  // prompt tokens the row's cache held (not prefilled)
  int64_t proposed = 0, accepted = 0;  // draft-verifying programs: the row's drafts up to this token, and accepted
};

// The one-line error of a failed event (Python's TokenEvent.error).
std::string failure_message(Failure failure, int64_t detail);

// One call's per-row values, laid out for the program's inputs by the caller (knob layouts:
// llm/decoder/step_inputs.py, tools/etmlx_decode/step_inputs.cpp).
struct CallLayout {
  int64_t width = 1;             // tokens per row (the widest row's, drafts included)
  std::vector<int64_t> tokens;   // [batch * width], each row's fed tokens then its drafts, 0 padding
  std::vector<int64_t> start_pos, lengths, seeds, steps;
  std::vector<uint8_t> first;    // the row's step 0: its penalty state resets
  std::vector<RowKind> kinds;
  std::vector<int64_t> forced;   // RowKind::Forced: the token to push up
  std::vector<std::vector<int64_t>> drafts;
  bool deliver = true;           // the call returns its own outputs (always, except pipelined draft programs)
};

struct RowState {
  RowRequest request;
  std::vector<int64_t> feed;  // tokens of the next call ({kFedBack} when a pipelined program decodes)
  size_t rest = 0;            // request.prompt[rest, end): what later prefill chunks feed (request.prefill_chunk)
  int64_t pos = 0;            // cache position of feed[0]
  int64_t cached = 0;         // prompt tokens its row's cache already held
  int64_t step = 0;           // the row's decode step of the next call (0 = prefill)
  int64_t produced = 0;       // tokens delivered; a pipelined row's step runs one ahead of them
  int64_t calls = 0;          // program calls that fed the row, the prefill included
  std::vector<int64_t> drafts, output;  // draft-verifying programs: next call's drafts; tokens so far
  int64_t proposed = 0, accepted = 0;
  // Pipelined draft-verifying programs:
  bool pending = false;  // the row's last call did not deliver: its token comes with the next call
  bool deliver = false;  // the next call must deliver: the row's source wants the token in flight
  bool asked = false;    // the source was asked for this call's drafts (ask())
  int64_t dry = 0;       // the source's answers in a row that held no draft
  int64_t quiet = 0;     // calls since the source was last asked
};

class DecodeRows {
 public:
  // copy(src, dst, n): positions [0, n) of row src's KV cache into row dst; false when it failed.
  using Copier = std::function<bool(int64_t src, int64_t dst, int64_t n)>;
  // advance(slot, token): a constrained row's matcher takes the token: 1; its grammar rejects it: 0; the
  // matcher itself failed: -1 (read() then throws, and the caller forgets the rows' caches).
  using Advance = std::function<int(int64_t slot, int64_t token)>;

  explicit DecodeRows(DecodeRowsConfig config);

  const DecodeRowsConfig& config() const { return config_; }
  int64_t active() const { return active_; }
  const RowState* row(int64_t slot) const;  // nullptr when the slot is free
  RowState* row(int64_t slot);
  // The last row that ended in `slot` (its final state), nullptr before any did.
  const RowState* ended(int64_t slot) const;

  // ---- the row caches ----
  int64_t reusable(int64_t slot, const std::vector<int64_t>& prompt) const;
  const std::vector<int64_t>& held(int64_t slot) const { return caches_[static_cast<size_t>(slot)].tokens; }
  void set_held(int64_t slot, std::vector<int64_t> tokens);  // what the row's cache holds (a loaded file)
  void taken(int64_t slot);                                   // a request took the row now (LRU)
  uint64_t used(int64_t slot) const { return caches_[static_cast<size_t>(slot)].used; }
  void forget();  // the program lost its state: no row's cache is reusable

  // ---- rows come and go ----
  int64_t room() const;  // tokens a call may feed: every row of a call writes pos .. pos + width - 1
  // (slot, prompt tokens it already holds) among the first `usable` slots; slot -1 when none is free.
  // Without `reuse`, the least recently used free slot.
  std::pair<int64_t, int64_t> choose(const std::vector<int64_t>& prompt, int64_t usable, bool reuse) const;
  // (slot, n, steps): the running row whose prompt shares the longest prefix (n) with `prompt`, and the
  // steps it has left at most (with copies: its prefill calls, at least 1). (-1, 0, 0) with none.
  std::vector<int64_t> busy_prefix(const std::vector<int64_t>& prompt) const;
  // Row `slot` takes `request`; with `reuse`, from the longest prefix its cache (or, with a copier, another
  // row's) holds. Returns the prompt tokens it did not need to prefill.
  int64_t start(int64_t slot, RowRequest request, bool reuse, const Copier& copy);
  void end(int64_t slot);
  // An explicit position and step for a row (a caller's own loop: Decoder.step_at).
  void place(int64_t slot, int64_t pos, int64_t step);

  // ---- one call ----
  // Draft-verifying programs: how many drafts row `slot` may carry next call (at most `limit`, K, its
  // tokens left minus one and the call's room); set_drafts() gives them.
  int64_t draft_room(int64_t slot, int64_t limit) const;
  // How many drafts to ask row `slot`'s source for now: draft_room(), except in a pipelined draft program,
  // where a row whose token is still in flight is not asked (0) and may instead have its next call deliver
  // (see the rules above). Call it before set_drafts(), which records the source's answer.
  int64_t ask(int64_t slot, int64_t limit);
  void set_drafts(int64_t slot, std::vector<int64_t> drafts);
  // Undelivered calls a pending row waits before its source is asked again, after `dry` empty answers.
  static constexpr int64_t kMaxQuiet = 16;
  // The next call's rows (`only` >= 0: that row alone, the others idle).
  CallLayout layout(int64_t only = -1);
  // Applies a call's outputs: tokens [batch] (output 0 of a plain program; output 1 of a draft-verifying
  // one, whose output 0 is `accepted`; a pipelined draft program's output 2 is `fed`). The call is the last
  // one layout() laid out. Events in slot order; a row whose event has a finish has ended.
  std::vector<RowEvent> read(const int64_t* tokens, const int64_t* accepted, const Advance& advance,
                             const int64_t* fed = nullptr);
  // Whether the program is a pipelined draft-verifying one (its calls take `deliver` and return `fed`).
  bool pipelined_drafts() const { return config_.pipelined && config_.draft_tokens > 0; }

 private:
  struct RowCache {
    std::vector<int64_t> tokens;  // the token at cache positions 0 .. size - 1
    uint64_t used = 0;
  };
  void wrote(int64_t slot, int64_t pos, const std::vector<int64_t>& tokens);
  int64_t idle_position(int64_t slot, int64_t width);
  std::pair<int64_t, int64_t> copyable(int64_t slot, const std::vector<int64_t>& prompt) const;
  // Checks a row's token; sets the event's finish (and failure). Returns whether the row goes on.
  bool check(RowState& row, int64_t slot, RowEvent& event, const Advance& advance);
  // A draft-verifying row's result of one call (accepted drafts, then `token`). False: the row has ended.
  bool take_verified(RowState& row, int64_t slot, int64_t accepted, int64_t token, const Advance& advance,
                     std::vector<RowEvent>& events);

  DecodeRowsConfig config_;
  std::vector<std::optional<RowState>> rows_;
  std::vector<std::optional<RowState>> ended_;
  std::vector<RowCache> caches_;
  uint64_t clock_ = 0;
  int64_t active_ = 0;
  bool delivered_ = true;  // whether the last laid-out call delivers
};

int64_t common_prefix(const std::vector<int64_t>& a, const std::vector<int64_t>& b);

}  // namespace etmlx
