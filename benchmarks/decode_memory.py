"""Model file size and peak resident memory of each `etmlx bench decode` engine.

The timed engines share one process, so its high-water mark is the largest of them plus whatever the
others left behind. Peak RSS is therefore taken in a short child process per engine: it loads the
engine, prefills the benchmark prompt and decodes the benchmark's steps once (greedy), then reports its
own VmHWM (/proc/self/status; ru_maxrss where there is no /proc). That includes the Python interpreter and
the libraries the engine imports, as a user of that engine would pay them.

    python -m benchmarks.decode_memory ENGINE PATH PROMPT_IDS_JSON STEPS   (prints one JSON line)
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

# GNU time: a child's own peak RSS (%M); wait4's ru_maxrss starts from the forking parent's.
GNU_TIME = Path("/usr/bin/time")


def model_files(engine: str, path: Path) -> list[Path]:
    """What each engine reads its weights from: .pte (+ .ptd external weights), mlx-lm's safetensors or a GGUF."""
    path = Path(path)
    if engine.startswith("mlx_lm"):
        return sorted(path.glob("*.safetensors"))
    if engine.startswith("llama_cpp"):
        return [path]
    from backends.mlx.exporter.export import weights_path

    return [p for p in (path, weights_path(path)) if p.is_file()]


def file_bytes(engine: str, path: Path) -> int:
    return sum(p.stat().st_size for p in model_files(engine, path))


def _peak_rss_bytes() -> int:
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def peak_rss(engine: str, path: Path, prompt_ids: list[int], steps: int) -> int:
    """Peak RSS in bytes of a fresh process that loads `engine` and generates once."""
    ran = subprocess.run([sys.executable, "-m", "benchmarks.decode_memory", engine, str(path),
                          json.dumps(prompt_ids), str(steps)], capture_output=True, text=True)
    if ran.returncode != 0:
        raise RuntimeError(f"{engine} memory probe failed:\n{ran.stderr[-3000:]}")
    return json.loads(ran.stdout.strip().splitlines()[-1])["peak_rss_bytes"]


def _child(engine: str, path: str, prompt_json: str, steps: str) -> None:
    from benchmarks.decode_engines import EtmlxEngine, LlamaCppEngine, MlxLmEngine, XnnpackEngine

    kinds = {"etmlx": EtmlxEngine, "mlx_lm": MlxLmEngine, "xnnpack": XnnpackEngine,
             "mlx_lm_bflo": lambda p: MlxLmEngine(p, activations="bfloat16")}
    made = LlamaCppEngine(Path(path)) if engine.startswith("llama_cpp") else kinds[engine](Path(path))
    run = made.generate(json.loads(prompt_json), int(steps), 0.0, 0)
    print(json.dumps({"peak_rss_bytes": _peak_rss_bytes(), "tokens": len(run.tokens)}))


if __name__ == "__main__":
    _child(*sys.argv[1:])
