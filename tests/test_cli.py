"""The command line of the README's table: `etmlx demo`, `etmlx inspect`, and a small `etmlx bench agreement`."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _etmlx(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "backends.mlx.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.subprocess
def test_demo_exports_runs_and_agrees_with_eager(tmp_path):
    out = _etmlx("demo", "--classifier", "--out", str(tmp_path / "demo.pte"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "0 ops outside the etmlx delegate" in out.stdout
    assert "same top-3 as eager: True" in out.stdout
    inspected = _etmlx("inspect", str(tmp_path / "demo.pte"))
    assert inspected.returncode == 0, inspected.stderr[-2000:]
    assert "1 etmlx delegate blob(s)" in inspected.stdout and "AddmmNode" in inspected.stdout


def test_inspect_names_a_missing_file(tmp_path):
    out = _etmlx("inspect", str(tmp_path / "nope.pte"))
    assert out.returncode != 0 and "nope.pte" in out.stderr


@pytest.mark.bench
@pytest.mark.subprocess
def test_bench_agreement_reports_rates():
    out = _etmlx("bench", "agreement", "--rows", "16", timeout=540)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("host reference == device") == 3


def test_bench_outside_a_checkout_says_where_the_benchmarks_are(tmp_path):
    """An install without benchmarks/ (a wheel): `etmlx bench ...` is one line naming the folder, exit 2."""
    import shutil
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    shutil.copytree(repo / "backends", tmp_path / "backends", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "_lib", "*.cpp", "*.h"))
    ran = subprocess.run([sys.executable, "-c", "import sys; from backends.mlx.cli.main import main; "
                          "sys.exit(main(['bench', 'decode', '--quick']))"], capture_output=True, text=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.strip().splitlines() == [
        "etmlx: error: etmlx bench runs from a checkout of the etmlx repository: the benchmarks are its top-level "
        "benchmarks/ folder, which the wheel does not ship (git clone, then make setup)"]


@pytest.mark.slow
def test_language_model_demo_trains_exports_and_matches_transformers(tmp_path, capsys):
    """`etmlx demo` on a short training recipe: cached checkpoint, exported .pte, greedy text equal to
    transformers (the demo returns 1 otherwise), and a second run reuses both."""
    from backends.mlx.cli import demo
    from backends.mlx.llm.builtin.model import BuiltinRecipe

    recipe = BuiltinRecipe(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           steps=20, batch=4, seq_len=64)
    pte = tmp_path / "builtin.pte"
    assert demo.main(pte, max_tokens=12, cache_dir=tmp_path / "cache", recipe=recipe, max_seq_len=64) == 0
    first = capsys.readouterr().out
    assert "0 ops outside the etmlx delegate" in first and "same tokens as transformers greedy generation: True" in first
    exported_at = pte.stat().st_mtime
    assert demo.main(pte, max_tokens=4, cache_dir=tmp_path / "cache", recipe=recipe, max_seq_len=64) == 0
    assert "exported from the current checkpoint" in capsys.readouterr().out and pte.stat().st_mtime == exported_at


@pytest.mark.subprocess  # many etmlx processes
def test_bad_paths_and_absent_servers_are_one_line_errors(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hi\n")
    cases = [(("inspect", str(tmp_path)), "is not a file"),
             (("inspect", str(text)), "is not a readable ExecuTorch .pte"),
             (("lmtp-client", "--url", "ws://127.0.0.1:9/lmtp", "--send", 'MODEL_INFO {"stream_id": 1}'),
              "Cannot connect"),
             (("export", "--model", str(tmp_path), "--out", str(tmp_path)), "is a directory; give the .pte file"),
             (("export", "--model", str(tmp_path), "--propose-tokens", "4", "--logprobs", "2"),
              "--propose-tokens takes the plain sampling head"),
             (("export", "--model", str(tmp_path), "--propose-tokens", "-1"), "--propose-tokens must be >= 0"),
             (("export", "--model", str(tmp_path), "--kv-scale-dtype", "bfloat16"),
              "--kv-scale-dtype needs a quantized cache (--kv-bits 4 or 8)")]
    for args, needle in cases:
        out = _etmlx(*args, timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode != 0 and len(lines) == 1 and needle in lines[0], out.stderr[-2000:]
