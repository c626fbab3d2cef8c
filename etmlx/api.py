"""load / generate / stream_generate, as mlx-lm spells them, over an exported decoder .pte.

A prompt is text (tokenized as the tokenizer's own template frames it: see llm/decoder/prompt.py),
a list of chat messages ({"role", "content"}: rendered by the chat template), or a list of token ids.
A vision-language program takes images: message content parts {"type": "image", "image": PIL image | path |
bytes}, or {"type": "image"} parts filled in order from `images=[...]` (with text or ids, `images=` fills the
prompt's image tokens); llm/decoder/image_prompt.py.
Sampling options are SamplingParams' fields (temperature, seed, top_k, top_p, min_p, the penalties,
logit_bias); the defaults are off, so the default is greedy decoding.

A program exported with --draft-tokens K loads as a SpeculativeDecoder and decodes speculatively, with the
plain program's tokens: drafts from prompt lookup by default, `prediction=` (Predicted Outputs: the expected
output, text or token ids), `draft="none"`, `draft_model=` (a small plain .pte with the same vocabulary, or a
DraftModel to keep its cache between calls) and `num_draft_tokens=` (at most K) as `etmlx generate` takes them
(llm/decoder/speculation.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

from backends.mlx.llm.decoder.image_prompt import (expand_images, has_image_parts, image_chat_prompt, load_image,
                                                   refuse_text_only)
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.prompt import chat_prompt, encode_prompt
from backends.mlx.llm.decoder.speculation import load_decoder, speculation
from backends.mlx.llm.decoder.speculative import SpeculativeDecoder
from backends.mlx.llm.sampler.params import SamplingParams
from backends.mlx.llm.decoder.text_generation import Response, stream_text

DEFAULT_MAX_TOKENS = 256  # as mlx-lm; capped by what the program's cache has room for

__all__ = ["PromptCache", "Response", "generate", "load", "load_prompt_cache", "make_prompt_cache", "save_prompt_cache",
           "stream_generate"]


Model = Decoder | SpeculativeDecoder  # what load returns: the plain loop, or the loop of a --draft-tokens program


def load(path: str | Path) -> Model:
    """The program at `path` (a .pte from `etmlx export`), ready to generate; `.tokenizer` is its tokenizer."""
    return load_decoder(Path(path))


def _check_model(model) -> None:
    if not isinstance(model, (Decoder, SpeculativeDecoder)):
        raise TypeError(f"model must be what etmlx.load returns, got {type(model).__name__}")


class PromptCache:
    """A conversation kept in the program's KV cache, as mlx-lm's prompt_cache: pass it to every
    stream_generate / generate of the conversation with only the new part as the prompt; it holds the
    tokens so far (prompts and replies), and each call prefills only what its row does not hold yet.

    The keys and values themselves live in the program's state on the device (row_caches.py);
    save_prompt_cache writes them with the tokens to a file, and load_prompt_cache puts them back into a
    row of the same program (llm/decoder/cache_file.py)."""

    def __init__(self, model: Model):
        _check_model(model)
        self.model = model
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)


def make_prompt_cache(model: Model) -> PromptCache:
    """An empty conversation for `model` (mlx-lm's make_prompt_cache)."""
    return PromptCache(model)


def save_prompt_cache(file_name: str | Path, cache: PromptCache, metadata: dict[str, str] | None = None) -> None:
    """Write the conversation in `cache` to `file_name` (safetensors): its tokens, the KV entries its row holds,
    and the program's identity; `metadata` (str -> str) goes along (mlx-lm's save_prompt_cache)."""
    from backends.mlx.llm.decoder import cache_file

    if not isinstance(cache, PromptCache):
        raise TypeError(f"cache must be a PromptCache (make_prompt_cache), got {type(cache).__name__}")
    cache_file.save(file_name, cache.model, cache.tokens, metadata)


def load_prompt_cache(file_name: str | Path, model: Model, return_metadata: bool = False):
    """The conversation saved in `file_name`, restored into a row of `model` (the program it was saved from; another
    is a one-line ValueError): the next stream_generate with it prefills only the new prompt. With
    `return_metadata`, (cache, metadata) as mlx-lm's load_prompt_cache."""
    from backends.mlx.llm.decoder import cache_file

    _check_model(model)
    tokens, _, metadata = cache_file.load(file_name, model)
    cache = PromptCache(model)
    cache.tokens = tokens
    return (cache, metadata) if return_metadata else cache


def _prompt_ids(model: Model, prompt) -> list[int]:
    if isinstance(prompt, str):
        return encode_prompt(model.tokenizer, prompt)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        return chat_prompt(model.tokenizer, prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise TypeError("prompt must be text, a list of chat messages ({'role', 'content'}) or a list of token ids")


def _prompt_and_images(model: Model, prompt, images) -> tuple[list[int], list]:
    """The prompt ids with each image's positions, and the RGB images in prompt order."""
    images = list(images or ())
    chat = isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt)
    if not images and not (chat and has_image_parts(prompt)):
        return _prompt_ids(model, prompt), []
    refuse_text_only(model.meta, getattr(model, "pte", "the program"))
    if chat:
        return image_chat_prompt(model.tokenizer, model.meta, prompt, images)
    ids, images = _prompt_ids(model, prompt), [load_image(image) for image in images]
    if isinstance(prompt, str):  # text names each image once (the image token); ids hold their positions already
        ids = expand_images(model.meta, ids, images)
    return ids, images


def _params(sampling: dict) -> SamplingParams:
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(sampling) - known)
    if unknown:
        raise TypeError(f"unknown sampling option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return SamplingParams(**sampling)


def stream_generate(model: Model, prompt, max_tokens: int | None = None, *, stop=(),
                    prompt_cache: PromptCache | None = None, prediction=None, draft: str | None = None,
                    num_draft_tokens: int | None = None, draft_model=None, images=None, adapter: str | None = None,
                    **sampling) -> Iterator[Response]:
    """Yield a Response per generated token: `.text` (the new piece of text), `.token`, `.logprobs`
    (token id -> logprob, when the program was exported with --logprobs N), `.finish_reason` (on the last:
    "stop" or "length"), and prompt/generation token counts and rates. With `prompt_cache`, `prompt` is
    what follows the conversation so far, and `.cached_tokens` says how much of it was not prefilled.
    On a --draft-tokens program: `prediction` (text or token ids), `draft` ("ngram", the default, or "none"),
    `draft_model` (a plain .pte path, or a DraftModel) and `num_draft_tokens` choose the drafts, and `.proposed_draft_tokens` / `.accepted_draft_tokens` count
    them so far; on a plain program they are a ValueError. `images`: a vision-language program's images (PIL
    images, paths or bytes) for the prompt's image parts without one (see the module's docstring). `adapter`: the name of
    one of the program's switchable LoRA adapters (`etmlx export --adapters`); None, the base model."""
    _check_model(model)
    if adapter is not None:
        model.meta.adapter_index(adapter)  # an unknown name fails here, not at the first token
    if prompt_cache is not None and (not isinstance(prompt_cache, PromptCache) or prompt_cache.model is not model):
        raise TypeError("prompt_cache must be make_prompt_cache(model) of this same model")
    drafts = speculation(model, prediction, draft, num_draft_tokens, draft_model=draft_model)
    ids, pictures = _prompt_and_images(model, prompt, images)
    if prompt_cache is not None:
        if model.meta.takes_images and model.meta.image_token_id in prompt_cache.tokens:
            raise ValueError("this prompt_cache conversation holds an image from an earlier turn: continue it "
                             "without the cache, giving the whole conversation and its images")
        ids = prompt_cache.tokens + ids
    params = _params(sampling)
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, model.meta.max_seq_len - len(ids)))
    tokenizer = model.tokenizer if model.has_tokenizer else None
    responses = stream_text(model, ids, max_tokens, params, stop, tokenizer, reuse=prompt_cache is not None,
                            speculation=drafts, images=pictures, adapter=adapter)
    return responses if prompt_cache is None else _recorded(responses, ids, prompt_cache)


def _recorded(responses: Iterator[Response], ids: list[int], cache: PromptCache) -> Iterator[Response]:
    """The responses, with the conversation's tokens kept in `cache` as they come (also when left early)."""
    generated = []
    try:
        for response in responses:
            generated.append(response.token)
            yield response
    finally:
        cache.tokens = ids + generated


def generate(model: Model, prompt, max_tokens: int | None = None, *, verbose: bool = False, stop=(),
             tools=None, tool_choice="auto", parallel_tool_calls: bool = True, **options):
    """The whole generated text; with verbose, also streamed to stdout followed by the counts and rates.
    `options`: stream_generate's (prompt_cache, the draft options, sampling).

    With `tools` (OpenAI's list of {"type": "function", "function": {...}}), `prompt` is the chat messages (they
    may hold earlier calls and `tool` results) and the answer is a ToolReply: `.content`, `.tool_calls` (parsed:
    `.name`, `.arguments` as a dict), `.finish_reason`, and `.message()` to append to the conversation.
    `tool_choice`: "auto", "required", "none" or a function's name; on a program exported with the mask input the
    calls are constrained to parse and match each function's parameters schema (llm/decoder/tool_calls.py)."""
    if tools is not None:
        return _tool_reply(model, prompt, max_tokens, stop, tools, tool_choice, parallel_tool_calls, verbose,
                           options)
    pieces, last = [], None
    for last in stream_generate(model, prompt, max_tokens, stop=stop, **options):
        pieces.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print()
        print("=" * 10)
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
        if isinstance(model, SpeculativeDecoder):
            print(f"Drafts: {last.accepted_draft_tokens} of {last.proposed_draft_tokens} accepted")
    return "".join(pieces)


def _tool_reply(model, messages, max_tokens, stop, tools, tool_choice, parallel, verbose, options):
    from backends.mlx.llm.decoder.tool_calls import ToolRequest, parse_tools, tool_format
    from backends.mlx.llm.decoder.tool_turn import tool_turn

    _check_model(model)
    if options.get("prompt_cache") is not None or any(options.get(k) is not None for k in
                                                      ("prediction", "draft", "num_draft_tokens", "draft_model")):
        raise ValueError("generate(tools=...) takes the conversation whole: no prompt_cache or draft options")
    sampling = {k: v for k, v in options.items() if k not in ("prompt_cache", "prediction", "draft",
                                                              "num_draft_tokens", "draft_model", "adapter")}
    adapter = options.get("adapter")
    if adapter is not None:
        model.meta.adapter_index(adapter)
    if not isinstance(tool_choice, str):
        raise TypeError("tool_choice must be 'auto', 'required', 'none' or a function's name")
    choice, name = (tool_choice, None) if tool_choice in ("auto", "required", "none") else ("function", tool_choice)
    request = ToolRequest(parse_tools(tools), choice, name, bool(parallel),
                          tool_format(model.meta, model.tokenizer))
    show = (lambda piece: print(piece, end="", flush=True)) if verbose else None
    reply, _, _ = tool_turn(model, messages, request, max_tokens or DEFAULT_MAX_TOKENS, _params(sampling), stop,
                            on_text=show, adapter=adapter)
    if verbose:
        for call in reply.tool_calls:
            print(f"\n[tool call] {call.name}({call.arguments_json})", flush=True)
        print()
    return reply
