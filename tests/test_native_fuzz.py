"""Drive the C++ backend directly with many mutated real blobs (truncations and extensions
included, which an in-place .pte edit cannot express); the harness must never crash."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from backends.mlx.inspect_pte import delegate_blobs
from backends.mlx.llm.export_sampler import LogitsInput, export_sampling_head

HARNESS = Path(__file__).resolve().parents[1] / "build" / "etmlx_blob_test"


def _blob(tmp_path) -> Path:
    result = export_sampling_head(LogitsInput(), (torch.zeros(4, 50),))
    path = tmp_path / "sampler.blob"
    path.write_bytes(delegate_blobs(result.pte)[0])
    return path


@pytest.fixture(scope="module")
def harness():
    assert HARNESS.is_file(), f"{HARNESS} is missing: run `make setup`"
    return HARNESS


def test_sampler_blob_runs_in_the_harness(harness, tmp_path):
    args = [str(harness), str(_blob(tmp_path)), "-i", "f32:4,50", "-i", "f32:-", "-i", "i64:-", "-o", "i64:4"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("OUT 0"))
    ids = [int(v) for v in line.split(":", 1)[1].split()]
    assert len(ids) == 4 and all(0 <= i < 50 for i in ids)


def test_twenty_thousand_mutations_of_the_sampler_blob(harness, tmp_path):
    args = [str(harness), str(_blob(tmp_path)), "-i", "f32:4,50", "-i", "f32:-", "-i", "i64:-", "-o", "i64:4",
            "--fuzz", "20000", "--seed", "3", "--quiet"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stderr[-2000:]}"
