"""The feature half of `etmlx bench sampler`: temp / topk_topp / topp on LM-shaped and flat logits.

Baselines, measured in the same run on the same (MLX CPU) device:
  upstream_formulation  ExecuTorch's upstream recipe in MLX ops: a full sort for the top-k
                        threshold, a full sort of the probabilities for top-p, then Gumbel-max
  mlx_lm                mlx_lm.sample_utils.make_sampler with the same settings
  read_once             a .pte that reads the logits once (a max): the floor
LM-shaped logits: a Zipf-like heavy tail, -1.1 * log(rank) plus N(0, 0.3) noise over a random
permutation of the vocabulary; flat: N(0, 0.01) noise, the worst case for top-p.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch

from benchmarks.timing import ReadOnce, median_ms
from backends.mlx.exporter.export import export_to_pte
from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head, sampler_inputs
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.runtime.runner import load_method

TEMPERATURE = 0.8
CONFIGS = {"temp": dict(), "topk_topp": dict(top_k=50, top_p=0.9), "topp": dict(top_p=0.9)}


def make_logits(kind: str, batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = np.random.default_rng(seed)
    if kind == "flat":
        return torch.from_numpy(gen.normal(0, 0.01, (batch, vocab)).astype(np.float32))
    rank = np.stack([gen.permutation(vocab) + 1 for _ in range(batch)])
    return torch.from_numpy((-1.1 * np.log(rank) + gen.normal(0, 0.3, (batch, vocab))).astype(np.float32))


def upstream_formulation(z: mx.array, temp: float, top_k: int, top_p: float, key: mx.array) -> mx.array:
    s = z / temp
    vocab = s.shape[-1]
    k = min(top_k, vocab) if top_k > 0 else vocab
    kth = mx.sort(s, axis=-1)[..., vocab - k: vocab - k + 1]  # first full sort
    s = mx.where(s >= kth, s, -mx.inf)
    probs = mx.softmax(s, axis=-1)
    sp = mx.sort(probs, axis=-1)[..., ::-1]  # second full sort
    keep = (mx.cumsum(sp, axis=-1) - sp) <= top_p
    thresh = mx.min(mx.where(keep, sp, mx.inf), axis=-1, keepdims=True)
    s = mx.where(probs >= thresh, s, -mx.inf)
    return mx.argmax(s + mx.random.gumbel(s.shape, key=key), axis=-1)


def measure(config_name: str, logits_kind: str, vocab: int, batch: int, repeats: int) -> list[dict]:
    from mlx_lm.sample_utils import make_sampler

    knobs = CONFIGS[config_name]
    logits = make_logits(logits_kind, batch, vocab)
    config = SamplerConfig(top_k="top_k" in knobs, top_p="top_p" in knobs)
    program = load_method(export_sampling_head(LogitsInput(), (torch.zeros(batch, vocab),), config=config).pte)
    reader = load_method(export_to_pte(ReadOnce(), (torch.zeros(batch, vocab),)).pte)
    knob_tensors = {"top_k": torch.tensor(knobs.get("top_k", 0)), "top_p": torch.tensor(knobs.get("top_p", 1.0))}
    knob_tensors = {k: v for k, v in knob_tensors.items() if k in config.knob_names()}
    temperature = torch.tensor(TEMPERATURE)
    z = mx.array(logits.numpy())
    sampler = make_sampler(temp=TEMPERATURE, top_p=knobs.get("top_p", 0.0), top_k=knobs.get("top_k", 0))
    step = iter(range(10**9))

    def etmlx():
        program.execute(sampler_inputs(config, [logits], temperature, torch.tensor(next(step)), validate=False,
                                       **knob_tensors))

    def upstream():
        mx.eval(upstream_formulation(z, TEMPERATURE, knobs.get("top_k", 0), knobs.get("top_p", 1.0),
                                     mx.random.key(next(step))))

    def mlx_lm():
        mx.eval(sampler(z - mx.logsumexp(z, axis=-1, keepdims=True)))

    def read_once():
        reader.execute([logits])

    return [
        {"config": config_name, "logits": logits_kind, "vocab": vocab, "batch": batch, "impl": name,
         "median_ms": median_ms(fn, repeats)}
        for name, fn in (("etmlx", etmlx), ("upstream_formulation", upstream), ("mlx_lm", mlx_lm),
                         ("read_once", read_once))
    ]


def main(vocab: int = 128256, batch: int = 1, repeats: int = 30) -> list[dict]:
    records = []
    print(f"\nfeatures at V={vocab} B={batch}, T={TEMPERATURE} (median ms; ratios are etmlx / baseline)")
    print(f"{'config':<11}{'logits':<7}{'etmlx':>9}{'upstream':>10}{'mlx_lm':>9}{'read':>8}"
          f"{'/upstream':>11}{'/mlx_lm':>9}{'/read':>8}")
    for name in CONFIGS:
        for kind in ("lm", "flat"):
            rows = measure(name, kind, vocab, batch, repeats)
            records.extend(rows)
            ms = {r["impl"]: r["median_ms"] for r in rows}
            print(f"{name:<11}{kind:<7}{ms['etmlx']:>9.3f}{ms['upstream_formulation']:>10.3f}{ms['mlx_lm']:>9.3f}"
                  f"{ms['read_once']:>8.3f}{ms['etmlx'] / ms['upstream_formulation']:>11.2f}"
                  f"{ms['etmlx'] / ms['mlx_lm']:>9.2f}{ms['etmlx'] / ms['read_once']:>8.2f}")
    return records
