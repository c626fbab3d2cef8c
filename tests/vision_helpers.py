"""What the vision-language tests share: random images, a one-image chat, and how far a quantized program's tokens are
from the float model's choices."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def random_image(seed: int, height: int, width: int) -> Image.Image:
    """An RGB image of uniform noise, the same for the same seed and size."""
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def one_image_chat(image=None) -> list[dict]:
    """A user turn "t5 t17 <image> t99 t3" (the word tokenizer's words around the image), with `image` in its part
    or, without one, the part alone (for a processor's chat template)."""
    part = {"type": "image", "image": image} if image is not None else {"type": "image"}
    return [{"role": "user", "content": [{"type": "text", "text": "t5 t17"}, part, {"type": "text", "text": "t99 t3"}]}]


def worst_gap(logits: torch.Tensor, tokens: list[int]) -> float:
    """The largest gap, in nats, between the float model's best log-probability and that of the token the program
    chose, over the steps: `logits` [steps, V] the eager model's at each step, `tokens` the program's."""
    logprobs = torch.log_softmax(logits.float(), -1)
    return (logprobs.max(-1).values - logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]).max().item()
