"""`etmlx bench structured`: the cost of structured output, every ratio measured in the same run.

1. Device: one sampler step (V = 32000, B = 1, top-k + top-p) of a program without the mask input,
   the same program with it and an all-ones mask, and with a mask allowing 1% of the tokens.
2. Host: llguidance's mask per token (compute + advance) for a JSON schema on the tiny model's tokenizer.
3. End to end: decode tok/s of the tiny random Llama (llm/builtin/tiny_model.py) unconstrained against
   the same program with a JSON schema, and the host's share of a constrained step.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"enum": ["ada", "alan", "grace"]}, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 4}}}


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def device_cost(repeats: int) -> dict:
    from backends.mlx.llm.sampler.config import SamplerConfig
    from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head, sampler_inputs
    from backends.mlx.llm.sampler.knobs import mask_words
    from backends.mlx.runtime.runner import load_method

    vocab = 32000
    logits = torch.randn(1, vocab) * 2
    base = dict(top_k=torch.tensor([50]), top_p=torch.tensor([0.9]))
    out = {}
    for name, config in (("no_mask", SamplerConfig(top_k=True, top_p=True)),
                         ("mask", SamplerConfig(top_k=True, top_p=True, allowed_mask=True))):
        method = load_method(export_sampling_head(LogitsInput(), (torch.zeros(1, vocab),), config=config,
                                                  per_row=True).pte)
        masks = {"": None} if name == "no_mask" else {
            "_all_ones": torch.full((1, mask_words(vocab)), -1, dtype=torch.int32),
            "_1pct": torch.where(torch.arange(mask_words(vocab)) % 3 == 0, 1 << 5, 0).to(torch.int32)[None]}
        for suffix, mask in masks.items():
            knobs = dict(base, **({"allowed_mask": mask} if mask is not None else {}))
            inputs = sampler_inputs(config, [logits], torch.tensor([0.8]), torch.tensor([1]), **knobs)
            out[name + suffix] = _median_ms(lambda: method.execute(inputs), repeats)
    return out


def host_and_end_to_end(tokens: int, runs: int) -> dict:
    from backends.mlx.llm.builtin.tiny_model import tiny_llama, train_tokenizer
    from backends.mlx.llm.decoder.constraints import Constraint
    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.decoder.loop import Decoder
    from backends.mlx.llm.sampler.config import SamplerConfig
    from backends.mlx.llm.sampler.params import SamplingParams

    tok = train_tokenizer()
    model = tiny_llama(len(tok), tok.eos_token_id, hidden=64, layers=2)
    with tempfile.TemporaryDirectory() as tmp:
        pte = Path(tmp) / "tiny.pte"
        export_decoder(model, pte, 160, config=SamplerConfig(top_k=True, top_p=True, allowed_mask=True), tokenizer=tok)
        decoder = Decoder(pte)
        prompt = tok("Hello there")["input_ids"]
        constraint = Constraint("json_schema", SCHEMA)

        # Host: mask + advance over the tokens of real constrained completions.
        matcher_ms, count = 0.0, 0
        for run in range(runs):
            gen = decoder.generate(prompt, tokens, SamplingParams(temperature=1.0, seed=run * 10 ** 6),
                                   constraint=constraint)
            m = decoder.matcher(constraint)
            t = time.perf_counter()
            for token in gen.tokens:
                m.mask()
                m.advance(token)
            matcher_ms += (time.perf_counter() - t) * 1000
            count += len(gen.tokens)
        host_ms = matcher_ms / count

        def tok_s(constrained: bool) -> float:
            # Same number of decode steps both ways: the unconstrained run ignores EOS.
            steps, seconds = 0, 0.0
            for run in range(runs):
                params = SamplingParams(temperature=1.0, seed=run * 10 ** 6)
                t = time.perf_counter()
                n = 0
                if constrained:
                    for _ in decoder.stream(prompt, tokens, params, constraint=constraint):
                        n += 1
                else:
                    for _ in decoder.stream(prompt, tokens, params, stop_at_eos=False):
                        n += 1
                seconds += time.perf_counter() - t
                steps += n
            return steps / seconds

        free, constrained = [], []
        for _ in range(3):  # alternate, median: the machine is shared
            free.append(tok_s(False))
            constrained.append(tok_s(True))
    free_s, cons_s = statistics.median(free), statistics.median(constrained)
    return {"host_mask_ms_per_token": host_ms, "unconstrained_tok_s": free_s, "json_schema_tok_s": cons_s,
            "end_to_end_ratio": cons_s / free_s, "host_share_of_step": host_ms / (1000 / cons_s)}


def run(repeats: int = 200, tokens: int = 48, runs: int = 6) -> dict:
    device = device_cost(repeats)
    rest = host_and_end_to_end(tokens, runs)
    print("device, one sampler step, V=32000 B=1 top-k 50 top-p 0.9 (median ms):")
    for name, ms in device.items():
        print(f"  {name:16s} {ms:7.3f} ms   / no_mask {ms / device['no_mask']:.2f}x")
    print(f"host: llguidance mask + advance {rest['host_mask_ms_per_token'] * 1000:.1f} us per token (JSON schema, V=320)")
    print(f"end to end (tiny Llama, V=320, {tokens} tokens max, {runs} seeds, median of 3):"
          f" unconstrained {rest['unconstrained_tok_s']:.1f} tok/s, JSON schema {rest['json_schema_tok_s']:.1f} tok/s,"
          f" ratio {rest['end_to_end_ratio']:.2f}x; host share of a constrained step {rest['host_share_of_step']:.1%}")
    return {"device_ms": device, **rest}


if __name__ == "__main__":
    run()
