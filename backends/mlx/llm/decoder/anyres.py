"""The "anyres" families, whose image is a base tile plus a grid of tiles packed on the host: LLaVA-NeXT
(llava_next.py) and LLaVA-OneVision (llava_onevision.py). Both modules offer the same functions (tiled, tiles,
feature_count, pack, verify_size; the image_newline as named data NEWLINE_KEY); DecoderMeta.image_prompt's "kind"
says which one a program takes.

    family, prompt = parse(meta.image_prompt) or (None, None)
    family.feature_count(prompt, height, width, images)
"""

from __future__ import annotations

from types import ModuleType

from backends.mlx.llm.decoder import llava_next, llava_onevision

FAMILIES = (llava_next, llava_onevision)


def parse(prompt_json: str) -> tuple[ModuleType, dict] | None:
    """(the family's module, its prompt settings) of an anyres program's image_prompt; None for another kind."""
    for family in FAMILIES:
        prompt = family.parse(prompt_json)
        if prompt is not None:
            return family, prompt
    return None
