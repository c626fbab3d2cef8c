"""`etmlx bench speculative --shape NAME`: speculative decoding at a published model's size, on this machine.

The checkpoint of `bench decode --shape` (random weights at that shape, `mlx_lm.convert -q` 4-bit group 64, cached:
benchmarks/checkpoints.py) exported twice, each once and cached beside it: the plain (pipelined) program and
a `--draft-tokens K` one. In each round, taking turns: plain decoding, then the draft-verifying program with
Predicted Outputs (the plain run's own greedy tokens as the prediction), with no drafts, and with a prediction that
never matches (random ids). Every run must give the plain tokens. Rates are decode tok/s after the first call
(the plain loop's measure, speculative.py), and each speculative run's ratio to the plain run of its round; the
report gives medians over the rounds after one untimed warm-up round. The shared machine's load moves from
round to round, which the per-round ratios follow.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from benchmarks import decode_programs as programs
from benchmarks.decode_shapes import export_in_child
from benchmarks import checkpoints as ckpt

SCHEME = "int4"
MAX_SEQ_LEN = 576  # as bench decode --shape: its programs are shared


def _programs(shape: str, cache_dir: Path, draft_tokens: int, log) -> tuple[Path, Path]:
    if shape in ckpt.PACKED_SHAPES:  # its float32 checkpoint would not fit in memory
        raise ValueError(f"--shape {shape} is built packed for `etmlx bench decode --shape` only; this benchmark "
                         "needs its float checkpoint")
    spec = ckpt.CheckpointSpec(**ckpt.SHAPES[shape], dtype="float32", seed=0)
    quantized_dir = ckpt.cached_quantized(ckpt.cached(spec, cache_dir), SCHEME, cache_dir)
    log(f"{shape}: {spec.parameters / 1e6:.0f}M parameters, {SCHEME}: {quantized_dir}")
    plain = programs.cached_pte(quantized_dir, "etmlx", MAX_SEQ_LEN)
    export_in_child(quantized_dir, plain, MAX_SEQ_LEN, log)
    verifying = programs.cached_pte(quantized_dir, f"spec-k{draft_tokens}", MAX_SEQ_LEN)
    export_in_child(quantized_dir, verifying, MAX_SEQ_LEN, log, extra=["--draft-tokens", str(draft_tokens)])
    return plain, verifying


def run(shape: str, cache_dir: Path, draft_tokens: int = 8, prompt_len: int = 64, max_tokens: int = 64,
        repeats: int = 3, log=print) -> dict:
    if shape not in ckpt.SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(ckpt.SHAPES)}, got {shape!r}")
    from benchmarks.speculative import _plain
    from backends.mlx.llm.decoder.draft_sources import PredictionDraft
    from backends.mlx.llm.decoder.loop import Decoder
    from backends.mlx.llm.decoder.speculative import SpeculativeDecoder

    plain_pte, spec_pte = _programs(shape, Path(cache_dir), draft_tokens, log)
    plain, spec = Decoder(plain_pte), SpeculativeDecoder(spec_pte)
    vocab = spec.meta.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    reference, _ = _plain(plain, prompt, max_tokens)
    miss = torch.randint(0, vocab, (max_tokens,), generator=torch.Generator().manual_seed(2)).tolist()
    sources = {"prediction": lambda: PredictionDraft(reference), "none": lambda: None,
               "miss": lambda: PredictionDraft(miss)}
    rounds = []
    for repeat in range(repeats + 1):  # the first round warms up
        tokens, rate = _plain(plain, prompt, max_tokens)
        if tokens != reference:
            raise RuntimeError("plain decoding is not deterministic")
        measured = {"plain": rate}
        drafts = {}
        for name, source in sources.items():
            tokens, rate = spec.generate(prompt, max_tokens, draft=source(), stop_at_eos=False)
            if tokens != reference:
                raise RuntimeError(f"speculative decoding with {name} drafts gave other tokens than plain decoding")
            measured[name] = rate
            drafts[name] = {"proposed": spec.stats.proposed, "accepted": spec.stats.accepted, "calls": spec.stats.calls}
        if repeat:
            rounds.append(measured)
            log(f"  round {repeat}/{repeats}: " + ", ".join(f"{name} {rate:.1f}" for name, rate in measured.items()))
    medians = {name: statistics.median(r[name] for r in rounds) for name in ("plain", *sources)}
    ratios = {name: statistics.median(r[name] / r["plain"] for r in rounds) for name in sources}
    return {"shape": shape, "scheme": SCHEME, "draft_tokens": draft_tokens, "prompt_tokens": prompt_len,
            "tokens": len(reference), "repeats": repeats, "programs": {"plain": str(plain_pte), "draft": str(spec_pte)},
            "decode_tok_s": medians, "vs_plain": ratios, "drafts": drafts, "rounds": rounds}


def main(shape: str, json_path: str | None, cache_dir: str, repeats: int | None = None, draft_tokens: int = 8) -> int:
    result = run(shape, Path(cache_dir), draft_tokens=draft_tokens, repeats=repeats or 3)
    print(f"{shape} {SCHEME}, greedy, {result['prompt_tokens']}-token prompt, {result['tokens']} tokens, "
          f"K = {draft_tokens}, medians of {result['repeats']} rounds (ratios: per round, then the median)")
    for name, rate in result["decode_tok_s"].items():
        line = f"  {name:12s} {rate:8.1f} tok/s"
        if name in result["vs_plain"]:
            d = result["drafts"][name]
            line += (f"  x{result['vs_plain'][name]:.2f} vs plain; drafts {d['accepted']}/{d['proposed']} accepted, "
                     f"{d['calls']} calls")
        print(line)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    return 0
