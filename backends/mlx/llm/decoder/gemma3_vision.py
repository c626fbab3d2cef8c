"""Gemma 3 multimodal (Gemma3ForConditionalGeneration): its vision method and how its prompts name an image.

The vision method is the model's get_image_features: the SigLIP tower's last hidden state, average-pooled by the
projector to mm_tokens_per_image tokens, normed and projected to the decoder's width. In a prompt the chat template
writes the image mark (the tokenizer's boi_token, "<start_of_image>"), which Gemma3Processor replaces in the text
with its full image sequence, "\\n\\n" boi, image_seq_length image tokens, eoi "\\n\\n", before tokenizing; etmlx
does the same with the parts recorded in DecoderMeta.image_text. Its image tokens attend to their whole image
(image_blocks.py).
"""

from __future__ import annotations

import torch
from torch import nn


class Gemma3Vision(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model.model.get_image_features(pixel_values=pixel_values).pooler_output.float()


def gemma3_image_text(tokenizer) -> list[str]:
    """DecoderMeta.image_text: [mark, before, image token, after], from the tokenizer's Gemma 3 tokens."""
    names = ("boi_token", "image_token", "eoi_token")
    missing = [name for name in names if not isinstance(getattr(tokenizer, name, None), str)]
    if missing:
        raise ValueError(f"a Gemma 3 tokenizer names its image tokens ({', '.join(missing)} missing): export it "
                         "with the checkpoint's tokenizer")
    boi, image, eoi = (getattr(tokenizer, name) for name in names)
    return [boi, f"\n\n{boi}", image, f"{eoi}\n\n"]
