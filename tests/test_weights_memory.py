"""Weights are mapped, not copied: etmlx_decode on a float32 decoder of ~25 MB grows its peak RSS by about the file
size over a tiny program's run (before named data the loader held the mapped file plus a private copy of the blob
plus the arrays: about 3x). A memory bound, measured with /usr/bin/time's maximum resident set size."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.mlx.llm.decoder.export import export_decoder

pytestmark = pytest.mark.subprocess  # etmlx_decode under /usr/bin/time

BINARY = Path(__file__).resolve().parents[1] / "build" / "etmlx_decode"
TIME = Path("/usr/bin/time")


def _decoder(path: Path, hidden: int, inter: int, layers: int, vocab: int, external: bool = False) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128, eos_token_id=None, bos_token_id=None,
                                         tie_word_embeddings=False)).eval()
    export_decoder(model, path, 32, external_weights=external)
    return path


def _peak_rss_bytes(pte: Path) -> int:
    assert BINARY.is_file(), f"{BINARY} is missing: `make setup` builds it"
    assert TIME.is_file(), "/usr/bin/time (GNU time) is needed to measure the peak RSS"
    done = subprocess.run([str(TIME), "-f", "%M", str(BINARY), str(pte), "--prompt-ids", "1,2,3", "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stderr.strip().splitlines()[-1]) * 1024


def _files_size(pte: Path) -> int:
    ptd = pte.with_suffix(".ptd")
    return pte.stat().st_size + (ptd.stat().st_size if ptd.is_file() else 0)


@pytest.mark.parametrize("external", [False, True], ids=["pte", "ptd"])
def test_decode_peak_rss_grows_by_about_the_file_size(tmp_path, external):
    small = _decoder(tmp_path / "small.pte", 32, 64, 1, 64)
    big = _decoder(tmp_path / "big.pte", 384, 1024, 2, 4096, external=external)
    weights = _files_size(big) - _files_size(small)
    assert weights > 20e6
    grown = _peak_rss_bytes(big) - _peak_rss_bytes(small)
    assert grown < 1.3 * weights, f"peak RSS grew by {grown / 1e6:.1f} MB for {weights / 1e6:.1f} MB of weights"


# Reports, after loading a program in a fresh process, how far the load's peak RSS rose above what it settled at,
# and whether the bytes it was loaded from (argv[2] == "bytes": a buffer this process owns) are unchanged.
LOAD_CHILD = """
import hashlib, re, sys
from pathlib import Path
from backends.mlx.runtime.runner import load_method
def kib(field):
    return int(re.search(field + r":\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1))
source = Path(sys.argv[1]) if sys.argv[2] == "path" else Path(sys.argv[1]).read_bytes()
digest = hashlib.sha256(source).hexdigest() if sys.argv[2] == "bytes" else ""
if sys.argv[2] == "copy":  # the control: hold one weight's worth twice, briefly, as the load did before
    copied = bytearray(memoryview(source)[: int(sys.argv[3])])
    del copied
else:
    method = load_method(source)
print(kib("VmHWM") - kib("VmRSS"), digest == (hashlib.sha256(source).hexdigest() if digest else ""))
"""


def _load_overshoot(pte: Path, how: str, largest: int) -> tuple[int, bool]:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(pte), how, str(largest)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    over_kib, unchanged = done.stdout.split()
    return int(over_kib) * 1024, unchanged == "True"


def test_load_never_holds_a_weight_twice(tmp_path):
    """The loader copies each weight out of ExecuTorch's mapping of the file; the copied pages of a file mapping
    are given back as the copy goes (runtime/mapped_source.cpp), so the load's peak stays near what it settles at,
    instead of one largest weight above it (the 262 MB head of an 8B was the export's peak, issue 51). Control:
    a child that holds a copy of that many bytes briefly shows it in the same measure. A program loaded from bytes
    the caller owns is never dropped: the bytes are unchanged after the load."""
    pte = _decoder(tmp_path / "wide.pte", 1024, 256, 1, 16384)  # head and embedding: 64 MB each in float32
    largest = 16384 * 1024 * 4
    over, _ = _load_overshoot(pte, "path", largest)
    assert over < 0.25 * largest, f"the load's peak was {over / 1e6:.1f} MB above its end (largest weight " \
                                   f"{largest / 1e6:.0f} MB)"
    control, _ = _load_overshoot(pte, "copy", largest)
    assert control > 0.9 * largest, f"the control's copy rose only {control / 1e6:.1f} MB above its end"
    _, unchanged = _load_overshoot(pte, "bytes", largest)
    assert unchanged, "loading from a buffer changed the buffer"
