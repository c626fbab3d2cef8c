"""Weights are mapped, not copied: etmlx_decode on a float32 decoder of ~25 MB grows its peak RSS by about the file
size over a tiny program's run (before named data the loader held the mapped file plus a private copy of the blob
plus the arrays: about 3x). A memory bound, measured with /usr/bin/time's maximum resident set size."""

from __future__ import annotations

import subprocess
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
