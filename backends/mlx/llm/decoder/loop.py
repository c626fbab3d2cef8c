"""The on-device decode loop over a decoder .pte (see export.py), one sequence at a time.

A program exported with --batch B > 1 runs too: the sequence is row 0, the other rows idle (one
token at position 0, greedy), and only row 0 is read back.

    decoder = Decoder("model.pte")
    for step in decoder.stream(prompt_ids, max_tokens=64, params=SamplingParams(temperature=0.8, seed=1)):
        print(step.token)

Step 0 is the prefill call (the whole prompt, one program call); step k > 0 feeds the previous
token at position len(prompt) + k - 1. Seeded programs draw with seed = params.seed + step, so a
whole generation is reproducible from one base seed. A pipelined program (pipelined.py) gets the
same calls, except that step k > 0 feeds -1 (the device's own token) and returns step k-1's token:
the host reads token k-1 while the device computes step k. Same tokens, one extra step at the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from backends.mlx.llm.decoder.constraints import EXPORT_HINT, Constraint, ConstraintError, Matcher, vocabulary_for
from backends.mlx.llm.decoder.meta import FED_BACK, PIPELINED_HINT, DecoderMeta
from backends.mlx.llm.decoder.step_inputs import step_inputs
from backends.mlx.llm.decoder.tokenizer_files import has_tokenizer, load_tokenizer
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.llm.sampler.processing import NO_ALLOWED_TOKEN
from backends.mlx.runtime.runner import load_method


@dataclass
class Step:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    first_token_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0


def check_prompt(meta: DecoderMeta, prompt_ids, max_tokens: int) -> list[int]:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    ids = list(prompt_ids)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < meta.vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be ints in [0, {meta.vocab_size})")
    if len(ids) + max_tokens > meta.max_seq_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the program's "
                         f"max_seq_len {meta.max_seq_len}")
    return ids


class Decoder:
    def __init__(self, pte: Path):
        self.pte = Path(pte)
        if not self.pte.is_file():
            raise FileNotFoundError(f"{self.pte} does not exist")
        self.meta = DecoderMeta.load(self.pte)
        self.method = load_method(self.pte)
        self.meta.check_program(self.pte, self.method.input_specs())
        self._tokenizer = None
        self._vocabulary = None

    @property
    def has_tokenizer(self) -> bool:
        return has_tokenizer(self.pte, self.meta)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.pte, self.meta)
            if self._tokenizer is None:
                raise FileNotFoundError(f"{self.pte} has no tokenizer: pass token ids (--prompt-ids) or re-export "
                                        "from a checkpoint that has one")
        return self._tokenizer

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh grammar state for one sequence; ConstraintError names a bad constraint, or a program
        exported without the mask input, before anything is decoded."""
        if not self.meta.config.allowed_mask:
            raise ConstraintError(EXPORT_HINT)
        if self.meta.pipelined:
            raise ConstraintError(PIPELINED_HINT)
        if self._vocabulary is None:
            self._vocabulary = vocabulary_for(self.pte, self.meta)
        return self._vocabulary.matcher(constraint)

    def _call(self, tokens: list[int], start: int, params: SamplingParams, step: int,
              matcher: Matcher | None = None, returns: bool = True) -> Step | None:
        # Rows 1.. of a batched program idle: one token at position 0, greedy, their output ignored.
        idle = self.meta.batch - 1
        batch = torch.zeros(self.meta.batch, len(tokens), dtype=torch.int64)
        batch[0] = torch.tensor(tokens)
        inputs = step_inputs(self.meta, batch, [start] + [0] * idle, [len(tokens)] + [1] * idle,
                             [params] + [SamplingParams()] * idle, [step] + [0] * idle, [step == 0] + [True] * idle,
                             masks=[matcher.mask()] if matcher is not None else None)
        out = self.method.execute(inputs)
        if not returns:
            return None
        result = Step(int(out[0][0]))
        if result.token == NO_ALLOWED_TOKEN:
            raise ConstraintError("the grammar allows no token the model can produce here (every allowed token "
                                  "has probability 0)")
        if matcher is not None:
            matcher.advance(result.token)
        if self.meta.config.logprobs:
            result.logprob = float(out[1][0])
            result.top = [(int(i), float(v)) for i, v in zip(out[2][0], out[3][0])]
        return result

    def stream(self, prompt_ids, max_tokens: int, params: SamplingParams | None = None,
               stop_at_eos: bool = True, constraint: Constraint | None = None) -> Iterator[Step]:
        """With a constraint the output matches it (ending with EOS once complete), or stops at max_tokens."""
        params = params or SamplingParams()
        params.check(self.meta.config, self.meta.vocab_size)
        prompt = check_prompt(self.meta, prompt_ids, max_tokens)
        matcher = self.matcher(constraint) if constraint is not None else None
        if self.meta.pipelined:
            yield from self._stream_pipelined(prompt, max_tokens, params, stop_at_eos)
            return
        step = self._call(prompt, 0, params, 0, matcher)
        for k in range(max_tokens):
            yield step
            if (stop_at_eos and step.token in self.meta.eos_token_ids) or k + 1 == max_tokens:
                return
            step = self._call([step.token], len(prompt) + k, params, k + 1, matcher)

    def _stream_pipelined(self, prompt: list[int], max_tokens: int, params: SamplingParams,
                          stop_at_eos: bool) -> Iterator[Step]:
        self._call(prompt, 0, params, 0, returns=False)  # its outputs are the previous call's
        for k in range(max_tokens):
            step = self._call([FED_BACK], len(prompt) + k, params, k + 1)  # runs step k + 1, returns step k
            yield step
            if (stop_at_eos and step.token in self.meta.eos_token_ids) or k + 1 == max_tokens:
                return

    def generate(self, prompt_ids, max_tokens: int, params: SamplingParams | None = None,
                 constraint: Constraint | None = None) -> Generation:
        out = Generation(prompt_tokens=len(list(prompt_ids)))
        start = time.perf_counter()
        decode_start = start
        for step in self.stream(prompt_ids, max_tokens, params, constraint=constraint):
            if not out.tokens:
                decode_start = time.perf_counter()
                out.first_token_s = decode_start - start
            out.tokens.append(step.token)
            if step.logprob is not None:
                out.logprobs.append(step.logprob)
                out.top_logprobs.append(step.top)
        decode_s = time.perf_counter() - decode_start
        out.prefill_tokens_per_s = out.prompt_tokens / out.first_token_s if out.first_token_s > 0 else 0.0
        out.decode_tokens_per_s = (len(out.tokens) - 1) / decode_s if decode_s > 0 and len(out.tokens) > 1 else 0.0
        out.finish_reason = "stop" if out.tokens and out.tokens[-1] in self.meta.eos_token_ids else "length"
        return out
