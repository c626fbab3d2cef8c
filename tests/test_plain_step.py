"""A program's plain step (exporter/plain_step.py): a second graph in the blob that the runtime runs, over the same
state, for a call whose selecting input has size 1 along axis 1; checked at export and at load."""

from __future__ import annotations

import pytest
import torch

import backends.mlx.exporter.preprocess as preprocess
from backends.mlx.exporter.export import export_to_pte
from backends.mlx.exporter.inspect_pte import delegate_blobs, describe
from backends.mlx.exporter.plain_step import PlainStep, PlainStepError
from backends.mlx.runtime.runner import load_method
from backends.mlx.serialization import serializer


class _Counter(torch.nn.Module):
    """State `total` [1]; x [1, 3] int64; the main mode adds the sum of `drafts` [1, G] and 100, the plain mode adds `step` only.
    Both return (the total before, x * 2 + their mark): the mark tells which graph ran."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(1, dtype=torch.int64))
        self.plain = False

    def forward(self, x, drafts, step):
        before = self.total.clone()
        if self.plain:
            self.total.add_(step)
            return before, x * 2 + 1
        self.total.add_(drafts.sum(dim=1) + step + 100)
        return before, x * 2 + 7


def _export(monkeypatch=None, mangle=None, order_swap=False):
    module = _Counter()
    if order_swap:  # the plain mode makes its outputs in the other order: the exporter must refuse it
        original = _Counter.forward

        def swapped(self, x, drafts, step):
            if not self.plain:
                return original(self, x, drafts, step)
            y = x * 2 + 1
            before = self.total.clone()
            self.total.add_(step)
            return before, y

        module.forward = swapped.__get__(module)
    if mangle is not None:
        real = preprocess.serialize

        def patched(graph):
            if graph.plainStep is not None and len(graph.plainStep):
                mangle(graph)
            return real(graph)

        monkeypatch.setattr(preprocess, "serialize", patched)
    width = torch.export.Dim("width", min=1, max=8)
    args = (torch.ones(1, 3, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64), torch.ones(1, dtype=torch.int64))
    return export_to_pte(module, args, dynamic_shapes=({}, {1: width}, {}),
                         plain_step=PlainStep(switch=lambda on: setattr(module, "plain", on), when="drafts"))


@pytest.fixture(scope="module")
def counter_pte():
    return _export().pte


def _call(method, drafts, step=1):
    before, y = method.execute([torch.full((1, 3), 2, dtype=torch.int64), torch.tensor([drafts], dtype=torch.int64),
                                torch.tensor([step], dtype=torch.int64)])
    return int(before[0]), int(y[0, 0])


def test_a_call_without_drafts_runs_the_plain_step_over_the_same_state(counter_pte):
    method = load_method(counter_pte)
    assert _call(method, [5, 6]) == (0, 11)     # main: + 11 + 1 + 100
    assert _call(method, [-1], step=3) == (112, 5)  # plain (width 1): + 3
    assert _call(method, [1, 1, 1]) == (115, 11)  # main again, on the state the plain step left
    assert _call(method, [9], step=2) == (219, 5)
    assert _call(method, [0, 0]) == (221, 11)


def test_the_blob_carries_a_smaller_plain_graph(counter_pte, tmp_path):
    graph = serializer.deserialize(delegate_blobs(counter_pte)[0])
    plain = serializer.deserialize(bytes(graph.plainStep))
    assert [io.name for io in graph.inputs][graph.plainStepWhen] == b"drafts"
    assert b"drafts" not in [io.name for io in plain.inputs]  # the plain mode never reads it
    assert [mb.name for mb in plain.mutableBuffers] == [mb.name for mb in graph.mutableBuffers]
    assert not plain.plainStep  # one level only
    (tmp_path / "counter.pte").write_bytes(counter_pte)
    assert (f"plain step: {len(graph.plainStep)} bytes, {len(plain.instructions)} instructions, run when input "
            f"{graph.plainStepWhen} (drafts)") in describe(tmp_path / "counter.pte")  # etmlx inspect


def test_the_plain_step_is_stored_once(counter_pte):
    # Preprocess stores it in the main blob; the compile spec that carried it there is dropped after lowering
    # (ExecuTorch writes a delegate's compile specs into the .pte beside its blob).
    plain = bytes(serializer.deserialize(delegate_blobs(counter_pte)[0]).plainStep)
    assert counter_pte.count(plain) == 1


def test_outputs_made_in_another_order_are_refused_at_export():
    with pytest.raises(PlainStepError, match="another order"):
        _export(order_swap=True)


def _rename_input(graph):
    plain = serializer.deserialize(bytes(graph.plainStep))
    plain.inputs[0].name = b"not_an_input"
    graph.plainStep = list(serializer.serialize(plain))


def _rename_state(graph):
    plain = serializer.deserialize(bytes(graph.plainStep))
    plain.mutableBuffers[0].name = b"other_state"
    graph.plainStep = list(serializer.serialize(plain))


def _truncate(graph):
    graph.plainStep = list(bytes(graph.plainStep)[:40])


def _select_by_constant(graph):
    graph.plainStepWhen = 7


@pytest.mark.parametrize("mangle, needle", [
    (_rename_input, "plain step's input 0 (\"not_an_input\")"),
    (_rename_state, "does not keep the program's state buffer"),
    (_truncate, "plain step (above) did not load"),
    (_select_by_constant, "selected by input 7"),
])
def test_a_plain_step_that_does_not_fit_is_refused_at_load(monkeypatch, capfd, mangle, needle):
    pte = _export(monkeypatch, mangle).pte
    with pytest.raises(RuntimeError) as err:
        load_method(pte)
    log = getattr(err.value, "log", "") + capfd.readouterr().err
    assert needle in log, log
