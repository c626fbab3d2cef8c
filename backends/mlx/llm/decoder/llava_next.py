"""LLaVA-NeXT ("anyres") in a vision-language program: a vision call per tile, the features packed on the host.

The image processor (llm/vision/preprocess.py) gives an image the whole image resized to one tile (the base) and
the tiles of the grid pinpoint that fits it best. transformers' get_image_features encodes every tile alike (CLIP
tower at the feature layer, the class position dropped, the projector), then pack_image_features lays the grid
tiles' patch features out as one picture, drops the rows or columns that are only padding (unpad_image: the image
was fitted into the pinpoint with black around it), appends the `image_newline` vector after each row, and puts the
result after the base tile's features. So an image takes a number of positions that depends on its size.

Here the vision method is the per-tile part ([N, C, S, S] -> [N, T, D]); `pack` is the rest, on the host, in
transformers' order, with the image_newline vector the program stores as named data (NEWLINE_KEY, float32).
DecoderMeta.image_prompt (KIND, as JSON) holds what `pack` and `feature_count` need: the grid pinpoints, the tile
side and the patch grid of one tile.

    LlavaNextVision(model)(pixels [N, C, S, S]) -> [N, T, D]
    pack(tile_features [1 + tiles, T, D], (height, width), prompt, newline [D]) -> [feature_count(...), D]
"""

from __future__ import annotations

import json

import numpy as np
import torch
from torch import nn

from backends.mlx.llm.vision.preprocess import best_resolution

KIND = "llava_next"
NEWLINE_KEY = "etmlx/vision/image_newline"  # named data: the model's image_newline [D], float32 little-endian


def check_config(config) -> None:
    """Refuse what pack_image_features would not lay out as a patch grid."""
    if config.vision_feature_select_strategy != "default":
        raise ValueError(f"llava_next: vision_feature_select_strategy {config.vision_feature_select_strategy!r} is "
                         "not supported (only 'default': the class position dropped)")


class LlavaNextVision(nn.Module):
    """One tile's projected patch features, as get_image_features computes them before packing."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.check(model.config)
        self.model = model
        self.tower, self.projector = model.model.vision_tower, model.model.multi_modal_projector
        self.layer = model.config.vision_feature_layer
        self.first = 1 if model.config.vision_feature_select_strategy == "default" else 0  # the class position

    @staticmethod
    def check(config) -> None:
        check_config(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        pixels = pixel_values.to(next(self.tower.parameters()).dtype)
        hidden = self.tower(pixels, output_hidden_states=True).hidden_states
        layers = [self.layer] if isinstance(self.layer, int) else list(self.layer)
        selected = torch.cat([hidden[i] for i in layers], dim=-1)[:, self.first:]
        return self.projector(selected).float()

    def reference(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """transformers' own get_image_features for tiles [1, C, S, S]: an S x S image whose every tile is these
        pixels; the packed features start with the base tile's."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        config, side = self.model.config, self.model.config.vision_config.image_size
        tiles = image_size_to_num_patches((side, side), config.image_grid_pinpoints, side)
        out = self.model.model.get_image_features(pixel_values=pixel_values[:, None].expand(1, tiles, -1, -1, -1),
                                                  image_sizes=torch.tensor([[side, side]]))
        tokens = (side // config.vision_config.patch_size) ** 2
        return out.pooler_output[0][None, :tokens].float()


def image_prompt(model: nn.Module, processor: dict | None) -> dict:
    """DecoderMeta.image_prompt of a LLaVA-NeXT program (JSON-able)."""
    config, vision = model.config, model.config.vision_config
    settings = (processor or {}).get("image_processor", processor or {})
    pinpoints = [list(p) for p in config.image_grid_pinpoints]
    if settings.get("image_grid_pinpoints") not in (None, pinpoints):
        raise ValueError(f"{config.model_type}: the image processor's image_grid_pinpoints differ from the model "
                         "config's")
    return {"kind": KIND, "pinpoints": pinpoints, "tile": vision.image_size,
            "side": vision.image_size // vision.patch_size}


def newline_blob(model: nn.Module) -> dict[str, bytes]:
    """The named data a LLaVA-NeXT program carries beside its methods."""
    return {NEWLINE_KEY: model.model.image_newline.detach().float().numpy().astype("<f4").tobytes()}


def newline_from(blob: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(blob, dtype="<f4").copy())


def grid(prompt: dict, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of grid tiles an image of height x width is cut into."""
    best_h, best_w = best_resolution(height, width, prompt["pinpoints"])
    return best_h // prompt["tile"], best_w // prompt["tile"]


def kept(prompt: dict, height: int, width: int) -> tuple[slice, slice]:
    """The patch rows and columns of the grid picture that unpad_image keeps (the others are padding)."""
    rows, cols = (n * prompt["side"] for n in grid(prompt, height, width))
    if width / height > cols / rows:
        inside = int(round(height * (cols / width), 7))
        pad = (rows - inside) // 2
        return slice(pad, rows - pad), slice(0, cols)
    inside = int(round(width * (rows / height), 7))
    pad = (cols - inside) // 2
    return slice(0, rows), slice(pad, cols - pad)


def tiled(images: int) -> bool:
    """Whether an image of a prompt with `images` images is cut into tiles (LLaVA-NeXT: always)."""
    return True


def tiles(prompt: dict, height: int, width: int, images: int = 1) -> int:
    """Vision calls an image takes: the base tile and the grid's."""
    rows, cols = grid(prompt, height, width)
    return 1 + rows * cols


def feature_count(prompt: dict, height: int, width: int, images: int = 1) -> int:
    """The image positions an image of height x width takes in the prompt."""
    ys, xs = kept(prompt, height, width)
    return prompt["side"] ** 2 + (ys.stop - ys.start) * (xs.stop - xs.start + 1)


def grid_picture(features: torch.Tensor, size: tuple[int, int], prompt: dict) -> torch.Tensor:
    """features [1 + tiles, side * side, D] (base tile first, then the grid's row by row) to the grid's patch
    features laid out as one picture [H, W, D], the padding rows or columns dropped (unpad_image)."""
    height, width = size
    rows, cols = grid(prompt, height, width)
    side, dim = prompt["side"], features.shape[-1]
    if features.shape[0] != 1 + rows * cols or features.shape[1] != side * side:
        raise ValueError(f"{prompt['kind']}: {tuple(features.shape[:2])} tile features for a {rows} x {cols} grid "
                         f"of {side} x {side} patches")
    # [tiles, side * side, D] -> the grid picture [rows * side, cols * side, D], a tile's patches row-major
    picture = features[1:].reshape(rows, cols, side, side, dim).permute(0, 2, 1, 3, 4)
    picture = picture.reshape(rows * side, cols * side, dim)
    ys, xs = kept(prompt, height, width)
    return picture[ys, xs]


def with_newlines(base: torch.Tensor, picture: torch.Tensor, newline: torch.Tensor) -> torch.Tensor:
    """The base tile's features [T, D], then the picture [H, W, D] row by row, `newline` after each row."""
    dim = picture.shape[-1]
    picture = torch.cat([picture, newline.to(picture)[None, None].expand(picture.shape[0], 1, dim)], dim=1)
    return torch.cat([base, picture.reshape(-1, dim)])


def pack(features: torch.Tensor, size: tuple[int, int], prompt: dict, newline: torch.Tensor,
         images: int = 1) -> torch.Tensor:
    """features [1 + tiles, side * side, D] (base tile first, then the grid's row by row) to the image's [L, D]
    (`images`, the prompt's image count, does not change LLaVA-NeXT's packing)."""
    return with_newlines(features[0], grid_picture(features, size, prompt), newline)


def verify_size(prompt: dict) -> tuple[int, int]:
    """An image size for the export check: the smallest pinpoint narrowed by a quarter, so unpadding drops columns."""
    height, width = min(prompt["pinpoints"], key=lambda p: p[0] * p[1])
    return height, max(1, width * 3 // 4)


def parse(prompt_json: str) -> dict | None:
    """DecoderMeta.image_prompt as a LLaVA-NeXT prompt; None for another kind."""
    prompt = json.loads(prompt_json) if prompt_json else {}
    return prompt if prompt.get("kind") == KIND else None
