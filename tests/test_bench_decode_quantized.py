"""`etmlx bench decode --quick --dtypes int4`: the quantized comparison's records.

etmlx exports the directory mlx_lm.convert -q wrote and mlx-lm loads it, so greedy ids must match; the
model file must be about an eighth of float32's; memory ratios must be the quotients of the measured
values. Timings are reported, never asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from benchmarks.decode import QUICK

pytestmark = [pytest.mark.bench, pytest.mark.subprocess]  # etmlx bench decode --quick, int4


def test_quick_int4_bench_records(tmp_path):
    out = tmp_path / "decode.json"
    ran = subprocess.run([sys.executable, "-m", "backends.mlx.cli.main", "bench", "decode", "--quick", "--dtypes",
                          "int4", "--json", str(out), "--cache-dir", str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads(out.read_text())
    (d,) = report["dtypes"]
    assert d["dtype"] == "int4" and "mlx-int4-g64" in d["checkpoint"]
    assert sorted({r["engine"] for r in report["results"]}) == ["etmlx", "mlx_lm"], "XNNPACK is skipped for int4"
    assert "XNNPACK skipped" in ran.stdout

    assert set(d["memory"]) == {"etmlx", "mlx_lm"}
    for m in d["memory"].values():
        assert set(m) == {"file_bytes", "bytes_per_parameter", "peak_rss_bytes"}
        assert m["bytes_per_parameter"] == m["file_bytes"] / d["parameters"]
        # A process that ran the model holds at least its weights (and Python, and MLX).
        assert m["peak_rss_bytes"] > m["file_bytes"]
    # 4-bit integers plus a float32 scale and bias per 64 weights is 0.625 bytes; float32 is 4. The rest is
    # norms kept in float, and (etmlx) the program and tokenizer, a few percent of this tiny model.
    for name, m in d["memory"].items():
        assert m["bytes_per_parameter"] < 4 / 4 + 0.1, name
    assert d["memory"]["mlx_lm"]["bytes_per_parameter"] > 0.625

    (mem_ratio,) = report["memory_ratios"]
    ours, base = d["memory"]["etmlx"], d["memory"]["mlx_lm"]
    assert math.isclose(mem_ratio["peak_rss_vs_mlx_lm"], ours["peak_rss_bytes"] / base["peak_rss_bytes"])
    assert math.isclose(mem_ratio["bytes_per_parameter_vs_mlx_lm"],
                        ours["bytes_per_parameter"] / base["bytes_per_parameter"])

    speed = {(r["sampler"], r["engine"]): r for r in report["results"]}
    assert len(report["ratios"]) == 2
    for r in report["ratios"]:
        assert set(r) == {"dtype", "sampler", "prefill_vs_mlx_lm", "decode_vs_mlx_lm"}
        for phase in ("prefill", "decode"):
            key = f"{phase}_tokens_per_s"
            assert math.isclose(r[f"{phase}_vs_mlx_lm"],
                                speed[(r["sampler"], "etmlx")][key] / speed[(r["sampler"], "mlx_lm")][key])

    tokens = d["greedy_tokens"]
    assert len(tokens["etmlx"]) == QUICK.steps + 1 and len(set(tokens["etmlx"])) > 3
    assert tokens["mlx_lm"] == tokens["etmlx"], "etmlx and mlx-lm greedy ids differ on the same int4 checkpoint"
