"""The export check of a vision-language program (verify.py's, with an image).

The vision method on seeded random pixels must give the eager vision forward's embeddings (within verify.py's
tolerance, relative to their largest magnitude); then the decoder, given those embeddings at a prompt's image
positions, must decode the eager model's greedy tokens for the same pixels (model(input_ids, pixel_values), with
Gemma 3's token_type_ids marking the prompt's image positions: its images attend both ways, image_blocks.py).
LLaVA-NeXT's and LLaVA-OneVision's decode runs on a whole image's tiles, packed on the host (anyres.py: the family's
pack, with the program's stored image_newline) against the forward's own packing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from backends.mlx.llm.decoder import anyres
from backends.mlx.llm.decoder.image_blocks import bidirectional_images
from backends.mlx.llm.decoder.image_encoder import PromptImages, processor_in
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.verify import (DECODE_STEPS, PROMPT_SEED, VerificationError, VerificationReport,
                                             compare_greedy, tolerance, verification_prompt)
from backends.mlx.llm.decoder.vision_export import vision_encoder
from backends.mlx.llm.decoder.release_memory import collect_if_large
from backends.mlx.llm.sampler.params import SamplingParams

TEXT_TOKENS = 8  # around the image: half before, half after


def verify_with_image(model: torch.nn.Module, pte: Path, steps: int = DECODE_STEPS) -> VerificationReport:
    """Raise VerificationError naming what differs; the report says how close the vision method came."""
    decoder = Decoder(Path(pte))
    meta = decoder.meta
    generated = 1 + steps
    image = meta.image_token_id
    family, packing = anyres.parse(meta.image_prompt) or (None, None)
    # anyres: a whole image of tiles, packed on the host as at run time, at a size that leaves padding to drop
    size = family.verify_size(packing) if family is not None else None
    taken = family.feature_count(packing, *size) if family is not None else meta.image_tokens
    text = [t if t != image else (t + 1) % meta.vocab_size for t in verification_prompt(meta.vocab_size, TEXT_TOKENS)]
    prompt = text[:TEXT_TOKENS // 2] + [image] * taken + text[TEXT_TOKENS // 2:]
    if len(prompt) + generated > meta.max_seq_len:
        raise VerificationError(f"max_seq_len {meta.max_seq_len} leaves no room to verify with an image "
                                f"({taken} image tokens + {TEXT_TOKENS} + {generated}): raise it or "
                                "pass verify=False / --no-verify")
    pixels = torch.randn(1, *meta.image_size, generator=torch.Generator().manual_seed(PROMPT_SEED))
    got = decoder.images.method.execute([pixels])[0][0].float()
    encoder = vision_encoder(model, processor_in(pte))
    with torch.no_grad():  # a family whose method is not transformers' own call has the call as `reference`
        want = getattr(encoder, "reference", encoder)(pixels)[0].float()
    error = float((got - want).abs().max())
    tol = tolerance(model) * max(1.0, float(want.abs().max()))
    if not error <= tol:
        raise VerificationError(f"{pte}'s vision method differs from the eager vision forward: max error {error:.4g} > "
                                f"tolerance {tol:.3g}")
    positions = torch.tensor([i for i, t in enumerate(prompt) if t == image], dtype=torch.int64)
    embeds = got
    if family is not None:
        pixels = torch.randn(family.tiles(packing, *size), *meta.image_size,
                             generator=torch.Generator().manual_seed(PROMPT_SEED + 1))
        embeds = decoder.images.anyres(pixels, size)

    marked = set(positions.tolist())

    def reference(ids):
        if family is not None:  # the family's forward packs the tiles itself (pack_image_features)
            return model(input_ids=torch.tensor([ids]), pixel_values=pixels[None],
                         image_sizes=torch.tensor([size])).logits[0]
        # a tiled family's forward takes pixels [1, tiles, C, H, W] (idefics3_vision.py)
        eager = encoder.eager_pixels(pixels) if hasattr(encoder, "eager_pixels") else pixels
        images = encoder.model_inputs(eager, ids) if hasattr(encoder, "model_inputs") else {"pixel_values": eager}
        if bidirectional_images(model.config):  # the prompt's image tokens see their whole image (image_blocks.py)
            images["token_type_ids"] = torch.tensor([[int(i in marked) for i in range(len(ids))]])
        return model(input_ids=torch.tensor([ids]), **images).logits[0]

    steps = list(decoder.stream(prompt, generated, SamplingParams(), stop_at_eos=False,
                                images=PromptImages(positions, embeds)))
    del decoder  # the program's weights freed before the eager forward (verify.py)
    collect_if_large(model)
    report = compare_greedy(model, Path(pte), steps, prompt, reference=reference)
    report.vision_error = error
    return report
