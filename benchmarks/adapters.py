"""`etmlx bench adapters`: what keeping LoRA adapters switchable costs per decoded token.

One run on the ~100M random Llama of `bench decode` (checkpoints.BENCH_SIZE; --quick: the CI size), float32 or 4-bit
(`mlx_lm.convert -q`), with two random mlx-lm-layout adapters of rank R on q_proj, v_proj and down_proj of every
layer. Three programs, exported once and cached: the base, the base with adapter A fused (`--adapter A`), and the
base with A and B switchable (`--adapters a=A,b=B`). Each repeat decodes the same prompt greedily with every
program and setting in turn (so load on this shared machine hits them alike; one untimed warm-up each); reported:
the median decode tok/s and the ratios switchable-with-a / fused and switchable-with-none / base (< 1: the
switchable program is slower), and whether the float32 switchable program's tokens with a equal the fused one's.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmarks import checkpoints as ckpt

TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def write_adapter(directory: Path, spec: ckpt.CheckpointSpec, rank: int, seed: int) -> Path:
    """A random adapter in mlx-lm's layout (lora_a [in, r], lora_b [r, out]), scale 2."""
    import numpy as np
    from safetensors.numpy import save_file

    h, i = spec.hidden_size, spec.intermediate_size
    kv = h // spec.num_attention_heads * spec.num_key_value_heads
    shapes = {"self_attn.q_proj": (h, h), "self_attn.v_proj": (h, kv), "mlp.down_proj": (i, h)}
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(spec.num_hidden_layers):
        for key in TARGETS:
            fan_in, fan_out = shapes[key]
            name = f"model.layers.{layer}.{key}"
            weights[f"{name}.lora_a"] = (rng.uniform(-1, 1, (fan_in, rank)) / fan_in ** 0.5).astype(np.float32)
            weights[f"{name}.lora_b"] = rng.normal(0, 0.02, (rank, fan_out)).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "adapters.safetensors"))
    config = {"fine_tune_type": "lora", "num_layers": spec.num_hidden_layers,
              "lora_parameters": {"rank": rank, "scale": 2.0, "dropout": 0.0, "keys": list(TARGETS)}}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def _export(model_dir: Path, out: Path, max_seq_len: int, **options) -> Path:
    from backends.mlx.llm.decoder.from_checkpoint import export_checkpoint

    if not out.is_file():
        export_checkpoint(model_dir, out, max_seq_len=max_seq_len, verify=False, **options)
    return out


def run(dtype: str = "int4", rank: int = 8, repeats: int = 3, steps: int = 64, quick: bool = False,
        cache_dir: Path = Path("out/bench"), log=print) -> dict:
    from backends.mlx.llm.decoder.loop import Decoder

    size = ckpt.QUICK_SIZE if quick else ckpt.BENCH_SIZE
    spec = ckpt.CheckpointSpec(**size, dtype="float32")
    model_dir = ckpt.cached(spec, cache_dir)
    if dtype in ckpt.QUANTIZED:
        model_dir = ckpt.cached_quantized(model_dir, dtype, cache_dir)
    elif dtype != "float32":
        raise ValueError(f"--dtype must be float32 or one of {', '.join(ckpt.QUANTIZED)}, got {dtype!r}")
    work = Path(cache_dir) / f"adapters-{spec.name}-{dtype}-r{rank}"
    a = write_adapter(work / "a", spec, rank, seed=1)
    b = write_adapter(work / "b", spec, rank, seed=2)
    max_seq_len = 16 + steps + 8
    log(f"exporting to {work}")
    programs = {"base": _export(model_dir, work / "base.pte", max_seq_len),
                "fused": _export(model_dir, work / "fused.pte", max_seq_len, adapter=a),
                "switchable": _export(model_dir, work / "switchable.pte", max_seq_len,
                                      adapters={"a": str(a), "b": str(b)})}
    decoders = {name: Decoder(path) for name, path in programs.items()}
    runs = [("base", None), ("fused", None), ("switchable", None), ("switchable", "a"), ("switchable", "b")]
    prompt = [(7 * i + 3) % spec.vocab_size for i in range(16)]
    rates = {run: [] for run in runs}
    tokens = {}
    for repeat in range(repeats + 1):  # repeat 0: the warm-up
        for name, adapter in runs:
            out = decoders[name].generate(prompt, steps, adapter=adapter)
            tokens[(name, adapter)] = out.tokens
            if repeat:
                rates[(name, adapter)].append(out.decode_tokens_per_s)
    median = {f"{name}{':' + adapter if adapter else ''}": statistics.median(r) for (name, adapter), r in rates.items()}
    return {"dtype": dtype, "rank": rank, "steps": steps, "repeats": repeats, "spec": spec.name,
            "decode_tokens_per_s": median,
            "switchable_a_over_fused": median["switchable:a"] / median["fused"],
            "switchable_none_over_base": median["switchable"] / median["base"],
            "same_tokens_a_as_fused": tokens[("switchable", "a")] == tokens[("fused", None)],
            "same_tokens_none_as_base": tokens[("switchable", None)] == tokens[("base", None)]}


def format_report(report: dict) -> str:
    lines = [f"{report['spec']} {report['dtype']}, two rank-{report['rank']} adapters on q/v/down, "
             f"{report['steps']} greedy steps, median of {report['repeats']} (a noisy shared machine)"]
    lines += [f"  {name:14s} {rate:8.1f} tok/s" for name, rate in report["decode_tokens_per_s"].items()]
    lines.append(f"  switchable:a / fused {report['switchable_a_over_fused']:.2f}x, switchable (none) / base "
                 f"{report['switchable_none_over_base']:.2f}x; tokens: a = fused {report['same_tokens_a_as_fused']}, "
                 f"none = base {report['same_tokens_none_as_base']}")
    return "\n".join(lines)


def main(json_path: str | None = None, dtype: str = "int4", rank: int = 8, repeats: int = 3, quick: bool = False,
         cache_dir: str = "out/bench") -> int:
    report = run(dtype, rank, repeats, quick=quick, cache_dir=Path(cache_dir),
                 log=lambda message: print(message, file=sys.stderr))
    print(format_report(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    return 0
