"""A `where` whose condition the host holds picks its side when the graph is built (interpreter.cpp exec_where).

This is what lets a pipelined draft-verifying program's undelivered call return without waiting for the step
it starts (llm/decoder/pipelined_verify.py): its outputs then depend only on the previous call's state. Checked:
the values equal torch.where's for all-true, all-false and mixed conditions (of the input and of a view of it),
and the call's graph holds the unpicked side's work only when the condition is mixed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.mlx.exporter.export import export_to_pte


class _Choose(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x, flag):  # x [B, 16], flag [B] bool
        heavy = (x @ self.w).tanh()  # the work a picked `previous` must not wait for
        light = x * 2.0
        return torch.where(flag.unsqueeze(1), heavy, light), torch.where(flag, heavy.sum(1), light.sum(1))


_CALL = """
import sys, torch
from backends.mlx.runtime.runner import load_method
pte, flags, out = sys.argv[1], [c == "1" for c in sys.argv[2]], sys.argv[3]
torch.manual_seed(1)
x = torch.randn(len(flags), 16)
flag = torch.tensor(flags)
got = load_method(open(pte, "rb").read()).execute([x, flag])
torch.save((x, flag, [g.clone() for g in got]), out)
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    pte = tmp_path_factory.mktemp("known") / "choose.pte"
    export_to_pte(_Choose().eval(), (torch.randn(3, 16), torch.ones(3, dtype=torch.bool))).save(pte)
    return pte


@pytest.mark.parametrize("flags, resolved", [("111", True), ("000", True), ("101", False)],
                         ids=["all-true", "all-false", "mixed"])
def test_a_condition_the_host_holds_is_resolved_when_the_graph_is_built(program, tmp_path, flags, resolved):
    dot, saved = tmp_path / "call.dot", tmp_path / "call.pt"
    env = {"ETMLX_DOT": str(dot), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", _CALL, str(program), flags, str(saved)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    x, flag, got = torch.load(saved)
    expected = _Choose().eval()(x, flag)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    graph = dot.read_text()
    assert ('label ="Select"' in graph) == (not resolved)
    # All false: the outputs need none of the heavy side's work (the matmul and tanh: MLX's Tanh, or the cpu kernel
    # set's TanhCpu host loop).
    assert ('label ="Tanh' in graph) == (flags != "000")
