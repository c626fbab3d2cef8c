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
before's token), so a draft model pays only where its calls are much cheaper than the target's. It therefore
sizes its own proposals with a DraftBudget (draft_sources.py) whose cost per draft adds the measured ratio of
a draft call's time to a target call's (the time between two proposals: the verifying call and whatever the
caller does per call). The acceptance it feeds that budget it reads off the output: how many of its last
drafts the next proposal's output starts with. `cost=` fixes the ratio instead (0: sized as prompt lookup's).
"""

from __future__ import annotations

import time
from pathlib import Path

from backends.mlx.llm.decoder.draft_sources import DraftBudget
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.decode_rows import common_prefix
from backends.mlx.llm.sampler.params import SamplingParams

GREEDY = SamplingParams()
SMOOTHING = 0.8  # weight of the earlier calls in the running time averages


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
        self.budget = DraftBudget(target.meta.draft_tokens if target is not None else 16)
        if cost is not None:
            self.budget.draft_cost = DraftBudget.DRAFT_COST + cost
        self.calls = 0  # draft program calls, all proposals together
        self.seconds = 0.0  # their time
        self._draft_s = self._target_s = None  # running averages: one draft call, the time between proposals
        self._last: tuple[list[int], list[int], float] | None = None  # (sequence, drafts, when) of the last proposal

    @property
    def meta(self):
        return self.decoder.meta

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        started = time.perf_counter()
        seq = list(prompt) + list(output)
        self._observe(seq, started)
        k = min(k, self.budget.size(), self.meta.max_seq_len - len(seq))  # the draft cache has room for no more
        drafts = [step.token for step in self.decoder.stream(seq, k, GREEDY, reuse=True)] if k > 0 else []
        seconds = time.perf_counter() - started
        calls = len(drafts) + (1 if drafts and self.meta.pipelined else 0)
        self.calls += calls
        self.seconds += seconds
        if output and calls:  # a prompt's prefill is not a draft call
            self._draft_s = _average(self._draft_s, seconds / calls)
        self._last = (seq, drafts, time.perf_counter())
        return drafts

    def _observe(self, seq: list[int], now: float) -> None:
        """What became of the last proposal, when `seq` continues its sequence: the drafts accepted, the time
        the target took; then the budget's cost per draft."""
        if self._last is None:
            return
        last, drafts, when = self._last
        if len(seq) <= len(last) or seq[:len(last)] != last:  # another sequence: nothing to learn
            return
        self.budget.update(len(drafts), min(common_prefix(seq[len(last):], drafts), len(drafts)))
        self._target_s = _average(self._target_s, now - when)
        if self.cost is None and self._draft_s is not None:
            # A draft costs its draft call, and its share of the verifying call (the default budget's cost).
            self.budget.draft_cost = DraftBudget.DRAFT_COST + self._draft_s / max(self._target_s, 1e-9)


def _average(mean: float | None, value: float) -> float:
    return value if mean is None else SMOOTHING * mean + (1 - SMOOTHING) * value


def check_vocabulary(draft_vocab: int, draft_pte, target_vocab: int, target_pte) -> None:
    if draft_vocab != target_vocab:
        raise ValueError(f"draft model {draft_pte} has a vocabulary of {draft_vocab} tokens but {target_pte} has "
                         f"{target_vocab}: a draft model must use the program's tokenizer")
