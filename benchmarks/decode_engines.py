"""The three decoders `etmlx bench decode` times, behind one call:

    engine.generate(prompt_ids, steps, temperature, seed) -> Run

Each prefills the prompt (which yields the first new token) and then runs `steps` decode steps of
one token each, so a Run holds steps + 1 tokens. Temperature 0 is greedy everywhere; above it each
engine uses its own seeded sampler (the token streams then differ between engines by design).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    prefill_s: float = 0.0  # prompt in, first new token out
    decode_s: float = 0.0   # the decode steps after it

    @property
    def decode_steps(self) -> int:
        return max(len(self.tokens) - 1, 0)


def timed(stream: Iterator[int], steps: int) -> Run:
    """Consume prefill + `steps` tokens from a generator that computes each token when asked for it."""
    run = Run()
    start = time.perf_counter()
    run.tokens.append(int(next(stream)))
    first = time.perf_counter()
    for _ in range(steps):
        run.tokens.append(int(next(stream)))
    run.decode_s = time.perf_counter() - first
    run.prefill_s = first - start
    return run


class EtmlxEngine:
    """Our .pte through `Decoder`: the loop a user of `etmlx generate` runs."""

    name = "etmlx"

    def __init__(self, pte: Path):
        from backends.mlx.llm.decoder.loop import Decoder

        self.decoder = Decoder(pte)

    def generate(self, prompt_ids: list[int], steps: int, temperature: float, seed: int) -> Run:
        from backends.mlx.llm.sampler.params import SamplingParams

        params = SamplingParams(temperature=temperature, seed=seed)
        stream = (step.token for step in self.decoder.stream(prompt_ids, steps + 1, params, stop_at_eos=False))
        return timed(stream, steps)


class MlxLmEngine:
    """mlx-lm's own generation loop (`generate_step`, with its asynchronous step pipelining)."""

    name = "mlx_lm"

    def __init__(self, checkpoint: Path, activations: str | None = None):
        """activations: None runs the checkpoint's float dtype; "bfloat16" casts every float parameter
        (norms, scales and biases of quantized layers) to it, keeping the same packed integers; "float32" casts
        the float parameters but quantized linears' scales and biases, as `etmlx export` does with a bfloat16
        directory (its quantized embedding's scales go to float32 too, so the rows dequantize in float32: the
        same numbers as etmlx's program). A float32 directory runs as it is either way, so the engine keeps the
        plain name."""
        import mlx.core as mx
        import mlx.nn as nn
        import mlx_lm
        from mlx.utils import tree_map_with_path

        self.model, _ = mlx_lm.load(str(checkpoint))
        if activations == "float32":
            keep = lambda path, x: path.endswith(("scales", "biases")) or not mx.issubdtype(x.dtype, mx.floating)
            self.model.update(tree_map_with_path(lambda path, x: x if keep(path, x) else x.astype(mx.float32),
                                                 self.model.parameters()))
            for _, module in self.model.named_modules():
                if isinstance(module, nn.QuantizedEmbedding):
                    module.scales, module.biases = module.scales.astype(mx.float32), module.biases.astype(mx.float32)
        elif activations is not None:
            self.model.set_dtype(getattr(mx, activations))
            self.name = f"mlx_lm_{activations[:4]}"

    def generate(self, prompt_ids: list[int], steps: int, temperature: float, seed: int) -> Run:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        mx.random.seed(seed)
        sampler = make_sampler(temp=temperature)
        stream = (token for token, _ in generate_step(mx.array(prompt_ids), self.model, max_tokens=steps + 1,
                                                       sampler=sampler))
        run = timed(stream, steps)
        # generate_step queues one step beyond the last token it yields; let it finish outside the timing.
        stream.close()
        mx.synchronize()
        return run


class XnnpackEngine:
    """ExecuTorch's XNNPACK .pte returning logits; sampling on the host with torch."""

    name = "xnnpack"

    def __init__(self, pte: Path):
        from backends.mlx.runtime.runner import load_method

        self.method = load_method(pte)

    def _stream(self, prompt_ids: list[int], steps: int, temperature: float, seed: int) -> Iterator[int]:
        generator = torch.Generator().manual_seed(seed)

        def sample(logits: torch.Tensor) -> int:
            if temperature <= 0:
                return int(logits.argmax(-1)[0])
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            return int(torch.multinomial(probs, 1, generator=generator)[0, 0])

        n = len(prompt_ids)
        one = torch.ones(1, dtype=torch.int64)
        token = sample(self.method.execute([torch.tensor([prompt_ids]), torch.zeros(1, dtype=torch.int64),
                                            torch.tensor([n])])[0])
        yield token
        for step in range(steps):
            token = sample(self.method.execute([torch.tensor([[token]]), torch.tensor([n + step]), one])[0])
            yield token

    def generate(self, prompt_ids: list[int], steps: int, temperature: float, seed: int) -> Run:
        return timed(self._stream(prompt_ids, steps, temperature, seed), steps)


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python (`make bench-deps`), on a GGUF of the same float weights
    (benchmarks/gguf_checkpoint.py). It feeds token ids; its own sampler picks (greedy at temperature 0)."""

    def __init__(self, gguf_path: Path, n_ctx: int = 1024, threads: int | None = None):
        import os

        from llama_cpp import Llama

        threads = threads or len(os.sched_getaffinity(0))
        self.name = "llama_cpp_" + Path(gguf_path).stem.rsplit("-", 1)[-1].lower()
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def generate(self, prompt_ids: list[int], steps: int, temperature: float, seed: int) -> Run:
        # reset() forgets the previous run's tokens: generate() would otherwise reuse the matching prefix
        # of its KV cache and skip most of the prefill being timed.
        self.llm.reset()
        self.llm.set_seed(seed)
        stream = self.llm.generate(prompt_ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0,
                                   repeat_penalty=1.0, reset=True)
        run = timed(stream, steps)
        stream.close()
        return run
