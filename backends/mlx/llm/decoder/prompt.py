"""Text to prompt token ids: the one rule every path uses (`etmlx generate` and `etmlx chat`, the Python
API, /v1/completions, /v1/chat/completions, LMTP GENERATE with a text prompt).

Raw text is framed as the tokenizer's own post-processor says, i.e. what `tokenizer(text)` gives: a
Llama-style tokenizer puts BOS in front, a GPT-2-style one adds nothing. Text that already starts with
BOS gets no second one (as mlx-lm infers it). A chat is rendered by the tokenizer's chat template with
the generation prompt appended; the template writes its own BOS, so the rendered text is tokenized
without special tokens (as transformers' apply_chat_template(tokenize=True) and mlx-lm do).
"""

from __future__ import annotations

ROLES_HINT = "an object with a string 'role' and a string 'content'"


def encode_prompt(tokenizer, text: str) -> list[int]:
    if not isinstance(text, str):
        raise TypeError(f"the prompt text must be a string, got {type(text).__name__}")
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_messages(messages) -> list[dict]:
    """Messages as {"role", "content"} dicts with string content (OpenAI's text content parts joined)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be {ROLES_HINT}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text exists for these models
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        clean.append({"role": message["role"], "content": content})
    return clean


def chat_text(tokenizer, messages) -> str:
    """The chat template's rendering of `messages`, ending with the assistant's generation prompt."""
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template: give raw text instead")
    return tokenizer.apply_chat_template(check_messages(messages), add_generation_prompt=True, tokenize=False)


def chat_prompt(tokenizer, messages) -> list[int]:
    return list(tokenizer.encode(chat_text(tokenizer, messages), add_special_tokens=False))


def user_messages(text: str, system_prompt: str | None = None) -> list[dict]:
    """A one-turn chat: the optional system prompt, then `text` as the user's message."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return system + [{"role": "user", "content": text}]
