"""Attention over a static cache attends only over its filled part when the mask proves the rest is hidden.

The exporter records a key window on SdpaNode (fusion/key_window.py); the runtime reads the rows' start
positions and drops the keys past max(start) + L. Checked here: the window is found for every decoder
family and not for masks that only look alike; the runtime really drops the keys (a poisoned unfilled part
of the cache leaves the output finite and equal to attention over the filled part); results equal eager
for rows at different positions; a malformed window is an error."""

from __future__ import annotations

import pytest
import torch

import backends.mlx.exporter.preprocess as preprocess
from backends.mlx.exporter.export import export_to_pte
from backends.mlx.exporter.inspect_pte import delegate_blobs
from backends.mlx.llm.decoder.kv_cache import StaticCacheLM
from backends.mlx.runtime.runner import load_method
from backends.mlx.serialization import serializer
from backends.mlx.serialization.generated.node_table import NODE_TAGS
from backends.mlx.serialization.serializer import deserialize
from test_kv_cache import FAMILIES

_NAMES = {tag: name for name, tag in NODE_TAGS.items()}
HEADS, KV_HEADS, DIM, SLOTS, BATCH = 4, 2, 8, 32, 2


def sdpa_nodes(pte: bytes) -> list:
    return [i.node for blob in delegate_blobs(pte) for i in deserialize(blob).instructions
            if _NAMES[i.nodeType] == "SdpaNode"]


class _RowsAttention(torch.nn.Module):
    """StaticCacheLM's attention: rows at their own start positions over a shared-size cache."""

    def __init__(self, compare=torch.le, slot_start=0):
        super().__init__()
        self.compare, self.slot_start = compare, slot_start

    def forward(self, q, k_cache, v_cache, start_pos):
        batch, length = q.shape[0], q.shape[2]
        positions = start_pos.unsqueeze(1) + torch.arange(length).unsqueeze(0)
        slots = torch.arange(self.slot_start, self.slot_start + k_cache.shape[2])
        mask = self.compare(slots.view(1, 1, 1, -1), positions.view(batch, 1, length, 1))
        return torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                                                enable_gqa=True)


class _GivenMask(torch.nn.Module):
    def forward(self, q, k_cache, v_cache, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                                                enable_gqa=True)


def _example(length=5, batch=BATCH):
    q = torch.randn(batch, HEADS, length, DIM)
    k = torch.randn(batch, KV_HEADS, SLOTS, DIM)
    v = torch.randn(batch, KV_HEADS, SLOTS, DIM)
    return q, k, v


def _export_rows(module=None, batch=BATCH, **kw):
    q, k, v = _example(batch=batch)
    length = torch.export.Dim("length", min=1, max=SLOTS)
    return export_to_pte(module or _RowsAttention(), (q, k, v, torch.arange(batch) * 3),
                         dynamic_shapes=({2: length}, None, None, None), **kw)


@pytest.mark.slow  # a decoder export per family
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_decoder_gets_a_window_on_each_attention(family):
    torch.manual_seed(0)
    lm = StaticCacheLM(FAMILIES[family]().eval(), max_seq_len=48, batch=2)
    length = torch.export.Dim("length", min=1, max=48)
    example = (torch.randint(0, 96, (2, 4)), torch.tensor([0, 5]))
    result = export_to_pte(lm, example, dynamic_shapes=({1: length}, None))
    nodes = sdpa_nodes(result.pte)
    assert len(nodes) == 2, len(nodes)
    for node in nodes:
        assert node.window and node.windowPerQuery and node.windowShift == 0, vars(node)
        assert node.windowBase is not None


def test_window_drops_the_unfilled_keys_and_matches_attention_over_the_filled_part():
    torch.manual_seed(0)
    result = _export_rows(batch=1)
    (node,) = sdpa_nodes(result.pte)
    assert node.window and node.windowBase is not None
    method = load_method(result.pte)
    for start, length in ((0, 5), (7, 1), (26, 6), (0, 32)):
        q, k, v = _example(length, batch=1)
        end = start + length
        # Poison the keys no query may see: attention over all SLOTS keys would give NaN (0 * NaN).
        k[:, :, end:], v[:, :, end:] = float("nan"), float("nan")
        starts = torch.tensor([start])
        got = method.execute([q, k, v, starts])[0]
        assert torch.isfinite(got).all(), f"keys past {end} were attended (start {start}, L {length})"
        expected = _RowsAttention()(q, k[:, :, :end], v[:, :, :end], starts)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_with_several_rows_a_rows_bits_do_not_depend_on_the_others():
    """A served request gets the same bits whatever shares its call: several rows attend over every key."""
    torch.manual_seed(0)
    method = load_method(_export_rows().pte)
    q, k, v = _example(3)
    outs = [method.execute([q, k, v, torch.tensor([4, other])])[0] for other in (0, 9, 25)]
    for out in outs[1:]:
        assert torch.equal(out[0], outs[0][0])
    expected = _RowsAttention()(q, k, v, torch.tensor([4, 25]))
    torch.testing.assert_close(outs[2], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("module", [_RowsAttention(compare=torch.lt), _RowsAttention(slot_start=1)],
                         ids=["strict-less", "slots-from-1"])
def test_masks_that_only_look_alike_get_no_window_and_stay_correct(module):
    torch.manual_seed(0)
    result = _export_rows(module)
    (node,) = sdpa_nodes(result.pte)
    assert not node.window
    q, k, v = _example(4)
    start = torch.tensor([2, 9])
    got = load_method(result.pte).execute([q, k, v, start])[0]
    # Rows whose first query sees no key give NaN in both (softmax over nothing).
    torch.testing.assert_close(got, module(q, k, v, start), atol=1e-5, rtol=1e-5, equal_nan=True)


def test_a_mask_given_as_input_gets_no_window():
    q, k, v = _example(3)
    mask = torch.rand(BATCH, 1, 3, SLOTS) > 0.3
    result = export_to_pte(_GivenMask(), (q, k, v, mask))
    (node,) = sdpa_nodes(result.pte)
    assert not node.window


def test_export_without_fusion_records_no_window():
    (node,) = sdpa_nodes(_export_rows(fuse=False).pte)
    assert not node.window


def test_window_base_that_is_not_an_integer_vector_is_an_error(monkeypatch, capfd):
    def mangle(graph):
        for ins in graph.instructions:
            if _NAMES[ins.nodeType] == "SdpaNode":
                ins.node.windowBase.idx = ins.node.q.idx  # a float 4-d tensor
        return serializer.serialize(graph)

    monkeypatch.setattr(preprocess, "serialize", mangle)
    method = load_method(_export_rows().pte)
    q, k, v = _example(2)
    with pytest.raises(RuntimeError):
        method.execute([q, k, v, torch.tensor([0, 1])])
    assert "window_base must be a non-empty 1-d integer tensor" in capfd.readouterr().err


_DEVICE_CALL = """
import sys, torch
from backends.mlx.runtime.runner import load_method
pte, start, length, batch, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
q, k, v = torch.randn(batch, %d, length, %d), torch.randn(batch, %d, %d, %d), torch.randn(batch, %d, %d, %d)
starts = start + 5 * torch.arange(batch)
got = load_method(open(pte, "rb").read()).execute([q, k, v, starts])[0]
torch.save((q, k, v, starts, got), out)
""" % (HEADS, DIM, KV_HEADS, SLOTS, DIM, KV_HEADS, SLOTS, DIM)


@pytest.mark.parametrize("batch, start, length, dropped", [
    (1, 7, 1, True),       # a decode step: every kept key is visible, no mask at all
    (1, 0, 1, True),       # the first step: one key
    (1, SLOTS - 1, 1, True),  # the window ends at the last slot
    (1, 26, 6, False),     # several queries (prefill, verify): the mask stays
    (1, -2, 1, False),     # the query sees no key: only the mask says so
    (2, 4, 1, False),      # several rows: every key, with the mask
], ids=["decode", "first-step", "last-slot", "several-queries", "negative-start", "two-rows"])
def test_device_kernels_drop_a_mask_the_window_makes_redundant(tmp_path, batch, start, length, dropped):
    """With a proven window, one row and one query that sees a key, the device kernel set (what CUDA and Metal
    builds run) calls MLX's attention without the array mask, so a GPU runs its fused decode kernel: the graph
    then has no trace of the mask's comparison, and the result is still the masked attention."""
    import subprocess
    import sys
    from pathlib import Path

    pte = tmp_path / "rows.pte"
    pte.write_bytes(_export_rows(batch=batch).pte)
    dot, saved = tmp_path / "call.dot", tmp_path / "call.pt"
    # Host folding off, as a CUDA build runs it by default (host_fold.h): folded, a small mask is a constant
    # and its comparison leaves the graph whether the kernel keeps the mask or not.
    env = {"ETMLX_KERNELS": "device", "ETMLX_DOT": str(dot), "PATH": "/usr/bin:/bin", "ETMLX_HOST_FOLD": "0"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _DEVICE_CALL, str(pte), str(start), str(length), str(batch),
                           str(saved)], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    q, k, v, starts, got = torch.load(saved)
    if start >= 0:  # a query that sees no key: eager gives NaN, MLX's composed softmax a uniform mix
        torch.testing.assert_close(got, _RowsAttention()(q, k, v, starts), atol=1e-5, rtol=1e-5)
    graph = dot.read_text()
    assert ('label ="LessEqual"' not in graph) == dropped, "the exported mask's comparison in the call's graph"
    assert ('label ="Select"' not in graph) == dropped
