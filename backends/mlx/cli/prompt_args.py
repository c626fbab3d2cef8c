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


def prompt_and_images(args, decoder) -> tuple[list[int], list]:
    """prompt_ids, and the RGB images of --image (repeatable): through the chat template they come before the
    text, each as an image part; raw text (--ignore-chat-template) and --prompt-ids name each image's place
    with the image token (ids: its positions, as many as the program's image_tokens)."""
    paths = getattr(args, "image", None) or []
    if not paths:
        return prompt_ids(args, decoder), []
    from backends.mlx.llm.decoder.image_prompt import expand_images, image_chat_prompt, load_image, refuse_text_only
    from backends.mlx.llm.decoder.prompt import has_chat_template

    refuse_text_only(decoder.meta, decoder.pte)
    images = [read_image(path, load_image) for path in paths]
    if args.prompt_ids is not None:
        return prompt_ids(args, decoder), images
    tokenizer = decoder.tokenizer
    if not args.ignore_chat_template and has_chat_template(tokenizer):
        text = sys.stdin.read() if args.prompt == "-" else args.prompt
        system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
        parts = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": text}]
        return image_chat_prompt(tokenizer, decoder.meta, system + [{"role": "user", "content": parts}])
    return expand_images(decoder.meta, prompt_ids(args, decoder), images), images


def read_image(path, load_image):
    try:
        return load_image(Path(path))
    except ValueError as exc:
        raise ValueError(f"--image {path}: {exc}") from None


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
