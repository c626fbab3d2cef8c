"""A draft model as the draft source of speculative decoding (speculative.py): a small plain decoder program
with the target's vocabulary proposes the next k tokens greedily.

    source = DraftModel("small.pte", target=SpeculativeDecoder("spec.pte"))
    tokens = list(target.stream(prompt_ids, 64, params, draft=source))

The draft program is driven by the plain loop (loop.py `Decoder.stream` with `reuse=True`), whose prompt cache
(runtime/decode_rows.h) records which token sits at each position of the row's KV cache. Each proposal hands it the
whole sequence so far (prompt + output); the row already holds the prefix it shares with what was drafted
before, so only the tokens it has not seen are fed: those the target accepted beyond the last draft it fed,
and the target's correction (or bonus) token, at their explicit positions. The entries of rejected drafts
lie past that prefix and are overwritten by the call that feeds the accepted tokens. A draft is only a
guess: whatever the draft model proposes, the target's tokens are its plain program's.

Cost: k drafts take k calls of the draft program (k + 1 for a pipelined one, whose calls return the call
before's token), or one call of a program exported with `--propose-tokens K` (proposer.py: K greedy steps in
one graph), so a draft model pays only where its calls are much cheaper than the target's. It therefore
sizes its own proposals with a DraftBudget whose cost per draft adds the measured ratio of
a draft call's time to a plain target call's (the time per token between two proposals of no drafts: the pacing
asks for one such proposal, once, to time it), and whose verifying call's cost per draft is measured too. The acceptance it feeds that budget it reads off the output: how many of its last
drafts the next proposal's output starts with. `cost=` fixes the ratio instead (0: sized as prompt lookup's).
That bookkeeping is the C++ core's (runtime/draft_sources.h DraftModelPacing), which `etmlx_decode --draft-model`
runs too (tools/etmlx_decode/model_draft.h), so both size their proposals alike.
"""

from __future__ import annotations

import time
from pathlib import Path

from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.runtime.decode_rows_lib import DecodeRowsError, PacingCore

GREEDY = SamplingParams()
UNSIZED_MAX_DRAFTS = 16  # without a target, the most drafts a proposal makes


class DraftModel:
    name = "draft-model"

    def __init__(self, pte: Path, target=None, cost: float | None = None):
        """`target`: the program the drafts are for (anything with `.pte` and `.meta`, e.g. a SpeculativeDecoder),
        whose vocabulary the draft program must share. `cost`: a draft call's time over a target call's
        (None: measured as it runs)."""
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float)) or cost < 0):
            raise ValueError(f"cost must be a number >= 0 or None, got {cost!r}")
        self.decoder = Decoder(pte)
        self.pte = self.decoder.pte
        if target is not None:
            check_vocabulary(self.decoder.meta.vocab_size, self.pte, target.meta.vocab_size, target.pte)
        self.cost = cost
        max_drafts = target.meta.draft_tokens if target is not None else UNSIZED_MAX_DRAFTS
        self.one_call = bool(self.meta.propose_tokens)  # proposer.py: a proposal is one call
        if self.one_call:
            max_drafts = min(max_drafts, self.meta.propose_tokens)
        try:  # the budget and its bookkeeping: the core's, which etmlx_decode --draft-model runs too
            self._pacing = PacingCore(max_drafts, cost, one_call=self.one_call)
        except DecodeRowsError as exc:
            raise ValueError(str(exc)) from None

    @property
    def meta(self):
        return self.decoder.meta

    @property
    def calls(self) -> int:
        """Draft program calls, every proposal together."""
        return self._pacing.get()[0]

    @property
    def seconds(self) -> float:
        """Their time."""
        return self._pacing.get()[1]

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        started = time.perf_counter()
        seq = list(prompt) + list(output)
        k = min(k, self._pacing.begin(seq, started), self.meta.max_seq_len - len(seq))  # the cache holds no more
        if self.one_call:
            drafts = _to_eos(self.decoder.propose(seq, GREEDY)[:k], self.meta.eos_token_ids) if k > 0 else []
            calls = 1 if drafts else 0
        else:
            drafts = [step.token for step in self.decoder.stream(seq, k, GREEDY, reuse=True)] if k > 0 else []
            calls = len(drafts) + (1 if drafts and self.meta.pipelined else 0)
        done = time.perf_counter()
        self._pacing.end(seq, bool(output), drafts, calls, done - started, done)
        return drafts


def check_vocabulary(draft_vocab: int, draft_pte, target_vocab: int, target_pte) -> None:
    if draft_vocab != target_vocab:
        raise ValueError(f"draft model {draft_pte} has a vocabulary of {draft_vocab} tokens but {target_pte} has "
                         f"{target_vocab}: a draft model must use the program's tokenizer")


def _to_eos(drafts: list[int], eos: list[int]) -> list[int]:
    """A proposal ends at an end-of-sequence token, which it keeps (as the plain loop's does)."""
    for i, token in enumerate(drafts):
        if token in eos:
            return drafts[:i + 1]
    return drafts
