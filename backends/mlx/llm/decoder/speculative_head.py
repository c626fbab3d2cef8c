"""DraftVerifyingHead: the decoder program of `etmlx export --draft-tokens K`.

Inputs: tokens [B, L], start_pos [B], lengths [B] (as every decoder program: row b's real tokens are
tokens[b, :lengths[b]] at cache positions start_pos[b]..), then verify [B, G] (G dynamic, 1..K+1): per row
its last accepted token, then its n drafts (0..K; they are the row's last n real tokens), then -1 padding.
Then temperature, seed and the sampler's knobs, as the plain program takes them; the allowed mask (structured
output) is per verified position, [B, G, words]: position i's is the grammar's after drafts 1..i.
Outputs: accepted [B] (drafts accepted, 0..n) and token [B] (the next token after them).

One pass runs all L tokens through the model (a prefill is a call without drafts, and may carry drafts too);
the logits of the last accepted token and the G - 1 positions after it go to the verification
(sampler/draft_verification.py): the head and the sampler cost what the call's drafts need, so a call
without drafts costs about a plain step (G = 1: only the last token). That is for one-row programs: with a batch > 1, sizes B * G
would be expressions of a dynamic G, which the delegate does not take, so G is always K + 1 there.
The KV entries written for rejected drafts stay in the cache: the next call starts at the row's next
position and overwrites them before anything attends to them, and until then the mask (key position <= query position) hides them. That is why this program keeps full-length caches for
sliding-window layers (StaticCacheLM(rings=False)): a ring slot written for a rejected position would have
lost an older position that later queries still see.
"""

from __future__ import annotations

import torch

from backends.mlx.llm.sampler.draft_verification import check_draft_config, counting, verify_drafts
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
        # True while the exporter traces the program's plain step: the graph the runtime runs instead of the
        # verifying one for a call without drafts (verify [1, 1]; plain_step.py).
        self.plain_step = False

    def forward(self, tokens, start_pos, lengths, verify, *, temperature, seed=None, top_k=None, top_p=None,
                min_p=None, bias_ids=None, bias_values=None, presence_penalty=None, frequency_penalty=None,
                repetition_penalty=None, penalty_reset=None, penalty_add=None, allowed_mask=None):
        if self.plain_step:
            # A call without drafts is a plain step: the plain sampler's token after the last real token (the
            # draw position 0 makes below, seed + 0), nothing accepted. `verify` is not read: the runtime
            # matches the plain step's inputs to the program's by name.
            # Nothing accepted, made first: a delegate returns its outputs in the order its graph makes them, and
            # the verifying graph makes `accepted` before the token (the exporter checks both orders agree).
            none = torch.zeros_like(lengths)
            mask = None if allowed_mask is None else allowed_mask[:, 0]
            token = SamplingHead.forward(self, tokens, start_pos, lengths, temperature=temperature, seed=seed,
                                         top_k=top_k, top_p=top_p, min_p=min_p, bias_ids=bias_ids,
                                         bias_values=bias_values, presence_penalty=presence_penalty,
                                         frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                                         penalty_reset=penalty_reset, penalty_add=penalty_add, allowed_mask=mask)
            return none, token
        last = lengths - 1
        # verify [B, G]: the row's last accepted token, its drafts, -1 padding. G (dynamic, 1..K+1) is the call's
        # widest row: the head and the sampler run over G positions, not K + 1, so a call without drafts costs
        # about what a plain step does.
        drafted = torch.minimum((verify >= 0).to(torch.int64).sum(dim=1) - 1, last).clamp(min=0)
        positions = counting(verify)  # [B, G]: 0, 1, .. (once: each counting is a few graph nodes)
        index = torch.minimum((last - drafted).unsqueeze(1) + positions, last.unsqueeze(1))
        logits = self.model(tokens, start_pos, lengths, gather=index)  # [B, G, V]
        # Position i's draw is checked against draft i + 1 (the last column wraps around: never a real draft).
        following = positions + 1
        width = torch.ones_like(verify).sum(dim=1, keepdim=True)  # G as a tensor: sizes stay out of arithmetic
        following = torch.where(following < width, following, torch.zeros_like(following))
        drafts = torch.where(verify >= 0, verify, torch.zeros_like(verify)).gather(1, following)
        knobs = dict(top_k=top_k, top_p=top_p, min_p=min_p, bias_ids=bias_ids, bias_values=bias_values,
                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                     repetition_penalty=repetition_penalty, penalty_reset=penalty_reset, penalty_add=penalty_add)
        if allowed_mask is not None and (allowed_mask.dim() != 3 or allowed_mask.shape[1] != verify.shape[1]):
            raise ValueError(f"allowed_mask must be [B, G, words] (a mask per verified position, G = "
                             f"{verify.shape[1]}), got {tuple(allowed_mask.shape)}")
        check_knobs(self.config, logits[:, 0], {**knobs, "allowed_mask": None if allowed_mask is None else allowed_mask[:, 0]})
        knobs = {name: value for name, value in knobs.items() if value is not None}
        if allowed_mask is not None:
            knobs["allowed_mask"] = allowed_mask
        state = self.penalty_counts if self.penalty_counts is not None else self.penalty_window
        return verify_drafts(self.config, logits, drafts, drafted, temperature, seed, knobs, state, positions)
