"""`etmlx bench structured --builtin`: structured output on the built-in model, three ways in one run.

- unconstrained: the demo's program (no mask input), sampling on the device;
- json_schema: the same model exported with `--sampler ...,mask`; llguidance's mask for step k+1 is
  computed on the host between calls and applied on the device;
- check_resample (llama.cpp's approach): the mask program with an all-ones mask samples freely; the
  host checks the token with the grammar and, only when it is rejected, computes the mask and samples
  the step again. llama.cpp resamples from logits already on the host; here the logits never leave the
  device, so a resample is a second call at the same position (the cache rewrite is identical), which
  makes every rejection cost a forward pass. The rejection rate is reported with the speed.

The checkpoint is the demo's (trained once, cached in `cache_dir/builtin-llama`); the two programs are
exported next to it once per checkpoint.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks.structured import SCHEMA
from backends.mlx.llm.builtin.model import DEFAULT_RECIPE, STAMP, ensure_builtin_checkpoint
from backends.mlx.llm.decoder.constraints import Constraint
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.prompt import encode_prompt
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams

PROMPT = "One morning, Mira went to"
MAX_SEQ_LEN = 256


def _program(ckpt: Path, pte: Path, config: SamplerConfig) -> Path:
    """`pte`, exported from `ckpt` unless it is newer than the checkpoint's stamp."""
    if pte.is_file() and pte.stat().st_mtime > (ckpt / STAMP).stat().st_mtime:
        return pte
    from transformers import AutoModelForCausalLM

    from backends.mlx.llm.decoder.export import export_decoder

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation="eager")
    export_decoder(model, pte, MAX_SEQ_LEN, config=config, tokenizer=ckpt)
    return pte


def check_resample(decoder: Decoder, prompt: list[int], tokens: int, params: SamplingParams,
                    constraint: Constraint, resampled: list[int]):
    """Decode with sample-check-resample, yielding each token; counts resampled steps in resampled[0]."""
    matcher = decoder.matcher(constraint)
    raw = matcher._m  # llguidance's LLMatcher: validate_tokens checks without advancing
    eos = set(decoder.meta.eos_token_ids)
    seq, start = list(prompt), 0
    for k in range(tokens):
        step = decoder.step_at(seq, start, params, k)
        if raw.validate_tokens([step.token]) == 1:
            matcher.advance(step.token)
        else:  # rejected: the same step again, with the grammar's mask
            resampled[0] += 1
            step = decoder.step_at(seq, start, params, k, matcher)
        yield step.token
        start += len(seq)
        seq = [step.token]
        if step.token in eos:  # once the grammar is complete only EOS passes the check
            return


def decode_rate(stream) -> tuple[int, float]:
    """(tokens after the first, seconds after the first): the prefill call and the matcher's set-up
    (time to first token) are left out, so runs of different lengths compare per decode step."""
    first, n = None, 0
    for _ in stream:
        if first is None:
            first = time.perf_counter()
        else:
            n += 1
    return n, time.perf_counter() - first


def run(cache_dir: Path, tokens: int = 48, runs: int = 6, rounds: int = 3) -> dict:
    ckpt = ensure_builtin_checkpoint(Path(cache_dir), DEFAULT_RECIPE)
    features = dict(top_k=True, top_p=True, min_p=True)  # the demo's sampler
    plain = Decoder(_program(ckpt, Path(cache_dir) / "builtin.pte", SamplerConfig(**features)))
    masked = Decoder(_program(ckpt, Path(cache_dir) / "builtin-mask.pte", SamplerConfig(**features, allowed_mask=True)))
    prompt = encode_prompt(plain.tokenizer, PROMPT)
    constraint = Constraint("json_schema", SCHEMA)
    masked.matcher(constraint)  # compiles the vocabulary once, outside the timings

    def rate(mode: str) -> tuple[float, int, int]:
        steps, seconds, resampled, calls = 0, 0.0, [0], 0
        for run_ in range(runs):
            params = SamplingParams(temperature=1.0, seed=run_ * 10 ** 6)
            if mode == "unconstrained":
                stream = plain.stream(prompt, tokens, params, stop_at_eos=False)
            elif mode == "json_schema":
                stream = masked.stream(prompt, tokens, params, constraint=constraint)
            else:
                stream = check_resample(masked, prompt, tokens, params, constraint, resampled)
            n, t = decode_rate(stream)
            steps, seconds, calls = steps + n, seconds + t, calls + n + 1
        return steps / seconds, calls, resampled[0]

    modes = ("unconstrained", "json_schema", "check_resample")
    rates = {m: [] for m in modes}
    counts = {}
    for _ in range(rounds):  # interleaved, median: the machine is shared
        for m in modes:
            r, steps, resampled = rate(m)
            rates[m].append(r)
            counts[m] = (steps, resampled)
    med = {m: statistics.median(v) for m, v in rates.items()}
    out = {"vocab": plain.meta.vocab_size, "tokens_max": tokens, "runs": runs,
           **{f"{m}_tok_s": med[m] for m in modes},
           "json_schema_ratio": med["json_schema"] / med["unconstrained"],
           "check_resample_ratio": med["check_resample"] / med["unconstrained"],
           "check_resample_rejected_share": counts["check_resample"][1] / max(1, counts["check_resample"][0])}
    print(f"built-in model (V={out['vocab']}, {runs} seeds x up to {tokens} tokens, T=1.0, decode tok/s after the "
          f"first token, median of {rounds}):")
    print(f"  unconstrained {med['unconstrained']:.1f} tok/s; JSON schema, mask on the device "
          f"{med['json_schema']:.1f} tok/s ({out['json_schema_ratio']:.2f}x); sample-check-resample "
          f"{med['check_resample']:.1f} tok/s ({out['check_resample_ratio']:.2f}x, "
          f"{out['check_resample_rejected_share']:.0%} of steps resampled)")
    return out
