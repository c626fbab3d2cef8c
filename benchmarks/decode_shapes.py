"""`etmlx bench decode --shape NAME`: a published model's shape at real size, quantized, on this machine's CPU.

One run builds (once, cached) a float32 random-weight checkpoint of that shape (benchmarks/checkpoints.py
SHAPES), converts it with `mlx_lm.convert -q` (group 64; int4 and/or int8), and times against each other:

  etmlx          `etmlx export --model <mlx-lm dir>` (its mlx-lm import: the same integers), through `Decoder`
  mlx_lm         mlx-lm on that directory, float32 activations (with --quantized-dtype bfloat16, the directory
                 converted by `mlx_lm.convert --dtype bfloat16`, as published 4-bit models are: its norms cast
                 to float32, its bfloat16 scales and biases kept, as etmlx's export does)
  mlx_lm_bflo    the same integers with every float parameter cast to bfloat16 (bfloat16 activations)
  llama_cpp_*    llama.cpp (llama-cpp-python, `make bench-deps`) on the same float weights written as GGUF:
                 Q4_0 and F16 beside int4, Q8_0 beside int8 (benchmarks/gguf_checkpoint.py); skipped, with a line
                 saying so, when llama_cpp is not installed

Per engine: prefill tok/s of a 64- and a 512-token prompt (the 64-token prefill is also the time to the first
token), decode tok/s of 32 greedy steps after the 64-token prompt, model file bytes per parameter, and peak RSS
of a fresh process that loads the engine and decodes once (decode_memory). Engines take turns within each
repeat; medians over repeats after one untimed warm-up each. An engine whose warm-up decodes under
SLOW_DECODE_TOKENS_PER_S (mlx-lm's scalar CPU kernel: minutes per run) is timed in the first repeat only, and not
on the longer prompts: its compute-bound loop prefills at the same tok/s at any length.
The peak-RSS probe decodes PROBE_STEPS tokens: the weights, the cache and the prefill's buffers are all
allocated by then.

The memory-bandwidth floor: a decode step reads every weight once (the tied head reads the whole embedding
table), so no engine decodes faster than read bandwidth / weight bytes; the bandwidth is measured in the same
run (numpy sums over 512 MB on all of this process's CPUs). The etmlx export runs in a child process whose wall
time and peak RSS are reported (issue: no float copy of the whole model is built).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks import decode_memory as memory
from benchmarks import decode_programs as programs
from benchmarks.decode import common_prefix
from benchmarks import checkpoints as ckpt
from benchmarks import packed_checkpoint as packed

GGUF_TYPES = {"int4": ("Q4_0", "F16"), "int8": ("Q8_0",)}
SLOW_DECODE_TOKENS_PER_S = 5.0
WARM_STEPS = 4
PROBE_STEPS = 2


@dataclass(frozen=True)
class ShapeSettings:
    prompt_lens: tuple = (64, 512)
    steps: int = 32
    repeats: int = 3
    seed: int = 0
    max_seq_len: int = 576  # the longest prompt + steps + 1, rounded up to a multiple of 64
    # The mlx-lm directory's scales, biases and norms: float32 (the float checkpoint's) or bfloat16 (mlx_lm.convert
    # --dtype bfloat16, as published 4-bit models have them: 0.5 bits a weight fewer at group 64).
    quantized_float_dtype: str = "float32"
    # Also export the shape's bfloat16 checkpoint with --quantize int4 and report its peak RSS (--bf16-export).
    bf16_export: bool = False

    def __post_init__(self):
        if self.quantized_float_dtype not in ckpt.QUANTIZED_FLOAT_DTYPES:
            raise ValueError(f"--quantized-dtype must be one of {', '.join(ckpt.QUANTIZED_FLOAT_DTYPES)}, "
                             f"got {self.quantized_float_dtype!r}")
        if self.repeats < 1 or self.steps < 1 or not self.prompt_lens:
            raise ValueError("repeats and steps must be >= 1 and prompt_lens non-empty")
        if max(self.prompt_lens) + self.steps + 1 > self.max_seq_len:
            raise ValueError(f"the longest prompt + steps + 1 exceeds max_seq_len {self.max_seq_len}")


def llama_cpp_available() -> bool:
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def export_in_child(checkpoint: Path, pte: Path, max_seq_len: int, log, extra: list[str] = ()) -> dict:
    """`etmlx export --model checkpoint [extra flags]` in a fresh process: its wall time and peak RSS (GNU
    time's, else wait4's ru_maxrss). `pte` is a decode_programs.cached_pte path: older exports of the same engine
    name (other sources, other lengths) are removed first."""
    info_path = Path(str(pte) + ".export.json")
    if pte.is_file() and info_path.is_file():
        log(f"  etmlx: cached {pte} (export figures from when it was made)")
        return json.loads(info_path.read_text())
    for stale in programs.cached_versions(pte):
        stale.unlink()
    command = [str(Path(sys.executable).parent / "etmlx"), "export", "--model", str(checkpoint), "--out", str(pte),
               "--max-seq-len", str(max_seq_len), *extra]
    log(f"  etmlx: {' '.join(command[1:])}")
    # A child's ru_maxrss starts from this process's own RSS (Linux keeps the forked parent's high-water mark
    # across exec): GNU time's child starts from time's few MB, so its figure is the export's alone.
    rss_file = Path(str(pte) + ".rss")
    timed = memory.GNU_TIME.is_file()
    if timed:
        command = [str(memory.GNU_TIME), "-f", "%M", "-o", str(rss_file), *command]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"etmlx export failed:\n{output[-3000:]}")
    peak_kb = int(rss_file.read_text().strip().splitlines()[-1]) if timed else usage.ru_maxrss
    rss_file.unlink(missing_ok=True)
    info = {"export_wall_s": wall, "export_peak_rss_bytes": peak_kb * 1024}
    info_path.write_text(json.dumps(info))
    log(f"  etmlx: exported in {wall:.1f} s, peak RSS {info['export_peak_rss_bytes'] / 1e6:.0f} MB")
    return info


def _engines(files: dict, max_seq_len: int) -> list:
    from benchmarks.decode_engines import EtmlxEngine, LlamaCppEngine, MlxLmEngine

    made = []
    for name, path in files.items():
        if name == "etmlx":
            made.append(EtmlxEngine(path))
        elif name == "mlx_lm":
            # float32 activations whatever the directory's float dtype (a no-op for float32 scales), its scales
            # and biases as stored, as etmlx's export takes them: its greedy tokens compare with etmlx's.
            made.append(MlxLmEngine(path, activations="float32"))
        elif name == "mlx_lm_bflo":
            made.append(MlxLmEngine(path, activations="bfloat16"))
        else:
            made.append(LlamaCppEngine(path, n_ctx=max_seq_len))
    return made


def with_weight_ratio(export: dict, weight_bytes: int, log) -> dict:
    """The export figures and its peak RSS over the checkpoint's weight bytes (issue 51's target: 1.3x for an
    mlx-lm directory, 1.5x for a bfloat16 checkpoint quantized at export)."""
    ratio = export["export_peak_rss_bytes"] / weight_bytes
    log(f"  etmlx: export peak RSS {ratio:.2f}x the checkpoint's {weight_bytes / 1e6:.0f} MB of weights")
    return {**export, "weight_bytes": weight_bytes, "peak_rss_over_weights": ratio}


def measure(settings: ShapeSettings, spec: ckpt.CheckpointSpec, float_dir: Path | None, dtype: str, cache_dir: Path,
            with_llama_cpp: bool, log) -> dict:
    """float_dir None: a packed shape (checkpoints.PACKED_SHAPES), its mlx-lm directory written directly."""
    if float_dir is None:
        quantized_dir = packed.cached(spec, cache_dir, ckpt.QUANTIZED[dtype])
    else:
        quantized_dir = ckpt.cached_quantized(float_dir, dtype, cache_dir, settings.quantized_float_dtype)
    log(f"{dtype}: {quantized_dir}")
    pte = programs.cached_pte(quantized_dir, "etmlx", settings.max_seq_len)
    export = with_weight_ratio(export_in_child(quantized_dir, pte, settings.max_seq_len, log),
                               packed.weight_bytes(quantized_dir), log)
    files = {"etmlx": pte, "mlx_lm": quantized_dir, "mlx_lm_bflo": quantized_dir}
    if with_llama_cpp and float_dir is not None:
        from benchmarks.gguf_checkpoint import cached_gguf

        for qtype in GGUF_TYPES[dtype]:
            files[f"llama_cpp_{qtype.lower()}"] = cached_gguf(float_dir, qtype)
    prompt = torch.randint(0, spec.vocab_size, (max(settings.prompt_lens),),
                           generator=torch.Generator().manual_seed(settings.seed + 1)).tolist()
    short = min(settings.prompt_lens)
    footprint = {}
    for name, path in files.items():
        size = memory.file_bytes(name, path)
        rss = memory.peak_rss(name, path, prompt[:short], PROBE_STEPS)
        footprint[name] = {"file_bytes": size, "bytes_per_parameter": size / spec.parameters, "peak_rss_bytes": rss}
        log(f"  {name:>16}: {size / 1e6:8.1f} MB, {size / spec.parameters:.3f} B/param, peak RSS {rss / 1e6:8.1f} MB")

    engines = _engines(files, settings.max_seq_len)
    slow, greedy = set(), {}
    for engine in engines:  # warm-up: first-call allocations and lazy loading; a few steps show the decode rate
        warm = engine.generate(prompt[:short], WARM_STEPS, 0.0, settings.seed)
        if warm.decode_steps / warm.decode_s < SLOW_DECODE_TOKENS_PER_S:
            slow.add(engine.name)
    runs = {engine.name: {"prefill": {n: [] for n in settings.prompt_lens}, "decode": [], "ttft_s": []}
            for engine in engines}
    for repeat in range(settings.repeats):
        for engine in engines:
            for n in settings.prompt_lens:
                if engine.name in slow and (repeat > 0 or n != short):
                    continue
                run = engine.generate(prompt[:n], settings.steps if n == short else 0, 0.0, settings.seed)
                runs[engine.name]["prefill"][n].append(n / run.prefill_s)
                if n == short:
                    if run.tokens != greedy.setdefault(engine.name, run.tokens):
                        raise RuntimeError(f"{engine.name}: greedy tokens changed between runs")
                    runs[engine.name]["decode"].append(run.decode_steps / run.decode_s)
                    runs[engine.name]["ttft_s"].append(run.prefill_s)
        log(f"  repeat {repeat + 1}/{settings.repeats} done")
    del engines
    gc.collect()
    results = {}
    for name, r in runs.items():
        results[name] = {"decode_tokens_per_s": statistics.median(r["decode"]),
                         "ttft_s": statistics.median(r["ttft_s"]),
                         **{f"prefill_{n}_tokens_per_s": statistics.median(r["prefill"][n]) if r["prefill"][n] else None
                            for n in settings.prompt_lens},
                         "runs": r}
        log(f"  {name:>16}: " + ", ".join(f"prefill {n}: {_num(results[name][f'prefill_{n}_tokens_per_s'], 12)} tok/s"
                                          for n in settings.prompt_lens)
            + f", decode {results[name]['decode_tokens_per_s']:.1f} tok/s")
    agreement = {name: common_prefix(greedy["etmlx"], tokens) for name, tokens in greedy.items()}
    return {"dtype": dtype, "checkpoint": str(quantized_dir), "export": export, "memory": footprint,
            "weight_bytes_per_token": footprint["mlx_lm"]["file_bytes"], "results": results,
            "slow_prefill_once": sorted(slow), "greedy_agreement_with_etmlx": agreement}


def run(shape: str, dtypes=("int4",), settings: ShapeSettings = ShapeSettings(), cache_dir: Path = Path("out/bench"),
        log=print) -> dict:
    if shape not in ckpt.SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(ckpt.SHAPES)}, got {shape!r}")
    unknown = [d for d in dtypes if d not in GGUF_TYPES]
    if not dtypes or unknown:
        raise ValueError(f"--shape runs quantized dtypes ({', '.join(GGUF_TYPES)}), got {', '.join(dtypes)}")
    from benchmarks.quantized_matmul import read_bandwidth_gbs
    from backends.mlx.runtime import kernels_info

    spec = ckpt.CheckpointSpec(**ckpt.SHAPES[shape], dtype="float32", seed=settings.seed)
    start = time.perf_counter()
    packed_shape = shape in ckpt.PACKED_SHAPES
    if packed_shape:  # no float checkpoint: the directories are written packed, with bfloat16 scales
        float_dir, settings = None, replace(settings, quantized_float_dtype="bfloat16")
        log(f"{shape}: {spec.parameters / 1e6:.0f}M parameters, written packed (no float checkpoint; "
            "llama.cpp, whose GGUF comes from float weights, is not measured)")
    else:
        float_dir = ckpt.cached(spec, Path(cache_dir))
        log(f"{shape}: {spec.parameters / 1e6:.0f}M parameters, checkpoint {float_dir} "
            f"({time.perf_counter() - start:.0f} s)")
    with_llama_cpp = llama_cpp_available() and not packed_shape
    if not with_llama_cpp and not packed_shape:
        log("llama.cpp baseline skipped: llama_cpp / gguf not installed (make bench-deps)")
    threads = len(os.sched_getaffinity(0))
    bandwidth = read_bandwidth_gbs(threads)
    per_dtype = [measure(settings, spec, float_dir, d, Path(cache_dir), with_llama_cpp, log) for d in dtypes]
    bf16_export = None
    if settings.bf16_export and not packed_shape:
        bf16_export = export_bfloat16(spec, float_dir, settings, Path(cache_dir), log)
    bandwidth = max(bandwidth, read_bandwidth_gbs(threads))  # again after the runs: the better of two
    import mlx.core as mx

    machine = (f"{platform.machine()} {threads} CPUs, MLX {mx.__version__}, "
               f"etmlx kernels {kernels_info()}")
    return {"shape": shape, "spec": asdict(spec), "parameters": spec.parameters, "settings": asdict(settings),
            "machine": machine, "read_bandwidth_gbs": bandwidth, "dtypes": per_dtype,
            "llama_cpp": with_llama_cpp, "packed": packed_shape, "bf16_export": bf16_export}


def export_bfloat16(spec: ckpt.CheckpointSpec, float_dir: Path, settings: ShapeSettings, cache_dir: Path,
                    log) -> dict:
    """`etmlx export --quantize int4` of the shape's bfloat16 Hugging Face checkpoint (the float32 one cast,
    tensor by tensor): its wall time and peak RSS over the checkpoint's bytes (target: 1.5x)."""
    bf16_dir = ckpt.cached_bfloat16(float_dir)
    log(f"bfloat16 checkpoint: {bf16_dir}")
    pte = programs.cached_pte(bf16_dir, "etmlx-int4", settings.max_seq_len)
    export = export_in_child(bf16_dir, pte, settings.max_seq_len, log, ["--quantize", "int4"])
    return with_weight_ratio(export, packed.weight_bytes(bf16_dir), log)


def _num(value, width: int) -> str:
    return f"{value:>{width}.1f}" if value is not None else f"{'-':>{width}}"


def _ratio(ours, theirs) -> str:
    return f"{ours / theirs:.2f}x" if ours is not None and theirs is not None else "-"


def floor_tokens_per_s(report: dict, d: dict) -> float:
    return report["read_bandwidth_gbs"] * 1e9 / d["weight_bytes_per_token"]


def format_report(report: dict) -> str:
    s = report["settings"]
    lens = s["prompt_lens"]
    lines = [f"{report['shape']}: {report['parameters'] / 1e6:.0f}M parameters, random weights, "
             f"{s.get('quantized_float_dtype', 'float32')} scales; prompts "
             f"{'/'.join(map(str, lens))} tokens, {s['steps']} greedy decode steps, median of {s['repeats']}; "
             f"{report['machine']}; read bandwidth {report['read_bandwidth_gbs']:.1f} GB/s", ""]
    header = (f"{'dtype':<5} {'engine':<16} " + " ".join(f"{'prefill ' + str(n):>12}" for n in lens)
              + f" {'TTFT s':>7} {'decode':>8} {'MB':>8} {'B/param':>8} {'RSS MB':>8}")
    lines.append(header)
    for d in report["dtypes"]:
        for name, r in d["results"].items():
            m = d["memory"][name]
            lines.append(f"{d['dtype']:<5} {name:<16} "
                         + " ".join(_num(r[f'prefill_{n}_tokens_per_s'], 12) for n in lens)
                         + f" {r['ttft_s']:>7.3f} {r['decode_tokens_per_s']:>8.1f} {m['file_bytes'] / 1e6:>8.1f}"
                         f" {m['bytes_per_parameter']:>8.3f} {m['peak_rss_bytes'] / 1e6:>8.0f}")
        floor = floor_tokens_per_s(report, d)
        lines.append(f"{d['dtype']:<5} {'bandwidth floor':<16} " + " ".join(f"{'':>12}" for _ in lens)
                     + f" {'':>7} {floor:>8.1f}   ({d['weight_bytes_per_token'] / 1e6:.1f} MB of weights per token)")
    lines += ["", "etmlx / baseline (tokens/s, > 1: etmlx faster; bytes and RSS, < 1: etmlx smaller)"]
    for d in report["dtypes"]:
        ours, ours_m = d["results"]["etmlx"], d["memory"]["etmlx"]
        for name, r in d["results"].items():
            if name == "etmlx":
                continue
            m = d["memory"][name]
            lines.append(f"{d['dtype']:<5} vs {name:<16} " + " ".join(
                f"prefill {n} {_ratio(ours[f'prefill_{n}_tokens_per_s'], r[f'prefill_{n}_tokens_per_s'])}" for n in lens)
                + f", decode {ours['decode_tokens_per_s'] / r['decode_tokens_per_s']:.2f}x"
                f", bytes {ours_m['file_bytes'] / m['file_bytes']:.2f}x, RSS {ours_m['peak_rss_bytes'] / m['peak_rss_bytes']:.2f}x")
        lines.append(f"{d['dtype']:<5} etmlx decode / bandwidth floor {ours['decode_tokens_per_s'] / floor_tokens_per_s(report, d):.2f}; "
                     f"export {d['export']['export_wall_s']:.0f} s, peak RSS {d['export']['export_peak_rss_bytes'] / 1e6:.0f} MB; "
                     f"greedy tokens equal to etmlx's: " + ", ".join(
                         f"{k} {v}/{s['steps'] + 1}" for k, v in d["greedy_agreement_with_etmlx"].items() if k != "etmlx"))
        if d["slow_prefill_once"]:
            lines.append(f"{d['dtype']:<5} {', '.join(d['slow_prefill_once'])}: timed once, not {s['repeats']} times "
                         f"and only the {min(lens)}-token prefill (it decodes under {SLOW_DECODE_TOKENS_PER_S:.0f} tok/s)")
    for d in report["dtypes"]:
        e = d["export"]
        if "peak_rss_over_weights" in e:
            lines.append(f"{d['dtype']:<5} etmlx export of the mlx-lm directory: peak RSS "
                         f"{e['peak_rss_over_weights']:.2f}x its {e['weight_bytes'] / 1e6:.0f} MB of weights "
                         "(target <= 1.3x)")
    e = report.get("bf16_export")
    if e:
        lines.append(f"bf16  etmlx export --quantize int4 of the bfloat16 checkpoint: {e['export_wall_s']:.0f} s, "
                     f"peak RSS {e['export_peak_rss_bytes'] / 1e6:.0f} MB, {e['peak_rss_over_weights']:.2f}x its "
                     f"{e['weight_bytes'] / 1e6:.0f} MB (target <= 1.5x)")
    if report.get("packed"):
        lines.append("llama.cpp not measured: a packed shape has no float weights to write its GGUF from")
    elif not report["llama_cpp"]:
        lines.append("llama.cpp not measured: run `make bench-deps` (llama-cpp-python built from source, gguf)")
    return "\n".join(lines)


def main(shape: str, json_path: str | None = None, dtypes=("int4",), repeats: int | None = None,
         cache_dir: str = "out/bench", quantized_float_dtype: str = "float32", bf16_export: bool = False) -> int:
    settings = ShapeSettings(quantized_float_dtype=quantized_float_dtype, bf16_export=bf16_export,
                             **({} if repeats is None else {"repeats": repeats}))
    report = run(shape, tuple(dtypes), settings, Path(cache_dir))
    print(format_report(report))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1))
    return 0
