"""`etmlx bench decode --quick`: the report's structure, and the three engines decode the same greedy ids.

The engines share only the checkpoint: our .pte (etmlx delegate), mlx-lm's own Llama, and an XNNPACK
.pte with host argmax. If one of them were miswired (weights, positions, cache, sampling) its greedy
ids would part from the others'. Timings are reported, never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.decode import ENGINES, QUICK

pytestmark = [pytest.mark.bench, pytest.mark.subprocess]  # etmlx bench decode --quick


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "backends.mlx.cli.main", "bench", "decode", *args],
                          capture_output=True, text=True, timeout=900)


def test_quick_decode_bench_report_and_greedy_agreement(tmp_path):
    out = tmp_path / "decode.json"
    ran = _bench("--quick", "--dtypes", "float32", "--json", str(out), "--cache-dir", str(tmp_path / "cache"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["prompt_len"] == QUICK.prompt_len and report["settings"]["steps"] == QUICK.steps
    samplers = {r["sampler"] for r in report["results"]}
    assert len(samplers) == 2 and "greedy" in samplers
    assert sorted((r["sampler"], r["engine"]) for r in report["results"]) == sorted(
        (s, e) for s in samplers for e in ENGINES)
    for r in report["results"]:
        assert r["dtype"] == "float32"
        assert len(r["decode_tokens_per_s_runs"]) == QUICK.repeats
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    assert {r["sampler"] for r in report["ratios"]} == samplers
    for r in report["ratios"]:
        assert set(r) == {"dtype", "sampler", "prefill_vs_mlx_lm", "decode_vs_mlx_lm", "prefill_vs_xnnpack",
                          "decode_vs_xnnpack"}
    (dtype,) = report["dtypes"]
    tokens = dtype["greedy_tokens"]
    assert set(tokens) == set(ENGINES)
    assert len(tokens["etmlx"]) == QUICK.steps + 1
    assert all(0 <= t < report["size"]["vocab_size"] for t in tokens["etmlx"])
    assert len(set(tokens["etmlx"])) > 3, "a constant stream would make the comparison below weak"
    assert tokens["mlx_lm"] == tokens["etmlx"], "mlx-lm and etmlx greedy ids differ"
    assert tokens["xnnpack"] == tokens["etmlx"], "XNNPACK and etmlx greedy ids differ"
    assert dtype["programs"]["etmlx"]["outside"] == {}
    assert "ours / baseline" in ran.stdout and "xnnpack" in ran.stdout


def test_unknown_dtype_is_one_error_line(tmp_path):
    ran = _bench("--quick", "--dtypes", "float64", "--cache-dir", str(tmp_path))
    assert ran.returncode == 2
    assert "dtypes must be some of" in ran.stderr and "int4" in ran.stderr and "Traceback" not in ran.stderr
