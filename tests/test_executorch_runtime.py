"""ExecuTorch's own Python runtime runs an etmlx .pte after `import etmlx.runtime`: the flow docs/python-api.md
shows (a SamplingHead lowered with MLXPartitioner, then executorch.runtime), each half in a fresh interpreter,
with the tokens checked against the eager model's argmax. The control: without the import ExecuTorch fails with
the error the docs name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

EXPORT = """
import sys, torch
from executorch.exir import to_edge_transform_and_lower
from backends.mlx.exporter.partitioner import MLXPartitioner
from backends.mlx.llm.sampler.head import SamplingHead


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.out = torch.nn.Linear(32, 64)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


torch.manual_seed(0)
model = Tiny().eval()
ids = torch.tensor([[1, 2, 3], [7, 8, 9], [4, 40, 20]])
head = SamplingHead(model)
ep = torch.export.export(head, (ids,), {"temperature": torch.tensor(0.0), "seed": torch.tensor(0)})
program = to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()]).to_executorch()
with open(sys.argv[1], "wb") as f:
    f.write(program.buffer)
print(model(ids)[:, -1].argmax(-1).tolist())
"""

RUN = """
import sys
{prelude}
import torch
from executorch.runtime import Runtime

ids = torch.tensor([[1, 2, 3], [7, 8, 9], [4, 40, 20]])
method = Runtime.get().load_program(sys.argv[1]).load_method("forward")
token = method.execute([ids, torch.tensor(0.0), torch.tensor(0)])[0]
print(token.tolist())
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=REPO)


@pytest.mark.subprocess  # fresh interpreters loading torch and ExecuTorch
def test_executorch_runtime_runs_a_pte_after_import_etmlx_runtime(tmp_path):
    pte = tmp_path / "head.pte"
    exported = _python(EXPORT, str(pte))
    assert exported.returncode == 0, exported.stderr[-3000:]
    expected = exported.stdout.strip().splitlines()[-1]

    ran = _python(RUN.format(prelude="import etmlx.runtime"), str(pte))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip().splitlines()[-1] == expected

    # The control: ExecuTorch alone has no EtmlxBackend.
    alone = _python(RUN.format(prelude=""), str(pte))
    assert alone.returncode != 0
    assert "Failed to load method forward, error: 0x:20" in alone.stderr
