"""`etmlx bench pipeline`: what pipelined programs and the in-place KV cache write buy, in one run.

One random-weight Llama (transformers LlamaConfig, fixed torch seed; nothing trained or downloaded),
exported three times with a top-k + top-p sampler:
  pipelined    the default (pipelined.py): each call returns the previous call's token, -1 feeds the
               device's own last token, so the device computes step k while the host handles token k-1
  unpipelined  the same model with pipelined=False: each call returns its own token
  long cache   pipelined, with a cache of `long_cache` slots instead of `short_cache`

1. Pipelined vs unpipelined: decode tokens/s through the Python `Decoder` (stream, stop_at_eos=False,
   `steps` new tokens after a `prompt_len`-token prompt), greedy and seeded top-k + top-p, on both kernel
   sets (ETMLX_KERNELS=cpu and =device: the runtime reads the variable when it loads a program, so each
   Decoder is loaded with it set). The two programs must decode identical tokens (a RuntimeError otherwise).
2. KV-cache cost: decode ms per step of the short- and the long-cache program, greedy, ratio long / short.
   The runtime writes the cache in place (MLX donation) and attends only over the filled keys (the SDPA key
   window), so a step should not cost more with a longer cache; when each step copied the cache it did.

Decode tokens/s counts the tokens after the first and the time after it (the prefill call is left out).
Every measurement is the median of `repeats` generations, all programs and kernel sets taking turns
within each repeat (the machine may be shared), after one warm-up generation each.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

KERNEL_SETS = ("cpu", "device")
SAMPLERS = {"greedy": dict(temperature=0.0), "top-k+top-p": dict(temperature=0.8, top_k=40, top_p=0.9)}


@dataclass(frozen=True)
class Settings:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    prompt_len: int = 16
    steps: int = 64
    short_cache: int = 128
    long_cache: int = 4096
    repeats: int = 5
    seed: int = 0

    def __post_init__(self):
        for name in ("prompt_len", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 2:
            raise ValueError("steps must be >= 2 (decode speed is timed after the first token)")
        if self.prompt_len + self.steps > self.short_cache or self.short_cache > self.long_cache:
            raise ValueError(f"need prompt_len + steps ({self.prompt_len + self.steps}) <= short_cache "
                             f"({self.short_cache}) <= long_cache ({self.long_cache})")


FULL = Settings()
QUICK = Settings(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, prompt_len=4, steps=8, short_cache=16, long_cache=128, repeats=1)


def build_model(s: Settings):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(s.seed)
    config = LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                         num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                         num_key_value_heads=s.num_key_value_heads, max_position_embeddings=s.long_cache,
                         initializer_range=0.05,  # less flat logits than 0.02: a greedy stream that varies
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def export_programs(s: Settings, directory: Path, log) -> tuple[dict, int]:
    """{name: .pte path} for pipelined, unpipelined and long_cache, and the model's parameter count."""
    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.sampler.config import SamplerConfig

    model = build_model(s)
    config = SamplerConfig(top_k=True, top_p=True)
    jobs = {"pipelined": (s.short_cache, True), "unpipelined": (s.short_cache, False),
            "long_cache": (s.long_cache, True)}
    paths = {}
    for name, (cache, pipelined) in jobs.items():
        t0 = time.perf_counter()
        paths[name] = directory / f"{name}.pte"
        export_decoder(model, paths[name], cache, config=config, pipelined=pipelined)
        log(f"  exported {name} (cache {cache}, pipelined={pipelined}) in {time.perf_counter() - t0:.1f} s")
    return paths, parameters(model)


@contextmanager
def kernel_set(name: str | None):
    """ETMLX_KERNELS=name while a program loads (None: the device's default set)."""
    from backends.mlx.runtime import options

    with options.overridden("ETMLX_KERNELS", name):
        yield


def load(pte: Path, kernels: str | None):
    from backends.mlx.llm.decoder.loop import Decoder

    with kernel_set(kernels):
        return Decoder(pte)


def generate(decoder, prompt: list[int], steps: int, sampler: str, seed: int) -> tuple[list[int], float]:
    """(tokens, decode tokens/s after the first token)."""
    from backends.mlx.llm.sampler.params import SamplingParams

    knobs = SAMPLERS[sampler]
    params = SamplingParams(**knobs, seed=seed) if knobs["temperature"] > 0 else SamplingParams()
    tokens, first = [], None
    for step in decoder.stream(prompt, steps, params, stop_at_eos=False):
        tokens.append(step.token)
        if first is None:
            first = time.perf_counter()
    return tokens, (len(tokens) - 1) / (time.perf_counter() - first)


def measure(decoders: dict, prompt: list[int], steps: int, sampler: str, repeats: int, seed: int) -> dict:
    """{key: {"tokens": [...per repeat], "tok_s": [...]}}; the decoders take turns within each repeat."""
    runs = {key: {"tokens": [], "tok_s": []} for key in decoders}
    for decoder in decoders.values():  # warm-up: first-call allocations and compilation
        generate(decoder, prompt, steps, sampler, seed)
    for repeat in range(repeats):
        for key, decoder in decoders.items():
            tokens, rate = generate(decoder, prompt, steps, sampler, seed + repeat)
            runs[key]["tokens"].append(tokens)
            runs[key]["tok_s"].append(rate)
    return runs


def _same_tokens(runs: dict, a, b, what: str) -> None:
    for repeat, (x, y) in enumerate(zip(runs[a]["tokens"], runs[b]["tokens"])):
        if x != y:
            first = next(i for i in range(len(x)) if x[i] != y[i])
            raise RuntimeError(f"{what}: {a} and {b} decoded different tokens (repeat {repeat}, first at index "
                               f"{first}: {x[first]} vs {y[first]})")


def machine() -> str:
    import mlx.core as mx

    default = "cpu" if mx.default_device() == mx.cpu else "device"  # kernel_set.cpp's choice without the variable
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, MLX {mx.__version__}, "
            f"device {mx.default_device()} (its default kernel set: {default})")


def run(s: Settings, log=print) -> dict:
    generator = torch.Generator().manual_seed(s.seed + 1)
    prompt = torch.randint(0, s.vocab_size, (s.prompt_len,), generator=generator).tolist()
    with tempfile.TemporaryDirectory(prefix="etmlx-bench-pipeline-") as tmp:
        log(f"exporting (hidden {s.hidden_size}, {s.num_hidden_layers} layers, vocab {s.vocab_size}):")
        paths, n_params = export_programs(s, Path(tmp), log)
        # Part 1: every (kernel set, program) loaded once, with ETMLX_KERNELS set while it loads.
        decoders = {(k, p): load(paths[p], k) for k in KERNEL_SETS for p in ("pipelined", "unpipelined")}
        pipeline_rows = []
        for sampler in SAMPLERS:
            runs = measure(decoders, prompt, s.steps, sampler, s.repeats, s.seed)
            for k in KERNEL_SETS:
                _same_tokens(runs, (k, "pipelined"), (k, "unpipelined"), f"{sampler}, {k} kernels")
            # Recorded, not required: the sets may round differently (the device set's fast rope).
            across = runs[("cpu", "pipelined")]["tokens"] == runs[("device", "pipelined")]["tokens"]
            for k in KERNEL_SETS:
                piped = statistics.median(runs[(k, "pipelined")]["tok_s"])
                plain = statistics.median(runs[(k, "unpipelined")]["tok_s"])
                row = {"kernels": k, "sampler": sampler, "pipelined_tok_s": piped, "unpipelined_tok_s": plain,
                       "ratio": piped / plain, "pipelined_tok_s_runs": runs[(k, "pipelined")]["tok_s"],
                       "unpipelined_tok_s_runs": runs[(k, "unpipelined")]["tok_s"],
                       "tokens": runs[(k, "pipelined")]["tokens"][0], "tokens_identical": True,
                       "tokens_equal_across_kernel_sets": across}
                pipeline_rows.append(row)
                log(f"  {sampler:>12} {k:>6}: pipelined {piped:8.1f} tok/s, unpipelined {plain:8.1f} tok/s, "
                    f"ratio {piped / plain:.2f}")
        del decoders
        # Part 2: the same pipelined program with a short and a long cache, greedy.
        cache_rows = []
        decoders = {(k, c): load(paths["pipelined" if c == "short" else "long_cache"], k)
                    for k in KERNEL_SETS for c in ("short", "long")}
        runs = measure(decoders, prompt, s.steps, "greedy", s.repeats, s.seed)
        for k in KERNEL_SETS:
            short = 1e3 / statistics.median(runs[(k, "short")]["tok_s"])
            long = 1e3 / statistics.median(runs[(k, "long")]["tok_s"])
            cache_rows.append({"kernels": k, "short_cache": s.short_cache, "long_cache": s.long_cache,
                               "short_ms_per_step": short, "long_ms_per_step": long, "ratio": long / short,
                               "tokens_identical": runs[(k, "short")]["tokens"] == runs[(k, "long")]["tokens"]})
            log(f"  cache {k:>6}: {s.short_cache} slots {short:.2f} ms/step, {s.long_cache} slots {long:.2f} "
                f"ms/step, ratio {long / short:.2f}")
        del decoders
    return {"settings": asdict(s), "parameters": n_params, "machine": machine(), "prompt": prompt,
            "pipeline": pipeline_rows, "kv_cache": cache_rows}


def format_report(report: dict) -> str:
    s = report["settings"]
    lines = [f"model: Llama, {report['parameters'] / 1e6:.2f}M parameters (hidden {s['hidden_size']}, "
             f"{s['num_hidden_layers']} layers, vocab {s['vocab_size']}), random weights (seed {s['seed']}); "
             f"prompt {s['prompt_len']} tokens, {s['steps']} new tokens, stop_at_eos=False; "
             f"median of {s['repeats']} runs after 1 warm-up, programs taking turns",
             f"machine: {report['machine']}",
             "",
             "1. pipelined vs unpipelined (cache "
             f"{s['short_cache']}; decode tok/s after the first token; > 1 means pipelining is faster)",
             f"{'kernels':<8} {'sampler':<12} {'pipelined':>10} {'unpipelined':>12} {'ratio':>6}  tokens"]
    for r in report["pipeline"]:
        lines.append(f"{r['kernels']:<8} {r['sampler']:<12} {r['pipelined_tok_s']:>10.1f} "
                     f"{r['unpipelined_tok_s']:>12.1f} {r['ratio']:>6.2f}  "
                     f"{'identical' if r['tokens_identical'] else 'DIFFER'}")
    lines += ["",
              "2. KV-cache cost (pipelined, greedy; decode ms per step; ~1 means the cache length costs nothing)",
              f"{'kernels':<8} {'short':>6} {'ms/step':>8} {'long':>6} {'ms/step':>8} {'long/short':>11}  tokens"]
    for r in report["kv_cache"]:
        lines.append(f"{r['kernels']:<8} {r['short_cache']:>6} {r['short_ms_per_step']:>8.2f} {r['long_cache']:>6} "
                     f"{r['long_ms_per_step']:>8.2f} {r['ratio']:>11.2f}  "
                     f"{'identical' if r['tokens_identical'] else 'differ'}")
    return "\n".join(lines)


def main(json_path: str | None = None, quick: bool = False, repeats: int | None = None) -> int:
    settings = QUICK if quick else FULL
    if repeats is not None:
        settings = Settings(**{**asdict(settings), "repeats": repeats})
    report = run(settings)
    print(format_report(report))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1))
    return 0
