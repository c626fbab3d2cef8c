"""`etmlx generate`: one prompt through the on-device decode loop, streaming text (flags as mlx_lm.generate
names them where they mean the same). A --draft-tokens program decodes speculatively (cli/draft_flags.py);
`--json` then adds "draft": {"proposed": P, "accepted": A, "calls": C}. Imports no exporter: see
tests/test_text_api.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from backends.mlx.cli.prompt_args import constraint_from_args, prompt_and_images


def pte_path(args) -> Path:
    pte = args.pte or args.model
    if not pte:
        raise ValueError("give the .pte to run (etmlx generate FILE.pte, or --model FILE.pte)")
    if args.pte and args.model and args.pte != args.model:
        raise ValueError(f"two programs given: {args.pte} and --model {args.model}")
    return Path(pte)


def run_generate(args, params) -> int:
    pte = pte_path(args)
    if not pte.is_file():  # before the decoder's imports (torch, ~2 s): a typo fails at once
        raise FileNotFoundError(f"{pte} does not exist")
    from backends.mlx.cli.ranks import rank_program, start_ranks

    ranks = rank_program(pte, args)
    if ranks and start_ranks(ranks, args):
        return 0
    pte = ranks.file if ranks else pte
    from backends.mlx.cli.draft_flags import speculation_from_args
    from backends.mlx.llm.decoder.speculation import load_decoder
    from backends.mlx.llm.decoder.text_generation import stream_text

    constraint = constraint_from_args(args)
    # a --draft-tokens program decodes speculatively: the same tokens
    decoder = load_decoder(pte, prefill_step_size=args.prefill_step_size)
    drafts = speculation_from_args(args, decoder)
    decoder.meta.adapter_index(args.adapter_name)  # an unknown adapter: one line, before decoding
    if constraint is not None:
        decoder.matcher(constraint)  # a bad schema / regex / grammar, or no mask input: one line, before decoding
    progress = ranks.progress() if ranks else None
    prompt, images = prompt_and_images(args, decoder)
    if args.stop and not decoder.has_tokenizer:
        decoder.tokenizer  # raises, naming the missing tokenizer: stop strings need text
    tokenizer = decoder.tokenizer if decoder.has_tokenizer else None
    tokens, logprobs, tops, text = [], [], [], []
    last = None
    for response in stream_text(decoder, prompt, args.max_tokens, params, args.stop, tokenizer, constraint,
                                speculation=drafts, images=images,
                                adapter=args.adapter_name):
        last = response
        tokens.append(response.token)
        if progress is not None:
            progress.say(str(response.token))
        if response.logprob is not None:
            logprobs.append(response.logprob)
            tops.append(response.top_logprobs)
        piece = response.text if tokenizer is not None else (
            "" if response.token in decoder.meta.eos_token_ids else f"{response.token} ")
        text.append(piece)
        if not args.json:
            print(piece, end="", flush=True)
    ttft = last.prompt_tokens / last.prompt_tps
    report = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens), "finish_reason": last.finish_reason,
              "time_to_first_token_s": round(ttft, 6), "prefill_tokens_per_s": round(last.prompt_tps, 2),
              "decode_tokens_per_s": round(last.generation_tps, 2)}
    if drafts is not None:
        report["draft"] = {"proposed": last.proposed_draft_tokens, "accepted": last.accepted_draft_tokens,
                           "calls": decoder.stats.calls}
    if args.json:
        out = {"tokens": tokens, **report}
        if tokenizer is not None:
            out["text"] = "".join(text)
        if decoder.meta.config.logprobs:
            out["logprobs"] = logprobs
            out["top_logprobs"] = [[{"id": i, "logprob": v} for i, v in top] for top in tops]
        print(json.dumps(out))
    else:
        print()
        print(f"[{len(prompt)} prompt tokens, {len(tokens)} generated, finish: {last.finish_reason}; "
              f"time to first token {ttft * 1000:.1f} ms, decode {last.generation_tps:.1f} tok/s{_drafts(report)}]",
              file=sys.stderr)
    return 0


def _drafts(report: dict) -> str:
    if "draft" not in report:
        return ""
    draft = report["draft"]
    return f"; drafts accepted {draft['accepted']}/{draft['proposed']} in {draft['calls']} calls"
