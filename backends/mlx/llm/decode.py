"""Export a Llama-family checkpoint for on-device decoding, and run the decode loop.

The .pte holds one method: (tokens [1, L], positions [L], temperature, seed) -> next token id,
with the model, its KV cache and the sampler on MLX. L is dynamic (1..max_seq_len), so the same
program prefills the prompt and then decodes one token per call with seed = base_seed + step.
`FILE.pte.json` beside it records what the loop needs (max_seq_len, eos ids, vocab size).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from backends.mlx.export import ExportResult, export_to_pte
from backends.mlx.llm.kv_cache import StaticCacheLM
from backends.mlx.llm.sampling import SamplingHead, SeedSchedule
from backends.mlx.runner import load_method


def export_decoder(model: torch.nn.Module, out: Path, max_seq_len: int) -> ExportResult:
    model = model.eval()
    head = SamplingHead(StaticCacheLM(model, max_seq_len=max_seq_len))
    length = torch.export.Dim("length", min=1, max=max_seq_len)
    # The example is as long as the cache: ExecuTorch sizes a dynamic input's buffer from it here.
    example = (torch.ones(1, max_seq_len, dtype=torch.int64), torch.arange(max_seq_len))
    kwargs = {"temperature": torch.tensor(1.0), "seed": torch.tensor(0)}
    # SamplingHead.forward(*args, temperature, seed): shapes are given per bound argument name.
    dynamic = {"args": ({1: length}, {0: length}), "temperature": None, "seed": None}
    result = export_to_pte(head, example, kwargs, dynamic_shapes=dynamic)
    out = Path(out)
    result.save(out)
    eos = model.config.eos_token_id
    meta = {"max_seq_len": max_seq_len, "vocab_size": model.config.vocab_size,
            "eos_token_ids": [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))}
    Path(str(out) + ".json").write_text(json.dumps(meta))
    return result


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    first_token_s: float = 0.0
    decode_tokens_per_s: float = 0.0


class Decoder:
    def __init__(self, pte: Path):
        pte = Path(pte)
        meta_path = Path(str(pte) + ".json")
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} is missing: export the model with `etmlx export`")
        self.meta = json.loads(meta_path.read_text())
        self.method = load_method(pte)

    def stream(self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
               stop_at_eos: bool = True) -> Iterator[int]:
        limit, vocab = self.meta["max_seq_len"], self.meta["vocab_size"]
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if any(not (0 <= t < vocab) for t in prompt_ids):
            raise ValueError(f"prompt_ids must be token ids in [0, {vocab})")
        if len(prompt_ids) + max_tokens > limit:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds max_seq_len {limit}")
        seeds = SeedSchedule(seed)
        t = torch.tensor(float(temperature))
        n = len(prompt_ids)
        token = int(self.method.execute([torch.tensor([prompt_ids]), torch.arange(n), t, seeds(0)])[0][0])
        for step in range(max_tokens):
            yield token
            if (stop_at_eos and token in self.meta["eos_token_ids"]) or step + 1 == max_tokens:
                return
            pos = n + step
            token = int(self.method.execute([torch.tensor([[token]]), torch.tensor([pos]), t, seeds(step + 1)])[0][0])

    def generate(self, prompt_ids, max_tokens, temperature=0.0, seed=0) -> Generation:
        out = Generation()
        start = time.perf_counter()
        for token in self.stream(prompt_ids, max_tokens, temperature, seed):
            if not out.tokens:
                out.first_token_s = time.perf_counter() - start
                decode_start = time.perf_counter()
            out.tokens.append(token)
        decode_s = time.perf_counter() - decode_start if out.tokens else 0.0
        out.decode_tokens_per_s = (len(out.tokens) - 1) / decode_s if decode_s > 0 else 0.0
        out.finish_reason = "stop" if out.tokens and out.tokens[-1] in self.meta["eos_token_ids"] else "length"
        return out
