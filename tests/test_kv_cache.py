"""Llama-family models with the KV cache inside the delegate: step-by-step logits equal a full forward,
and on-device greedy decoding equals transformers' greedy generation."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from backends.mlx.export import export_to_pte
from backends.mlx.llm.kv_cache import StaticCacheLM
from backends.mlx.llm.sampling import SamplingHead
from backends.mlx.runner import load_method

VOCAB = 96


def _llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        attn_implementation="eager"))


def _qwen2():
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        attn_implementation="eager"))


@pytest.mark.parametrize("make", [_llama, _qwen2], ids=["llama", "qwen2"])
def test_cached_steps_give_the_full_forward_logits(make):
    torch.manual_seed(0)
    model = make().eval()
    result = export_to_pte(StaticCacheLM(model, max_seq_len=32), (torch.tensor([[1]]), torch.tensor([0])))
    assert result.ops_outside == 0, result.summary()
    method = load_method(result.pte)
    seq = torch.randint(0, VOCAB, (10,)).tolist()
    with torch.no_grad():
        full = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0]
    for pos, token in enumerate(seq):
        step = method.execute([torch.tensor([[token]]), torch.tensor([pos])])[0]
        torch.testing.assert_close(step[0, -1], full[pos], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [_llama, _qwen2], ids=["llama", "qwen2"])
def test_on_device_greedy_decoding_equals_transformers(make):
    torch.manual_seed(1)
    model = make().eval()
    head = SamplingHead(StaticCacheLM(model, max_seq_len=64))
    result = export_to_pte(head, (torch.tensor([[1]]), torch.tensor([0])),
                           {"temperature": torch.tensor(0.0), "seed": torch.tensor(0)})
    assert result.ops_outside == 0, result.summary()
    method = load_method(result.pte)
    prompt = [3, 14, 15, 9, 2]
    new_tokens = 40
    generated = []
    token = None
    for pos in range(len(prompt) + new_tokens - 1):
        feed = prompt[pos] if pos < len(prompt) else token
        token = int(method.execute([torch.tensor([[feed]]), torch.tensor([pos]), torch.tensor(0.0),
                                    torch.tensor(pos)])[0][0])
        if pos >= len(prompt) - 1:
            generated.append(token)
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                  min_new_tokens=new_tokens, pad_token_id=0)[0, len(prompt):].tolist()
    assert generated == expected


def test_unsupported_architecture_is_refused_by_name():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64))
    with pytest.raises(ValueError, match="not a Llama-style causal LM"):
        StaticCacheLM(gpt2, max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        StaticCacheLM(_llama(), max_seq_len=0)


@pytest.mark.parametrize("make", [_llama, _qwen2], ids=["llama", "qwen2"])
def test_one_program_prefills_any_length_then_decodes(make):
    torch.manual_seed(2)
    model = make().eval()
    length = torch.export.Dim("length", min=1, max=32)
    result = export_to_pte(StaticCacheLM(model, max_seq_len=32), (torch.tensor([[1, 2, 3]]), torch.arange(3)),
                           dynamic_shapes=({1: length}, {0: length}))
    assert result.ops_outside == 0, result.summary()
    method = load_method(result.pte)
    seq = torch.randint(0, VOCAB, (14,)).tolist()
    with torch.no_grad():
        full = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0]
    for prompt_len in (1, 7, 11):  # each prefill rewrites positions 0..n-1, so the cache can be reused
        prefill = method.execute([torch.tensor([seq[:prompt_len]]), torch.arange(prompt_len)])[0]
        assert prefill.shape == (1, prompt_len, VOCAB)
        torch.testing.assert_close(prefill[0], full[:prompt_len], atol=1e-5, rtol=1e-5)
        for pos in range(prompt_len, prompt_len + 3):
            step = method.execute([torch.tensor([[seq[pos]]]), torch.tensor([pos])])[0]
            torch.testing.assert_close(step[0, -1], full[pos], atol=1e-5, rtol=1e-5)
