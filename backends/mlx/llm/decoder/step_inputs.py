"""Per-row sampling parameters and the input list of one decoder-program call."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from backends.mlx.llm.decoder.meta import DecoderMeta

# The export flag that enables each knob, for error messages.
_FEATURE_FLAG = {"top_k": "top-k", "top_p": "top-p", "min_p": "min-p", "presence_penalty": "penalties",
                 "frequency_penalty": "penalties", "repetition_penalty": "penalties", "logit_bias": "logit-bias=N"}


@dataclass
class SamplingParams:
    """One row's sampling settings; the defaults are "off". temperature 0 is greedy."""

    temperature: float = 0.0
    seed: int = 0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict = field(default_factory=dict)  # token id -> bias in [-100, 100]

    def check(self, meta: DecoderMeta) -> None:
        """Reject values out of range, and values a program exported without that feature would ignore."""
        def number(name, value, kinds=(int, float)):
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if isinstance(value, float) and math.isnan(value):
                raise ValueError(f"{name} is NaN")
            return value

        if number("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        number("seed", self.seed, (int,))
        if number("top_k", self.top_k, (int,)) < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < number("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= number("min_p", self.min_p) <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(name, getattr(self, name)) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if number("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not isinstance(self.logit_bias, dict):
            raise TypeError("logit_bias must be a dict of token id -> bias")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < meta.vocab_size:
                raise ValueError(f"logit_bias keys must be token ids in [0, {meta.vocab_size}), got {token!r}")
            if not -100 <= number("logit_bias value", bias) <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        config = meta.config
        used = {"top_k": self.top_k != 0, "top_p": self.top_p != 1, "min_p": self.min_p != 0,
                "presence_penalty": self.presence_penalty != 0, "frequency_penalty": self.frequency_penalty != 0,
                "repetition_penalty": self.repetition_penalty != 1}
        available = set(config.knob_names())
        for name, on in used.items():
            if on and name not in available:
                raise ValueError(f"{name}: this program was exported without it (export with --sampler "
                                 f"{_FEATURE_FLAG[name]})")
        if len(self.logit_bias) > config.logit_bias:
            raise ValueError(f"logit_bias: {len(self.logit_bias)} entries but the program takes at most "
                             f"{config.logit_bias} (export with --sampler logit-bias=N)")


def step_inputs(meta: DecoderMeta, tokens: torch.Tensor, start_pos, lengths, params: list[SamplingParams],
                steps: list[int], reset: list[bool]) -> list[torch.Tensor]:
    """The input list, in the program's order, for one call over meta.batch rows.

    steps[b] is row b's decode step (its seed is params[b].seed + steps[b]); reset[b] zeroes the
    row's penalty counts before this call (the start of a sequence)."""
    batch = meta.batch
    if tokens.shape[0] != batch or len(params) != batch:
        raise ValueError(f"the program decodes {batch} row(s) per call, got {tokens.shape[0]}")
    config = meta.config
    values = {
        "tokens": tokens.contiguous(),
        "start_pos": torch.as_tensor(start_pos, dtype=torch.int64),
        "lengths": torch.as_tensor(lengths, dtype=torch.int64),
        "temperature": torch.tensor([float(p.temperature) for p in params]),
        "seed": torch.tensor([p.seed + s for p, s in zip(params, steps)], dtype=torch.int64),
        "top_k": torch.tensor([p.top_k for p in params], dtype=torch.int64),
        "top_p": torch.tensor([float(p.top_p) for p in params]),
        "min_p": torch.tensor([float(p.min_p) for p in params]),
        "presence_penalty": torch.tensor([float(p.presence_penalty) for p in params]),
        "frequency_penalty": torch.tensor([float(p.frequency_penalty) for p in params]),
        "repetition_penalty": torch.tensor([float(p.repetition_penalty) for p in params]),
        "penalty_reset": torch.tensor([int(r) for r in reset], dtype=torch.int64),
        "penalty_add": torch.full((batch, config.penalty_seed), -1, dtype=torch.int64),
    }
    if config.logit_bias:
        ids = torch.zeros(batch, config.logit_bias, dtype=torch.int64)
        vals = torch.zeros(batch, config.logit_bias)
        for row, p in enumerate(params):
            for j, (token, bias) in enumerate(p.logit_bias.items()):
                ids[row, j], vals[row, j] = token, float(bias)
        values["bias_ids"], values["bias_values"] = ids, vals
    return [values[name] for name in meta.inputs]
