"""Weights outside the delegate blob: constants are ExecuTorch named data, in the .pte's segments by default or
in a FILE.ptd (`weights="external"`), outside the delegate blob. The blob stays small, outputs
are bit-identical to the inline layout, and a missing, mismatched or truncated .ptd is a clean error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import backends.mlx.exporter.preprocess as preprocess
from backends.mlx.exporter.builder.weights import NAMED_MIN_BYTES
from backends.mlx.exporter.export import export_to_pte, weights_path
from backends.mlx.exporter.inspect_pte import delegate_blobs
from backends.mlx.runtime.load_errors import LoadError
from backends.mlx.runtime.runner import load_method, run
from backends.mlx.serialization import serializer

ROOT = Path(__file__).resolve().parents[1]


class _Mlp(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = torch.nn.Linear(128, 512)
        self.down = torch.nn.Linear(512, 64)
        self.scale = torch.nn.Parameter(torch.tensor([1.5]))  # small: stays inline

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.scale


X = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
WEIGHT_BYTES = 4 * (128 * 512 + 512 + 512 * 64 + 64)
NAMED_BYTES = WEIGHT_BYTES - 4 * 64  # the down projection's bias is under NAMED_MIN_BYTES: inline


def _save(tmp_path: Path, name: str, weights: str, seed: int = 0) -> Path:
    return export_to_pte(_Mlp(seed), (X,), weights=weights).save(tmp_path / f"{name}.pte")


def _graph(pte: Path):
    (blob,) = delegate_blobs(pte.read_bytes())
    return blob, serializer.deserialize(blob)


def test_weights_are_named_data_not_in_the_blob(tmp_path):
    inline_blob, _ = _graph(_save(tmp_path, "inline", "inline"))
    blob, graph = _graph(_save(tmp_path, "named", "pte"))
    assert len(inline_blob) > WEIGHT_BYTES
    assert len(blob) < 8192, f"the blob holds {len(blob)} bytes: weights are still inside it"
    named = [c for c in graph.constants if c.key]
    assert NAMED_MIN_BYTES == 1024
    assert sum(4 * int(torch.tensor(c.shape).prod()) for c in named) == NAMED_BYTES
    assert all(len(c.data) == 0 for c in named)
    assert any(not c.key and len(c.data) == 4 for c in graph.constants), "the 1-element scale should stay inline"


def test_outputs_are_bit_identical_across_layouts(tmp_path):
    expected = _Mlp()(X).detach()
    outs = {w: run(_save(tmp_path, w, w), [X])[0] for w in ("inline", "pte", "external")}
    torch.testing.assert_close(outs["inline"], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(outs["pte"], outs["inline"])
    assert torch.equal(outs["external"], outs["inline"])


def test_external_weights_go_to_a_ptd_beside_the_pte(tmp_path):
    pte = _save(tmp_path, "ext", "external")
    ptd = weights_path(pte)
    assert ptd == tmp_path / "ext.ptd" and ptd.is_file()
    assert pte.stat().st_size < 16384 < WEIGHT_BYTES < ptd.stat().st_size
    # An explicit weights= path works from anywhere.
    moved = tmp_path / "elsewhere.ptd"
    shutil.move(ptd, moved)
    expected = run(_save(tmp_path, "ref", "inline"), [X])[0]
    assert torch.equal(run(pte, [X], weights=moved)[0], expected)


def test_missing_ptd_is_a_clear_error(tmp_path):
    pte = _save(tmp_path, "ext", "external")
    weights_path(pte).unlink()
    with pytest.raises(LoadError, match="not in the program or its weights file"):
        load_method(pte)
    with pytest.raises(FileNotFoundError, match="weights: no such file"):
        load_method(pte, weights=tmp_path / "nope.ptd")


def test_ptd_of_another_export_is_a_clear_error(tmp_path):
    pte = _save(tmp_path, "a", "external", seed=0)
    other = weights_path(_save(tmp_path, "b", "external", seed=1))
    with pytest.raises(LoadError, match="not in the program or its weights file"):
        load_method(pte, weights=other)


_LOAD_CHILD = """
import sys
from backends.mlx.runtime.runner import load_method
try:
    load_method(sys.argv[1], weights=sys.argv[2])
except Exception as e:
    print("refused:", type(e).__name__)
    sys.exit(3)
print("loaded")
"""


@pytest.mark.parametrize("keep", [0.5, 0.02])
@pytest.mark.subprocess
def test_truncated_ptd_is_refused_without_a_crash(tmp_path, keep):
    pte = _save(tmp_path, "ext", "external")
    ptd = weights_path(pte)
    data = ptd.read_bytes()
    ptd.write_bytes(data[: int(len(data) * keep)])
    # In a child process: a crash (a signal) must show up as such, not take the test run down.
    done = subprocess.run([sys.executable, "-c", _LOAD_CHILD, str(pte), str(ptd)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 3, f"rc {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "refused: LoadError" in done.stdout


def _mangled_named(monkeypatch, edit):
    real = serializer.serialize

    def mangle(graph):
        edit([c for c in graph.constants if c.key])
        return real(graph)

    monkeypatch.setattr(preprocess, "serialize", mangle)
    return export_to_pte(_Mlp(), (X,), weights="pte").pte


def test_named_constant_whose_shape_disagrees_is_refused(monkeypatch):
    def edit(named):
        named[0].shape = [named[0].shape[0] + 1, *named[0].shape[1:]]

    pte = _mangled_named(monkeypatch, edit)
    with pytest.raises(LoadError, match="names a size other than its shape and dtype need"):
        load_method(pte)


def test_unknown_key_is_refused(monkeypatch):
    def edit(named):
        nbytes = 4 * int(np.prod(named[0].shape))  # float32: a well-formed key that no entry has
        named[0].key = "etmlx/w/" + "0" * 40 + f"-{nbytes}-00000000"

    pte = _mangled_named(monkeypatch, edit)
    with pytest.raises(LoadError, match="is not in the program or its weights file"):
        load_method(pte)


def test_key_without_a_checksum_asks_for_a_re_export(monkeypatch):
    def edit(named):  # the key layout before checked weights
        named[0].key = named[0].key.rpartition("-")[0]

    pte = _mangled_named(monkeypatch, edit)
    with pytest.raises(LoadError, match="carries no checksum .*re-export the model"):
        load_method(pte)


def test_named_constant_with_inline_bytes_is_refused(monkeypatch):
    def edit(named):
        named[0].data = np.zeros(4, np.uint8)

    pte = _mangled_named(monkeypatch, edit)
    with pytest.raises(LoadError, match="also carries 4 inline bytes"):
        load_method(pte)


@pytest.mark.subprocess
def test_cli_export_external_weights_then_generate_and_etmlx_decode(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import run_cli

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         eos_token_id=None, bos_token_id=None)).eval()
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    ids = {}
    for name, flags in (("one", []), ("ext", ["--external-weights"])):
        pte = tmp_path / f"{name}.pte"
        done = run_cli("export", "--model", str(ckpt), "--out", str(pte), "--max-seq-len", "32", *flags)
        assert done.returncode == 0, done.stderr[-2000:]
        ran = run_cli("generate", str(pte), "--prompt-ids", "7,1,33", "--max-tokens", "12", "--json")
        assert ran.returncode == 0, ran.stderr[-2000:]
        ids[name] = json.loads(ran.stdout.strip().splitlines()[-1])["tokens"]
    ptd = tmp_path / "ext.ptd"
    assert ptd.is_file() and f"and {ptd}" in done.stdout
    assert (tmp_path / "ext.pte").stat().st_size < ptd.stat().st_size
    assert ids["ext"] == ids["one"] and len(ids["one"]) == 12
    binary = ROOT / "build" / "etmlx_decode"
    assert binary.is_file(), f"{binary} is missing: `make setup` builds it"
    moved = tmp_path / "moved.ptd"
    ptd.rename(moved)
    decode = [str(binary), str(tmp_path / "ext.pte"), "--prompt-ids", "7,1,33", "--max-tokens", "12"]
    without = subprocess.run(decode, capture_output=True, text=True, timeout=120)
    assert without.returncode != 0 and "not in the program or its weights file" in without.stderr
    given = subprocess.run(decode + ["--weights", str(moved)], capture_output=True, text=True, timeout=120)
    assert given.returncode == 0, given.stderr[-2000:]
    missing = subprocess.run(decode + ["--weights", str(tmp_path / "nope.ptd")], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode != 0 and "nope.ptd: no such file (--weights)" in missing.stderr


def test_inspect_counts_the_constants_in_named_data(tmp_path):
    from backends.mlx.exporter.inspect_pte import describe

    assert "5 constants (3 in named data)" in describe(_save(tmp_path, "named", "pte"))
    assert "5 constants (0 in named data)" in describe(_save(tmp_path, "inline", "inline"))
