"""`etmlx bench pipeline --quick`: the report's structure, and pipelined and unpipelined programs decode the
same tokens on both kernel sets (the bench raises otherwise; the report says so too). Timings are reported,
never asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.pipeline import KERNEL_SETS, QUICK, SAMPLERS

pytestmark = [pytest.mark.bench, pytest.mark.subprocess]  # etmlx bench pipeline --quick


def test_quick_pipeline_bench_report_and_identical_tokens(tmp_path):
    out = tmp_path / "pipeline.json"
    ran = subprocess.run([sys.executable, "-m", "backends.mlx.cli.main", "bench", "pipeline", "--quick",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["steps"] == QUICK.steps and report["settings"]["repeats"] == QUICK.repeats
    assert "device" in report["machine"]
    rows = report["pipeline"]
    assert sorted((r["kernels"], r["sampler"]) for r in rows) == sorted((k, s) for k in KERNEL_SETS for s in SAMPLERS)
    for r in rows:
        assert r["tokens_identical"] is True
        assert len(r["tokens"]) == QUICK.steps and all(0 <= t < QUICK.vocab_size for t in r["tokens"])
        assert len(r["pipelined_tok_s_runs"]) == len(r["unpipelined_tok_s_runs"]) == QUICK.repeats
        assert r["pipelined_tok_s"] > 0 and r["unpipelined_tok_s"] > 0
        assert abs(r["ratio"] - r["pipelined_tok_s"] / r["unpipelined_tok_s"]) < 1e-9
    greedy = [r["tokens"] for r in rows if r["sampler"] == "greedy"]
    sampled = [r["tokens"] for r in rows if r["sampler"] != "greedy"]
    assert greedy[0] != sampled[0], "the top-k+top-p run should not replay the greedy stream"
    cache = report["kv_cache"]
    assert sorted(r["kernels"] for r in cache) == sorted(KERNEL_SETS)
    for r in cache:
        assert (r["short_cache"], r["long_cache"]) == (QUICK.short_cache, QUICK.long_cache)
        assert r["short_ms_per_step"] > 0 and r["long_ms_per_step"] > 0
        assert isinstance(r["tokens_identical"], bool)
    for heading in ("pipelined vs unpipelined", "KV-cache cost", "identical", "machine:"):
        assert heading in ran.stdout
