"""Image tokens that attend to each other both ways: Gemma 3's image block mask.

Gemma 3 (transformers' token_type_ids mask) lets every image token of a prompt see every token of its own image,
later ones included, inside the causal mask, on full and sliding layers alike (a sliding layer still applies its
window). An image is a run of consecutive image tokens within one call: a prefill holds the whole prompt, so each
image is whole in it; a decode step's single token sees what the causal mask shows it.

etmlx expresses the block as each query's upper key position: its own position for a text token, its image run's
last position for an image token (attention.py's mask then shows keys <= that limit). No extra program input:
the limit is computed from the tokens inside the program.
"""

from __future__ import annotations

import torch

# model_types whose image tokens attend bidirectionally within their image.
BIDIRECTIONAL_IMAGES = ("gemma3",)


def bidirectional_images(config) -> bool:
    return getattr(config, "model_type", None) in BIDIRECTIONAL_IMAGES


def image_positions(tokens: torch.Tensor, image_embeds: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """[B, L] bool: the positions that take an image embedding: the image token where the host gave a vector.

    The token alone is not enough: a model may generate its image token, and then (as in transformers, whose
    decode steps carry no pixels) that position embeds the token as text. The host leaves image_embeds zero
    everywhere but at a prompt's image positions, and a projected image vector is never exactly zero."""
    return (tokens == image_token_id) & image_embeds.ne(0).any(dim=-1)


def image_limits(image: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """[B, L] the last key position each query may see: positions, raised for an image position (`image`, from
    image_positions) to its run's end.

    Two image tokens share a run when no other token lies between them, i.e. when as many non-image tokens precede
    both ([B, L, L] booleans, the size of the prefill's own attention mask; a decode step's is 1 x 1). A row's
    padding (index >= lengths) is never an image."""
    length = image.shape[1]
    index = torch.arange(length).unsqueeze(0)
    if lengths is not None:
        image = image & (index < lengths.unsqueeze(1))
    texts_before = torch.cumsum((~image).to(torch.int32), dim=1)  # [B, L]
    same_run = texts_before.unsqueeze(2) == texts_before.unsqueeze(1)  # [B, L(query), L(key)]
    later = index.view(1, length, 1) < index.view(1, 1, length)
    after = (same_run & later & image.unsqueeze(1)).sum(dim=2)  # image tokens after the query in its run
    return positions + torch.where(image, after, torch.zeros_like(after))
