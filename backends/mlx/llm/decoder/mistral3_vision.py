"""Mistral 3 (Mistral3ForConditionalGeneration, a Pixtral tower): its vision method at one image size, and how its
prompts lay an image out.

The Pixtral tower takes an image at its own size (sides multiples of patch x merge, the longest at most the image
processor's longest_edge), with 2-D rotary positions per patch; the projector merges merge x merge patches into one
token. A program is exported for one size: the one the processor gives a PROBE_SIDE square image (448 x 448 when
longest_edge allows it); any other image is resized to it first (aspect ratio not kept), as for Qwen2-VL. With one
image of a fixed size the tower's block mask is all-visible, its rotary angles and the merger's patch grouping are
constants: the blocks run here over the tower's own modules.

In the prompt the chat template writes the image token once; PixtralProcessor replaces it with the image's rows of
merged tokens, each row ended by [IMG_BREAK], the last by [IMG_END]. `row_prompt` stores that layout in
DecoderMeta.image_prompt (kind ROWS) and `image_ids` lays it out at run time (image_prompt.expand_images); the image
embeddings go to the image tokens only.
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch
from PIL import Image
from torch import nn

MODEL_TYPE = "mistral3"
PROBE_SIDE = 448
ROWS = "mistral3_rows"
BREAK, END = "[IMG_BREAK]", "[IMG_END]"


def _merged_patch(config) -> int:
    return config.vision_config.patch_size * config.spatial_merge_size


def program_side(config, processor: dict) -> int:
    """The side of the program's (square) images: what the processor makes of a PROBE_SIDE square image."""
    from backends.mlx.llm.vision.preprocess import _settings

    longest = int(_settings(processor)[1]["size"]["longest_edge"])
    side = min(PROBE_SIDE, longest)  # the processor scales an image down to longest_edge, floored
    patch = _merged_patch(config)
    side = math.ceil(side / patch) * patch
    if side > longest:  # rounding up passed the limit: one merged patch less
        side -= patch
    if side < patch:
        raise ValueError(f"the image processor's longest_edge {longest} is below one merged patch ({patch} pixels)")
    return side


class Mistral3Vision(nn.Module):
    """pixels [1, 3, S, S] -> [1, (S / (patch x merge))^2, D]: the tower's blocks, the projector's norm, the patch
    merger's grouping of merge x merge patches (unfold's channel order: feature, then row, then column in the
    window), its linear and the two projections. `reference` is transformers' get_image_features."""

    def __init__(self, model: nn.Module, side: int):
        super().__init__()
        config = model.config
        if config.vision_feature_layer != -1:
            raise ValueError(f"mistral3: vision_feature_layer {config.vision_feature_layer!r} is not exported (only -1, "
                             "the last layer)")
        self.model, self.side = model, side
        self.tower = model.model.vision_tower
        self.projector = model.model.multi_modal_projector
        self.merge = config.spatial_merge_size
        self.patches = side // self.tower.patch_size
        grid = torch.arange(self.patches)
        rows, cols = torch.meshgrid(grid, grid, indexing="ij")
        positions = torch.stack([rows.flatten(), cols.flatten()], dim=-1)
        with torch.no_grad():
            cos, sin = self.tower.patch_positional_embedding(torch.zeros(1, dtype=torch.float32), positions)
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)

    @property
    def pixel_shape(self) -> list[int]:
        return [self.tower.config.num_channels, self.side, self.side]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        tower = self.tower
        x = tower.patch_conv(pixel_values.to(tower.patch_conv.weight.dtype))[0]  # [D, P, P]
        x = tower.ln_pre(x.flatten(1).T.unsqueeze(0))
        angles = (self.cos.to(x.dtype), self.sin.to(x.dtype))
        for layer in tower.transformer.layers:
            x = layer(x, None, position_embeddings=angles)
        x = self.projector.norm(x[0])
        m, n, d = self.merge, self.patches // self.merge, x.shape[-1]
        x = x.reshape(n, m, n, m, d).permute(0, 2, 4, 1, 3).reshape(n * n, d * m * m)
        x = self.projector.patch_merger.merging_layer(x)
        x = self.projector.linear_2(self.projector.act(self.projector.linear_1(x)))
        return x.unsqueeze(0).float()

    def reference(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model.model.get_image_features(pixel_values=pixel_values, image_sizes=self._sizes())
        return torch.cat(list(out.pooler_output)).unsqueeze(0).float()

    def model_inputs(self, pixel_values: torch.Tensor, _ids: list[int]) -> dict:
        return {"pixel_values": pixel_values, "image_sizes": self._sizes()}

    def _sizes(self) -> torch.Tensor:
        return torch.tensor([[self.side, self.side]])


def row_prompt(tokenizer, image_tokens: int) -> dict:
    """DecoderMeta.image_prompt of a Mistral 3 program: the merged grid's rows and the break / end tokens' ids."""
    side = math.isqrt(image_tokens)
    ids = {}
    for name, token in (("break", BREAK), ("end", END)):
        found = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(found, int) or found == tokenizer.unk_token_id:
            raise ValueError(f"mistral3: the tokenizer lacks the image prompt's token {token}")
        ids[name] = found
    return {"kind": ROWS, "rows": side, "cols": side, **ids}


def image_ids(prompt: dict, image_token_id: int) -> list[int]:
    """One image's ids: each row of image tokens ended by the break token, the last by the end token."""
    row = [image_token_id] * prompt["cols"]
    out = (row + [prompt["break"]]) * prompt["rows"]
    out[-1] = prompt["end"]
    return out


def parse(prompt_json: str) -> dict | None:
    """DecoderMeta.image_prompt of a Mistral 3 program, else None."""
    if not prompt_json:
        return None
    prompt = json.loads(prompt_json)
    return prompt if prompt.get("kind") == ROWS else None


def program_pixels(image: Image.Image, processor: dict, side: int) -> torch.Tensor:
    """[1, 3, side, side]: `image` resized to the program's size (where it is not) and normalised as the processor
    does; an image of that size is one the processor leaves as it is."""
    from backends.mlx.llm.vision.preprocess import preprocess

    if image.size != (side, side):
        image = image.resize((side, side), Image.Resampling.BICUBIC)
    pixels = np.asarray(preprocess([image], processor).pixel_values)
    if list(pixels.shape) != [1, 3, side, side]:
        raise ValueError(f"the image processor made pixels {list(pixels.shape)}, the vision method takes "
                         f"[1, 3, {side}, {side}]")
    return torch.from_numpy(pixels).float()
