"""OpenAI request bodies (completions and chat completions) to a checked generation job.

Every value is checked here, so a bad request gets a 400 naming the parameter before anything is
queued. The sampler parameters are the knobs of llm/sampler/knobs.py (names, ranges, "exported
without it" messages); extensions beyond OpenAI's set, as vLLM names them: top_k, min_p,
repetition_penalty.
Seeds: choice i of a request with seed s draws with s + i * max_seq_len + step, so the choices of
one request never share a draw and the same request repeats exactly. Without a seed the server
picks one at random.
"""

from __future__ import annotations

import dataclasses
import math

import jinja2
import random
from dataclasses import dataclass, field

from backends.mlx.llm.decoder import prompt as prompt_rules
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.decoder.tool_calls import ToolRequest
from backends.mlx.llm.decoder.image_prompt import image_chat_prompt
from backends.mlx.llm.decoder.tool_prompt import tool_chat_prompt
from backends.mlx.llm.sampler.knobs import SEED_LIMIT, USER_KNOBS, Knob, KnobError
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.serve.api_errors import ApiError

MAX_N = 16
MAX_STOPS = 4
# OpenAI fields this server does not implement: a 400 naming the field rather than silently
# ignoring it (a client relying on them would get a different answer than it asked for).
UNSUPPORTED = ("best_of", "echo", "suffix")


def check_unsupported(body: dict) -> None:
    harmless = {"best_of": 1}  # the values that ask for nothing beyond plain decoding
    for name in UNSUPPORTED:
        value = body.get(name)
        if value is None or value is False or value == [] or value == harmless.get(name):
            continue
        raise ApiError(f"'{name}' is not supported by this server", param=name)


def prompt_text_bytes(body: dict, chat: bool) -> int:
    """The UTF-8 size of a request's prompt text (what tokenizing costs), before any tokenizing.
    A lone surrogate (invalid Unicode) is a 400 naming the parameter."""
    if chat:
        messages = body.get("messages")
        texts = [m.get("content") for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        texts = [p.get("text") if isinstance(p, dict) else p for t in texts
                 for p in (t if isinstance(t, list) else [t])]
    else:
        prompt = body.get("prompt")
        texts = prompt if isinstance(prompt, list) else [prompt]
    total = 0
    for text in texts:
        if isinstance(text, str):
            try:
                total += len(text.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise ApiError(f"the {'messages' if chat else 'prompt'} text is not valid Unicode (a lone surrogate "
                               f"at character {exc.start})", param="messages" if chat else "prompt") from None
    return total


@dataclass
class Job:
    prompt: list[int]
    choices: list[SamplingParams]  # one per choice (n)
    max_tokens: int
    stops: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k: chosen token's logprob and k alternatives
    stream: bool = False
    include_usage: bool = False
    prediction: list[int] | None = None  # Predicted Outputs: the expected output's tokens (draft programs' drafts)
    images: list = field(default_factory=list)  # the chat's images (PIL, RGB), in prompt order (image_parts.py)


def _number(body: dict, name: str, default, low=None, high=None, *, integer=False, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int,) if integer else (int, float)):
        raise ApiError(f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(f"'{name}' must be finite, got {value!r}", param=name)
    if low is not None and (value <= low if low_open else value < low) or high is not None and value > high:
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise ApiError(f"'{name}' must be in {bounds}, got {value!r}", param=name)
    return value


def _flag(body: dict, name: str, default=False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"'{name}' must be a boolean, got {value!r}", param=name)
    return value


def check_model(body: dict, model_name: str, meta: DecoderMeta) -> int:
    """The request's adapter index (0: the base model): a switchable adapter is named as "model": "BASE:NAME"
    or with an "adapter": "NAME" field (both: the same name)."""
    model, field = body.get("model"), body.get("adapter")
    name = None
    if isinstance(model, str) and model.startswith(model_name + ":") and meta.adapters:
        name = model[len(model_name) + 1:]
    elif model is not None and model != model_name:
        raise ApiError(f"The model '{model}' does not exist; this server serves '{model_name}'", status=404,
                       param="model", code="model_not_found")
    if field is not None:
        if not isinstance(field, str):
            raise ApiError(f"'adapter' must be a string (an adapter's name), got {field!r}", param="adapter")
        if name is not None and field != name:
            raise ApiError(f"'adapter' is {field!r} but 'model' names adapter {name!r}", param="adapter")
        name = field
    try:
        return meta.adapter_index(name)
    except ValueError as exc:
        raise ApiError(str(exc), param="adapter" if field is not None else "model") from None


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError("'stop' must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    return stops


def _knob(body: dict, knob: Knob):
    """The request's value for one knob of the table, before SamplingParams checks its range.

    OpenAI's own rules on top of the table: numbers must be finite, a knob may have a tighter
    upper bound (temperature <= 2), a default of its own (temperature 1) and values below its
    range that mean off (top_k -1, as vLLM)."""
    name, value = knob.name, body.get(knob.name)
    if value is None and knob.width:
        return {}
    if value is None:
        return knob.off if knob.openai_default is None else knob.openai_default
    if knob.width:  # token id -> value: JSON keys are strings
        if not isinstance(value, dict):
            raise ApiError(f"'{name}' must be an object of token id -> value", param=name)
        try:
            return {int(key): v for key, v in value.items()}
        except (TypeError, ValueError):
            raise ApiError(f"'{name}' keys must be token ids", param=name) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(f"'{name}' must be finite, got {value!r}", param=name)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if knob.openai_low is not None and value < knob.low:
            if value < knob.openai_low:
                raise ApiError(f"'{name}' must be {knob.range_text(low=knob.openai_low)}, got {value!r}", param=name)
            return knob.off
        if knob.openai_high is not None and value > knob.openai_high:
            raise ApiError(f"'{name}' must be {knob.range_text(high=knob.openai_high)}, got {value!r}", param=name)
    return value


def _choice_seed(seed: int, offset: int) -> int:
    """seed + offset, wrapped into the seed range (only seeds within `offset` of its ends move)."""
    return (seed + offset + SEED_LIMIT) % (2 * SEED_LIMIT + 1) - SEED_LIMIT


def _prompt_budget(meta: DecoderMeta, prompt: list[int], body: dict, names) -> int:
    if len(prompt) >= meta.max_seq_len:
        raise ApiError(f"This model's maximum context length is {meta.max_seq_len} tokens; the prompt has "
                       f"{len(prompt)} tokens and leaves no room to generate", param="messages" if "messages" in body
                       else "prompt", code="context_length_exceeded")
    room = meta.max_seq_len - len(prompt)
    for name in names:
        if body.get(name) is not None:
            max_tokens = _number(body, name, None, 1, None, integer=True)
            if max_tokens > room:
                raise ApiError(f"This model's maximum context length is {meta.max_seq_len} tokens; the prompt "
                               f"({len(prompt)} tokens) plus '{name}' ({max_tokens}) exceeds it", param=name,
                               code="context_length_exceeded")
            return max_tokens
    return room


def build_job(body: dict, meta: DecoderMeta, prompt: list[int], *, chat: bool) -> Job:
    """The sampling part, common to both endpoints; `prompt` is already tokenized."""
    config = meta.config
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    if chat:
        want = _flag(body, "logprobs")
        top = _number(body, "top_logprobs", None, 0, 20, integer=True)
        if top is not None and not want:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (top or 0) if want else None
        param = "top_logprobs"
    else:
        logprobs = _number(body, "logprobs", None, 0, 5, integer=True)
        param = "logprobs"
    if logprobs is not None:
        if not config.logprobs:
            raise ApiError("logprobs are not available: this .pte was exported without them (export with "
                           "--logprobs N)", param="logprobs")
        if logprobs > config.logprobs:
            raise ApiError(f"'{param}' is {logprobs} but this .pte returns at most {config.logprobs} alternatives",
                           param=param)
    values = {knob.name: _knob(body, knob) for knob in USER_KNOBS}
    if body.get("seed") is None:
        values["seed"] = random.getrandbits(31)
    try:
        base = SamplingParams(**values)  # the one range check
        base.check(config, meta.vocab_size)
    except KnobError as exc:
        raise ApiError(str(exc), param=exc.knob) from None
    choices = [dataclasses.replace(base, seed=_choice_seed(base.seed, i * meta.max_seq_len)) for i in range(n)]
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    return Job(prompt=prompt, choices=choices, max_tokens=_prompt_budget(meta, prompt, body, names),
               stops=_stops(body), logprobs=logprobs, stream=_flag(body, "stream"),
               include_usage=bool((stream_options or {}).get("include_usage", False)))


def chat_prompt(body: dict, tokenizer, tools: ToolRequest | None = None, meta: DecoderMeta | None = None,
                images=()) -> list[int]:
    """The chat's prompt ids; with `tools` (serve/tool_params.py), the tools and earlier calls and results rendered
    in the program's tool-call format (llm/decoder/tool_prompt.py). `images`: the RGB images of the messages'
    {"type": "image"} parts (serve/image_parts.py), each expanded to its positions (llm/decoder/image_prompt.py)."""
    if tokenizer is None:
        raise ApiError("chat needs a tokenizer and this .pte has none", param="messages")
    if not prompt_rules.has_chat_template(tokenizer):
        raise ApiError("this model's tokenizer has no chat template: use /v1/completions", param="messages")
    try:
        if images:
            if tools is not None:
                raise ValueError("tools with images are not supported")
            return image_chat_prompt(tokenizer, meta, body.get("messages"), images)[0]
        if tools is not None:
            return tool_chat_prompt(tokenizer, body.get("messages"), tools.tools, tools.fmt)
        return prompt_rules.chat_prompt(tokenizer, body.get("messages"))
    except (ValueError, TypeError) as exc:
        raise ApiError(str(exc).replace("messages must", "'messages' must", 1), param="messages") from None
    except jinja2.TemplateError as exc:  # the template itself refuses them (e.g. a role it does not know)
        raise ApiError(f"the model's chat template rejected the messages: {exc}", param="messages") from None


def completion_prompt(body: dict, tokenizer, meta: DecoderMeta) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError("this .pte has no tokenizer: send the prompt as token ids", param="prompt")
        ids = prompt_rules.encode_prompt(tokenizer, prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        if any(not 0 <= t < meta.vocab_size for t in ids):
            raise ApiError(f"prompt token ids must be in [0, {meta.vocab_size})", param="prompt")
    else:
        raise ApiError("'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")
    if not ids:
        raise ApiError("the prompt is empty", param="prompt")
    return ids


def prediction_text(body: dict) -> str | None:
    """OpenAI's Predicted Outputs field: {"type": "content", "content": TEXT or [{"type": "text", "text": TEXT},
    ...]} -> the predicted text (parts joined), or None without one; a bad shape is a 400 naming `prediction`."""
    prediction = body.get("prediction")
    if prediction is None:
        return None
    shape = ("'prediction' must be {\"type\": \"content\", \"content\": a string or a list of "
             "{\"type\": \"text\", \"text\": a string}}")
    if not isinstance(prediction, dict) or prediction.get("type") != "content" or set(prediction) - {"type", "content"}:
        raise ApiError(shape, param="prediction")
    content = prediction.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"}
                                         and isinstance(p["text"], str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(shape, param="prediction")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(f"the prediction text is not valid Unicode (a lone surrogate at character {exc.start})",
                       param="prediction") from None
    return content


def prediction_tokens(text: str, tokenizer, meta: DecoderMeta) -> list[int]:
    """The predicted text's token ids (no special tokens: it continues the output, not a new sequence), cut to
    the first 2 x max_seq_len (an output never holds more, and re-aligning (draft_sources.py) scans the
    prediction on the engine thread: an endless one would slow every row) and before any id the model has no
    embedding for (a tokenizer with more tokens than the model). Drafts only change speed, so cutting is safe."""
    if tokenizer is None:
        raise ApiError("'prediction' needs a tokenizer and this .pte has none", param="prediction")
    tokens = list(tokenizer.encode(text, add_special_tokens=False))[:2 * meta.max_seq_len]
    return tokens[:next((i for i, t in enumerate(tokens) if not 0 <= t < meta.vocab_size), len(tokens))]
