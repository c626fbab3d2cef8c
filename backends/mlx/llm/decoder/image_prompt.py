"""Images in a prompt: chat messages with image parts to token ids with each image's positions, and the images.

A message's content may be a list of parts, {"type": "text", "text": ...} and {"type": "image"} (the image in
the part's "image" key: a PIL image, a path or bytes; or, with no such key, the next of the `images` given
beside the messages). The chat template renders the parts (a vision-language template writes the image token
where an image part is), and each image token then becomes the positions one image takes, as the checkpoint's
processor expands it: DecoderMeta.image_tokens of them, a tiled family's tiles (tile_prompt.py), as many as
the image's size gives LLaVA-NeXT and LLaVA-OneVision (anyres.py; OneVision's also by the prompt's image
count), or Mistral 3's rows with their break tokens
(mistral3_vision.py). A family whose processor replaces the mark in the text (Gemma 3: DecoderMeta.image_text) has
it replaced there, before tokenizing.

    ids, images = image_chat_prompt(tokenizer, meta, messages)
"""

from __future__ import annotations

from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.vision.images import load_image  # noqa: F401 (callers take it from here with the prompt rules)
from backends.mlx.llm.decoder.prompt import ROLES_HINT, has_chat_template
from backends.mlx.llm.decoder import anyres, mistral3_vision
from backends.mlx.llm.decoder.tile_prompt import expand_tiles


def refuse_text_only(meta: DecoderMeta, pte) -> None:
    if not meta.takes_images:
        raise ValueError(f"{pte} takes no images: it was exported from a text-only model")


def _parts(messages, images: list) -> tuple[list[dict], list]:
    """The messages with image parts reduced to {"type": "image"}, and the images in prompt order."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    pending, found, clean = list(images), [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be {ROLES_HINT}")
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                if "image" in part:
                    found.append(load_image(part["image"]))
                elif pending:
                    found.append(load_image(pending.pop(0)))
                else:
                    raise ValueError(f"messages[{i}].content[{j}] is an image part without an image (give it "
                                     "in the part's 'image' key or in images=)")
                parts.append({"type": "image"})
            else:
                raise ValueError(f"messages[{i}].content[{j}] must be a text or an image part")
        clean.append({"role": message["role"], "content": parts})
    if pending:
        raise ValueError(f"{len(pending)} image(s) given beyond the messages' image parts")
    return clean, found


def expand_images(meta: DecoderMeta, ids: list[int], images: list) -> list[int]:
    """`ids` with each image token expanded to the positions one image takes (a tiled family's: the image's tiles,
    tile_prompt.py; LLaVA-NeXT's and LLaVA-OneVision's: by the image's size and the image count, anyres.py); the
    tokens must match the RGB images."""
    count = len(images)
    marks = sum(1 for t in ids if t == meta.image_token_id)
    if marks != count:
        raise ValueError(f"the prompt has {marks} image token(s) for {count} image(s)")
    packed = anyres.parse(meta.image_prompt)
    if packed is not None:
        family, prompt = packed
        sizes = iter([family.feature_count(prompt, image.height, image.width, count) for image in images])
        return [t for t0 in ids for t in ([t0] * next(sizes) if t0 == meta.image_token_id else [t0])]
    rows = mistral3_vision.parse(meta.image_prompt)
    if rows is not None:
        one = mistral3_vision.image_ids(rows, meta.image_token_id)
        return [t for t0 in ids for t in (one if t0 == meta.image_token_id else [t0])]
    if meta.image_prompt:
        return expand_tiles(meta.image_prompt, ids, images, meta.image_token_id)
    out = []
    for t in ids:
        out.extend([t] * meta.image_tokens if t == meta.image_token_id else [t])
    return out


def image_chat_prompt(tokenizer, meta: DecoderMeta, messages, images=()) -> tuple[list[int], list]:
    """(prompt ids with each image's positions, the RGB images in prompt order) of a chat with image parts."""
    if not has_chat_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template: give raw text instead")
    clean, found = _parts(messages, list(images))
    text = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
    if meta.image_text:
        return expand_image_text(meta, tokenizer, text, len(found)), found
    return expand_images(meta, list(tokenizer.encode(text, add_special_tokens=False)), found), found


def expand_image_text(meta: DecoderMeta, tokenizer, text: str, count: int) -> list[int]:
    """The ids of `text` with each image mark replaced by the image's full text (DecoderMeta.image_text)."""
    mark, before, token, after = meta.image_text
    marks = text.count(mark)
    if marks != count:
        raise ValueError(f"the prompt has {marks} image mark(s) {mark!r} for {count} image(s)")
    ids = list(tokenizer.encode(text.replace(mark, before + token * meta.image_tokens + after),
                                add_special_tokens=False))
    if ids.count(meta.image_token_id) != count * meta.image_tokens:
        raise ValueError(f"the prompt's text holds {ids.count(meta.image_token_id)} image positions; {count} "
                         f"image(s) take {count * meta.image_tokens}")
    return ids


def has_image_parts(messages) -> bool:
    return isinstance(messages, (list, tuple)) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in messages)
