"""Check a written decoder .pte against the eager model it was exported from.

    report = verify_decoder(model, "model.pte")   # raises VerificationError on a wrong program
    print(report.summary())

The program runs in the real runtime through the Decoder (loop.py), so batch, knob inputs, penalties,
the mask, seeding and pipelining are driven exactly as `etmlx generate` drives them: a prompt of
PROMPT_TOKENS ids drawn from the vocabulary with a fixed seed, its prefill and DECODE_STEPS greedy
steps. The reference at each step is the eager model's full-sequence `model(ids).logits` over the
prompt and the program's own tokens so far (no cache; one causal forward over the whole sequence gives
every step's), so one accepted near tie does not make every later step differ.

A step passes when the program's token is the eager argmax, or its eager logit is within the
tolerance of the argmax's (a near tie: rounding may pick either; reported, not a failure). Where the
program returns logprobs, the chosen one and the top-N are compared with the eager log-softmax
within LOGPROB_FACTOR x the tolerance (a log-softmax moves by up to twice its inputs' error).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.release_memory import collect_if_large
from backends.mlx.llm.sampler.params import SamplingParams

PROMPT_TOKENS = 8
DECODE_STEPS = 4
PROMPT_SEED = 0
# Logit tolerance as a fraction of the step's largest |eager logit| (floor 1, so a flat tiny model gets
# an absolute one): float32 differs from eager only by summation order; the half types by one or two
# ulps of their 11- and 8-bit mantissas, compounded over the layers.
RELATIVE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}
# Quantized linears: MLX's quantized kernels and the torch reference (llm/quantize/modules.py) hold the
# same weights but accumulate the dequantized products in a different order and precision.
QUANTIZED_FACTOR = 2.0
LOGPROB_FACTOR = 2.0
# A --kv-bits program's cache entries, how much farther from the eager keys and values than the eager's own
# quantization, in quantization steps: a key that differs by float noise may round to the neighbouring step (1),
# a scale made from a range that differs by float noise moves every value by a hair more.
PINNED_CACHE_STEPS = 1.25


class VerificationError(ValueError):
    """The program decodes differently from the eager model (one line: step, ids, logit gap)."""


@dataclass
class VerificationReport:
    steps: int  # greedy tokens compared (the prefill's included)
    dtype: str
    quantized: bool
    near_ties: list[str] = field(default_factory=list)
    max_logprob_error: float | None = None  # None: the program returns no logprobs
    vision_error: float | None = None  # a vision-language program's vision method against eager (max |error|)

    def summary(self) -> str:
        kind = f"{self.dtype}{', quantized' if self.quantized else ''}"
        line = f"verified against the eager model ({kind}): {self.steps} greedy tokens match"
        if self.max_logprob_error is not None:
            line += f", logprobs within {self.max_logprob_error:.2g}"
        if self.vision_error is not None:
            line += f" with an image (vision method within {self.vision_error:.2g} of eager)"
        if self.near_ties:
            line += f"; near ties (either token is right): {'; '.join(self.near_ties)}"
        return line


def is_quantized(model: torch.nn.Module) -> bool:
    from backends.mlx.llm.quantize.modules import QuantizedEmbedding, QuantizedLinear

    return any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules())


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    floating = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
    return floating[0] if floating else torch.float32


def tolerance(model: torch.nn.Module) -> float:
    """The fraction of the largest |logit| within which the program's logits may differ from eager."""
    relative = RELATIVE_TOLERANCE.get(activation_dtype(model), RELATIVE_TOLERANCE[torch.bfloat16])
    return relative * (QUANTIZED_FACTOR if is_quantized(model) else 1.0)


def verification_prompt(vocab_size: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def _step_name(k: int) -> str:
    return "prefill" if k == 0 else f"decode step {k}"


def verify_decoder(model: torch.nn.Module, pte: Path, steps: int = DECODE_STEPS,
                   prompt_tokens: int = PROMPT_TOKENS) -> VerificationReport:
    """Run `pte` (prefill + `steps` greedy steps) and compare with `model`, the eager module it was
    exported from; raise VerificationError naming the first divergent step. (A vision-language program's
    check, with an image, is verify_vision.py's.)"""
    decoder = Decoder(Path(pte))
    meta = decoder.meta
    generated = 1 + steps
    room = meta.max_seq_len - generated
    if room < 1:  # a tiny cache: fewer steps, at least a one-token prompt
        generated = max(1, meta.max_seq_len - 1)
        room = meta.max_seq_len - generated
    if room < 1:
        raise VerificationError(f"max_seq_len {meta.max_seq_len} leaves no room for a prompt and a token: "
                                "nothing to verify (pass verify=False / --no-verify)")
    prompt = verification_prompt(meta.vocab_size, min(prompt_tokens, room))
    steps = list(decoder.stream(prompt, generated, SamplingParams(), stop_at_eos=False))
    pin = getattr(model, "pin_program_cache", None)  # a --kv-bits program's reference (kv_reference.py)
    pinned = pin is not None and pin(decoder.method.state, len(prompt) + len(steps) - 1)
    # The runtime's copy of the weights is freed before the eager forward reads the model's: at real size the
    # two together would be twice the weights (docs/weights.md). No other reference to the program may remain.
    del decoder
    collect_if_large(model)
    try:
        return compare_greedy(model, Path(pte), steps, prompt)
    finally:
        if pinned:  # the entries belong to this sequence: later checks (drafts, proposals) run others
            model.unpin()


def compare_greedy(model: torch.nn.Module, pte: Path, steps: list, prompt: list[int],
                   reference=None) -> VerificationReport:
    """The program's greedy `steps` (Decoder.stream's, after `prompt`) against the eager argmax; `reference(ids)`:
    the eager logits [len(ids), V] (default: model(ids)). The caller frees its Decoder first."""
    relative = tolerance(model)
    dtype = str(activation_dtype(model)).replace("torch.", "")
    report = VerificationReport(steps=0, dtype=dtype, quantized=is_quantized(model))
    logprob_errors = []
    # One causal forward over the prompt and the program's tokens gives, at each position, the logits of a
    # full-sequence forward over that prefix: the per-step reference without a cache, for one call's cost.
    ids = prompt + [step.token for step in steps[:-1]]
    with torch.no_grad():
        logits = reference(ids) if reference is not None else model(torch.tensor([ids])).logits[0]
        all_logits = logits[len(prompt) - 1:].float()
    if getattr(model, "pinned", None) is not None and model.pin_steps > PINNED_CACHE_STEPS:
        raise VerificationError(f"{pte} holds quantized KV cache entries {model.pin_steps:.3g} quantization steps "
                                f"farther from the eager keys and values than their own quantization (at most "
                                f"{PINNED_CACHE_STEPS})")
    for k, (step, logits) in enumerate(zip(steps, all_logits)):
        tol = relative * max(1.0, float(logits.abs().max()))
        expected = int(logits.argmax())
        gap = float(logits[expected] - logits[step.token])
        if step.token != expected:
            where = f"{_step_name(k)}: expected token {expected} (eager greedy), got {step.token}"
            if gap > tol:
                raise VerificationError(
                    f"{pte} decodes differently from the eager model at {where}; eager logit gap {gap:.4g} > "
                    f"tolerance {tol:.3g} ({dtype}{', quantized' if report.quantized else ''})")
            report.near_ties.append(f"{where} (gap {gap:.3g} <= {tol:.3g})")
        if step.logprob is not None:
            logprob_errors.append(_check_logprobs(pte, k, step, logits, LOGPROB_FACTOR * tol))
        report.steps += 1
    if logprob_errors:
        report.max_logprob_error = max(logprob_errors)
    return report


def check_continuation(model: torch.nn.Module, pte, prompt: list[int], tokens: list[int],
                       report: VerificationReport, name: str, differs: str) -> None:
    """Each of `tokens`, the program's continuation of `prompt`, against the eager argmax over the prompt and
    the tokens before it (one causal forward gives them all): a near tie within the tolerance goes into
    `report.near_ties`; a wider gap raises VerificationError "{pte} {differs} at {name} k: ...". For the
    programs whose tokens come otherwise than through the plain loop (drafts verified, tokens proposed)."""
    with torch.no_grad():
        all_logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
    relative = tolerance(model)
    for k, (token, logits) in enumerate(zip(tokens, all_logits)):
        tol = relative * max(1.0, float(logits.abs().max()))
        expected = int(logits.argmax())
        gap = float(logits[expected] - logits[token])
        if token != expected:
            where = f"{name} {k}: expected {expected} (eager greedy), got {token}"
            if gap > tol:
                kind = f"{report.dtype}{', quantized' if report.quantized else ''}"
                raise VerificationError(f"{pte} {differs} at {where}; eager logit gap {gap:.4g} > tolerance "
                                        f"{tol:.3g} ({kind})")
            report.near_ties.append(f"{where} (gap {gap:.3g} <= {tol:.3g})")
        report.steps += 1


def _check_logprobs(pte, k: int, step, logits: torch.Tensor, tol: float) -> float:
    """The largest error of the step's chosen and top-N logprobs against the eager log-softmax."""
    eager = torch.log_softmax(logits, -1)
    top_values = torch.topk(eager, len(step.top)).values.tolist()
    pairs = [("the chosen token's logprob", step.logprob, float(eager[step.token]))]
    # Each returned (id, logprob) against eager at that id, and the values, best first, against eager's
    # top-N (the ids of a near tie may swap, the values may not move).
    pairs += [(f"top logprob of token {i}", v, float(eager[i])) for i, v in step.top]
    pairs += [(f"top-{n + 1} logprob", v, e) for n, ((_, v), e) in enumerate(zip(step.top, top_values))]
    worst = 0.0
    for what, got, want in pairs:
        error = abs(got - want)
        if not error <= tol:  # NaN fails too
            raise VerificationError(f"{pte} returns logprobs unlike the eager model at {_step_name(k)}: {what} "
                                    f"{got:.5g}, eager {want:.5g} (difference {error:.3g} > tolerance {tol:.3g})")
        worst = max(worst, error)
    return worst
