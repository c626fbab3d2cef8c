"""Drive the C++ backend directly with many mutated real blobs (truncations and extensions
included, which an in-place .pte edit cannot express); the harness must never crash."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from backends.mlx.exporter.inspect_pte import delegate_blobs
from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head

pytestmark = pytest.mark.subprocess  # the C++ fuzz harness

HARNESS = Path(__file__).resolve().parents[1] / "build" / "etmlx_blob_test"


def _blob(tmp_path) -> Path:
    result = export_sampling_head(LogitsInput(), (torch.zeros(4, 50),))
    path = tmp_path / "sampler.blob"
    path.write_bytes(delegate_blobs(result.pte)[0])
    return path


_HARNESS_DTYPES = {6: "f32", 4: "i64", 3: "i32", 11: "bool"}  # ExecuTorch ScalarType codes


def _delegate_io_args(pte: bytes) -> list[str]:
    """Harness arguments for the first delegate call's tensors, in the order the runtime passes them."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    plan = deserialize_pte_binary(pte).program.execution_plan[0]
    call = next(i.instr_args for c in plan.chains for i in c.instructions
                if type(i.instr_args).__name__ == "DelegateCall")
    tensors = [plan.values[i].val for i in call.args]
    *inputs, output = tensors  # these sampler programs have exactly one output
    spec = lambda t: f"{_HARNESS_DTYPES[int(t.scalar_type)]}:{','.join(str(d) for d in t.sizes) or '-'}"
    return [a for t in inputs for a in ("-i", spec(t))] + ["-o", spec(output)]


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


def test_mutations_of_a_full_sampler_blob(harness, tmp_path):
    """Filters, fused Gumbel-max and delegate-owned penalty state under mutation."""
    from backends.mlx.llm.sampler.config import SamplerConfig

    config = SamplerConfig(top_k=True, top_p=True, min_p=True, penalties=True)
    result = export_sampling_head(LogitsInput(), (torch.zeros(4, 50),), config=config, per_row=True)
    path = tmp_path / "full.blob"
    path.write_bytes(delegate_blobs(result.pte)[0])
    args = [str(harness), str(path), *_delegate_io_args(result.pte)]
    plain = subprocess.run(args + ["--repeat", "3"], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-2000:]
    fuzz = subprocess.run(args + ["--fuzz", "10000", "--seed", "5", "--quiet"], capture_output=True, text=True,
                          timeout=540)
    assert fuzz.returncode == 0, f"rc={fuzz.returncode}\n{fuzz.stderr[-2000:]}"
