"""The C++ decode loop's half of `etmlx bench speculative`: the same programs and prompt through `etmlx_bench`
(tools/etmlx_bench: etmlx_decode's loop, the C++ draft sources and draft model, no Python per call).

Each round runs, taking turns: the plain program, then the draft-verifying one with no drafts, with Predicted
Outputs (its own greedy continuation), with prompt lookup and with the draft model. Every figure is etmlx_bench's
`sequence_tokens_per_s` (tokens after the first call over the time after it, median of its warm sequences: the
measure that counts a call's several tokens), and every run must give the plain program's tokens (its
`token_sum`, a sum over all its sequences, and etmlx_bench's own check that drafts never change a token).
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

SOURCES = ("none", "prediction", "ngram", "draft-model")


def _bench(binary: Path, pte: Path, prompt: list[int], steps: int, runs: int, *flags: str) -> dict:
    done = subprocess.run([str(binary), str(pte), "--prompt-ids", ",".join(map(str, prompt)), "--decode-steps",
                           str(steps), "--runs", str(runs), *flags], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"etmlx_bench {pte.name} {' '.join(flags)}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(plain: Path, spec: Path, draft_model: Path, prompt: list[int], max_tokens: int, repeats: int) -> dict:
    from backends.mlx.runtime.native_tools import tool_path

    binary = tool_path("etmlx_bench")
    steps, runs = max_tokens - 1, 4  # a cold sequence, then three warm ones
    rates = {name: [] for name in ("plain", *SOURCES)}
    ratios = {name: [] for name in SOURCES}
    drafts = {}
    for _ in range(repeats):
        base = _bench(binary, plain, prompt, steps, runs)
        rates["plain"].append(base["sequence_tokens_per_s"])
        for name in SOURCES:
            flags = ["--draft-model", str(draft_model)] if name == "draft-model" else ["--drafts", name]
            out = _bench(binary, spec, prompt, steps, runs, *flags)
            if out["token_sum"] != base["token_sum"]:
                raise RuntimeError(f"the C++ loop with {name} drafts gave other tokens than the plain program")
            rates[name].append(out["sequence_tokens_per_s"])
            ratios[name].append(out["sequence_tokens_per_s"] / base["sequence_tokens_per_s"])
            drafts[name] = {**out["draft"], **({"draft_model": out["draft_model"]} if "draft_model" in out else {})}
    return {"decode_tok_s": {name: statistics.median(v) for name, v in rates.items()},
            "speedup": {name: statistics.median(v) for name, v in ratios.items()}, "drafts": drafts}


def report(result: dict) -> None:
    print("C++ loop (etmlx_bench), the same programs and prompt; ratios: per round, then the median")
    for name, rate in result["decode_tok_s"].items():
        line = f"  {name:18s} {rate:8.0f} tok/s"
        if name in result["speedup"]:
            d = result["drafts"][name]
            share = f"{d['accepted'] / d['proposed']:.0%}" if d["proposed"] else "-"
            line += f"  x{result['speedup'][name]:.2f} vs plain; drafts {d['accepted']}/{d['proposed']} ({share})"
            if "draft_model" in d:
                line += f", draft model {d['draft_model']['ms_per_call']:.2f} ms per call"
        print(line)
