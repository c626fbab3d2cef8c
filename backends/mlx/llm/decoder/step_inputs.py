"""The input list of one decoder-program call, laid out from the knob table.

No validation here: a SamplingParams is checked when it is made, and against the program
(`SamplingParams.check`) where a request enters (Decoder.stream, Engine.check).
"""

from __future__ import annotations

import torch

from backends.mlx.llm.decoder.meta import (ADAPTER_INPUT, DELIVER_INPUT, DRAFT_INPUT, IMAGE_INPUT, ROPE_INPUT,
                                           DecoderMeta)
from backends.mlx.llm.sampler.knobs import KNOBS, enabled, width
from backends.mlx.llm.sampler.params import SamplingParams


def verify_input(tokens: torch.Tensor, lengths, drafts: list, draft_tokens: int, min_width: int = 1) -> torch.Tensor:
    """[B, G]: per row its last accepted token (the one before its drafts), its drafts, -1 padding. A one-row
    program's G is dynamic: one more than the row's drafts, at least `min_width` (DecoderMeta.verify_min_width);
    a batched program's is K + 1."""
    width = max(min_width, 1 + max(len(d) for d in drafts)) if tokens.shape[0] == 1 else draft_tokens + 1
    # Rows made as lists, then one tensor: element-wise tensor writes cost a decode step's host time several times.
    rows = []
    for b, (n, d) in enumerate(zip(lengths, drafts)):
        row = [int(tokens[b, int(n) - 1 - len(d)])] + [int(x) for x in d]
        rows.append(row + [-1] * (width - len(row)))
    return torch.tensor(rows, dtype=torch.int64)


def step_inputs(meta: DecoderMeta, tokens: torch.Tensor, start_pos, lengths, params: list[SamplingParams],
                seeds: list[int], reset: list[bool], masks: list | None = None,
                drafts: list | None = None, deliver: bool = True,
                image_embeds: torch.Tensor | None = None, adapters: list[int] | None = None,
                rope_positions: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The input list, in the program's order, for one call over meta.batch rows.

    seeds[b] is row b's seed for this call (the decode-step rules' schedule, runtime/decode_rows.h: its base
    seed + its step); reset[b] zeroes the row's penalty counts before this call (the start of a sequence); masks[b], for a program with
    the allowed-mask input, is row b's packed bitmask (ceil(V/32) int32 words) or None (all allowed).
    drafts[b], for a draft-verifying program (meta.draft_tokens > 0): row b's drafted tokens, which are also
    its last real tokens (default none); its masks[b] then holds one mask per verified position ([n + 1, words]:
    the grammar before the row's drafts, and after each), positions past them allowing every token.
    `deliver`: a pipelined draft-verifying program's call returns its own outputs (pipelined_verify.py).
    `image_embeds` [B, L, D]: a vision-language program's image embeddings (zeros where none is given).

    adapters[b], for a program with switchable adapters (meta.adapters): row b's adapter index (default 0, none).
    `rope_positions` [B, L, 3], for a program with multimodal RoPE (qwen2_vl.py): each token's rotary positions
    (default: its cache position in all three)."""
    batch = meta.batch
    if tokens.shape[0] != batch or len(params) != batch:
        raise ValueError(f"the program decodes {batch} row(s) per call, got {tokens.shape[0]}")
    config = meta.config
    values = {
        "tokens": tokens.contiguous(),
        "start_pos": torch.as_tensor(start_pos, dtype=torch.int64),
        "lengths": torch.as_tensor(lengths, dtype=torch.int64),
    }
    if meta.takes_images:
        values[IMAGE_INPUT] = (image_embeds if image_embeds is not None else
                               torch.zeros(*tokens.shape, meta.image_embed_dim)).contiguous()
    if ROPE_INPUT in meta.inputs:
        if rope_positions is None:
            rope_positions = (values["start_pos"].view(-1, 1) + torch.arange(tokens.shape[1])).unsqueeze(2).expand(
                -1, -1, 3)
        values[ROPE_INPUT] = rope_positions.contiguous()
    if meta.draft_tokens:
        values[DRAFT_INPUT] = verify_input(tokens, lengths, drafts or [[] for _ in range(batch)], meta.draft_tokens,
                                            meta.verify_min_width)
        values[DELIVER_INPUT] = torch.full((batch,), bool(deliver), dtype=torch.bool)
    if meta.adapters:
        values[ADAPTER_INPUT] = torch.tensor(list(adapters) if adapters is not None else [0] * batch, dtype=torch.int64)
    for knob in KNOBS:
        if not enabled(knob, config):
            continue
        dtype = getattr(torch, knob.dtype)
        if knob.name == "seed":
            values["seed"] = torch.tensor(list(seeds), dtype=torch.int64)
        elif knob.width:  # [rows, N]: the caller's pairs, or nothing (internal), padded with the off values
            n = width(knob, config, meta.vocab_size)
            # A draft-verifying program's mask is per verified position: [B, G, words].
            rows = (batch, values[DRAFT_INPUT].shape[1]) if knob.words and meta.draft_tokens else (batch,)
            tensors = [torch.full((*rows, n), i.off, dtype=getattr(torch, i.dtype)) for i in knob.program_inputs]
            if knob.words:
                for row, m in enumerate(masks if masks is not None else ()):
                    if m is None:
                        continue
                    m = torch.as_tensor(m, dtype=torch.int32)
                    if meta.draft_tokens:  # [positions, words]: the row's first positions; the rest allow all
                        m = m.reshape(-1, n)
                        tensors[0][row, :m.shape[0]] = m
                    else:
                        tensors[0][row] = m.reshape(-1)
            elif knob.api:
                ids, vals = tensors
                for row, p in enumerate(params):
                    for j, (token, value) in enumerate(getattr(p, knob.name).items()):
                        ids[row, j], vals[row, j] = token, value
            values.update({i.name: t for i, t in zip(knob.program_inputs, tensors)})
        elif knob.api:
            values[knob.name] = torch.tensor([getattr(p, knob.name) for p in params], dtype=dtype)
        else:  # internal, set on a sequence's first call
            values[knob.name] = torch.tensor([knob.first if r else knob.off for r in reset], dtype=dtype)
    return [values[name] for name in meta.inputs]
