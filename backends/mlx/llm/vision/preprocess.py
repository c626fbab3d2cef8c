"""RGB images to what a vision-language checkpoint's image processor gives its vision tower, with PIL and numpy.

`preprocess(images, config, prompt_images)`: `images` are RGB images of one prompt (images.py's load_image; all of
them unless `prompt_images` says how many it holds, which only LLaVA-OneVision reads), `config` the
checkpoint's image-processor configuration (its preprocessor_config.json, or `image_processor.to_dict()`; a
`processor.to_dict()` with an "image_processor" entry works too and also gives the image-token counts). The
families, by `image_processor_type`:

- CLIPImageProcessor / LlavaImageProcessor (LLaVA 1.5): shortest edge resized, centre crop (LLaVA's optional
  pad to a square of the mean colour first); pixel_values [N, 3, H, W].
- LlavaNextImageProcessor (LLaVA-NeXT, "anyres"): the whole image resized to a square plus the tiles of the
  grid pinpoint that fits it best (resized into it, padded black, cut); pixel_values [N, 1 + tiles, 3, H, W] (zero
  tiles pad images with fewer), image_sizes [N, 2].
- LlavaOnevisionImageProcessor (LLaVA-OneVision): LLaVA-NeXT's tiles for the only image of a prompt (its base
  resized to the tile, no crop); an image of a prompt with several is instead padded to a square of the mean colour
  and resized to one tile (transformers' batch_num_images > 1); pixel_values [N, tiles, 3, H, W], image_sizes [N, 2],
  batch_num_images [1] (the prompt's image count).
- SiglipImageProcessor / Gemma3ImageProcessor (Gemma 3): resized to a fixed size; Gemma 3's num_crops [N] (pan and
  scan is refused).
- Idefics3ImageProcessor / SmolVLMImageProcessor: longest edge resized, then (image splitting) resized to
  multiples of max_image_size and cut into tiles plus the whole image; pixel_values [1, tiles, 3, H, W],
  pixel_attention_mask [1, tiles, H, W], rows / cols per image.
- Qwen2VLImageProcessor (Qwen2-VL, Qwen2.5-VL): smart resize to multiples of patch x merge within the pixel range,
  then flattened patches; pixel_values [patches, 3 x temporal x patch x patch], image_grid_thw [N, 3].
- PixtralImageProcessor (Mistral 3): scaled down to the longest edge (floored), sides rounded up to multiples of
  the patch, padded to the batch's largest with zeros; pixel_values [N, 3, H, W], image_sizes [N, 2].

Each step is the one transformers' PIL backend takes (PIL resizes the 8-bit image; rescale in float64 then
float32; normalise in float32), so the results equal transformers' processors (tests/test_image_preprocess.py).
The fast (torchvision) processors resize differently; this matches the PIL ones, transformers' choice without
torchvision. Anything else is refused in one line (PreprocessError).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN, OPENAI_CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
HALF = [0.5, 0.5, 0.5]
BICUBIC, BILINEAR, LANCZOS = Image.Resampling.BICUBIC, Image.Resampling.BILINEAR, Image.Resampling.LANCZOS
MAX_IDEFICS_SIDE = 4096  # transformers' Idefics3 absolute maximum side after the first resize

_COMMON = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True}
# transformers' class defaults, for keys a preprocessor_config.json leaves out
DEFAULTS = {
    "CLIPImageProcessor": {**_COMMON, "size": {"shortest_edge": 224}, "resample": BICUBIC, "do_center_crop": True,
                           "crop_size": {"height": 224, "width": 224}, "image_mean": OPENAI_CLIP_MEAN,
                           "image_std": OPENAI_CLIP_STD},
    "SiglipImageProcessor": {**_COMMON, "size": {"height": 224, "width": 224}, "resample": BICUBIC,
                             "image_mean": HALF, "image_std": HALF},
    "Gemma3ImageProcessor": {**_COMMON, "size": {"height": 224, "width": 224}, "resample": BILINEAR,
                             "image_mean": HALF, "image_std": HALF},
    "Idefics3ImageProcessor": {**_COMMON, "size": {"longest_edge": 4 * 364}, "resample": LANCZOS,
                               "max_image_size": {"longest_edge": 364}, "do_image_splitting": True, "do_pad": True,
                               "image_mean": HALF, "image_std": HALF},
    "Qwen2VLImageProcessor": {**_COMMON, "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
                              "resample": BICUBIC, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
                              "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD},
    "PixtralImageProcessor": {**_COMMON, "size": {"longest_edge": 1024}, "patch_size": {"height": 16, "width": 16},
                              "resample": BICUBIC, "do_pad": True, "image_mean": OPENAI_CLIP_MEAN,
                              "image_std": OPENAI_CLIP_STD},
}
DEFAULTS["LlavaImageProcessor"] = {**DEFAULTS["CLIPImageProcessor"], "do_pad": False}
DEFAULTS["LlavaNextImageProcessor"] = {**DEFAULTS["CLIPImageProcessor"], "do_pad": True, "image_grid_pinpoints": [
    [336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]}
DEFAULTS["LlavaOnevisionImageProcessor"] = {
    **_COMMON, "size": {"height": 384, "width": 384}, "resample": BICUBIC, "do_pad": True,
    "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD,
    "image_grid_pinpoints": [[384 * r, 384 * c] for r in range(1, 7) for c in range(1, 7)]}
DEFAULTS["SmolVLMImageProcessor"] = DEFAULTS["Idefics3ImageProcessor"]  # the same processor under SmolVLM's name
# Processor-level keys (processor.to_dict()) that say how many tokens an image takes.
PROCESSOR_KEYS = ("image_seq_len", "image_seq_length", "patch_size", "num_additional_image_tokens",
                  "vision_feature_select_strategy", "num_image_tokens", "vision_aspect_ratio")


class PreprocessError(ValueError):
    """A configuration or image this preprocessing cannot handle exactly; the message is one line."""


@dataclass
class ImageBatch:
    """What the vision method takes for one prompt's images."""
    pixel_values: np.ndarray  # float32
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # the family's other inputs, as transformers names them
    image_tokens: list[int] | None = None  # image-placeholder tokens each image takes (None: the config does not say)


def processor_type(config: dict) -> str:
    name = config.get("image_processor_type") or ""
    for suffix in ("Fast", "Pil"):
        name = name.removesuffix(suffix)
    return name


def _settings(config: dict) -> tuple[str, dict]:
    if not isinstance(config, dict):
        raise PreprocessError(f"the image processor configuration must be a dict, got {type(config).__name__}")
    if isinstance(config.get("image_processor"), dict):  # processor.to_dict(): the image processor inside
        outer = {k: config[k] for k in PROCESSOR_KEYS if config.get(k) is not None}
        config = {**config["image_processor"], **{k: v for k, v in outer.items() if k not in config["image_processor"]}}
    name = processor_type(config)
    if name not in DEFAULTS:
        raise PreprocessError(f"image processor {config.get('image_processor_type')!r} is not supported (supported: "
                              f"{', '.join(sorted(DEFAULTS))})")
    settings = {**DEFAULTS[name], **{k: v for k, v in config.items() if v is not None}}
    if settings.get("do_pan_and_scan"):
        raise PreprocessError("Gemma 3's pan and scan (do_pan_and_scan) is not supported: export with it off")
    return name, settings


def _resize(image: Image.Image, height: int, width: int, resample) -> Image.Image:
    if height < 1 or width < 1:
        raise PreprocessError(f"the image ({image.width} x {image.height}) would be resized to {width} x {height}")
    return image.resize((width, height), resample=Image.Resampling(int(resample)))


def _normalised(image: Image.Image | np.ndarray, s: dict) -> np.ndarray:
    """[3, H, W] float32: rescaled (in float64, as transformers) and normalised (in float32)."""
    pixels = np.asarray(image)
    if s["do_rescale"]:
        pixels = (pixels.astype(np.float64) * s["rescale_factor"]).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if s["do_normalize"]:
        mean, std = (np.broadcast_to(np.asarray(s[k], dtype=np.float32), (3,)) for k in ("image_mean", "image_std"))
        pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _shortest_edge_size(height: int, width: int, shortest: int) -> tuple[int, int]:
    """(height, width) with the shorter side `shortest`, the other scaled and truncated (transformers' rule)."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest * long / short)
    return (new_long, shortest) if width <= height else (shortest, new_long)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] cropped around its centre; a side shorter than the crop is padded with zeros around it."""
    h, w = pixels.shape[:2]
    if height > h or width > w:
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), dtype=pixels.dtype)
        top, left = math.ceil((padded.shape[0] - h) / 2), math.ceil((padded.shape[1] - w) / 2)
        padded[top:top + h, left:left + w] = pixels
        pixels, h, w = padded, *padded.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top:top + height, left:left + width]


def _square_pad(image: Image.Image, mean) -> Image.Image:
    """LLaVA's pad to a square of the mean colour (transformers: int(mean x 255) per channel), centred."""
    side = max(image.size)
    if image.width == image.height:
        return image
    colour = tuple(int(m * 255) for m in mean) if mean else (0, 0, 0)
    square = Image.new("RGB", (side, side), colour)
    square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return square


def _clip_resize(image: Image.Image, size: dict, resample, name: str) -> Image.Image:
    if "shortest_edge" in size and "longest_edge" not in size:
        height, width = _shortest_edge_size(image.height, image.width, size["shortest_edge"])
    elif "height" in size and "width" in size:
        height, width = size["height"], size["width"]
    else:
        raise PreprocessError(f"size {size} is not supported for {name} (shortest_edge, or height and width)")
    return _resize(image, height, width, resample)


def _clip(images: list[Image.Image], s: dict, name: str) -> ImageBatch:
    out = []
    for image in images:
        if name == "LlavaImageProcessor" and s.get("do_pad"):
            image = _square_pad(image, s["image_mean"])
        if s["do_resize"]:
            image = _clip_resize(image, s["size"], s["resample"], name)
        if s.get("do_center_crop"):
            crop = s["crop_size"]
            image = _center_crop(np.asarray(image), crop["height"], crop["width"])
        out.append(_normalised(image, s))
    return ImageBatch(np.stack(out))


def _llava_tokens(batch: ImageBatch, s: dict) -> list[int] | None:
    patch = s.get("patch_size")
    if not patch:
        return None
    height, width = batch.pixel_values.shape[-2:]
    tokens = (height // patch) * (width // patch) + s.get("num_additional_image_tokens", 0)
    if s.get("vision_feature_select_strategy") == "default":  # the class token is dropped
        tokens -= 1
    return [tokens] * len(batch.pixel_values)


# ---- LLaVA-NeXT ----

def best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The (height, width) of `pinpoints` that keeps the most of the image, then wastes the least."""
    best, most, waste = None, 0, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        if kept > most or kept == most and h * w - kept < waste:
            best, most, waste = (h, w), kept, h * w - kept
    return best


def _fit_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """The image's size scaled to fit inside `target` (the side that binds exact, the other rounded up)."""
    th, tw = target
    if tw / width < th / height:
        return min(math.ceil(height * tw / width), th), tw
    return th, min(math.ceil(width * th / height), tw)


def _llava_next(images: list[Image.Image], s: dict, name: str) -> ImageBatch:
    size, crop = s["size"], s.get("crop_size") or {}
    square = (size["height"], size["width"]) if "height" in size else (size["shortest_edge"],) * 2
    tile = crop.get("height") or size.get("height") or size["shortest_edge"]
    per_image, sizes = [], []
    for image in images:
        target = best_resolution(image.height, image.width, s["image_grid_pinpoints"])
        fitted = _resize(image, *_fit_size(image.height, image.width, target), s["resample"])
        canvas = np.zeros((*target, 3), dtype=np.uint8)  # black around it, the fitted image centred
        top, left = (target[0] - fitted.height) // 2, (target[1] - fitted.width) // 2
        canvas[top:top + fitted.height, left:left + fitted.width] = np.asarray(fitted)
        pieces = [np.asarray(_resize(image, *square, s["resample"]))]
        pieces += [canvas[y:y + tile, x:x + tile] for y in range(0, target[0], tile) for x in range(0, target[1], tile)]
        out = []
        for piece in pieces:
            if s["do_resize"]:
                piece = _clip_resize(Image.fromarray(piece), size, s["resample"], name)
            if s.get("do_center_crop"):
                piece = _center_crop(np.asarray(piece), crop["height"], crop["width"])
            out.append(_normalised(piece, s))
        per_image.append(np.stack(out))
        sizes.append([image.height, image.width])
    if s.get("do_pad"):
        most = max(len(p) for p in per_image)
        per_image = [np.concatenate([p, np.zeros((most - len(p), *p.shape[1:]), np.float32)]) for p in per_image]
    elif len({p.shape for p in per_image}) > 1:
        raise PreprocessError(f"{name} without do_pad gives images different tile counts: one image per prompt")
    batch = ImageBatch(np.stack(per_image), {"image_sizes": np.array(sizes, dtype=np.int64)})
    if s.get("patch_size"):
        height, width = batch.pixel_values.shape[-2:]
        batch.image_tokens = [_llava_next_tokens(h, w, height, width, s) for h, w in sizes]
    return batch


def _unpadded(orig_height: int, orig_width: int, rows: int, cols: int) -> tuple[int, int]:
    """The rows and columns of a grid picture of patches that unpad_image keeps for an image of that size."""
    if orig_width / orig_height > cols / rows:
        return rows - (rows - int(round(orig_height * (cols / orig_width), 7))) // 2 * 2, cols
    return rows, cols - (cols - int(round(orig_width * (rows / orig_height), 7))) // 2 * 2


def _llava_next_tokens(orig_height: int, orig_width: int, height: int, width: int, s: dict) -> int:
    """LLaVA-NeXT's image features: the base tile's patches, then the grid's patches with the padding rows or
    columns dropped, one newline per row."""
    patch = s["patch_size"]
    best_h, best_w = best_resolution(orig_height, orig_width, s["image_grid_pinpoints"])
    rows, cols = _unpadded(orig_height, orig_width, height // patch * (best_h // height),
                           width // patch * (best_w // width))
    tokens = rows * cols + rows + (height // patch) * (width // patch) + s.get("num_additional_image_tokens", 0)
    return tokens - (s.get("vision_feature_select_strategy") == "default")


# ---- LLaVA-OneVision ----

def _llava_onevision(images: list[Image.Image], s: dict, name: str) -> ImageBatch:
    prompt_images = s["prompt_images"]
    if prompt_images == 1:  # the only image of its prompt: LLaVA-NeXT's tiles
        batch = _llava_next(images, {**s, "patch_size": None}, name)
    else:  # one of several: a square of the mean colour around it, resized to one tile
        squares = [_square_pad(image, s["image_mean"]) for image in images]
        tiles = [_normalised(_clip_resize(square, s["size"], s["resample"], name) if s["do_resize"] else square, s)
                 for square in squares]
        sizes = [[image.height, image.width] for image in images]
        batch = ImageBatch(np.stack(tiles)[:, None], {"image_sizes": np.array(sizes, dtype=np.int64)})
    batch.extras["batch_num_images"] = np.array([prompt_images], dtype=np.int64)
    if s.get("num_image_tokens") and s.get("vision_aspect_ratio"):
        height = batch.pixel_values.shape[-2]
        batch.image_tokens = [_llava_onevision_tokens(h, w, height, prompt_images, s)
                              for h, w in batch.extras["image_sizes"].tolist()]
    return batch


def _max_tiles(aspect_ratio: str) -> int:
    """N of "anyres_max_N" (read as transformers' processor reads it)."""
    digits = str(aspect_ratio).strip("anyres_max_")
    if not digits.isdigit() or int(digits) < 1:
        raise PreprocessError(f"vision_aspect_ratio {aspect_ratio!r} is not supported (only 'anyres_max_N', N >= 1)")
    return int(digits)


def _llava_onevision_tokens(orig_height: int, orig_width: int, tile: int, prompt_images: int, s: dict) -> int:
    """LlavaOnevisionProcessor's image features: alone, the base tile's, then the unpadded grid's (shrunk to about
    N tiles' worth under anyres_max_N) with one newline per row; among several, one tile's and one newline."""
    base = int(s["num_image_tokens"])
    if prompt_images > 1:
        tokens = base + 1
    else:
        side = int(math.sqrt(base))
        best_h, best_w = best_resolution(orig_height, orig_width, s["image_grid_pinpoints"])
        rows, cols = _unpadded(orig_height, orig_width, side * (best_h // tile), side * (best_w // tile))
        ratio = math.sqrt(rows * cols / (_max_tiles(s["vision_aspect_ratio"]) * side ** 2))
        if ratio > 1.1:
            rows, cols = int(rows // ratio), int(cols // ratio)
        tokens = base + rows * cols + rows
    return tokens - (s.get("vision_feature_select_strategy") == "default")


def _siglip(images: list[Image.Image], s: dict, name: str) -> ImageBatch:
    size = s["size"]
    if s["do_resize"] and not ("height" in size and "width" in size):
        raise PreprocessError(f"size {size} is not supported for {name} (height and width)")
    out = [_normalised(_resize(image, size["height"], size["width"], s["resample"]) if s["do_resize"] else image, s)
           for image in images]
    batch = ImageBatch(np.stack(out))
    if name == "Gemma3ImageProcessor":
        batch.extras["num_crops"] = np.zeros(len(images), dtype=np.int64)
        if s.get("image_seq_length"):
            batch.image_tokens = [int(s["image_seq_length"])] * len(images)
    return batch


# ---- Idefics3 / SmolVLM ----

def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longest side to `longest`, the other scaled (truncated, then made even), then both within 4096."""
    ratio = width / height
    if width >= height:
        width, height = longest, int(longest / ratio)
        height += height % 2
    else:
        height, width = longest, int(longest * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    ratio = width / height
    if width >= height and width > MAX_IDEFICS_SIDE:
        width, height = MAX_IDEFICS_SIDE, int(MAX_IDEFICS_SIDE / ratio)
    elif height > width and height > MAX_IDEFICS_SIDE:
        height, width = MAX_IDEFICS_SIDE, int(MAX_IDEFICS_SIDE * ratio)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both sides up to multiples of `tile`, the aspect ratio kept as transformers' resize_for_vision_encoder."""
    ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    return height, width


def _idefics3(images: list[Image.Image], s: dict, name: str) -> ImageBatch:
    tile = s["max_image_size"]["longest_edge"]
    frames, rows, cols = [], [], []
    for image in images:
        if s["do_resize"]:
            image = _resize(image, *_longest_edge_size(image.height, image.width, s["size"]["longest_edge"]),
                            s["resample"])
        if not s["do_image_splitting"]:
            frames.append(_resize(image, tile, tile, s["resample"]))
            rows.append(0)
            cols.append(0)
            continue
        image = _resize(image, *_tile_multiple_size(image.height, image.width, tile), s["resample"])
        if image.height > tile or image.width > tile:
            down, across = (image.height - tile) // tile + 1, (image.width - tile) // tile + 1
            frames += [image.crop((c * tile, r * tile, c * tile + tile, r * tile + tile))
                       for r in range(down) for c in range(across)]
            frames.append(_resize(image, tile, tile, s["resample"]))  # the whole image, after its tiles
            rows.append(down)
            cols.append(across)
        else:
            frames.append(image)
            rows.append(0)
            cols.append(0)
    arrays = [_normalised(frame, s) for frame in frames]
    extras = {"rows": np.array([rows], dtype=np.int64), "cols": np.array([cols], dtype=np.int64)}  # [1, N]
    if s.get("do_pad", True):
        height, width = max(a.shape[1] for a in arrays), max(a.shape[2] for a in arrays)
        padded = np.zeros((1, len(arrays), 3, height, width), dtype=np.float32)
        mask = np.zeros((1, len(arrays), height, width), dtype=np.int64)
        for i, a in enumerate(arrays):
            padded[0, i, :, :a.shape[1], :a.shape[2]] = a
            mask[0, i, :a.shape[1], :a.shape[2]] = 1
        pixel_values = padded
        extras["pixel_attention_mask"] = mask
    elif len({a.shape for a in arrays}) == 1:
        pixel_values = np.stack(arrays)[None]
    else:
        raise PreprocessError(f"{name} without do_pad gives tiles of different sizes: export with do_pad")
    batch = ImageBatch(pixel_values, extras)
    if s.get("image_seq_len"):
        batch.image_tokens = [int(s["image_seq_len"]) * (r * c + 1 if r else 1) for r, c in zip(rows, cols)]
    return batch


# ---- Qwen2-VL ----

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width): multiples of `factor`, about the same aspect ratio, min_pixels <= h x w <= max_pixels."""
    if max(height, width) / min(height, width) > 200:
        raise PreprocessError(f"the image is {width} x {height}: an aspect ratio over 200 is not taken")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _qwen2_vl(images: list[Image.Image], s: dict, name: str) -> ImageBatch:
    size = s["size"]
    min_pixels = s.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
    max_pixels = s.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
    patch, merge, temporal = s["patch_size"], s["merge_size"], s["temporal_patch_size"]
    factor = patch * merge
    patches, grids = [], []
    for image in images:
        if s["do_resize"]:
            image = _resize(image, *smart_resize(image.height, image.width, factor, min_pixels, max_pixels),
                            s["resample"])
        elif image.height % factor or image.width % factor:
            raise PreprocessError(f"without do_resize the image's sides must be multiples of {factor}, got "
                                  f"{image.width} x {image.height}")
        pixels = _normalised(image, s)
        grid_h, grid_w = image.height // patch, image.width // patch
        # [C, H, W] -> one row per patch, the patches of each merge x merge block next to each other; a still
        # image is its own `temporal` frames
        blocks = pixels.reshape(3, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)[:, :, :, :, :, None]
        blocks = np.broadcast_to(blocks, (*blocks.shape[:5], temporal, patch, patch))
        patches.append(blocks.reshape(grid_h * grid_w, 3 * temporal * patch * patch))
        grids.append([1, grid_h, grid_w])
    grid = np.array(grids, dtype=np.int64)
    tokens = [int(t * h * w) // (merge * merge) for t, h, w in grid]
    return ImageBatch(np.concatenate(patches).astype(np.float32, copy=False), {"image_grid_thw": grid}, tokens)


# ---- Pixtral (Mistral 3) ----

def pixtral_size(height: int, width: int, longest: int, patch: tuple[int, int]) -> tuple[int, int]:
    """(height, width) the processor resizes an image to: within longest x longest (floored, the aspect ratio
    kept), then each side rounded up to a multiple of its patch side."""
    ratio = max(height / longest, width / longest)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return ((height - 1) // patch[0] + 1) * patch[0], ((width - 1) // patch[1] + 1) * patch[1]


def _pixtral(images: list[Image.Image], s: dict, name: str) -> ImageBatch:
    patch = s["patch_size"]
    patch = (patch["height"], patch["width"]) if isinstance(patch, dict) else (int(patch), int(patch))
    arrays = []
    for image in images:
        if s["do_resize"]:
            image = _resize(image, *pixtral_size(image.height, image.width, s["size"]["longest_edge"], patch),
                            s["resample"])
        arrays.append(_normalised(image, s))
    sizes = np.array([a.shape[1:] for a in arrays], dtype=np.int64)
    if s["do_pad"]:
        pixel_values = np.zeros((len(arrays), 3, *sizes.max(0)), dtype=np.float32)
        for i, a in enumerate(arrays):
            pixel_values[i, :, :a.shape[1], :a.shape[2]] = a
    elif len({a.shape for a in arrays}) == 1:
        pixel_values = np.stack(arrays)
    else:
        raise PreprocessError(f"{name} without do_pad gives images of different sizes: export with do_pad")
    return ImageBatch(pixel_values, {"image_sizes": sizes})


FAMILIES = {"CLIPImageProcessor": _clip, "LlavaImageProcessor": _clip, "LlavaNextImageProcessor": _llava_next,
            "LlavaOnevisionImageProcessor": _llava_onevision,
            "SiglipImageProcessor": _siglip,
            "Gemma3ImageProcessor": _siglip, "Idefics3ImageProcessor": _idefics3,
            "SmolVLMImageProcessor": _idefics3, "Qwen2VLImageProcessor": _qwen2_vl,
            "PixtralImageProcessor": _pixtral}


def files_config(files: dict[str, bytes] | None) -> dict | None:
    """The configuration `preprocess` takes, from a checkpoint's processor files (name -> bytes; None where it has
    neither). transformers 5 writes one processor_config.json holding the image processor's settings under
    "image_processor"; older checkpoints keep those in preprocessor_config.json, beside a processor_config.json of
    the processor's own keys (num_image_tokens, ...): merged here as processor.to_dict() nests them."""
    loaded = {name: json.loads(data) for name, data in (files or {}).items()
              if name in ("processor_config.json", "preprocessor_config.json")}
    outer, inner = loaded.get("processor_config.json"), loaded.get("preprocessor_config.json")
    if isinstance(outer, dict) and isinstance(inner, dict) and not isinstance(outer.get("image_processor"), dict) \
            and "image_processor_type" not in outer:
        return {**outer, "image_processor": inner}
    return outer if outer is not None else inner


# Families whose processing is one fixed pipeline (pad, resize, crop, rescale, normalise): what pixel_steps describes.
FIXED_PIPELINES = ("CLIPImageProcessor", "LlavaImageProcessor", "SiglipImageProcessor", "Gemma3ImageProcessor")


def pixel_steps(config: dict) -> dict | None:
    """The processing of `config` as DecoderMeta.pixel_steps (serialization/decoder_meta.fbs PixelSteps), which the C++
    runner (tools/etmlx_decode/pixel_steps.cpp) follows to make the same pixels `preprocess` makes; None for a family
    or setting it cannot follow (tiles, patches, other resampling filters)."""
    try:
        name, s = _settings(config)
    except PreprocessError:
        return None
    if name not in FIXED_PIPELINES:
        return None
    steps = {"pad_colour": [], "resize": "", "size": [], "resample": 0, "crop": [], "rescale": 0.0, "mean": [],
             "std": []}
    if name == "LlavaImageProcessor" and s.get("do_pad"):
        steps["pad_colour"] = [int(m * 255) for m in s["image_mean"]] if s["image_mean"] else [0, 0, 0]
    if s["do_resize"]:
        size = s["size"]
        if int(s["resample"]) not in (BILINEAR, BICUBIC):
            return None
        if "shortest_edge" in size and "longest_edge" not in size and name in ("CLIPImageProcessor",
                                                                               "LlavaImageProcessor"):
            steps["resize"], steps["size"] = "shortest_edge", [int(size["shortest_edge"])]
        elif "height" in size and "width" in size:
            steps["resize"], steps["size"] = "fixed", [int(size["height"]), int(size["width"])]
        else:
            return None
        steps["resample"] = int(s["resample"])
    if s.get("do_center_crop") and name in ("CLIPImageProcessor", "LlavaImageProcessor"):
        steps["crop"] = [int(s["crop_size"]["height"]), int(s["crop_size"]["width"])]
    if s["do_rescale"]:
        steps["rescale"] = float(s["rescale_factor"])
    if s["do_normalize"]:
        steps["mean"], steps["std"] = ([float(v) for v in np.broadcast_to(np.asarray(s[k], dtype=np.float32), (3,))]
                                       for k in ("image_mean", "image_std"))
    return steps


def check_config(config: dict) -> str:
    """The processor type `config` names, or PreprocessError (unknown type, unsupported setting) in one line."""
    return _settings(config)[0]


def preprocess(images: list[Image.Image], config: dict, prompt_images: int | None = None) -> ImageBatch:
    """One prompt's RGB images (in prompt order) to the vision method's inputs; see the module docstring.
    `prompt_images`: how many images the prompt holds when `images` are only some of them."""
    name, settings = _settings(config)
    if not images:
        raise PreprocessError("no images to preprocess")
    bad = [type(i).__name__ for i in images if not isinstance(i, Image.Image) or i.mode != "RGB"]
    if bad:
        raise PreprocessError(f"preprocess takes RGB PIL images (llm/vision/images.py's load_image), got {bad[0]}")
    if prompt_images is not None and prompt_images < len(images):
        raise PreprocessError(f"{len(images)} images of a prompt said to hold {prompt_images}")
    settings["prompt_images"] = prompt_images or len(images)
    batch = FAMILIES[name](list(images), settings, name)
    if name in ("CLIPImageProcessor", "LlavaImageProcessor"):
        batch.image_tokens = _llava_tokens(batch, settings)
    return batch
