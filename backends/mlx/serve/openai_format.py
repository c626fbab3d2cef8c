"""OpenAI response bodies and stream chunks for completions and chat completions."""

from __future__ import annotations

import json
import time
import uuid

from backends.mlx.serve.engine import TokenEvent


class TokenText:
    """Text of single token ids, for logprob entries (cached: the same ids recur)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.cache.get(token)
        if text is None:
            text = (self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                    if self.tokenizer is not None else str(token))
            self.cache[token] = text
        return text


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_logprobs(tokens: list[TokenEvent], top: int, text: TokenText) -> dict:
    def entry(token, logprob):
        s = text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob),
                         "top_logprobs": [entry(i, lp) for i, lp in (t.top or [])[:top]]} for t in tokens]}


def completion_logprobs(tokens: list[TokenEvent], top: int, text: TokenText, offset: int = 0) -> dict:
    offsets, strings = [], []
    for t in tokens:
        offsets.append(offset)
        strings.append(text(t.token))
        offset += len(strings[-1])
    def alternatives(t):
        best = {}  # keyed by text: of ids with the same text (e.g. partial characters) keep the likeliest
        for i, lp in (t.top or [])[:top]:
            best.setdefault(text(i), lp)
        return best

    return {"tokens": strings, "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [alternatives(t) for t in tokens], "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          prediction: tuple[int, int] | None = None) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens the prompt cache supplied (not computed again);
    prediction: (accepted, rejected) drafted tokens of a request that sent a `prediction`."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if prediction is not None:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                            "rejected_prediction_tokens": prediction[1]}
    return out


def envelope(kind: str, request_id: str, model: str, choices: list, **extra) -> dict:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            **extra}


def sse(data) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


DONE = b"data: [DONE]\n\n"
