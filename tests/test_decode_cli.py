"""`etmlx export` + `etmlx generate` on a local checkpoint: on-device greedy decoding equals transformers."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import run_cli

pytestmark = pytest.mark.slow  # a whole-decoder export through the CLI


_etmlx = run_cli


def test_export_then_generate_matches_transformers_greedy(tmp_path):
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         eos_token_id=None, bos_token_id=None)).eval()
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    pte = tmp_path / "llama.pte"
    exported = _etmlx("export", "--model", str(ckpt), "--out", str(pte), "--max-seq-len", "48")
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "0 ops outside" in exported.stdout
    prompt = [7, 1, 33, 20]
    ran = _etmlx("generate", str(pte), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "20", "--json")
    assert ran.returncode == 0, ran.stderr[-2000:]
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert result["tokens"] == expected and result["finish_reason"] == "length"
    seeded = [_etmlx("generate", str(pte), "--prompt-ids", "5,6", "--max-tokens", "12", "--temperature", "1.0",
                     "--seed", "42", "--json") for _ in range(2)]
    tokens = [json.loads(s.stdout.strip().splitlines()[-1])["tokens"] for s in seeded]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 12
    too_long = _etmlx("generate", str(pte), "--prompt-ids", "1,2,3", "--max-tokens", "60")
    assert too_long.returncode == 2 and "exceeds the program's max_seq_len 48" in too_long.stderr
    empty = _etmlx("generate", str(pte), "--prompt-ids", "", "--max-tokens", "3")
    assert empty.returncode == 2 and "empty" in empty.stderr
    out_of_range = _etmlx("generate", str(pte), "--prompt-ids", "1,500", "--max-tokens", "3")
    assert out_of_range.returncode == 2 and "[0, 80)" in out_of_range.stderr
    no_tokenizer = _etmlx("generate", str(pte), "--prompt", "hello", "--max-tokens", "3")
    assert no_tokenizer.returncode == 2 and "llama.pte has no tokenizer" in no_tokenizer.stderr
