"""Half-precision linear weights on the CPU are widened to float32 once at load (runtime/cpu_weights.cpp), not on
every call: the same bits as the per-call conversion (ETMLX_CPU_WIDEN=0), only linears' weights are widened (a
tied embedding keeps its dtype), and etmlx_decode reports how many it widened."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.mlx.exporter.export import export_to_pte
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.runtime.runner import load_method

BINARY = Path(__file__).resolve().parents[1] / "build" / "etmlx_decode"


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 32, bias=False)
        self.table = torch.nn.Parameter(torch.randn(16, 64))  # read by a gather and a product: not widened

    def forward(self, x, idx):
        h = self.down(torch.relu(self.up(x + self.table[idx])))
        return h, x @ self.table.T


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_weights_give_the_per_call_conversion_bits(monkeypatch, dtype):
    torch.manual_seed(0)
    model = _Mlp().to(dtype)
    x, idx = torch.randn(3, 64, dtype=dtype), torch.tensor([1, 5, 9])
    pte = export_to_pte(model, (x, idx)).pte
    outs = {}
    for widen in ("0", "1"):
        monkeypatch.setenv("ETMLX_CPU_WIDEN", widen)
        outs[widen] = load_method(pte).execute([x, idx])
    for a, b in zip(outs["0"], outs["1"]):
        assert a.dtype == dtype and torch.equal(a, b)
    expected = model(x, idx)
    torch.testing.assert_close(outs["1"][0], expected[0], rtol=2e-2, atol=2e-2)


def _decode(pte: Path, widen: str):
    assert BINARY.is_file(), f"{BINARY} is missing: `make setup` builds it"
    return subprocess.run([str(BINARY), str(pte), "--prompt-ids", "3,1,4,1,5", "--max-tokens", "24"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "ETMLX_CPU_WIDEN": widen})


@pytest.mark.subprocess  # build/etmlx_decode runs
@pytest.mark.parametrize("tied,expected", [(False, 2 * 7 + 1), (True, 2 * 7)])
def test_decoder_widens_its_linears_once_with_the_same_tokens(tmp_path, tied, expected):
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         eos_token_id=None, bos_token_id=None, tie_word_embeddings=tied,
                                         initializer_range=0.2)).eval().to(torch.bfloat16)
    pte = export_decoder(model, tmp_path / "bf16.pte", 48) and tmp_path / "bf16.pte"
    per_call, widened = _decode(pte, "0"), _decode(pte, "1")
    assert per_call.returncode == 0 and widened.returncode == 0, widened.stderr[-2000:]
    assert widened.stdout.split() == per_call.stdout.split() and len(widened.stdout.split()) == 24
    assert f"etmlx: {expected} half-precision linear weights widened to float32 at load" in widened.stderr
    assert "widened" not in per_call.stderr
