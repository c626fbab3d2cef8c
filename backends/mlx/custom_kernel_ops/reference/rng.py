"""MLX's counter-based random bits, reproduced bit for bit in NumPy.

MLX derives a key from a seed as the pair (seed >> 32, seed & 0xffffffff) of
uint32 words and fills an n-word draw with Threefry-2x32 (20 rounds): word i
and word i + ceil(n/2) of the output are the two halves of the hash of the
counter pair (i, ceil(n/2) + i) for i < floor(n/2); when n is odd, the middle
word floor(n/2) is the first half of the hash of (floor(n/2), 0).
tests/test_rng_reference.py checks this against mlx.core.random for many keys
and shapes.
"""

from __future__ import annotations

import numpy as np

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def key(seed: int) -> tuple[int, int]:
    """The (hi, lo) uint32 key MLX makes from a seed (negative seeds wrap as uint64)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s >> 32, s & 0xFFFFFFFF


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k: tuple[int, int], c0: np.ndarray, c1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32 with 20 rounds over uint32 counter arrays (wrapping arithmetic)."""
    ks = (np.uint32(k[0]), np.uint32(k[1]), np.uint32(k[0]) ^ np.uint32(k[1]) ^ _PARITY)
    with np.errstate(over="ignore"):
        x0 = c0.astype(np.uint32) + ks[0]
        x1 = c1.astype(np.uint32) + ks[1]
        for i in range(5):
            for r in _ROTATIONS[i % 2]:
                x0 = x0 + x1
                x1 = _rotl(x1, r) ^ x0
            x0 = x0 + ks[(i + 1) % 3]
            x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def bits(shape, seed: int) -> np.ndarray:
    """uint32 random bits of `shape` from one key, as mlx.core.random.bits(shape, key=key(seed))."""
    n = int(np.prod(shape, dtype=np.int64))
    out = np.empty(n, dtype=np.uint32)
    half, odd = n // 2, n % 2
    k = key(seed)
    i = np.arange(half, dtype=np.uint32)
    a, b = threefry2x32(k, i, i + np.uint32(half + odd))
    out[:half] = a
    out[half + odd:] = b
    if odd:
        out[half] = threefry2x32(k, np.array([half], np.uint32), np.array([0], np.uint32))[0][0]
    return out.reshape(shape)


def uniform(shape, seed: int) -> np.ndarray:
    """MLX's uniform in [0, 1): float32(bits) / float32(2**32 - 1), clamped just below 1."""
    u = bits(shape, seed).astype(np.float32) / np.float32(4294967295.0)
    return np.minimum(u, np.nextafter(np.float32(1), np.float32(0)))


def gumbel(u: np.ndarray) -> np.ndarray:
    """-log(-log(u)) in float32, each log correctly rounded (computed in float64, rounded once)."""
    with np.errstate(divide="ignore"):
        inner = (-np.log(u.astype(np.float64))).astype(np.float32)
        return (-np.log(inner.astype(np.float64))).astype(np.float32)
