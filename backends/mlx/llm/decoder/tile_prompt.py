"""An Idefics3 / SmolVLM image's place in the prompt: its tiles, each a marker and image_seq_len image positions.

The processor writes, for an image cut into rows x cols tiles (llm/vision/preprocess.py),
    per row r, per column c: <fake_token_around_image><row_r_col_c><image> x image_seq_len; "\\n" after each row;
    then "\\n<fake_token_around_image><global-img>" <image> x image_seq_len "<fake_token_around_image>"
and for an image that is not split (small, or do_image_splitting off) only the global part without the newline.
Every piece between two special tokens is tokenized on its own, so the pieces' ids, taken from the tokenizer at
export (`tile_prompt`, stored as DecoderMeta.image_prompt with the image processor's settings), joined in that
order equal the processor's ids; `expand_tiles` does that per image at run time, without the tokenizer.

Tiles per image: rows and cols are at most ceil(size.longest_edge / max_image_size.longest_edge) each (the
longest side is resized to size.longest_edge first), so an image takes at most that squared plus one tiles; the
program's max_seq_len bounds the prompt as for any other.
"""

from __future__ import annotations

import json
import math

from backends.mlx.llm.vision.preprocess import DEFAULTS, preprocess, processor_type

KIND = "idefics3_tiles"
FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"


def _settings(processor: dict) -> dict:
    processor = processor.get("image_processor", processor)  # processor_config.json nests it
    return {**DEFAULTS[processor_type(processor)], **processor}


def tile_size(processor: dict) -> int:
    """The side of the processor's tiles."""
    return _settings(processor)["max_image_size"]["longest_edge"]


def max_grid(processor: dict) -> int:
    """The most tile rows (or columns) the processor cuts an image into."""
    return math.ceil(_settings(processor)["size"]["longest_edge"] / tile_size(processor))


def tile_prompt(tokenizer, processor: dict, image_seq_len: int) -> dict:
    """DecoderMeta.image_prompt of an Idefics3 / SmolVLM program: the pieces' ids and the processor's settings."""
    def ids(text):
        return list(tokenizer.encode(text, add_special_tokens=False))

    grid = max_grid(processor)
    missing = [t for t in (FAKE, GLOBAL) if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise ValueError(f"the tokenizer lacks the image prompt's token {missing[0]}")
    return {"kind": KIND, "image_seq_len": image_seq_len, "processor": processor,
            "fake": ids(FAKE), "global": ids(GLOBAL), "row_end": ids("\n"), "global_start": ids("\n\n"),
            "tiles": {f"{r},{c}": ids(f"<row_{r}_col_{c}>") for r in range(1, grid + 1) for c in range(1, grid + 1)}}


def image_ids(prompt: dict, rows: int, cols: int, image_token_id: int) -> list[int]:
    """One image's prompt ids for a rows x cols split (0, 0: not split)."""
    image = [image_token_id] * prompt["image_seq_len"]
    whole = prompt["fake"] + prompt["global"] + image + prompt["fake"]
    if rows == 0 and cols == 0:
        return whole
    out = []
    for r in range(1, rows + 1):
        for c in range(1, cols + 1):
            out += prompt["fake"] + prompt["tiles"][f"{r},{c}"] + image
        if r < rows:
            out += prompt["row_end"]
    # the last row's "\n" and the whole image's "\n" are one piece
    return out + prompt["global_start"] + whole


def expand_tiles(prompt_json: str, ids: list[int], images: list, image_token_id: int) -> list[int]:
    """`ids` with each image token (one per image, in order) replaced by that image's tiles' ids; `prompt_json`
    DecoderMeta.image_prompt."""
    prompt = json.loads(prompt_json)
    if prompt.get("kind") != KIND:
        raise ValueError(f"this program's image prompt {prompt.get('kind')!r} is not known: upgrade etmlx")
    out, n = [], 0
    for t in ids:
        if t != image_token_id:
            out.append(t)
            continue
        extras = preprocess([images[n]], prompt["processor"]).extras
        out += image_ids(prompt, int(extras["rows"][0, 0]), int(extras["cols"][0, 0]), image_token_id)
        n += 1
    return out
