"""A bfloat16 Hugging Face checkpoint written directly, one decoder layer per shard, no float32 copy made.

`checkpoints.cached_bfloat16` converts the float32 checkpoint (6 GB at the Qwen2.5-1.5B shape, built whole by
transformers first); measuring an export's peak RSS against the checkpoint only needs the bfloat16 files, so here
each tensor is drawn from a seeded generator, N(0, initializer_range) like transformers' init (norms 1, q/k/v
biases of qwen2 N(0, 0.02)), under transformers' names for `spec.architecture`, at most one layer in memory.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks import checkpoints as ckpt


def _normal(shape, spec: ckpt.CheckpointSpec, g: torch.Generator, std: float | None = None) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * (spec.initializer_range if std is None else std)).to(torch.bfloat16)


def _layer(spec: ckpt.CheckpointSpec, index: int, g: torch.Generator) -> dict:
    h, i = spec.hidden_size, spec.intermediate_size
    kv = h // spec.num_attention_heads * spec.num_key_value_heads
    p = f"model.layers.{index}"
    tensors = {f"{p}.{name}.weight": _normal((out_f, in_f), spec, g) for name, out_f, in_f in (
        ("self_attn.q_proj", h, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
        ("self_attn.o_proj", h, h), ("mlp.gate_proj", i, h), ("mlp.up_proj", i, h), ("mlp.down_proj", h, i))}
    if spec.architecture == "qwen2":  # q, k and v carry biases
        for name, size in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            tensors[f"{p}.self_attn.{name}.bias"] = _normal(size, spec, g, 0.02)
    for name in ("input_layernorm", "post_attention_layernorm"):
        tensors[f"{p}.{name}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return tensors


def build(spec: ckpt.CheckpointSpec, directory: Path) -> None:
    """config.json (dtype bfloat16), a tokenizer, and the weights: the embedding, one shard per layer, and the
    final norm (with the head unless it is tied), with an index."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(spec.seed)
    shards = [lambda: {"model.embed_tokens.weight": _normal((spec.vocab_size, spec.hidden_size), spec, g)}]
    shards += [lambda i=i: _layer(spec, i, g) for i in range(spec.num_hidden_layers)]
    shards.append(lambda: {"model.norm.weight": torch.ones(spec.hidden_size, dtype=torch.bfloat16),
                           **({} if spec.tie_word_embeddings else
                              {"lm_head.weight": _normal((spec.vocab_size, spec.hidden_size), spec, g)})})
    ckpt.save_shards(directory, shards, "pt")  # one layer's tensors at a time
    config = ckpt._config(spec).to_dict()
    config.update(rope_theta=spec.rope_theta, torch_dtype="bfloat16", dtype="bfloat16")  # checkpoints.build: why
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    ckpt.save_tokenizer(spec.vocab_size, directory)
    (directory / "bench_spec.json").write_text(json.dumps(asdict(spec)))


def cached(spec: ckpt.CheckpointSpec, cache_dir: Path) -> Path:
    """The bfloat16 directory for `spec` (its dtype taken as bfloat16) under `cache_dir`, built on first use."""
    spec = replace(spec, dtype="bfloat16")
    directory = Path(cache_dir) / f"{spec.name}-direct"
    marker = directory / "bench_spec.json"
    if not (marker.is_file() and json.loads(marker.read_text()) == asdict(spec)):
        build(spec, directory)
    return directory
