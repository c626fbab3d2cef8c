"""Quantized decoders end to end: an `mlx_lm.convert -q` checkpoint exports as it is and decodes
greedily to mlx-lm's own tokens; `etmlx export --quantize` runs; int8 logits stay near float;
the KV cache costs the file nothing; bad input is a one-line error."""

from __future__ import annotations

import json

import pytest
import torch

import backends.mlx  # noqa: F401  (before mlx.core: routes MLX's CPU GEMMs)
import mlx.core as mx
from backends.mlx.cli.main import main
from benchmarks.checkpoints import save_tokenizer
from backends.mlx.llm.decoder.loop import Decoder

# Whole decoder exports: the slow tier (make test), not make test-fast.
pytestmark = pytest.mark.slow

STEPS = 48
PROMPT = [5, 17, 99, 3, 42]


def _checkpoint(directory, family: str, tied: bool = False, dtype=torch.float32):
    """A small random model with a wider-than-default init (argmaxes far from ties) and a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    config = config_cls(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        initializer_range=0.1, tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None,
                        pad_token_id=None)
    torch.manual_seed(3)
    model_cls(config).eval().to(dtype).save_pretrained(directory)
    # transformers 5 writes rope_theta inside rope_parameters only, where mlx-lm does not look (it would
    # take its own default, 1e6 for Qwen2): state it at the top level too, as older checkpoints do.
    saved = json.loads((directory / "config.json").read_text())
    saved["rope_theta"] = saved["rope_parameters"]["rope_theta"]
    (directory / "config.json").write_text(json.dumps(saved))
    save_tokenizer(config.vocab_size, directory)
    return directory


def _mlx_lm_quantized(tmp_path, family: str, tied: bool = False, bits: int = 4, group: int = 64,
                      dtype: str | None = "float32"):
    from mlx_lm import convert

    source = _checkpoint(tmp_path / f"{family}-float", family, tied,
                         getattr(torch, dtype) if dtype else torch.bfloat16)
    out = tmp_path / f"{family}-q{bits}"
    convert(str(source), str(out), quantize=True, q_group_size=group, q_bits=bits, dtype=dtype)
    return out


def _mlx_lm_greedy(directory, steps: int) -> list[int]:
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from mlx.utils import tree_map_with_path

    import mlx.nn as nn

    model, _ = load(str(directory))
    # mlx-lm computes in its weights' dtype; etmlx exports float32 activations by default: the float parts of a
    # bf16 directory go to float32 (the packed integers, scales and biases stay as stored), and so do a quantized
    # embedding's scales and biases, whose rows etmlx dequantizes in float32 (quantize/modules.embedding_scales).
    model.update(tree_map_with_path(lambda path, x: x if path.endswith(("scales", "biases")) or x.dtype == mx.uint32
                                    else x.astype(mx.float32), model.parameters()))
    for _, module in model.named_modules():
        if isinstance(module, nn.QuantizedEmbedding):
            module.scales, module.biases = module.scales.astype(mx.float32), module.biases.astype(mx.float32)
    greedy = lambda logits: mx.argmax(logits, axis=-1)
    steps_iter = generate_step(mx.array(PROMPT), model, max_tokens=steps, sampler=greedy)
    return [int(token) for token, _ in steps_iter]


def _export(model_dir, out, *flags):
    assert main(["export", "--model", str(model_dir), "--out", str(out), "--max-seq-len", "96", *flags]) == 0
    return out


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True)])
def test_mlx_lm_checkpoint_decodes_to_mlx_lm_tokens(tmp_path, family, tied):
    quantized = _mlx_lm_quantized(tmp_path, family, tied)
    assert json.loads((quantized / "config.json").read_text())["quantization"]["bits"] == 4
    pte = _export(quantized, tmp_path / "q.pte")
    ours = Decoder(pte).generate(PROMPT, STEPS).tokens
    expected = _mlx_lm_greedy(quantized, STEPS)
    assert len(set(expected)) > 8, f"degenerate reference, the comparison would say little: {expected}"
    assert ours == expected


def test_quantize_flag_holds_mlx_lm_integers(tmp_path):
    """--quantize int4 of the float checkpoint and mlx_lm.convert -q give the same program."""
    from backends.mlx.exporter.inspect_pte import delegate_blobs

    source = _checkpoint(tmp_path / "float", "llama")
    ours = _export(source, tmp_path / "ours.pte", "--quantize", "int4", "--group-size", "64")
    theirs = _export(_mlx_lm_quantized(tmp_path, "llama"), tmp_path / "theirs.pte")
    assert delegate_blobs(ours.read_bytes()) == delegate_blobs(theirs.read_bytes())


def test_quantize_of_a_bf16_checkpoint_is_mlx_lm_byte_for_byte(tmp_path):
    """--quantize int4 of a bf16 checkpoint quantizes its bf16 values and keeps bf16 scales and biases, as
    mlx_lm.convert -q does: the same bytes, and greedy tokens equal to mlx-lm's at float32 activations."""
    from safetensors.torch import load_file

    from backends.mlx.exporter.inspect_pte import delegate_blobs

    theirs_dir = _mlx_lm_quantized(tmp_path, "llama", tied=True, dtype=None)  # keeps the checkpoint's bf16
    tensors = load_file(str(theirs_dir / "model.safetensors"))
    assert tensors["model.embed_tokens.scales"].dtype == torch.bfloat16
    ours = _export(tmp_path / "llama-float", tmp_path / "ours.pte", "--quantize", "int4")
    theirs = _export(theirs_dir, tmp_path / "theirs.pte")
    assert delegate_blobs(ours.read_bytes()) == delegate_blobs(theirs.read_bytes())
    # The file holds the integers and bf16 scales once: no more than the mlx-lm directory's weights, plus the
    # float32 norms (mlx-lm stores them in bf16) and the program.
    weights = (theirs_dir / "model.safetensors").stat().st_size
    assert ours.stat().st_size < weights * 1.02 + 64 * 1024, (ours.stat().st_size, weights)
    expected = _mlx_lm_greedy(theirs_dir, STEPS)
    assert len(set(expected)) > 8, expected
    assert Decoder(ours).generate(PROMPT, STEPS).tokens == expected


def _greedy_with_logprobs(model_dir, flags, tmp_path, name):
    """Greedy tokens with the model's raw log-probabilities of the top 8 at each step."""
    pte = _export(model_dir, tmp_path / name, "--logprobs", "8", *flags)
    out = Decoder(pte).generate(PROMPT, 16)
    return out.tokens, [[lp for _, lp in top] for top in out.top_logprobs]


@pytest.mark.parametrize("tied", [False, True])
def test_each_weight_is_stored_once(tmp_path, tied):
    """Nothing of the model stays in ExecuTorch's own constant storage: a tied embedding and head are one set
    of named tensors (torch.export keeps a second, unread set of placeholders for the alias)."""
    from backends.mlx.exporter.inspect_pte import host_constant_bytes

    source = _checkpoint(tmp_path / "float", "qwen2", tied)
    for name, model_dir, flags in (("i4.pte", source, ["--quantize", "int4"]), ("i8.pte", source, ["--quantize", "int8"]),
                                   ("f.pte", source, []), ("mlx.pte", _mlx_lm_quantized(tmp_path, "qwen2", tied), [])):
        pte = _export(model_dir, tmp_path / name, *flags)
        assert host_constant_bytes(pte.read_bytes()) == 0, name
    # The tied int4 file holds one table: it is smaller than the untied one by about the head's share.
    if tied:
        untied = _export(_checkpoint(tmp_path / "untied", "qwen2", False), tmp_path / "u.pte", "--quantize", "int4")
        head_bytes = 256 * 128 // 2 + 2 * 256 * 2 * 4  # [vocab, hidden] int4 + float32 scales and biases (group 64)
        saved = untied.stat().st_size - (tmp_path / "i4.pte").stat().st_size
        assert abs(saved - head_bytes) < 2048, (saved, head_bytes)


def test_int8_stays_near_float_and_int4_runs(tmp_path):
    source = _checkpoint(tmp_path / "float", "llama")
    float_tokens, float_lp = _greedy_with_logprobs(source, [], tmp_path, "f.pte")
    int8_tokens, int8_lp = _greedy_with_logprobs(source, ["--quantize", "int8"], tmp_path, "i8.pte")
    # Steps see the same context while the tokens agree; rounding may flip a later near-tie.
    same = next((i for i, (a, b) in enumerate(zip(float_tokens, int8_tokens)) if a != b), len(float_tokens))
    assert same >= 4, (float_tokens, int8_tokens)
    # Stated tolerance: the top-8 log-probabilities (log-softmax of the logits) within 0.1 nats of float's.
    worst = max(abs(a - b) for fa, ia in zip(float_lp[:same + 1], int8_lp[:same + 1]) for a, b in zip(fa, ia))
    print(f"int8 vs float: {same} equal greedy tokens of 16, top-8 logprobs within {worst:.4f} nats")
    assert worst < 0.1, worst
    int4_tokens, _ = _greedy_with_logprobs(source, ["--quantize", "int4"], tmp_path, "i4.pte")
    assert len(int4_tokens) == 16


def test_kv_cache_does_not_grow_the_file(tmp_path):
    source = _checkpoint(tmp_path / "float", "llama")
    small = _export(source, tmp_path / "s.pte", "--quantize", "int4")
    assert main(["export", "--model", str(source), "--out", str(tmp_path / "l.pte"), "--max-seq-len", "512",
                 "--batch", "4", "--quantize", "int4"]) == 0
    grown = (tmp_path / "l.pte").stat().st_size - small.stat().st_size
    # 2 layers x 2 caches x [4, 2, 512, 32] float32 would be 1 MiB; only shapes and the metadata change.
    assert abs(grown) < 4096, grown


def _error_line(capsys, model_dir, tmp_path, *flags) -> str:
    rc = main(["export", "--model", str(model_dir), "--out", str(tmp_path / "x.pte"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err and err[-1].startswith("etmlx: error: "), (rc, err)
    return err[-1]


def test_bad_input_is_a_one_line_error(tmp_path, capsys):
    source = _checkpoint(tmp_path / "float", "llama")
    assert "group size 256 is not supported" in _error_line(capsys, source, tmp_path, "--quantize", "int4",
                                                            "--group-size", "256")
    assert "--quantize must be one of int4, int8" in _error_line(capsys, source, tmp_path, "--quantize", "int3")
    quantized = _mlx_lm_quantized(tmp_path, "llama")
    assert "already quantized" in _error_line(capsys, quantized, tmp_path, "--quantize", "int8")
    config = json.loads((quantized / "config.json").read_text())
    config["model_type"] = "gpt2"
    (quantized / "config.json").write_text(json.dumps(config))
    assert "a quantized 'gpt2' checkpoint is not supported" in _error_line(capsys, quantized, tmp_path)
