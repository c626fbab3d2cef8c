"""LLaVA-OneVision in a vision-language program: LLaVA-NeXT's tiles and host packing (llava_next.py), plus two rules.

transformers' LlavaOnevisionModel differs from LLaVA-NeXT where this module does:
- anyres_max_N (config.vision_aspect_ratio): after unpadding, a grid picture of h x w patches with
  sqrt(h * w / (N * side^2)) > 1.1 is bilinearly interpolated (align_corners False) down to
  (int(h // ratio), int(w // ratio)) before the image_newline column is appended; `pack` does the same on the host.
- An image in a prompt with several images is not tiled (batch_num_images > 1): the processor pads it to a square
  of the mean colour and resizes it to one tile (llm/vision/preprocess.py), and its features are that tile's plus
  one image_newline vector. So how an image is encoded depends on the prompt's image count, `images` below.
The vision tower is usually SigLIP with every position kept ("full"); "default" drops the first, and either way a
tile must give side * side features, which `image_prompt` checks against the vision method's count.

    LlavaOnevisionVision(model)(pixels [N, C, S, S]) -> [N, side * side, D]
    pack(tile_features, (height, width), prompt, newline [D], images) -> [feature_count(..., images), D]
"""

from __future__ import annotations

import json
import math
import re

import torch
from torch import nn

from backends.mlx.llm.decoder import llava_next
from backends.mlx.llm.decoder.llava_next import NEWLINE_KEY, newline_from  # noqa: F401 (anyres.py reads them here)

KIND = MODEL_TYPE = "llava_onevision"
_ASPECT = re.compile(r"anyres_max_([1-9][0-9]*)")


def max_tiles(aspect_ratio) -> int:
    """N of "anyres_max_N": the grid picture holds about N tiles' patches before it is shrunk."""
    match = _ASPECT.fullmatch(aspect_ratio) if isinstance(aspect_ratio, str) else None
    if match is None:
        raise ValueError(f"llava_onevision: vision_aspect_ratio {aspect_ratio!r} is not supported (only "
                         "'anyres_max_N', N >= 1)")
    return int(match.group(1))


def check_config(config) -> None:
    """Refuse what pack_image_features would not pack as transformers does."""
    max_tiles(config.vision_aspect_ratio)
    if config.vision_feature_select_strategy not in ("default", "full"):
        raise ValueError(f"llava_onevision: vision_feature_select_strategy {config.vision_feature_select_strategy!r} "
                         "is not supported (only 'full' or 'default')")


class LlavaOnevisionVision(llava_next.LlavaNextVision):
    """One tile's projected features, as get_image_features computes them before packing."""

    @staticmethod
    def check(config) -> None:
        check_config(config)

    def reference(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """transformers' own get_image_features for one tile [1, C, S, S], as an image of a two-image prompt (one
        tile, not packed): its features, the image_newline after them left out."""
        side = self.model.config.vision_config.image_size
        out = self.model.model.get_image_features(pixel_values=pixel_values[:, None],
                                                  image_sizes=torch.tensor([[side, side]]),
                                                  batch_num_images=torch.tensor([2]))
        return out.pooler_output[0][None, :-1].float()


def image_prompt(model: nn.Module, processor: dict | None, tile_tokens: int) -> dict:
    """DecoderMeta.image_prompt of a LLaVA-OneVision program (JSON-able); `tile_tokens`: the vision method's
    features per tile."""
    config = model.config
    check_config(config)
    prompt = {**llava_next.image_prompt(model, processor), "kind": KIND,
              "max_tiles": max_tiles(config.vision_aspect_ratio)}
    if tile_tokens != prompt["side"] ** 2:
        raise ValueError(f"llava_onevision: the vision method gives {tile_tokens} features per tile, the packing "
                         f"takes {prompt['side']} x {prompt['side']} (vision_feature_select_strategy "
                         f"{config.vision_feature_select_strategy!r} with this vision tower)")
    outer = processor or {}
    if outer.get("vision_aspect_ratio") not in (None, config.vision_aspect_ratio):
        raise ValueError(f"llava_onevision: the processor's vision_aspect_ratio {outer['vision_aspect_ratio']!r} "
                         f"differs from the model config's {config.vision_aspect_ratio!r}")
    given = outer.get("num_image_tokens")
    if given is not None and given - (config.vision_feature_select_strategy == "default") != tile_tokens:
        raise ValueError(f"llava_onevision: the processor's num_image_tokens {given} does not match the vision "
                         f"tower's {tile_tokens} features per tile")
    return prompt


def tiled(images: int) -> bool:
    """Whether an image of a prompt with `images` images is cut into tiles (only when it is the only one)."""
    return images == 1


def tiles(prompt: dict, height: int, width: int, images: int = 1) -> int:
    """Vision calls an image takes: the base tile and the grid's when alone, else one."""
    return llava_next.tiles(prompt, height, width) if tiled(images) else 1


def _shrunk(prompt: dict, rows: int, cols: int) -> tuple[int, int] | None:
    """The size anyres_max_N interpolates a rows x cols grid picture down to; None where it is kept."""
    ratio = math.sqrt(rows * cols / (prompt["max_tiles"] * prompt["side"] ** 2))
    return (int(rows // ratio), int(cols // ratio)) if ratio > 1.1 else None


def feature_count(prompt: dict, height: int, width: int, images: int = 1) -> int:
    """The image positions an image of height x width takes in a prompt with `images` images."""
    base = prompt["side"] ** 2
    if not tiled(images):
        return base + 1
    ys, xs = llava_next.kept(prompt, height, width)
    rows, cols = ys.stop - ys.start, xs.stop - xs.start
    rows, cols = _shrunk(prompt, rows, cols) or (rows, cols)
    return base + rows * (cols + 1)


def pack(features: torch.Tensor, size: tuple[int, int], prompt: dict, newline: torch.Tensor,
         images: int = 1) -> torch.Tensor:
    """features [tiles(...), side * side, D] (base tile first, then the grid's row by row) to the image's [L, D]."""
    if not tiled(images):
        if features.shape[0] != 1:
            raise ValueError(f"llava_onevision: {features.shape[0]} tiles for an image of a several-image prompt "
                             "(one expected)")
        return torch.cat([features[0], newline.to(features)[None]])
    picture = llava_next.grid_picture(features, size, prompt)  # [H, W, D]
    target = _shrunk(prompt, *picture.shape[:2])
    if target is not None:  # as transformers: [1, D, H, W], bilinear, align_corners False
        channels = picture.permute(2, 0, 1).contiguous()[None]
        picture = nn.functional.interpolate(channels, list(target), mode="bilinear")[0].permute(1, 2, 0)
    return llava_next.with_newlines(features[0], picture, newline)


def verify_size(prompt: dict) -> tuple[int, int]:
    """An image size for the export check: the smallest pinpoint of more than one tile (else the smallest), narrowed
    by a quarter so unpadding drops columns."""
    tile = prompt["tile"]
    several = [p for p in prompt["pinpoints"] if p[0] * p[1] > tile * tile] or prompt["pinpoints"]
    height, width = min(several, key=lambda p: p[0] * p[1])
    return height, max(1, width * 3 // 4)


def parse(prompt_json: str) -> dict | None:
    """DecoderMeta.image_prompt as a LLaVA-OneVision prompt; None for another kind."""
    prompt = json.loads(prompt_json) if prompt_json else {}
    return prompt if prompt.get("kind") == KIND else None
