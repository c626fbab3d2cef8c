"""What the partitioner claims, what stays on ExecuTorch's CPU kernels, and that both run."""

from __future__ import annotations

import pytest
import torch

from backends.mlx.exporter.builder.program_builder import BuildError
from backends.mlx.exporter.builder.registry import REGISTRY, OpEntry
from backends.mlx.runtime.runner import run
from helpers import assert_matches, check_parity, export_fn


class CoreModel(torch.nn.Module):
    """Built only from the ops the delegate covers: every compute op must land inside."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 6, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, x, idx):
        h = torch.relu(self.proj(x))
        logits = self.head(h) * self.scale
        probs = torch.softmax(logits, -1)
        top_v, top_i = torch.topk(probs, 3, -1)
        picked = torch.gather(logits, 1, idx)
        lse = torch.logsumexp(logits, -1, keepdim=True)
        stats = torch.cat([logits.amax(-1, keepdim=True), logits.mean(-1, keepdim=True), lse], -1)
        ranks = torch.argsort(logits, -1, descending=True)
        return probs, top_v, top_i, picked, stats, torch.cumsum(probs, -1), ranks, logits.argmax(-1)


def test_core_model_runs_entirely_in_the_delegate():
    x = torch.randn(4, 8)
    idx = torch.randint(0, 6, (4, 2))
    result = check_parity(CoreModel().eval(), [x, idx])
    assert result.ops_outside == 0, result.summary()
    assert result.delegated_calls == 1


class Mixed(torch.nn.Module):
    """An integer matmul (MLX multiplies floats only) between ops the delegate runs."""

    def forward(self, a, b):
        c = (a + 1) @ b
        return c * 2 - a


def test_unsupported_op_stays_on_cpu_and_the_program_still_runs():
    a = torch.randint(-5, 5, (3, 3), dtype=torch.int32)
    b = torch.randint(-5, 5, (3, 3), dtype=torch.int32)
    result = export_fn(Mixed(), [a, b])
    assert dict(result.outside) == {"aten.mm.default": 1}, result.summary()
    assert "floating" in result.summary()
    assert result.delegated_calls == 2  # before and after the matmul
    assert_matches(run(result.pte, [a, b]), Mixed()(a, b))


def test_unsupported_dtype_stays_outside():
    x = torch.randn(3, 4, dtype=torch.float64)
    result = export_fn(lambda t: (t * 2).exp(), [x])
    assert result.delegated_calls == 0
    assert result.outside["aten.exp.default"] == 1 and result.outside["aten.mul.Tensor"] == 1, result.summary()
    assert "float64 is not supported" in result.summary()
    assert_matches(run(result.pte, [x]), (x * 2).exp())


def test_a_handler_that_raises_is_surfaced_not_silently_moved_to_cpu(monkeypatch):
    target = torch.ops.aten.exp.default
    entry = REGISTRY._entries[target]

    def broken(builder, node):
        raise KeyError("boom")

    monkeypatch.setitem(REGISTRY._entries, target, OpEntry(target, broken, entry.supports))
    with pytest.raises(BuildError, match="aten.exp.default.*boom"):
        export_fn(lambda t: t.exp() + 1, [torch.randn(3)])


def test_partitioner_report_names_what_stayed_outside():
    from executorch.exir import to_edge_transform_and_lower

    from backends.mlx.exporter.partitioner import MLXPartitioner

    a = torch.randint(-5, 5, (2, 2), dtype=torch.int32)
    ep = torch.export.export(Mixed(), (a, a))
    partitioner = MLXPartitioner()
    to_edge_transform_and_lower(ep, partitioner=[partitioner])
    report = partitioner.report()
    assert "1 op(s) stayed outside" in report and "aten.mm.default" in report


def test_export_rejects_bad_arguments():
    with pytest.raises(TypeError, match="module"):
        export_fn.__globals__["export_to_pte"](lambda x: x, (torch.ones(1),))
    with pytest.raises(TypeError, match="args"):
        export_fn.__globals__["export_to_pte"](CoreModel(), [torch.ones(1)])


class StateAcrossCalls(torch.nn.Module):
    """A running state read before an op the delegate does not run (fmod) and updated after it, so
    two delegate calls use the buffer: both must see each call's update."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.tensor([0.5, -1.0, 2.0]))

    def forward(self, x):
        seen = self.total * 2  # delegate call 1 reads the state
        y = torch.fmod(x + seen, 1.5)  # ExecuTorch's CPU kernel
        self.total.copy_(self.total + y)  # delegate call 2 updates it
        return seen


def test_state_used_by_two_delegate_calls_is_updated_for_both():
    from backends.mlx.runtime.runner import load_method

    module = StateAcrossCalls().eval()
    result = export_fn(module, [torch.zeros(3)])
    assert dict(result.outside) == {"aten.fmod.Scalar": 1}, result.summary()
    assert result.delegated_calls == 2
    assert result.host_state == ["fn.total"], result.summary()
    method = load_method(result.pte)
    eager = StateAcrossCalls().eval()  # starts from the initial total, as the program does
    for step in range(4):
        x = torch.full((3,), float(step))
        assert_matches(method.execute([x])[0], eager(x))
