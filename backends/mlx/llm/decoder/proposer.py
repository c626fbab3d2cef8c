"""A draft model's program that proposes K tokens in one call (`etmlx export --propose-tokens K`).

    call:  tokens [B, L], start_pos [B], lengths [B], temperature [B], seed [B]  (a plain program's inputs)
    returns tokens [B, K]: column 0 is what the plain program's call returns; column i is the token the
                           plain program's next call would return, fed column i - 1 at the next position

Why: a draft model (draft_model.py) pays only where its proposals cost a fraction of the target's calls, and a
plain draft program makes one call per drafted token, each paying the per-call cost (building and evaluating the
graph, the runtime's call) that dominates a small model's step. This program runs the model and sampler K times
in one graph, feeding each step's token to the next, so a proposal of K drafts is one call.

Any decode loop can still drive it as a plain unpipelined program (llm/decoder/decode_rows.py reads column 0):
its later columns are then written into the row's cache past the fed tokens and overwritten by the next call,
like a rejected draft's. The KV cache is full-length (no sliding-window ring): a ring slot written for a proposed
position would hold an entry that an earlier position's next call still attends to.

Only the plain sampler (temperature and seed; no knobs, no logprobs): a proposal is the draft model's greedy
guess, and knobs would need a penalty state and a mask per proposed step. A seeded program draws step i with
seed + i, the plain schedule, so the K columns at temperature > 0 are what K plain calls would draw.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.verify import (PROMPT_TOKENS, VerificationError, VerificationReport, check_continuation,
                                             verification_prompt, verify_decoder)
from backends.mlx.llm.sampler.head import SamplingHead
from backends.mlx.llm.sampler.params import SamplingParams


class ProposingHead(nn.Module):
    """Wraps a plain SamplingHead over a StaticCacheLM: the same inputs, K tokens per row out."""

    def __init__(self, head: SamplingHead, propose_tokens: int, max_seq_len: int):
        super().__init__()
        if not head.config.plain:
            raise ValueError("--propose-tokens takes the plain sampler (temperature and seed): a proposal is a "
                             "draft model's greedy guess; export it without sampler knobs or logprobs")
        self.head = head
        self.propose_tokens = propose_tokens
        self.last_position = max_seq_len - 1

    def forward(self, tokens, start_pos, lengths, temperature, seed=None):
        token = self.head(tokens, start_pos, lengths, temperature=temperature, seed=seed)
        proposed = [token]
        pos = start_pos + lengths  # the position after each row's last fed token
        one = torch.ones_like(lengths)
        for i in range(1, self.propose_tokens):
            # A step past the cache's end writes its last slot: no later call can attend to it (the cache is
            # full), and the caller drops such tokens (loop.py Decoder.propose); never an out-of-range write.
            token = self.head(token.unsqueeze(1), pos.clamp(max=self.last_position), one, temperature=temperature,
                              seed=None if seed is None else seed + i)
            proposed.append(token)
            pos = pos + 1
        return torch.stack(proposed, dim=1)

    forward.__signature__ = inspect.signature(SamplingHead.forward)


def verify_proposer(model: nn.Module, pte: Path) -> VerificationReport:
    """verify_decoder's check of column 0 (a plain decode through the program), then one call's K columns
    against the eager model's greedy continuation of the verification prompt."""
    report = verify_decoder(model, pte)
    decoder = Decoder(Path(pte))
    k = decoder.meta.propose_tokens
    room = decoder.meta.max_seq_len - k
    if room < 1:
        raise VerificationError(f"max_seq_len {decoder.meta.max_seq_len} leaves no room for a prompt and "
                                f"{k} proposed tokens: nothing to verify (pass verify=False / --no-verify)")
    prompt = verification_prompt(decoder.meta.vocab_size, min(PROMPT_TOKENS, room))
    proposed = decoder.propose(prompt, SamplingParams())
    check_continuation(model, pte, prompt, proposed, report, "proposed token",
                       "proposes differently from the eager model")
    return report
