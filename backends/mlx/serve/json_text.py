"""Client JSON (HTTP bodies, LMTP lines) parsed with one clear message for each way it can be wrong."""

from __future__ import annotations

import json


def parse_json_text(text: str, what: str, error: type[Exception]):
    """json.loads for text a client sent. Malformed JSON, nesting too deep for the parser (a
    RecursionError, which is a RuntimeError and would otherwise read as a server failure) and a lone
    surrogate escape ("\\ud800": not text any tokenizer takes) raise `error(message)` naming which."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON ({exc})") from None
    except RecursionError:
        raise error(f"{what} is nested too deeply to be a request") from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(exc.object[exc.start])
        raise error(f"{what} holds a lone surrogate (\\u{code:04x}): not valid Unicode text") from None
    return value
