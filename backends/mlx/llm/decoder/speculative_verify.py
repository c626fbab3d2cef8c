"""Check a written draft-verifying program (--draft-tokens K) against the eager model it was exported from.

The program decodes greedily through the speculative driver with the eager model's own greedy continuation as
the prediction, one token of it corrupted halfway: calls then accept drafts, reject one, and go on from the
correction. Every token must be the eager argmax over the prompt and the program's tokens so far (verify.py's
rule: a near tie within the tolerance is reported, not failed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from backends.mlx.llm.decoder.draft_sources import PredictionDraft
from backends.mlx.llm.decoder.speculative import SpeculativeDecoder
from backends.mlx.llm.decoder.verify import (PROMPT_TOKENS, VerificationError, VerificationReport, activation_dtype,
                                             check_continuation, is_quantized, verification_prompt)
from backends.mlx.llm.sampler.params import SamplingParams

GENERATED = 12


@dataclass
class DraftVerificationReport(VerificationReport):
    proposed: int = 0
    accepted: int = 0

    def summary(self) -> str:
        return f"{super().summary()}; drafts verified: {self.accepted}/{self.proposed} accepted"


def _eager_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def verify_draft_program(model: torch.nn.Module, pte: Path) -> DraftVerificationReport:
    decoder = SpeculativeDecoder(Path(pte))
    meta = decoder.meta
    generated = min(GENERATED, meta.max_seq_len - 1)
    room = meta.max_seq_len - generated
    if generated < 1 or room < 1:
        raise VerificationError(f"max_seq_len {meta.max_seq_len} leaves no room for a prompt and a token: "
                                "nothing to verify (pass verify=False / --no-verify)")
    prompt = verification_prompt(meta.vocab_size, min(PROMPT_TOKENS, room))
    prediction = _eager_greedy(model, prompt, generated)
    half = len(prediction) // 2
    prediction[half] = (prediction[half] + 1) % meta.vocab_size  # a draft the program must reject
    tokens = list(decoder.stream(prompt, generated, SamplingParams(), draft=PredictionDraft(prediction),
                                 stop_at_eos=False))
    dtype = str(activation_dtype(model)).replace("torch.", "")
    report = DraftVerificationReport(steps=0, dtype=dtype, quantized=is_quantized(model),
                                     proposed=decoder.stats.proposed, accepted=decoder.stats.accepted)
    check_continuation(model, pte, prompt, tokens, report, "output token",
                       "decodes differently from the eager model with drafts")
    return report
