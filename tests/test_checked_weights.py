"""Checked weights: every named-data weight carries the CRC-32 of its bytes in its key and the runtime checks it
while copying the segment, so a flipped bit, four NaN bytes or a segment table moved by 64 bytes is a one-line
load error naming the constant, never different tokens; a truncated, missing or foreign .ptd is a one-line
error naming the file; the CLI answers all of them with exit 2 and no traceback."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.mlx.exporter.export import export_to_pte, weights_path
from backends.mlx.runtime.load_errors import LoadError, reason
from backends.mlx.runtime.runner import load_method

ROOT = Path(__file__).resolve().parents[1]
# "constant 1 (float32 [512, 128]): weight 'etmlx/w/0b28947285c1de8c...' fails its checksum (crc32 ..."
CHECKSUM = r"constant \d+ \(float32 \[\d+(, \d+)*\]\): weight 'etmlx/w/[0-9a-f]{16}\.\.\.' fails its checksum"


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(128, 512)
        self.down = torch.nn.Linear(512, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


X = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("checked")
    pte = export_to_pte(_Mlp(), (X,), weights="external").save(d / "ext.pte")
    return pte, weights_path(pte).read_bytes()


def _segment_base(ptd: bytes) -> int:
    # FlatTensor's extended header follows the flatbuffer's 8-byte prefix: magic "FH01", length, flatbuffer
    # offset and size, then the segment base offset (extension/flat_tensor/serialize/serialize.py).
    assert ptd[8:12] == b"FH01"
    return struct.unpack_from("<Q", ptd, 8 + 24)[0]


def _flip_exponent(ptd: bytes) -> bytes:
    b = bytearray(ptd)
    b[_segment_base(ptd) + 4 * 100 + 3] ^= 0x40  # float #100's top exponent bit: 0.05 becomes ~1e37
    return bytes(b)


def _nan_bytes(ptd: bytes) -> bytes:
    b = bytearray(ptd)
    at = _segment_base(ptd) + 4 * 77
    b[at:at + 4] = np.array([np.nan], np.float32).tobytes()
    return bytes(b)


def _offset_minus_64(ptd: bytes) -> bytes:
    b = bytearray(ptd)
    struct.pack_into("<Q", b, 8 + 24, _segment_base(ptd) - 64)  # every segment read 64 bytes early
    return bytes(b)


def _load_with(tmp_path, exported, data: bytes):
    pte, _ = exported
    ptd = tmp_path / "w.ptd"
    ptd.write_bytes(data)
    return load_method(pte, weights=ptd)


def test_intact_weights_load_and_match_eager(tmp_path, exported):
    (out,) = _load_with(tmp_path, exported, exported[1]).execute([X])
    torch.testing.assert_close(out, _Mlp()(X), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("damage", [_flip_exponent, _nan_bytes, _offset_minus_64])
def test_damaged_weight_is_refused_naming_the_constant(tmp_path, exported, damage):
    damaged = damage(exported[1])
    assert damaged != exported[1] and len(damaged) == len(exported[1])
    with pytest.raises(LoadError, match=CHECKSUM) as err:
        _load_with(tmp_path, exported, damaged)
    assert "\n" not in str(err.value) and str(tmp_path / "w.ptd") in str(err.value)


def test_damaged_weight_inside_the_pte_is_refused(tmp_path):
    pte = export_to_pte(_Mlp(), (X,), weights="pte").save(tmp_path / "one.pte")
    data = bytearray(pte.read_bytes())
    raw = _Mlp().up.weight.detach().numpy().tobytes()[:64]  # where the first weight's bytes sit in the segments
    at = bytes(data).index(raw)
    data[at + 3] ^= 0x40
    pte.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=CHECKSUM):
        load_method(pte)


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_ptd_names_the_file(tmp_path, exported, keep):
    with pytest.raises(LoadError, match=r"w\.ptd: .*truncated|w\.ptd: .*corrupt") as err:
        _load_with(tmp_path, exported, exported[1][: int(len(exported[1]) * keep)])
    assert "\n" not in str(err.value)


def test_foreign_ptd_names_the_file(tmp_path, exported):
    with pytest.raises(LoadError, match=r"w\.ptd: Failed to parse FlatTensor header"):
        _load_with(tmp_path, exported, b"not a weights file\n" * 500)


def test_missing_ptd_names_the_constant(tmp_path, exported):
    pte = tmp_path / "alone.pte"
    pte.write_bytes(exported[0].read_bytes())
    with pytest.raises(LoadError, match=r"alone\.pte: constant \d+ .* not in the program or its weights file"):
        load_method(pte)


def test_foreign_pte_names_the_file(tmp_path):
    pte = tmp_path / "foreign.pte"
    pte.write_bytes(b"\x7fELF" + bytes(4000))
    with pytest.raises(LoadError, match=r"foreign\.pte: .*identifier"):
        load_method(pte)


def test_reason_prefers_etmlx_line_and_drops_the_log_prefix():
    log = ("[method.cpp:128] Init failed for backend EtmlxBackend: 0x23\n"
           "E 00:00:00.000123 executorch:named_constant.cpp:155] etmlx: constant 3 (float16 [4]): bad\n")
    assert reason(log) == "constant 3 (float16 [4]): bad"
    assert reason("[flat_tensor_data_map.cpp:255] File size is too small\n") == "File size is too small"
    assert reason("") is None


# ---- the CLI: one line, exit 2, no traceback ----------------------------------------------------------------

def _cli(*args, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "etmlx", *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=300, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import run_cli

    d = tmp_path_factory.mktemp("llm")
    torch.manual_seed(3)
    LlamaForCausalLM(LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 eos_token_id=None, bos_token_id=None)).save_pretrained(d / "ckpt")
    pte = d / "llm.pte"
    done = run_cli("export", "--model", d / "ckpt", "--out", pte, "--max-seq-len", "32", "--external-weights")
    assert done.returncode == 0, done.stderr[-2000:]
    return d, pte


def _one_line_exit_2(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, f"rc {done.returncode}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("etmlx: error: ")]
    assert len(errors) == 1, done.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.mark.subprocess
def test_cli_refuses_damaged_weights_in_one_line(llm):
    d, pte = llm
    ptd = weights_path(pte)
    good = ptd.read_bytes()
    try:
        ptd.write_bytes(_flip_exponent(good))
        _one_line_exit_2(_cli("generate", pte, "--prompt-ids", "7,1,33", "--max-tokens", "4"), "fails its checksum")
        _one_line_exit_2(_cli("chat", pte, stdin="hi\n"), "fails its checksum")
        _one_line_exit_2(_cli("serve", pte, "--port", "0"), "fails its checksum")
        ptd.write_bytes(good[: len(good) // 2])
        _one_line_exit_2(_cli("generate", pte, "--prompt-ids", "7,1,33", "--max-tokens", "4"), "truncated")
        ptd.write_bytes(b"foreign" * 1000)
        _one_line_exit_2(_cli("generate", pte, "--prompt-ids", "7,1,33", "--max-tokens", "4"), "llm.ptd")
        ptd.unlink()
        _one_line_exit_2(_cli("generate", pte, "--prompt-ids", "7,1,33", "--max-tokens", "4"),
                         "not in the program or its weights file")
    finally:
        ptd.write_bytes(good)
    ran = _cli("generate", pte, "--prompt-ids", "7,1,33", "--max-tokens", "4", "--json")
    assert ran.returncode == 0, ran.stderr[-2000:]


@pytest.mark.subprocess
def test_cli_export_refuses_a_truncated_checkpoint_in_one_line(llm, tmp_path):
    import shutil

    d, _ = llm
    bad = tmp_path / "bad"
    shutil.copytree(d / "ckpt", bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    _one_line_exit_2(_cli("export", "--model", bad, "--out", tmp_path / "x.pte"), str(weights), "not a readable")
