"""Seeded sampling through the on-device decode loop is reproducible and equals the host reference:
the same sampler run on the CPU (the custom ops' reference implementations) over eager logits, with the
seed schedule seed + step."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.sampler.processing import process_and_sample
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams

pytestmark = pytest.mark.slow  # a decoder export decoded step by step against the host reference

VOCAB = 120


def test_seeded_decode_is_reproducible_and_equals_the_host_reference(tmp_path):
    torch.manual_seed(6)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         eos_token_id=None, bos_token_id=None)).eval()
    # Scale the logits up so top-k / top-p actually cut (random tiny models are nearly uniform).
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    config = SamplerConfig(top_k=True, top_p=True, min_p=True)
    export_decoder(model, tmp_path / "m.pte", max_seq_len=48, config=config)
    decoder = Decoder(tmp_path / "m.pte")
    prompt = [4, 8, 15, 16, 23, 42]
    params = SamplingParams(temperature=0.9, seed=1234, top_k=30, top_p=0.9, min_p=0.02)
    first = decoder.generate(prompt, 30, params).tokens
    again = decoder.generate(prompt, 30, params).tokens
    assert first == again and len(first) == 30
    other = decoder.generate(prompt, 30, SamplingParams(temperature=0.9, seed=1235, top_k=30, top_p=0.9,
                                                        min_p=0.02)).tokens
    assert other != first  # the seed matters

    knobs = {"top_k": torch.tensor([30]), "top_p": torch.tensor([0.9]), "min_p": torch.tensor([0.02])}
    sequence, expected = list(prompt), []
    with torch.no_grad():
        for step in range(30):
            logits = model(torch.tensor([sequence])).logits[:, -1]
            token = int(process_and_sample(config, logits, torch.tensor([0.9]), torch.tensor([1234 + step]), knobs)[0])
            expected.append(token)
            sequence.append(token)
    assert first == expected
