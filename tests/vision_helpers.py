"""What the vision-language tests share: how far a quantized program's tokens are from the float model's choices."""

from __future__ import annotations

import torch


def worst_gap(logits: torch.Tensor, tokens: list[int]) -> float:
    """The largest gap, in nats, between the float model's best log-probability and that of the token the program
    chose, over the steps: `logits` [steps, V] the eager model's at each step, `tokens` the program's."""
    logprobs = torch.log_softmax(logits.float(), -1)
    return (logprobs.max(-1).values - logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]).max().item()
