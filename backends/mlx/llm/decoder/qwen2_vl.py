"""Qwen2-VL and Qwen2.5-VL in a vision-language program: the vision method at one image size, and the multimodal
RoPE positions (the same for both families' images).

The vision tower takes flattened patches and their grid (t, h, w). A program is exported for one grid: the one the
checkpoint's image processor gives a PROBE_SIDE x PROBE_SIDE image (448 x 448 when the processor's pixel range holds
it: 32 x 32 patches, 16 x 16 = 256 image tokens with the usual 14-pixel patches merged 2 x 2). An image the
processor would give another grid is resized to the program's size first (aspect ratio not kept), so every image
takes the same image_tokens positions; transformers' processor would give such an image another number of tokens.

Multimodal RoPE (M-RoPE, transformers' get_rope_index): every position has a rotary position per section (temporal,
height, width). A text token's three are its cache position plus the row's shift so far; an image's tokens all sit
at the image's first position (plus the shift) in the temporal section, and at that plus their row / column in the
merged grid in the height / width sections; the text after an image goes on from the image's start plus its grid
side, i.e. the shift grows by side - image_tokens. The decoder program takes these as ROPE_INPUT [B, L, 3] beside
the tokens (its cache position start_pos still decides where keys are written and what is masked); the host lays
them out from a row's image positions (rope_positions), so decode steps are plain positions plus the row's shift.

Qwen2.5-VL's tower differs in its blocks (RMSNorm, gated MLP: called as the tower's own modules) and in window
attention: its patches are reordered into windows of window_size pixels (in merged-token units, as transformers'
get_vision_window_index lays them out), and every block not in fullatt_block_indexes attends only within its
window. With one image of a fixed grid the order and the windows are constants: a gather before the blocks, a
boolean [P, P] mask per windowed block, the inverse gather after the merger.

    encoder = Qwen2VLVision(model, grid)                # grid_for(processor config) at export
    rope_positions(prompt_images, image_tokens, start, length) -> [length, 3] int64
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from backends.mlx.llm.decoder.meta import ROPE_INPUT  # noqa: F401 (the decoder's input named here)

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
PROBE_SIDE = 448


def uses_mrope(config) -> bool:
    return getattr(config, "model_type", "") in MODEL_TYPES


def grid_for(processor: dict) -> list[int]:
    """The patch grid [1, h, w] of the program's images: the processor's for a PROBE_SIDE square image."""
    from backends.mlx.llm.vision.preprocess import preprocess

    grid = preprocess([Image.new("RGB", (PROBE_SIDE, PROBE_SIDE))], processor).extras["image_grid_thw"][0]
    return [int(g) for g in grid]


class Qwen2VLVision(nn.Module):
    """pixels [1, P, patch values] (the processor's patches of one image of the program's grid) -> [1, T, D].

    transformers' tower splits its attention by each image's sequence lengths, read from grid_thw on the host
    (data-dependent for the exporter): with one image of a fixed grid the whole sequence attends to itself, so the
    blocks run here over the tower's own modules, the rotary angles computed once for the grid.
    `reference` is transformers' own get_image_features for the same grid (the export check compares the two)."""

    def __init__(self, model: nn.Module, grid: list[int]):
        super().__init__()
        from transformers.vision_utils import get_vision_position_ids

        self.model = model
        self.visual = model.model.visual
        self.grid = list(grid)
        thw = torch.tensor([self.grid])
        positions = get_vision_position_ids(thw, self.visual.spatial_merge_size)
        with torch.no_grad():
            cos, sin = self.visual.rotary_pos_emb(torch.zeros(1), positions)
        order, restore, windows = _window_layout(self.visual, thw)
        self.reordered = order is not None
        if self.reordered:  # Qwen2.5-VL: patches (and their angles) in window order
            cos, sin = cos[order], sin[order]
            self.register_buffer("order", order, persistent=False)
            self.register_buffer("restore", restore, persistent=False)
            self.register_buffer("windows", windows, persistent=False)  # [P, P] bool: same window
        self.windowed = [self.reordered and i not in self.visual.fullatt_block_indexes
                         for i in range(len(self.visual.blocks))]
        self.register_buffer("cos", cos.float().unsqueeze(-2), persistent=False)  # [P, 1, head_dim]
        self.register_buffer("sin", sin.float().unsqueeze(-2), persistent=False)

    @property
    def pixel_shape(self) -> list[int]:
        t, h, w = self.grid
        patch = self.visual.patch_embed
        return [t * h * w, patch.in_channels * patch.temporal_patch_size * patch.patch_size ** 2]

    def _rotate(self, x):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * self.cos + rotated.float() * self.sin).to(x.dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        visual = self.visual
        x = visual.patch_embed(pixel_values[0])
        if self.reordered:
            x = x.index_select(0, self.order)
        length = x.shape[0]
        for block, windowed in zip(visual.blocks, self.windowed):
            attn = block.attn
            q, k, v = attn.qkv(block.norm1(x)).reshape(length, 3, attn.num_heads, -1).permute(1, 2, 0, 3).unbind(0)
            q, k = self._rotate(q.transpose(0, 1)).transpose(0, 1), self._rotate(k.transpose(0, 1)).transpose(0, 1)
            out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=attn.scaling,
                                                 attn_mask=self.windows if windowed else None)
            x = x + attn.proj(out[0].transpose(0, 1).reshape(length, -1))
            x = x + block.mlp(block.norm2(x))
        merged = visual.merger(x)
        if self.reordered:
            merged = merged.index_select(0, self.restore)
        return merged.unsqueeze(0).float()

    def reference(self, pixel_values: torch.Tensor) -> torch.Tensor:
        grid = torch.tensor([self.grid])
        out = self.model.model.get_image_features(pixel_values=pixel_values[0], image_grid_thw=grid)
        return torch.cat(list(out.pooler_output)).unsqueeze(0).float()

    def model_inputs(self, pixel_values: torch.Tensor, ids: list[int]) -> dict:
        """The eager forward's image keywords for prompt `ids` holding one image's positions."""
        image = self.model.config.image_token_id
        return {"pixel_values": pixel_values[0], "image_grid_thw": torch.tensor([self.grid]),
                "mm_token_type_ids": torch.tensor([[int(t == image) for t in ids]])}


def _window_layout(visual: nn.Module, thw: torch.Tensor):
    """(patch order, merged-token inverse order, [P, P] same-window mask) of Qwen2.5-VL's window attention for the
    grid `thw`; (None, None, None) for a tower without windows (Qwen2-VL)."""
    if not hasattr(visual, "fullatt_block_indexes"):
        return None, None, None
    from transformers.vision_utils import get_vision_window_index

    merge = visual.spatial_merge_size
    window_index, bounds = get_vision_window_index(thw, merge, visual.window_size, visual.patch_size)
    unit = merge * merge
    order = (window_index.unsqueeze(1) * unit + torch.arange(unit)).reshape(-1)
    # each reordered patch's window: how many window ends lie at or before it
    window = torch.searchsorted(torch.as_tensor(bounds)[1:].contiguous(), torch.arange(order.numel()), right=True)
    return order, torch.argsort(window_index), window.unsqueeze(1) == window.unsqueeze(0)


class MropeInputs(nn.Module):
    """The decoder's model inputs of an M-RoPE program: tokens, start_pos, lengths, image_embeds, rope_positions."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, tokens, start_pos, lengths, image_embeds, rope_positions):
        return self.lm(tokens, start_pos, lengths, image_embeds=image_embeds,
                       position_ids=rope_positions.permute(2, 0, 1))


def image_side(image_tokens: int) -> int:
    """The merged grid's side of a program's (square) images."""
    side = math.isqrt(image_tokens)
    if side * side != image_tokens:
        raise ValueError(f"{image_tokens} image tokens are not a square grid: not a Qwen2-VL program's images")
    return side


def plain_positions(start: int, length: int) -> torch.Tensor:
    return (start + torch.arange(length, dtype=torch.int64)).unsqueeze(1).expand(length, 3)


def rope_positions(images, image_tokens: int, start: int, length: int) -> torch.Tensor:
    """[length, 3]: the rotary positions of cache positions start .. start + length - 1 of a row whose prompt has
    `images` (image_encoder.PromptImages: each image's image_tokens positions in a run; None: no image)."""
    out = plain_positions(start, length).clone()
    if images is None or len(images.positions) == 0:
        return out
    side = image_side(image_tokens)
    firsts = images.positions[::image_tokens].tolist()
    cache = torch.arange(start, start + length, dtype=torch.int64)
    shift = torch.zeros(length, dtype=torch.int64)
    for first in firsts:
        inside = (cache >= first) & (cache < first + image_tokens)
        k = cache[inside] - first
        base = first + shift[inside]  # the shift of the text before this image
        out[inside] = torch.stack([base, base + k // side, base + k % side], dim=1)
        shift[cache >= first + image_tokens] += side - image_tokens
        out[cache >= first + image_tokens] = (cache + shift)[cache >= first + image_tokens].unsqueeze(1).expand(-1, 3)
    return out


def fixed_size_pixels(image: Image.Image, processor: dict, pixel_shape: list[int]) -> torch.Tensor:
    """[1, P, patch values]: `image`'s patches at the program's grid, resized to its size first where the
    processor would give it another grid."""
    from backends.mlx.llm.vision.preprocess import _settings, preprocess

    batch = preprocess([image], processor)
    if list(batch.pixel_values.shape) != list(pixel_shape):
        side = math.isqrt(pixel_shape[0]) * int(_settings(processor)[1]["patch_size"])
        batch = preprocess([image.resize((side, side), Image.BICUBIC)], processor)
    pixels = np.asarray(batch.pixel_values)
    if list(pixels.shape) != list(pixel_shape):
        raise ValueError(f"the image processor made pixels {list(pixels.shape)}, the vision method takes {pixel_shape}")
    return torch.from_numpy(pixels).float().unsqueeze(0)
