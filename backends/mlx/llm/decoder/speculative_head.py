"""DraftVerifyingHead: the decoder program of `etmlx export --draft-tokens K`.

Inputs: tokens [B, L], start_pos [B], lengths [B] (as every decoder program: row b's real tokens are
tokens[b, :lengths[b]] at cache positions start_pos[b]..), then draft_len [B] in 0..K: the last draft_len
real tokens of the row are drafts, the token before them is the row's last accepted token. Then temperature,
seed and the sampler's knobs, as the plain program takes them.
Outputs: accepted [B] (drafts accepted, 0..draft_len) and token [B] (the next token after them).

One pass runs all L tokens through the model (a prefill is a call with draft_len 0, and may carry drafts
too); the logits of the last accepted token and the K positions after it go to the verification
(sampler/draft_verification.py). The KV entries written for rejected drafts stay in the cache: the next call
starts at the row's next position and overwrites them before anything attends to them, and until then the
mask (key position <= query position) hides them. That is why this program keeps full-length caches for
sliding-window layers (StaticCacheLM(rings=False)): a ring slot written for a rejected position would have
lost an older position that later queries still see.
"""

from __future__ import annotations

import torch

from backends.mlx.llm.sampler.draft_verification import check_draft_config, verify_drafts
from backends.mlx.llm.sampler.head import SamplingHead
from backends.mlx.llm.sampler.processing import check_knobs


class DraftVerifyingHead(SamplingHead):
    """A SamplingHead (its penalty state included) over a StaticCacheLM that verifies up to K drafts."""

    def __init__(self, lm, config, *, batch: int, vocab: int, draft_tokens: int):
        if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
            raise ValueError(f"draft_tokens must be an int >= 1, got {draft_tokens!r}")
        if getattr(lm, "rings", False):
            raise ValueError("a draft-verifying program needs full-length caches: StaticCacheLM(rings=False)")
        check_draft_config(config)
        super().__init__(lm, config, batch=batch, vocab=vocab)
        self.draft_tokens = draft_tokens

    def forward(self, tokens, start_pos, lengths, draft_len, *, temperature, seed=None, top_k=None, top_p=None,
                min_p=None, bias_ids=None, bias_values=None, presence_penalty=None, frequency_penalty=None,
                repetition_penalty=None, penalty_reset=None, penalty_add=None):
        batch = tokens.shape[0]
        last = lengths - 1
        drafted = torch.minimum(draft_len.clamp(min=0, max=self.draft_tokens), last)
        # Token indices of the last accepted token and the K after it; beyond the row's real tokens they repeat
        # its last one (those positions are never accepted: their drafts lie past draft_len).
        index = torch.minimum((last - drafted).unsqueeze(1) + torch.arange(self.draft_tokens + 1).unsqueeze(0),
                              last.unsqueeze(1))
        logits = self.model(tokens, start_pos, lengths, gather=index)  # [B, K+1, V]
        drafts = tokens.gather(1, index[:, 1:])
        knobs = dict(top_k=top_k, top_p=top_p, min_p=min_p, bias_ids=bias_ids, bias_values=bias_values,
                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                     repetition_penalty=repetition_penalty, penalty_reset=penalty_reset, penalty_add=penalty_add)
        check_knobs(self.config, logits[:, 0], {**knobs, "allowed_mask": None})
        knobs = {name: value for name, value in knobs.items() if value is not None}
        state = self.penalty_counts if self.penalty_counts is not None else self.penalty_window
        return verify_drafts(self.config, logits, drafts, drafted, temperature, seed, knobs, state)
