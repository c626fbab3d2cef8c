"""A malformed delegate blob is rejected with an ExecuTorch error and a log line, never a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import backends.mlx.exporter.preprocess as preprocess
from backends.mlx.exporter.inspect_pte import delegate_blobs
from backends.mlx.runtime.runner import load_method, run
from backends.mlx.serialization import serializer
from helpers import export_fn  # noqa: E402

HERE = Path(__file__).parent


class _Model(torch.nn.Module):
    """Small, but with a weight (a constant in the blob) and several node kinds."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.linspace(-1, 1, 5))

    def forward(self, a, b, idx):
        h = torch.softmax(a @ b, -1) + self.bias
        return torch.gather(h, 1, idx), h.sum(0), torch.cumsum(h, 1).topk(2)[1]


_model = _Model()


def _inputs():
    return [torch.randn(3, 4), torch.randn(4, 5), torch.randint(0, 5, (3, 2))]


@pytest.fixture(scope="module")
def good_pte():
    torch.manual_seed(0)
    return export_fn(_model, _inputs()).pte


def _export_with(monkeypatch, mangle):
    """Export the model with serialize() replaced by mangle(graph) -> bytes."""
    monkeypatch.setattr(preprocess, "serialize", mangle)
    return export_fn(_model, _inputs()).pte


def _assert_rejected(pte, capfd, *needles):
    with pytest.raises(RuntimeError) as err:
        load_method(pte)
    log = getattr(err.value, "log", "") + capfd.readouterr().err  # LoadError carries the native log
    for needle in needles:
        assert needle in log, f"expected {needle!r} in the runtime log, got:\n{log}"


def _patched_blob(pte: bytes, offset: int, data: bytes) -> bytes:
    blob = delegate_blobs(pte)[0]
    at = pte.find(blob)
    out = bytearray(pte)
    out[at + offset: at + offset + len(data)] = data
    return bytes(out)


def test_good_blob_runs(good_pte):
    torch.manual_seed(1)
    inputs = _inputs()
    outs = run(good_pte, inputs)
    assert torch.allclose(outs[1], _model(*inputs)[1], atol=1e-5)


def test_wrong_magic(good_pte, capfd):
    _assert_rejected(_patched_blob(good_pte, 0, b"NOPE"), capfd, "magic")


def test_newer_schema_version(good_pte, capfd):
    _assert_rejected(_patched_blob(good_pte, 4, (2).to_bytes(4, "little")), capfd, "schema version 2")


def test_header_length_mismatch(good_pte, capfd):
    _assert_rejected(_patched_blob(good_pte, 8, (12345).to_bytes(8, "little")), capfd, "12345")


def test_truncated_blob(monkeypatch, capfd):
    pte = _export_with(monkeypatch, lambda g: serializer.serialize(g)[:-40])
    _assert_rejected(pte, capfd, "etmlx")


def test_truncated_payload_with_consistent_header(monkeypatch, capfd):
    def truncate(graph):
        blob = serializer.serialize(graph)
        payload = blob[16:][: len(blob) // 2]
        return blob[:8] + len(payload).to_bytes(8, "little") + payload

    _assert_rejected(_export_with(monkeypatch, truncate), capfd, "etmlx")


def _mangled(edit):
    def mangle(graph):
        edit(graph)
        return serializer.serialize(graph)

    return mangle


def test_out_of_range_tensor_slot(monkeypatch, capfd):
    def edit(g):
        g.instructions[0].node.out.idx = g.numTensors + 7

    _assert_rejected(_export_with(monkeypatch, _mangled(edit)), capfd, "slot")


def test_out_of_range_io_slot(monkeypatch, capfd):
    def edit(g):
        g.inputs[0].slot.idx = 10**6

    _assert_rejected(_export_with(monkeypatch, _mangled(edit)), capfd, "slot")


def test_unsupported_dtype(monkeypatch, capfd):
    def edit(g):
        g.constants[0].dtype = 99

    _assert_rejected(_export_with(monkeypatch, _mangled(edit)), capfd, "dtype")


def test_unknown_activation_precision(monkeypatch, capfd):
    def edit(g):
        g.qmmActivations = 9

    _assert_rejected(_export_with(monkeypatch, _mangled(edit)), capfd,
                     "graph asks for quantized-product activations 9, not int16 (0), int8 (1) or float32 (2)")


def test_unknown_node_type(monkeypatch, capfd):
    def edit(g):
        g.instructions[0].nodeType = 250

    _assert_rejected(_export_with(monkeypatch, _mangled(edit)), capfd, "unknown node type 250")


def test_constant_size_mismatch(monkeypatch, capfd):
    def edit(g):
        g.constants[0].data = g.constants[0].data[:-1]

    _assert_rejected(_export_with(monkeypatch, _mangled(edit)), capfd, "constant")


def test_read_before_write_fails_at_run_time(monkeypatch, capfd):
    def edit(g):
        # The last instruction reads a fresh slot nobody writes.
        g.numTensors += 1
        node = g.instructions[-1].node
        for name in ("x", "a"):
            if hasattr(node, name) and getattr(node, name) is not None:
                getattr(node, name).idx = g.numTensors - 1
                break

    pte = _export_with(monkeypatch, _mangled(edit))
    method = load_method(pte)
    with pytest.raises(RuntimeError):
        method.execute(_inputs())
    assert "before it is written" in capfd.readouterr().err


@pytest.mark.subprocess
def test_many_random_corruptions_never_crash(good_pte, tmp_path):
    """Bit flips and byte overwrites anywhere in a real blob, run in a child so a crash is seen."""
    src = tmp_path / "good.pte"
    src.write_bytes(good_pte)
    proc = subprocess.run(
        [sys.executable, str(HERE / "corruption_worker.py"), str(src), "400", "7"],
        capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, f"worker died (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["tried"] == 400
    # Flips in constant data legitimately still run; most structural flips must be refused.
    assert summary["rejected_at_load"] + summary["rejected_at_run"] >= 100, summary
    assert summary["unexpected"] == [], summary


class _Quantized(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from backends.mlx.llm.quantize.affine import quantize_tensor
        from backends.mlx.llm.quantize.modules import QuantizedLinear

        self.linear = QuantizedLinear(*quantize_tensor(torch.randn(8, 128), 64, 4), 64, 4)

    def forward(self, x):
        return self.linear(x)


def _quantized_pte(monkeypatch, edit):
    def mangle(graph):
        for instr in graph.instructions:
            if type(instr.node).__name__ == "QuantizedLinearNodeT":
                edit(graph, instr.node)
        return serializer.serialize(graph)

    monkeypatch.setattr(preprocess, "serialize", mangle)
    return export_fn(_Quantized(), [torch.randn(2, 128)]).pte


def _constant(graph, slot):
    return next(c for c in graph.constants if c.slot.idx == slot.idx)


@pytest.mark.parametrize("field,value,needle", [("bits", 3, "bits 3 is not supported"),
                                                ("groupSize", 48, "group size 48 is not supported"),
                                                ("groupSize", 32, "need scales and biases [8, 4]")])
def test_quantized_node_parameters_are_checked_at_load(monkeypatch, capfd, field, value, needle):
    pte = _quantized_pte(monkeypatch, lambda g, node: setattr(node, field, value))
    _assert_rejected(pte, capfd, "QuantizedLinearNode", needle)


def test_quantized_weights_of_the_wrong_shape_fail_at_load(monkeypatch, capfd):
    def edit(graph, node):
        scales = _constant(graph, node.scales)
        scales.shape = [4, 4]  # same byte count, rows no longer match the packed weights

    _assert_rejected(_quantized_pte(monkeypatch, edit), capfd, "QuantizedLinearNode", "need scales and biases [8, 2]")


def test_quantized_weights_must_be_uint32(monkeypatch, capfd):
    def edit(graph, node):
        _constant(graph, node.w).dtype = 3  # Int32

    _assert_rejected(_quantized_pte(monkeypatch, edit), capfd, "packed weights must be a 2-d uint32 tensor")


def test_a_huge_zeros_constant_is_refused_before_allocating(monkeypatch, capfd):
    """State allocated at load (a KV cache) is sized by the blob: beyond the array memory limit it is a load
    error, not an allocation MLX turns into a write through a null pointer."""
    def edit(g):
        c = g.constants[0]
        c.zeros, c.data = True, np.zeros(0, dtype=np.uint8)
        c.shape = [2 ** 31 - 1] + [50] * (len(c.shape) - 1 or 1)

    _assert_rejected(_export_with(monkeypatch, _mangled(edit)), capfd, "exceed the", "bytes one array may use")


def test_zeros_constant_with_data_is_rejected(monkeypatch, capfd):
    def edit(g):
        g.constants[0].zeros = True

    _assert_rejected(_export_with(monkeypatch, _mangled(edit)), capfd, "marked zeros")


class _Filled(torch.nn.Module):
    def forward(self, a):
        return a + torch.full((3, 4), 2.0)


def _full_of(monkeypatch, rows: int, cols: int) -> bytes:
    """_Filled exported with its FullNode's shape set to [rows, cols] (float32)."""
    def edit(g):
        node = next(i.node for i in g.instructions if type(i.node).__name__ == "FullNodeT")
        node.shape[0].literal, node.shape[1].literal = rows, cols
    monkeypatch.setattr(preprocess, "serialize", _mangled(edit))
    return export_fn(_Filled(), [torch.zeros(3, 4)]).pte


# Run in a child process: a crash (SIGSEGV inside MLX on a failed allocation) must show as a
# signal there rather than take the test runner down.
_RUN_BLOB = """
import sys, torch
from backends.mlx.runtime.runner import load_method
try:
    load_method(sys.argv[1]).execute([torch.zeros(3, 4)])
except RuntimeError:
    sys.exit(3)
print("ran")
"""


def _run_child(pte: bytes, tmp_path, env=None):
    import os
    path = tmp_path / "bomb.pte"
    path.write_bytes(pte)
    return subprocess.run([sys.executable, "-c", _RUN_BLOB, str(path)], capture_output=True, text=True,
                          timeout=300, cwd=HERE.parent, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("rows, cols", [(2 ** 31 - 1, 8),  # 64 GiB: under the old fixed 64 GiB cap
                                        (2 ** 31 - 1, 2 ** 4 * 3)])  # beyond it
@pytest.mark.subprocess
def test_an_allocation_bomb_is_refused_before_allocating(monkeypatch, tmp_path, rows, cols):
    import os
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE")
    assert rows * cols * 4 > physical  # the premise: more than this machine has
    proc = _run_child(_full_of(monkeypatch, rows, cols), tmp_path)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])  # a clean error, not a signal
    assert "ETMLX_MAX_ARRAY_BYTES" in proc.stderr or "too large" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.subprocess
def test_the_array_limit_can_be_lowered(monkeypatch, tmp_path):
    pte = _full_of(monkeypatch, 3, 4)  # 48 bytes
    assert _run_child(pte, tmp_path).stdout.strip() == "ran"
    proc = _run_child(pte, tmp_path, env={"ETMLX_MAX_ARRAY_BYTES": "40"})
    assert proc.returncode == 3 and "more than the 40 bytes one array may use" in proc.stderr, proc.stderr[-2000:]
