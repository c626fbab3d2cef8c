"""`etmlx bench speculative`: speculative decoding on the built-in model, against plain decoding, in one run.

The built-in demo checkpoint (trained once, cached) is exported three times with the same top-k/top-p/min-p
sampler: the plain program as `etmlx export` writes it (pipelined), the same unpipelined, and a draft-verifying
program (--draft-tokens K, default 8). Measured, decode tok/s (tokens after the first call over the time
after it), greedy, `max_tokens` tokens after the demo prompt (EOS does not stop them):
  plain              Decoder.generate on the plain programs
  prediction         Predicted Outputs: the prediction is the model's own greedy continuation (the plain
                     run's tokens), the best case a correct prediction gives
  ngram              prompt lookup over prompt + output
  miss               a prediction that never matches (random ids): what a source that never hits costs
  draft-model        the built-in draft model (builtin/model.py DRAFT_RECIPE: same tokenizer, one layer a quarter
                     as wide; trained once, cached), exported with --propose-tokens K (K greedy tokens in one
                     call, llm/decoder/proposer.py), proposing as many drafts as its budget finds worth the
                     measured cost of its call
  draft-model all    the same with cost=0: the drafts prompt lookup's budget would ask for (up to K; the
                     acceptance rate of longer drafts)
  draft-model stepwise  the same model as a plain unpipelined program: one call per drafted token
Every speculative run must yield the plain run's tokens (a RuntimeError otherwise). Each figure is the median
of `repeats` runs, the variants taking turns within each repeat (the machine may be shared). Then the same
programs and prompt through the C++ decode loop (speculative_cpp.py: etmlx_bench, no Python per call).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks import speculative_cpp

DEFAULT_PROMPT = "One morning, Mira went to"


def _export(ckpt: Path, pte: Path, config=None, **kw) -> Path:
    from transformers import AutoModelForCausalLM

    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.decoder.meta import has_embedded_meta
    from backends.mlx.llm.sampler.config import SamplerConfig

    from benchmarks.decode_programs import source_fingerprint

    # Named after the exporting code too, as `bench decode`'s programs are: a cache written by older code (a draft
    # program without its plain step, say) is not timed as this code's.
    pte = pte.with_name(f"{pte.stem}-{source_fingerprint()}{pte.suffix}")
    stamp = ckpt / "etmlx_builtin.json"
    if pte.is_file() and has_embedded_meta(pte) and pte.stat().st_mtime > stamp.stat().st_mtime:
        return pte
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager")
    pte.parent.mkdir(parents=True, exist_ok=True)
    config = config or SamplerConfig(top_k=True, top_p=True, min_p=True)
    export_decoder(model, pte, 256, config=config, tokenizer=ckpt, **kw)
    return pte


def _plain(decoder, prompt, max_tokens) -> tuple[list[int], float]:
    """Decoder.generate's measure without stopping at EOS: tokens after the first over the time after it."""
    tokens, first = [], None
    for step in decoder.stream(prompt, max_tokens, stop_at_eos=False):
        first = first or time.perf_counter()
        tokens.append(step.token)
    return tokens, (len(tokens) - 1) / (time.perf_counter() - first)


def run(cache_dir: Path, draft_tokens: int = 8, max_tokens: int = 200, repeats: int = 5) -> dict:
    from backends.mlx.llm.builtin.model import ensure_builtin_checkpoint, ensure_builtin_draft_checkpoint
    from backends.mlx.llm.decoder.draft_model import DraftModel
    from backends.mlx.llm.decoder.draft_sources import NgramDraft, PredictionDraft
    from backends.mlx.llm.decoder.loop import Decoder
    from backends.mlx.llm.decoder.prompt import encode_prompt
    from backends.mlx.llm.decoder.speculative import SpeculativeDecoder

    ckpt = ensure_builtin_checkpoint(cache_dir)
    plain_pte = _export(ckpt, cache_dir / "spec-plain.pte")
    plain = Decoder(plain_pte)
    unpipelined = Decoder(_export(ckpt, cache_dir / "spec-unpipelined.pte", pipelined=False))
    spec = SpeculativeDecoder(_export(ckpt, cache_dir / f"spec-draft{draft_tokens}.pte", draft_tokens=draft_tokens))
    draft_ckpt = ensure_builtin_draft_checkpoint(cache_dir)
    if (draft_ckpt / "tokenizer.json").read_bytes() != (ckpt / "tokenizer.json").read_bytes():
        raise RuntimeError(f"the built-in draft model's tokenizer differs from the demo model's ({draft_ckpt})")
    from backends.mlx.llm.sampler.config import SamplerConfig

    stepwise_pte = _export(draft_ckpt, cache_dir / "spec-draft-model.pte", pipelined=False)
    draft_pte = _export(draft_ckpt, cache_dir / f"spec-draft-model-propose{draft_tokens}.pte", config=SamplerConfig(),
                        propose_tokens=draft_tokens)
    draft_model, draft_model_all = DraftModel(draft_pte, target=spec), DraftModel(draft_pte, target=spec, cost=0)
    stepwise = DraftModel(stepwise_pte, target=spec)
    prompt = encode_prompt(plain.tokenizer, DEFAULT_PROMPT)
    reference, _ = _plain(plain, prompt, max_tokens)
    miss = torch.randint(0, spec.meta.vocab_size, (max_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    sources = {"prediction": lambda: PredictionDraft(reference), "ngram": NgramDraft, "miss": lambda: PredictionDraft(miss),
               # one draft program each, its row cache (and budget) carried between runs
               "draft-model": lambda: draft_model, "draft-model all": lambda: draft_model_all,
               "draft-model stepwise": lambda: stepwise}
    rates = {name: [] for name in ("plain", "plain unpipelined", *sources)}
    acceptance = {}
    for _ in range(repeats + 1):  # the first round warms up
        for name, decoder in (("plain", plain), ("plain unpipelined", unpipelined)):
            tokens, rate = _plain(decoder, prompt, max_tokens)
            if tokens != reference:
                raise RuntimeError(f"{name} decoding is not deterministic")
            rates[name].append(rate)
        for name, source in sources.items():
            tokens, rate = spec.generate(prompt, max_tokens, draft=source(), stop_at_eos=False)
            if tokens != reference:
                raise RuntimeError(f"speculative decoding with {name} drafts gave other tokens than plain decoding")
            rates[name].append(rate)
            acceptance[name] = {"proposed": spec.stats.proposed, "accepted": spec.stats.accepted,
                                "calls": spec.stats.calls}
    draft_calls = {"calls": draft_model.calls, "ms_per_call": 1000 * draft_model.seconds / max(draft_model.calls, 1)}
    cpp = speculative_cpp.run(plain_pte, spec.pte, draft_pte, prompt, max_tokens, repeats)
    medians = {name: statistics.median(values[1:]) for name, values in rates.items()}
    return {"machine": platform.machine(), "model": "builtin", "draft_tokens": draft_tokens, "tokens": len(reference),
            "repeats": repeats, "decode_tok_s": medians,
            "speedup": {name: medians[name] / medians["plain"] for name in sources}, "drafts": acceptance,
            "draft_model_calls": draft_calls, "cpp_loop": cpp}


def main(json_path: str | None, cache_dir: str, repeats: int | None = None, draft_tokens: int = 8) -> int:
    result = run(Path(cache_dir), draft_tokens=draft_tokens, repeats=repeats or 5)
    print(f"built-in model, greedy, {result['tokens']} tokens, K = {draft_tokens}, median of {result['repeats']}")
    for name, rate in result["decode_tok_s"].items():
        line = f"  {name:18s} {rate:8.0f} tok/s"
        if name in result["speedup"]:
            d = result["drafts"][name]
            rate_text = f"{d['accepted'] / d['proposed']:.0%}" if d["proposed"] else "-"
            line += (f"  x{result['speedup'][name]:.2f} vs plain; drafts {d['accepted']}/{d['proposed']} accepted "
                     f"({rate_text}), {d['calls']} calls")
        print(line)
    print(f"  draft model: {result['draft_model_calls']['ms_per_call']:.2f} ms per draft program call")
    speculative_cpp.report(result["cpp_loop"])
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    return 0
