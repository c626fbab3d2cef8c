"""What the sampler benchmarks share: a median timer and the one-read-of-the-logits baseline."""

from __future__ import annotations

import statistics
import time

import torch


class ReadOnce(torch.nn.Module):
    """A program that reads the logits once: the floor any sampler is compared with."""

    def forward(self, logits):
        return logits.amax(-1)


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
