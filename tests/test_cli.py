"""The README's command line: `etmlx demo`, `etmlx inspect`, and a small `etmlx bench agreement`."""

from __future__ import annotations

import subprocess
import sys


def _etmlx(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "backends.mlx.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_demo_exports_runs_and_agrees_with_eager(tmp_path):
    out = _etmlx("demo", "--out", str(tmp_path / "demo.pte"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "0 ops outside the etmlx delegate" in out.stdout
    assert "same top-3 as eager: True" in out.stdout
    inspected = _etmlx("inspect", str(tmp_path / "demo.pte"))
    assert inspected.returncode == 0, inspected.stderr[-2000:]
    assert "1 etmlx delegate blob(s)" in inspected.stdout and "AddmmNode" in inspected.stdout


def test_inspect_names_a_missing_file(tmp_path):
    out = _etmlx("inspect", str(tmp_path / "nope.pte"))
    assert out.returncode != 0 and "nope.pte" in out.stderr


def test_bench_agreement_reports_rates():
    out = _etmlx("bench", "agreement", "--rows", "16", timeout=540)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("host reference == device") == 3
