"""The KV cache inside the delegate, for each supported family: cached calls give the full-forward
logits (rows at different positions, padded rows included), greedy decoding through the exported
decoder equals transformers' greedy generation for 64 steps, and half-precision weights work."""

from __future__ import annotations

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from backends.mlx.exporter.export import export_to_pte
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.kv_cache import StaticCacheLM
from backends.mlx.runtime.runner import load_method

# Whole decoder exports: the slow tier (make test), not make test-fast.
pytestmark = pytest.mark.slow

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None)


def _llama(dtype=torch.float32):
    return LlamaForCausalLM(LlamaConfig(**SMALL)).to(dtype)


def _qwen2():
    return Qwen2ForCausalLM(Qwen2Config(**SMALL))


def _qwen3():
    return Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=8))


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                      eos_token_id=None, bos_token_id=None))


FAMILIES = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "gpt2": _gpt2}


def _logits_program(model, max_seq_len=32, batch=2):
    length = torch.export.Dim("length", min=1, max=max_seq_len)
    example = (torch.ones(batch, max_seq_len, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64),
               torch.full((batch,), max_seq_len, dtype=torch.int64))
    result = export_to_pte(StaticCacheLM(model, max_seq_len=max_seq_len, batch=batch), example,
                           dynamic_shapes=({1: length}, None, None))
    assert result.ops_outside == 0, result.summary()
    return load_method(result.pte)


def _call(method, rows, starts, lengths):
    width = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    return method.execute([tokens, torch.tensor(starts), torch.tensor(lengths)])[0]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_rows_at_different_positions_get_the_full_forward_logits(family):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    method = _logits_program(model)
    a, b = torch.randint(0, VOCAB, (2, 14)).tolist()
    with torch.no_grad():
        full = model(input_ids=torch.tensor([a, b]), use_cache=False).logits
    # Row b has 3 real tokens padded to 6: its padding writes slots 3..5, which later calls overwrite.
    out = _call(method, [a[:6], b[:3]], [0, 0], [6, 3])
    torch.testing.assert_close(out, torch.stack([full[0, 5], full[1, 2]]), atol=1e-5, rtol=1e-5)
    out = _call(method, [a[6:8], b[3:5]], [6, 3], [2, 2])
    torch.testing.assert_close(out, torch.stack([full[0, 7], full[1, 4]]), atol=1e-5, rtol=1e-5)
    for k in range(4):  # one token per row, the rows 3 positions apart
        out = _call(method, [[a[8 + k]], [b[5 + k]]], [8 + k, 5 + k], [1, 1])
        torch.testing.assert_close(out, torch.stack([full[0, 8 + k], full[1, 5 + k]]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_greedy_decoding_equals_transformers_for_64_steps(family, tmp_path):
    torch.manual_seed(1)
    model = FAMILIES[family]().eval()
    result = export_decoder(model, tmp_path / "m.pte", max_seq_len=80)
    assert result.ops_outside == 0, result.summary()
    prompt = [3, 14, 15, 9, 2]
    got = Decoder(tmp_path / "m.pte").generate(prompt, 64).tokens
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert got == expected


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 0.06), (torch.float16, 0.01)])
def test_half_precision_weights_and_cache(dtype, tolerance):
    """Tolerance: max |logit diff| relative to the largest |logit|, against the same-dtype eager forward
    (the two sides round their half-precision intermediates at different points)."""
    torch.manual_seed(4)
    model = _llama(dtype).eval()
    method = _logits_program(model, batch=1)
    seq = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        full = model(input_ids=seq, use_cache=False).logits[0].float()
    got = [_call(method, [seq[0, :8].tolist()], [0], [8])[0].float()]
    for pos in range(8, 12):
        got.append(_call(method, [[int(seq[0, pos])]], [pos], [1])[0].float())
    got = torch.stack(got)
    want = full[7:12]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - want).abs().max() <= tolerance * want.abs().max()


def test_unsupported_architectures_are_refused_by_name():
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1))
    with pytest.raises(ValueError, match="MambaForCausalLM .* takes no KV cache and positions"):
        StaticCacheLM(mamba, max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        StaticCacheLM(_llama(), max_seq_len=0)
    with pytest.raises(ValueError, match="exceeds the model's 128 positions"):
        StaticCacheLM(_llama(), max_seq_len=129)


def test_a_program_loaded_on_one_thread_runs_on_another():
    """The cache is allocated at load (not stored in the file); a server loads on one thread and calls from
    another, and MLX evaluates an array only on the thread whose stream built it, so the loader materializes it."""
    import threading

    torch.manual_seed(0)
    model = _llama().eval()
    method = _logits_program(model)
    a = torch.randint(0, VOCAB, (1, 6)).tolist()[0]
    with torch.no_grad():
        full = model(input_ids=torch.tensor([a]), use_cache=False).logits
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=_call(method, [a, a], [0, 0], [6, 6])))
    worker.start()
    worker.join(120)
    torch.testing.assert_close(result["out"], torch.stack([full[0, 5], full[0, 5]]), atol=1e-5, rtol=1e-5)


def test_wrapping_a_model_twice_keeps_it_a_plain_model_and_frees_the_caches():
    """StaticCacheLM leaves the model as it was (eager forward unchanged), wrapping it again gathers the last
    position once, and a dropped StaticCacheLM is freed with its caches (the model holds no reference to it)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = _llama().eval()
    ids = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        before = model(ids).logits
        first = StaticCacheLM(model, max_seq_len=16)
        gone = weakref.ref(first)
        del first
        gc.collect()
        assert gone() is None
        lm = StaticCacheLM(model, max_seq_len=16)
        last = lm(ids, torch.tensor([0]), torch.tensor([6]))
        torch.testing.assert_close(model(ids).logits, before)
    torch.testing.assert_close(last, before[:, -1], atol=1e-5, rtol=1e-5)
