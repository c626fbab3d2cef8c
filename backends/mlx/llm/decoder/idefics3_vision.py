"""The vision method of an Idefics3 / SmolVLM program: one tile's pixels to its image embeddings.

The checkpoint's image processor cuts an image into tiles of the vision tower's size (rows x cols of them plus the
whole image resized to one tile; llm/vision/preprocess.py), and get_image_features encodes each tile alone: the
SigLIP-style tower over the tile's patches, the pixel-shuffle connector, the projection. A tile the processor
makes is never padded (every tile is the tower's square), so the patch mask is all ones; the patch position ids it
gives then are a constant, computed here once by the eager embeddings' own arithmetic, which keeps bucketize and the
boolean indexing of get_image_features out of the exported graph.

    Idefics3Vision(model)(pixels [N, C, S, S]) -> [N, image_seq_len, D]    (N tiles, encoded independently)
"""

from __future__ import annotations

import torch
from torch import nn


def full_tile_positions(embeddings: nn.Module, height: int, width: int) -> torch.Tensor:
    """[1, patches] position ids the eager Idefics3VisionEmbeddings gives an unpadded tile of height x width."""
    patch = embeddings.patch_size
    mask = torch.ones(1, height // patch, width // patch, dtype=torch.bool)
    captured = {}
    original = embeddings.position_embedding.forward

    def spy(ids):
        captured["ids"] = ids.clone()
        return original(ids)

    embeddings.position_embedding.forward = spy
    try:
        with torch.no_grad():
            embeddings(torch.zeros(1, 3, height, width, dtype=embeddings.patch_embedding.weight.dtype), mask)
    finally:
        del embeddings.position_embedding.forward
    return captured["ids"]


class Idefics3Vision(nn.Module):
    """Tiles [N, C, S, S] (S the vision config's image_size) to embeddings [N, T, D], as get_image_features."""

    def __init__(self, model: nn.Module):
        super().__init__()
        inner = model.model
        self.vision, self.connector = inner.vision_model, inner.connector
        size = model.config.vision_config.image_size
        self.register_buffer("positions", full_tile_positions(self.vision.embeddings, size, size), persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        embeddings = self.vision.embeddings
        pixels = pixel_values.to(embeddings.patch_embedding.weight.dtype)
        hidden = embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        hidden = hidden + embeddings.position_embedding(self.positions)
        hidden = self.vision.encoder(inputs_embeds=hidden, attention_mask=None).last_hidden_state
        hidden = self.vision.post_layernorm(hidden)
        return self.connector(hidden).float()

    @staticmethod
    def eager_pixels(pixels: torch.Tensor) -> torch.Tensor:
        """The family forward's pixel_values for tiles [N, C, S, S]: one image of N tiles [1, N, C, S, S]."""
        return pixels[None]
