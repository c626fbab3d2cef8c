"""What a small array made from host data costs the GPU backend, against the same array computed by a kernel.

Run on the GPU host with only numpy and mlx (`etmlx bench gpu-kit` copies it into the kit):

    python3 gpu_host_arrays.py [--rounds 3] [--iters 300]

Each timed step adds n small int32 arrays to a slice of a device array and evaluates one sum: `host` makes each
a 64-byte array from numpy (what host folding, runtime/host_fold.h, hands MLX for each folded value), `host8` a
4-byte scalar (MLX's CUDA scalar pool), `device` computes it with mx.arange. Why it exists: on CUDA, MLX's
allocator puts host data in managed memory and, once its buffer cache holds device buffers of that size, moves one
back to managed memory per array; this measured ~15 us an array on an H200 (2026-11-27), more than the node it
saves, so folding is off by default there. Prints median ms per step for n in 0, 10 and 40.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def step_ms(mx, base, kind: str, n: int, iters: int, warmup: int = 20) -> float:
    host = [np.arange(i, i + 16, dtype=np.int32) for i in range(n)]
    times = []
    for it in range(iters + warmup):
        t0 = time.perf_counter()
        y = base[:16]
        for i in range(n):
            if kind == "host":
                a = mx.array(host[i])
            elif kind == "host8":
                a = mx.array(np.int32(i + it))
            else:
                a = mx.arange(i, i + 16, dtype=mx.int32)
            y = y + a
        mx.eval(y.sum() + base.sum())
        if it >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    import mlx.core as mx

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=300)
    a = parser.parse_args(argv)
    print("device", mx.default_device())
    base = mx.arange(4096, dtype=mx.int32)
    mx.eval(base)
    for r in range(a.rounds):
        for n in (0, 10, 40):
            row = {kind: round(step_ms(mx, base, kind, n, a.iters), 4) for kind in ("host", "host8", "device")}
            print(r, n, row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
