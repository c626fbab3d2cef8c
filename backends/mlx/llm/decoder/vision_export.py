"""The vision method of a vision-language program: pixels to the embeddings the decoder takes at image positions.

A vision-language `.pte` holds two methods over one file: `forward`, the decoder (kv_cache.py's StaticCacheLM
around the checkpoint's whole ...ForConditionalGeneration, taking `image_embeds` [B, L, D] beside the tokens), and
`vision` (VISION_METHOD): pixel values [N, C, H, W], as the checkpoint's image processor makes them, to
embeddings [N, T, D], T the image tokens one image takes in the prompt (Idefics3 / SmolVLM: one tile, an image
being several, idefics3_vision.py; LLaVA-NeXT and LLaVA-OneVision: one tile, the host packing an image's tiles,
llava_next.py, llava_onevision.py). Both
are the family's own transformers forward: the vision method is the model's get_image_features (vision tower,
feature layer and selection, projector), so what the decoder receives at the image positions is what the family's
forward would merge there.

    encoder = vision_encoder(model)          # None for a text-only model
    encoder(pixels [N, C, H, W]) -> [N, T, D] float32
"""

from __future__ import annotations

import torch
from torch import nn

from backends.mlx.llm.decoder.gemma3_vision import Gemma3Vision, gemma3_image_text
from backends.mlx.llm.decoder.idefics3_vision import Idefics3Vision
from backends.mlx.llm.decoder import llava_next, llava_onevision, mistral3_vision
from backends.mlx.llm.decoder.model_support import check_vision_family, is_vision_language
from backends.mlx.llm.decoder.tile_prompt import tile_prompt, tile_size
from backends.mlx.llm.vision.preprocess import files_config

VISION_METHOD = "vision"
# The image processor's files a checkpoint may carry (transformers 5 writes processor_config.json, holding the
# image processor's settings; older checkpoints preprocessor_config.json): stored in the program as they are.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


class LlavaVision(nn.Module):
    """LLaVA 1.5: CLIP vision tower, the configured feature layer (its CLS position dropped under the "default"
    strategy), the MLP projector."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        config = self.model.config
        out = self.model.model.get_image_features(pixel_values=pixel_values,
                                                  vision_feature_layer=config.vision_feature_layer,
                                                  vision_feature_select_strategy=config.vision_feature_select_strategy)
        return torch.stack(list(out.pooler_output)).float()


def _one_size(model: nn.Module, processor: dict | None) -> dict:
    """The image processor's config of a family whose vision method is exported for one image size (read there)."""
    if processor is None:
        raise ValueError(f"a {model.config.model_type} vision method is exported for one image size: it needs the "
                         "image processor's config")
    return processor


def _qwen2_vl(model: nn.Module, processor: dict | None) -> nn.Module:
    from backends.mlx.llm.decoder.qwen2_vl import Qwen2VLVision, grid_for

    return Qwen2VLVision(model, grid_for(_one_size(model, processor)))


def _mistral3(model: nn.Module, processor: dict | None) -> nn.Module:
    side = mistral3_vision.program_side(model.config, _one_size(model, processor))
    return mistral3_vision.Mistral3Vision(model, side)


# model_type -> (model, the image processor's config or None) -> the vision method's module
ENCODERS = {"llava": lambda model, _processor: LlavaVision(model),
            "gemma3": lambda model, _processor: Gemma3Vision(model), "qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_vl,
            "idefics3": lambda model, _processor: Idefics3Vision(model),
            "smolvlm": lambda model, _processor: Idefics3Vision(model),
            "llava_next": lambda model, _processor: llava_next.LlavaNextVision(model),
            "llava_onevision": lambda model, _processor: llava_onevision.LlavaOnevisionVision(model),
            "mistral3": _mistral3}
ANYRES = ("llava_next", "llava_onevision")  # tiles packed on the host, image_newline stored (anyres.py)
TILED = ("idefics3", "smolvlm")  # an image is several tiles, one vision call each (tile_prompt.py)
# How a family's prompt text names an image, beyond the image token expanded in ids (DecoderMeta.image_text).
IMAGE_TEXT = {"gemma3": gemma3_image_text}


def vision_encoder(model: nn.Module, processor: dict | None = None) -> nn.Module | None:
    """The vision method's module for a vision-language model; None for a text-only one. `processor`: the
    checkpoint's image processor config (families whose method takes one image size read it from there)."""
    config = model.config
    if not is_vision_language(config):
        return None
    check_vision_family(config)
    return ENCODERS[config.model_type](model, processor).eval()


def processor_config(files: dict[str, bytes] | None) -> dict | None:
    """The image processor's config from a checkpoint's PROCESSOR_FILES (name -> bytes), as the program keeps them."""
    return files_config(files)


def image_shape(model: nn.Module) -> list[int]:
    """One image's pixel input [C, H, W], from the vision config."""
    vision = model.config.vision_config
    size = vision.image_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    return [getattr(vision, "num_channels", 3), height, width]


def vision_spec(model: nn.Module, encoder: nn.Module) -> tuple:
    """DecoderMeta.build's `vision`: (image_token_id, image_tokens, image_embed_dim, VISION_METHOD, image_size),
    the token count and width read from one eager call; image_size is the encoder's `pixel_shape` where it has one
    (Qwen2-VL: [patches, values per patch])."""
    shape = getattr(encoder, "pixel_shape", None) or image_shape(model)
    with torch.no_grad():
        probe = encoder(torch.zeros(1, *shape))
    return model.config.image_token_id, int(probe.shape[1]), int(probe.shape[2]), VISION_METHOD, shape


def image_text(model: nn.Module, tokenizer) -> list[str]:
    """DecoderMeta.image_text of a vision-language model: [] where the image token is expanded in ids."""
    rule = IMAGE_TEXT.get(getattr(model.config, "model_type", ""))
    if rule is None:
        return []
    if tokenizer is None:
        raise ValueError(f"a {model.config.model_type} program needs its tokenizer to name images in prompts")
    return rule(tokenizer)


def vision_data(model: nn.Module) -> dict[str, bytes]:
    """Named data a family's program carries for its host-side image code (the anyres families' image_newline)."""
    return llava_next.newline_blob(model) if model.config.model_type in ANYRES else {}


def image_prompt(model: nn.Module, tokenizer, processor_files: dict, tile_tokens: int) -> str:
    """DecoderMeta.image_prompt as JSON: a tiled family's image prompt pieces (tile_prompt.py), the anyres
    families' packing settings (llava_next.py, llava_onevision.py), Mistral 3's rows (mistral3_vision.py); "" for
    others."""
    import json

    kind = model.config.model_type
    if kind == "llava_next":
        return json.dumps(llava_next.image_prompt(model, processor_config(processor_files)))
    if kind == llava_onevision.MODEL_TYPE:
        return json.dumps(llava_onevision.image_prompt(model, processor_config(processor_files), tile_tokens))
    if kind not in (*TILED, mistral3_vision.MODEL_TYPE):
        return ""
    if tokenizer is None:
        raise ValueError(f"{kind}: exporting needs the tokenizer (the image prompt's tokens)")
    if kind == mistral3_vision.MODEL_TYPE:
        return json.dumps(mistral3_vision.row_prompt(tokenizer, tile_tokens))
    processor = processor_config(processor_files)
    tile, size = tile_size(processor), model.config.vision_config.image_size
    if tile != size:  # the vision method's patch positions are those of a whole tower-sized tile
        raise ValueError(f"the image processor's tiles are {tile} pixels, the vision tower takes {size}: not supported")
    return json.dumps(tile_prompt(tokenizer, processor, tile_tokens))
