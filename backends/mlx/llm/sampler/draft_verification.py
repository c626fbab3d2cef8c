"""Verify drafted tokens against the target model's logits: greedy at T = 0, rejection sampling at T > 0.

    accepted, token = verify_drafts(config, logits, drafts, draft_len, temperature, seed, knobs, state)

logits [B, G, V] (G <= K + 1): position i holds the model's logits after the row's last accepted token and its
drafts 1..i. drafts [B, G]: drafts[:, i] is the draft that position i's draw must equal, so draft i + 1;
draft_len [B] of them are real, the rest (the last column always) padding. Returns per row the number of drafts
accepted, n in 0..draft_len, and the next token after them (the correction when a draft was rejected, the
bonus token when all were accepted).

The drafts are deterministic proposals (n-gram lookup, a prediction, a draft model's greedy token): the draft
distribution q is a point mass at draft x. Leviathan et al. 2023 / Chen et al. 2023 then accept x with
probability min(1, p(x) / q(x)) = p(x) and, on rejection, draw from normalise((p - q)+), which is p with x
removed and renormalised, where p is the processed target distribution (after every sampler knob). Both
draws are made here with one Gumbel-max draw y ~ p, the plain sampler's own (process_and_sample) under the
seed the plain decode loop would use at that step (seed + i for position i): accept iff y == x, which happens
with probability p(x); given y != x, y is distributed as p restricted to the other tokens, which is the
residual. So the output distribution is exactly the plain sampler's, and, for the same seeds, the tokens are
the plain loop's tokens. At T = 0 the sampler's draw is the argmax after every knob: greedy acceptance.

Structured output: the allowed mask is per position ([B, G, W]): position i's is the grammar's after drafts
1..i, so position i draws as the plain sampler would under that step's mask (the host cuts the drafts at the
first one the grammar rejects). A draw no token can satisfy is -1, which no draft equals.

Penalty state: position i sees the row's counts (or window) plus drafts 1..i; the state written back is the
one of the last accepted position, plus the next token: rejected drafts are never counted.

Traced by torch.export this is part of the device program (decoder/speculative_head.py); run eagerly it is
the host reference, bit for bit (the custom ops' CPU implementations reproduce the device: processing.py).
"""

from __future__ import annotations

import torch

from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.processing import counts_for_step, process_and_sample, window_for_step

_STATE_KNOBS = ("penalty_reset", "penalty_add")


def check_draft_config(config: SamplerConfig) -> None:
    """What a verifying program cannot return or apply yet, refused by name."""
    if config.logprobs:
        raise ValueError("--draft-tokens: logprobs are not returned by a draft-verifying program yet; export "
                         "without --logprobs")
    if config.expose_counts:
        raise ValueError("expose_counts is for sampler tests, not draft-verifying programs")


# The number of positions G is a dynamic size in a program (the call's widest row of drafts, plus one): sizes
# here come from tensors (`counting`, expand to a tensor's shape, reshape with -1), never from arithmetic on G,
# which the exported program could not evaluate.


def counting(like: torch.Tensor) -> torch.Tensor:
    """0, 1, .. along the last axis of `like` (int64, like's shape): arange without a size."""
    return torch.cumsum(torch.ones_like(like, dtype=torch.int64), dim=-1) - 1


def _row_owner(positions: torch.Tensor) -> torch.Tensor:
    """[B*G]: the row b of each (b, i), in row-major order."""
    return (torch.cumsum(torch.ones_like(positions), dim=0) - 1).reshape(-1)


def _spread(t: torch.Tensor, batch: int, owner: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B*G, ...]: row b's value for each of its G positions (`owner`: _row_owner of the positions;
    scalars broadcast as they are). An index_select, not expand + reshape: reshaping an expanded tensor of
    dynamic size makes torch.export guard on its strides."""
    if t.dim() == 0:
        return t
    if t.shape[0] != batch:
        raise ValueError(f"per-row knob tensors must have {batch} rows, got shape {tuple(t.shape)}")
    return t.index_select(0, owner)


def draft_prefixes(drafts: torch.Tensor, positions: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """[B, G] -> [B*G, G]: the drafts position (b, i) has seen (drafts[b, :i]), left-aligned, -1 after
    (penalty_add's layout); `positions` counting(drafts), `owner` its _row_owner."""
    rows = drafts.index_select(0, owner)  # [B*G, G]
    seen = positions.index_select(0, owner) < positions.reshape(-1, 1)  # j < i
    return torch.where(seen, rows, torch.full_like(rows, -1))


def position_tokens(config: SamplerConfig, logits: torch.Tensor, drafts: torch.Tensor, temperature, seed,
                    knobs: dict, state: torch.Tensor | None = None, positions: torch.Tensor | None = None):
    """The plain sampler's token at every position ([B, K+1]) and the penalty state after each ([B, K+1, ...],
    None without penalties), position i assuming drafts 1..i were accepted. `positions`: counting(drafts), when
    the caller has it (each counting is a few graph nodes, and a small program's call time is its nodes')."""
    check_draft_config(config)
    batch, vocab = logits.shape[0], logits.shape[2]
    if drafts.dim() != 2 or drafts.shape[0] != batch or logits.dim() != 3:
        raise ValueError(f"drafts must be [{batch}, G] for logits [{batch}, G, V], got {tuple(drafts.shape)} "
                         f"and {tuple(logits.shape)}")
    positions = counting(drafts) if positions is None else positions  # [B, G]: i
    owner = _row_owner(positions)
    temperature = temperature.reshape(-1).expand(batch)
    t_rows = _spread(temperature, batch, owner)
    seed_rows = None
    if seed is not None:  # position i draws as the plain loop's step i later would: seed + i
        seed_rows = (seed.reshape(-1).expand(batch).unsqueeze(1) + positions).reshape(-1)
    knobs_rows = {name: (None if value is None else _spread(value, batch, owner)) for name, value in knobs.items()
                  if name not in _STATE_KNOBS and name != "allowed_mask"}
    if knobs.get("allowed_mask") is not None:  # [B, G, W]: position i's mask, the grammar after drafts 1..i
        mask = knobs["allowed_mask"]
        knobs_rows["allowed_mask"] = mask.reshape(-1, mask.shape[-1])
    state_rows = None
    if config.penalties:
        if state is None:
            raise ValueError("penalties need the penalty state")
        step = window_for_step if config.penalty_window else counts_for_step
        before = step(state, knobs["penalty_reset"], knobs.get("penalty_add"))  # the call's reset and prompt ids
        state_rows = _spread(before, batch, owner).clone()
        knobs_rows["penalty_reset"] = torch.zeros_like(positions).reshape(-1)
        knobs_rows["penalty_add"] = draft_prefixes(drafts, positions, owner)
    tokens = process_and_sample(config, logits.reshape(-1, vocab), t_rows, seed_rows, knobs_rows, state_rows)
    after = state_rows.view(batch, -1, *state_rows.shape[1:]) if state_rows is not None else None
    return tokens.view(batch, -1), after


def accepted_run(tokens: torch.Tensor, drafts: torch.Tensor, draft_len: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B]: how many leading drafts equal the sampler's token at their position (and are real drafts); tokens
    and drafts [B, G], positions counting(drafts)."""
    hit = (tokens == drafts) & (positions < draft_len.unsqueeze(1))
    return (torch.cumsum((~hit).to(torch.int64), dim=1) == 0).to(torch.int64).sum(dim=1)


def verify_drafts(config: SamplerConfig, logits: torch.Tensor, drafts: torch.Tensor, draft_len: torch.Tensor,
                  temperature, seed, knobs: dict, state: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None):
    """(accepted [B] int64, next token [B] int64); `state` (penalty counts or window) is updated in place.
    `positions`: counting(drafts), when the caller has it."""
    positions = counting(drafts) if positions is None else positions
    tokens, after = position_tokens(config, logits, drafts, temperature, seed, knobs, state, positions)
    accepted = accepted_run(tokens, drafts, draft_len, positions)
    token = tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)
    if after is not None:
        batch, width = state.shape
        state.copy_(after.gather(1, accepted.view(batch, 1, 1).expand(batch, 1, width)).squeeze(1))
    return accepted, token
