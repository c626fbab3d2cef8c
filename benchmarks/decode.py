"""`etmlx bench decode`: prefill and decode speed of our .pte against mlx-lm and ExecuTorch's XNNPACK.

One run, per dtype, on one locally built random-weight Llama checkpoint (see decode_checkpoint):
  etmlx    our .pte through `Decoder` (model, KV cache and sampler in the etmlx delegate)
  mlx_lm   mlx-lm's `generate_step` on the same checkpoint, sampler from `make_sampler`
  xnnpack  the same StaticCacheLM lowered with XnnpackPartitioner, returning logits; torch samples on the host
each prefills the same prompt ids (which gives the first new token) and then decodes `steps` tokens,
greedy and at a temperature. Engines take turns within each repeat so that load on this shared
machine hits them alike; one warm-up generation per engine and setting is not timed. Reported:
the median over repeats of prefill tokens/s (prompt length / time to the first new token) and of
decode tokens/s (steps / time of the steps after it), and ours / baseline ratios (> 1: ours faster).

Dtypes int4 and int8 are the float32 checkpoint converted by `mlx_lm.convert -q` (group size 64): etmlx
exports that directory (its mlx-lm import, no requantization) and mlx-lm loads it, so both run the same
integers; XNNPACK is skipped. For every dtype each engine's model file size (bytes per parameter) and
peak RSS (decode_memory: a child process per engine) are reported with etmlx / mlx-lm ratios.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import checkpoints as ckpt
from benchmarks import decode_memory as memory
from benchmarks import decode_programs as programs
from benchmarks.decode_engines import EtmlxEngine, MlxLmEngine, XnnpackEngine

ENGINES = ("etmlx", "mlx_lm", "xnnpack")
BASELINES = ("mlx_lm", "xnnpack")


@dataclass(frozen=True)
class Settings:
    prompt_len: int = 128
    steps: int = 128
    temperature: float = 0.8
    seed: int = 0
    repeats: int = 3
    max_seq_len: int = 272  # prompt + steps + 1 fits, rounded up to a multiple of 16

    def __post_init__(self):
        for name in ("prompt_len", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_len + self.steps + 1 > self.max_seq_len:
            raise ValueError(f"prompt_len + steps + 1 ({self.prompt_len + self.steps + 1}) exceeds "
                             f"max_seq_len {self.max_seq_len}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (greedy is always measured too), got {self.temperature}")


FULL = Settings()
QUICK = Settings(prompt_len=16, steps=16, repeats=1, max_seq_len=48)


def prompt_ids(settings: Settings, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(settings.seed + 1)
    return torch.randint(0, vocab_size, (settings.prompt_len,), generator=generator).tolist()


def engines_for(dtype: str) -> tuple:
    """XNNPACK has no lowering of MLX's packed affine weights (its own int4/int8 are other schemes with
    other integers), so quantized dtypes compare etmlx with mlx-lm only."""
    return ENGINES[:2] if dtype in ckpt.QUANTIZED else ENGINES


def _programs(checkpoint: Path, dtype: str, max_seq_len: int, log) -> dict:
    """The .pte paths for a checkpoint (etmlx, and XNNPACK for float dtypes), exporting what is not cached yet."""
    paths = {engine: programs.cached_pte(checkpoint, engine, max_seq_len)
             for engine in engines_for(dtype) if engine != "mlx_lm"}
    model = None
    for engine, path in paths.items():
        info = Path(str(path) + ".export.json")
        if path.is_file() and info.is_file():
            log(f"  {engine}: cached {path}")
            continue
        model = model or programs.load_model(checkpoint, dtype)
        log(f"  {engine}: exporting {path.name} (minutes for the full-size model)")
        for stale in path.parent.glob(f"{engine}-*.pte*"):  # other fingerprints: ~the model's size each
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
        if engine == "etmlx":
            result = programs.export_etmlx(model, path, max_seq_len, checkpoint)
            summary = {"delegate_calls": result.delegated_calls, "outside": dict(result.outside)}
        else:
            calls, outside = programs.export_xnnpack(model, path, max_seq_len)
            summary = {"delegate_calls": calls, "outside": outside}
        # Written last: a program without it (an interrupted export) is exported again.
        info.write_text(json.dumps(summary))
    del model
    gc.collect()
    return {engine: (path, json.loads(Path(str(path) + ".export.json").read_text()))
            for engine, path in paths.items()}


def _median(values):
    return statistics.median(values) if values else float("nan")


def measure_dtype(settings: Settings, size: dict, dtype: str, cache_dir: Path, log) -> dict:
    quantized = dtype in ckpt.QUANTIZED
    spec = ckpt.CheckpointSpec(**size, dtype="float32" if quantized else dtype, seed=settings.seed)
    checkpoint = ckpt.cached(spec, cache_dir)
    if quantized:
        checkpoint = ckpt.cached_quantized(checkpoint, dtype, cache_dir)
    log(f"{dtype}: checkpoint {checkpoint}")
    ptes = _programs(checkpoint, dtype, settings.max_seq_len, log)
    files = {name: ptes[name][0] if name in ptes else checkpoint for name in engines_for(dtype)}
    prompt = prompt_ids(settings, spec.vocab_size)
    # Before the timed engines load: the probes are separate processes, but this one's pages count
    # against the machine's memory while they run.
    footprint = memory_of(files, spec.parameters, prompt, settings.steps, log)
    kinds = {"etmlx": EtmlxEngine, "mlx_lm": MlxLmEngine, "xnnpack": XnnpackEngine}
    engines = [kinds[name](path) for name, path in files.items()]
    results, greedy_tokens = [], {}
    for sampler, temperature in (("greedy", 0.0), (f"temperature {settings.temperature}", settings.temperature)):
        runs = {engine.name: [] for engine in engines}
        for engine in engines:  # warm-up: first-call allocations, lazy loading, caches
            warm = engine.generate(prompt, settings.steps, temperature, settings.seed)
            if temperature == 0:
                greedy_tokens[engine.name] = warm.tokens
        for repeat in range(settings.repeats):
            for engine in engines:
                # A seed per repeat: sampled runs do not replay one token stream.
                run = engine.generate(prompt, settings.steps, temperature, settings.seed + repeat)
                if temperature == 0 and run.tokens != greedy_tokens[engine.name]:
                    raise RuntimeError(f"{engine.name}: greedy tokens changed between runs of one program")
                runs[engine.name].append(run)
        for name, engine_runs in runs.items():
            prefill = [settings.prompt_len / r.prefill_s for r in engine_runs]
            decode = [r.decode_steps / r.decode_s for r in engine_runs]
            results.append({"dtype": dtype, "sampler": sampler, "temperature": temperature, "engine": name,
                            "prefill_tokens_per_s": _median(prefill), "decode_tokens_per_s": _median(decode),
                            "prefill_tokens_per_s_runs": prefill, "decode_tokens_per_s_runs": decode})
            log(f"  {sampler:>16} {name:>8}: prefill {_median(prefill):9.1f} tok/s, decode {_median(decode):8.1f} tok/s")
    del engines
    gc.collect()
    reference = greedy_tokens["etmlx"]
    agreement = {name: common_prefix(reference, tokens) for name, tokens in greedy_tokens.items()}
    return {"dtype": dtype, "checkpoint": str(checkpoint), "parameters": spec.parameters, "memory": footprint,
            "programs": {engine: summary for engine, (_, summary) in ptes.items()},
            "results": results, "greedy_tokens": greedy_tokens, "greedy_agreement_with_etmlx": agreement}


def memory_of(files: dict, parameters: int, prompt: list[int], steps: int, log) -> dict:
    """Per engine: model file bytes, bytes per parameter, and the peak RSS of a child that loads it and
    decodes once (decode_memory)."""
    out = {}
    for name, path in files.items():
        size = memory.file_bytes(name, path)
        rss = memory.peak_rss(name, path, prompt, steps)
        out[name] = {"file_bytes": size, "bytes_per_parameter": size / parameters, "peak_rss_bytes": rss}
        log(f"  {name:>8}: {size / 1e6:8.1f} MB on disk, {size / parameters:.3f} bytes/parameter, "
            f"peak RSS {rss / 1e6:8.1f} MB")
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def ratios(results: list[dict]) -> list[dict]:
    """ours / baseline tokens/s per dtype and sampler (> 1 means ours is faster)."""
    table = {(r["dtype"], r["sampler"], r["engine"]): r for r in results}
    out = []
    for (dtype, sampler, engine), ours in table.items():
        if engine != "etmlx":
            continue
        row = {"dtype": dtype, "sampler": sampler}
        for base in BASELINES:
            other = table.get((dtype, sampler, base))
            if other is None:  # XNNPACK, for quantized dtypes
                continue
            for phase in ("prefill", "decode"):
                row[f"{phase}_vs_{base}"] = ours[f"{phase}_tokens_per_s"] / other[f"{phase}_tokens_per_s"]
        out.append(row)
    return out


def memory_ratios(per_dtype: list[dict]) -> list[dict]:
    """etmlx / mlx-lm bytes per parameter and peak RSS per dtype (< 1 means etmlx is smaller)."""
    out = []
    for d in per_dtype:
        ours, base = d["memory"]["etmlx"], d["memory"]["mlx_lm"]
        out.append({"dtype": d["dtype"],
                    "bytes_per_parameter_vs_mlx_lm": ours["bytes_per_parameter"] / base["bytes_per_parameter"],
                    "peak_rss_vs_mlx_lm": ours["peak_rss_bytes"] / base["peak_rss_bytes"]})
    return out


def _ratio(row: dict, key: str, width: int) -> str:
    return f"{row[key]:>{width}.2f}" if key in row else f"{'-':>{width}}"


def format_report(report: dict) -> str:
    s = report["settings"]
    lines = [f"model: Llama, {report['parameters'] / 1e6:.1f}M parameters, random weights (seed {s['seed']}); "
             f"prompt {s['prompt_len']} tokens, {s['steps']} decode steps, cache {s['max_seq_len']}; "
             f"median of {s['repeats']} runs after 1 warm-up; {report['machine']}",
             "",
             f"{'dtype':<9} {'sampler':<16} {'engine':<8} {'prefill tok/s':>14} {'decode tok/s':>13}"]
    for r in report["results"]:
        lines.append(f"{r['dtype']:<9} {r['sampler']:<16} {r['engine']:<8} {r['prefill_tokens_per_s']:>14.1f} "
                     f"{r['decode_tokens_per_s']:>13.1f}")
    lines += ["", "ours / baseline (tokens/s; > 1 means etmlx is faster)",
              f"{'dtype':<9} {'sampler':<16} {'prefill/mlx_lm':>15} {'decode/mlx_lm':>14} "
              f"{'prefill/xnnpack':>16} {'decode/xnnpack':>15}"]
    for r in report["ratios"]:
        lines.append(f"{r['dtype']:<9} {r['sampler']:<16} {_ratio(r, 'prefill_vs_mlx_lm', 15)} "
                     f"{_ratio(r, 'decode_vs_mlx_lm', 14)} {_ratio(r, 'prefill_vs_xnnpack', 16)} "
                     f"{_ratio(r, 'decode_vs_xnnpack', 15)}")
    lines += ["", "model files and memory (peak RSS: a fresh process loading the engine and decoding once)",
              f"{'dtype':<9} {'engine':<8} {'file MB':>9} {'bytes/param':>12} {'peak RSS MB':>12}"]
    for d in report["dtypes"]:
        for name, m in d["memory"].items():
            lines.append(f"{d['dtype']:<9} {name:<8} {m['file_bytes'] / 1e6:>9.1f} {m['bytes_per_parameter']:>12.3f} "
                         f"{m['peak_rss_bytes'] / 1e6:>12.1f}")
    lines += ["", f"{'dtype':<9} {'bytes/param etmlx/mlx_lm':>25} {'peak RSS etmlx/mlx_lm':>22}"]
    for r in report["memory_ratios"]:
        lines.append(f"{r['dtype']:<9} {r['bytes_per_parameter_vs_mlx_lm']:>25.2f} {r['peak_rss_vs_mlx_lm']:>22.2f}")
    lines.append("")
    for d in report["dtypes"]:
        agree = ", ".join(f"{k} {v}/{s['steps'] + 1}" for k, v in d["greedy_agreement_with_etmlx"].items()
                          if k != "etmlx")
        xnn = d["programs"].get("xnnpack")
        xnn = (f"XNNPACK program: {xnn['delegate_calls']} delegate calls, {sum(xnn['outside'].values())} ops on "
               "the CPU kernels" if xnn else "XNNPACK skipped: it has no path for MLX's packed affine weights "
               f"(mlx_lm.convert -q, group size {ckpt.GROUP_SIZE}), which etmlx and mlx-lm both run")
        lines.append(f"{d['dtype']}: greedy tokens equal to etmlx's for the first {agree}; {xnn}")
    return "\n".join(lines)


def run(settings: Settings, size: dict, dtypes, cache_dir: Path, log=print) -> dict:
    known = [*ckpt.DTYPES, *ckpt.QUANTIZED]
    if not dtypes or any(d not in known for d in dtypes):
        raise ValueError(f"dtypes must be some of {known}, got {list(dtypes)}")
    per_dtype = [measure_dtype(settings, size, dtype, Path(cache_dir), log) for dtype in dtypes]
    results = [r for d in per_dtype for r in d["results"]]
    import mlx.core as mx

    from backends.mlx.runtime import blas_route

    # mlx_lm runs in this process, so its CPU GEMMs take the same BLAS as ours.
    machine = (f"{platform.machine()} {os.cpu_count()} cores, MLX {mx.__version__} device {mx.default_device()}, "
               f"MLX CPU GEMMs: {blas_route.status().describe()}, torch threads {torch.get_num_threads()}")
    return {"settings": asdict(settings), "size": size, "parameters": per_dtype[0]["parameters"],
            "machine": machine, "results": results, "ratios": ratios(results),
            "memory_ratios": memory_ratios(per_dtype), "dtypes": per_dtype}


def main(json_path: str | None = None, quick: bool = False, dtypes=("float32", "bfloat16"),
         repeats: int | None = None, cache_dir: str = "out/bench") -> int:
    settings = QUICK if quick else FULL
    if repeats is not None:
        settings = Settings(**{**asdict(settings), "repeats": repeats})
    report = run(settings, ckpt.QUICK_SIZE if quick else ckpt.BENCH_SIZE, tuple(dtypes), Path(cache_dir))
    print(format_report(report))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1))
    return 0
