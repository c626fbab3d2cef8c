"""`etmlx generate` on a draft-verifying program (`etmlx export --draft-tokens K`): the same output as the plain
loop, produced by speculative decoding (llm/decoder/speculative.py) with drafts from prompt lookup
(`--draft ngram`, the default) or a predicted output (`--prediction TEXT|@FILE`). `--json` adds
"draft": {"proposed": P, "accepted": A}."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def prediction_text(value: str) -> str:
    """--prediction TEXT, or @FILE for a file's contents."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise ValueError(f"--prediction: cannot read {value[1:]}: {exc.strerror}") from None


def draft_source(args, decoder):
    """The draft source the flags ask for (None: no drafts)."""
    from backends.mlx.llm.decoder.draft_sources import NgramDraft, PredictionDraft
    from backends.mlx.llm.decoder.prompt import encode_prompt

    if args.prediction is not None:
        if args.prompt_ids is not None:
            try:  # with token-id prompts, a prediction is token ids too
                return PredictionDraft([int(t) for t in args.prediction.split(",") if t.strip()])
            except ValueError:
                raise ValueError("--prediction with --prompt-ids must be comma-separated token ids") from None
        return PredictionDraft(encode_prompt(decoder.tokenizer, prediction_text(args.prediction)))
    return NgramDraft() if args.draft == "ngram" else None


def run_speculative(args, params, pte: Path) -> int:
    from backends.mlx.cli.prompt_args import constraint_from_args, prompt_ids
    from backends.mlx.llm.decoder.draft_sources import DraftBudget
    from backends.mlx.llm.decoder.speculative import SpeculativeDecoder

    if constraint_from_args(args) is not None:
        raise ValueError(f"{pte} verifies drafts, which structured output does not support yet: "
                         "export without --draft-tokens for --json-schema/--regex/--choice/--grammar")
    decoder = SpeculativeDecoder(pte)
    k = decoder.meta.draft_tokens if args.num_draft_tokens is None else args.num_draft_tokens
    if not 0 <= k <= decoder.meta.draft_tokens:
        raise ValueError(f"--num-draft-tokens must be 0..{decoder.meta.draft_tokens} (the program's --draft-tokens), "
                         f"got {k}")
    prompt = prompt_ids(args, decoder)
    source = draft_source(args, decoder)
    tokenizer = decoder.tokenizer if decoder.has_tokenizer else None
    if args.stop and tokenizer is None:
        decoder.tokenizer  # raises, naming the missing tokenizer: stop strings need text
    eos = set(decoder.meta.eos_token_ids)
    start = time.perf_counter()
    tokens, text, finish = [], "", "length"
    for token in decoder.stream(prompt, args.max_tokens, params, source if k else None, budget=DraftBudget(max(k, 1))):
        tokens.append(token)
        if token in eos:
            finish = "stop"
            break
        if tokenizer is not None:
            new_text = tokenizer.decode([t for t in tokens if t not in eos])
            hit = min((new_text.find(s) for s in args.stop or [] if s in new_text), default=-1)
            piece = (new_text if hit < 0 else new_text[:hit])[len(text):]
            text += piece
            if not args.json:
                print(piece, end="", flush=True)
            if hit >= 0:
                finish = "stop"
                break
        elif not args.json:
            print(f"{token} ", end="", flush=True)
    elapsed = time.perf_counter() - start
    first_time, first_tokens = decoder.first_call
    ttft = first_time - start if first_time else elapsed
    decode_tps = (len(tokens) - first_tokens) / max(elapsed - ttft, 1e-9) if len(tokens) > first_tokens else 0.0
    stats = decoder.stats
    report = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens), "finish_reason": finish,
              "time_to_first_token_s": round(ttft, 6), "decode_tokens_per_s": round(decode_tps, 2),
              "draft": {"proposed": stats.proposed, "accepted": stats.accepted, "calls": stats.calls}}
    if args.json:
        out = {"tokens": tokens, **report}
        if tokenizer is not None:
            out["text"] = text
        print(json.dumps(out))
    else:
        print()
        print(f"[{len(prompt)} prompt tokens, {len(tokens)} generated, finish: {finish}; drafts accepted "
              f"{stats.accepted}/{stats.proposed} in {stats.calls} calls; decode {decode_tps:.1f} tok/s]", file=sys.stderr)
    return 0
