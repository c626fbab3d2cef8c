"""A draft model as the draft source of speculative decoding (speculative.py): a small plain decoder program
with the target's vocabulary proposes the next k tokens greedily.

    source = DraftModel("small.pte", target=SpeculativeDecoder("spec.pte"))
    tokens = list(target.stream(prompt_ids, 64, params, draft=source))

The draft program is driven by the plain loop (loop.py `Decoder.stream` with `reuse=True`), whose prompt cache
(row_caches.py) records which token sits at each position of the row's KV cache. Each proposal hands it the
whole sequence so far (prompt + output); the row already holds the prefix it shares with what was drafted
before, so only the tokens it has not seen are fed: those the target accepted beyond the last draft it fed,
and the target's correction (or bonus) token, at their explicit positions. The entries of rejected drafts
lie past that prefix and are overwritten by the call that feeds the accepted tokens. A draft is only a
guess: whatever the draft model proposes, the target's tokens are its plain program's.

Cost: k drafts take k calls of the draft program (k + 1 for a pipelined one, whose calls return the call
before's token), so a draft model pays where its calls are much cheaper than the target's.
"""

from __future__ import annotations

import time
from pathlib import Path

from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.sampler.params import SamplingParams

GREEDY = SamplingParams()


class DraftModel:
    name = "draft-model"

    def __init__(self, pte: Path, target=None):
        """`target`: the program the drafts are for (anything with `.pte` and `.meta`, e.g. a SpeculativeDecoder),
        whose vocabulary the draft program must share."""
        self.decoder = Decoder(pte)
        self.pte = self.decoder.pte
        if target is not None:
            check_vocabulary(self.decoder.meta.vocab_size, self.pte, target.meta.vocab_size, target.pte)
        self.calls = 0  # draft program calls, all proposals together
        self.seconds = 0.0  # their time

    @property
    def meta(self):
        return self.decoder.meta

    def propose(self, prompt: list[int], output: list[int], k: int) -> list[int]:
        seq = list(prompt) + list(output)
        k = min(k, self.meta.max_seq_len - len(seq))  # the draft program's cache has room for no more
        if k < 1:
            return []
        started = time.perf_counter()
        drafts = [step.token for step in self.decoder.stream(seq, k, GREEDY, reuse=True)]
        self.seconds += time.perf_counter() - started
        self.calls += len(drafts) + (1 if self.meta.pipelined else 0)
        return drafts


def check_vocabulary(draft_vocab: int, draft_pte, target_vocab: int, target_pte) -> None:
    if draft_vocab != target_vocab:
        raise ValueError(f"draft model {draft_pte} has a vocabulary of {draft_vocab} tokens but {target_pte} has "
                         f"{target_vocab}: a draft model must use the program's tokenizer")
