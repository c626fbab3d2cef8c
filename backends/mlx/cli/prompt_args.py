"""What `etmlx generate` (plain and speculative) reads from its flags: the prompt's token ids and the
structured-output constraint."""

from __future__ import annotations

import sys
from pathlib import Path


def prompt_ids(args, decoder) -> list[int]:
    """--prompt-ids as given; --prompt text through the chat template (the default when the tokenizer has
    one) or, with --ignore-chat-template, as raw text."""
    from backends.mlx.llm.decoder.prompt import chat_prompt, encode_prompt, has_chat_template, user_messages

    if args.prompt_ids is not None:
        if args.system_prompt is not None:
            raise ValueError("--system-prompt needs a text --prompt (token ids are used as they are)")
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    tokenizer = decoder.tokenizer  # raises, naming the missing tokenizer
    if not args.ignore_chat_template and has_chat_template(tokenizer):
        return chat_prompt(tokenizer, user_messages(text, args.system_prompt))
    if args.system_prompt is not None:
        why = "--ignore-chat-template was given" if args.ignore_chat_template else "the tokenizer has none"
        raise ValueError(f"--system-prompt needs the chat template, and {why}")
    return encode_prompt(tokenizer, text)


def constraint_from_args(args):
    """--json-schema FILE | --regex R | --choice a,b,c | --grammar FILE as a Constraint (None: unconstrained)."""
    from backends.mlx.llm.decoder.constraints import Constraint

    def read(flag, path):
        try:
            return Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None

    if getattr(args, "json_schema", None):
        return Constraint("json_schema", read("--json-schema", args.json_schema))
    if getattr(args, "regex", None):
        return Constraint("regex", args.regex)
    if getattr(args, "choice", None):
        return Constraint("choice", [c for c in args.choice.split(",") if c])
    if getattr(args, "grammar", None):
        return Constraint("grammar", read("--grammar", args.grammar))
    return None
