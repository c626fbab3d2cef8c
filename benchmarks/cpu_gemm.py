"""`etmlx bench gemm`: MLX matrix products on the CPU with etmlx's OpenBLAS route against the stock wheel.

Each configuration is timed in two fresh processes: one that imports only `mlx.core` (MLX's own
BLAS: the reference BLAS in the Linux `mlx[cpu]` wheel, and its generic half-precision kernel) and one
that imports `backends.mlx` first (GEMMs routed to OpenBLAS, and products written the way the etmlx interpreter does on the CPU:
one-row ones as one-column ones, which go to sgemv, and half precision in float32). Shapes are those of a
decode step (1 row) and a 128-token prefill through a 768 -> 2048 linear and a 32000-entry lm_head.
"""

from __future__ import annotations

import json
import subprocess
import sys

SHAPES = [(1, 768, 2048), (128, 768, 2048), (1, 768, 32000), (128, 768, 32000)]
DTYPES = ("float32", "bfloat16")

_TIMER = r"""
import json, sys, time
if sys.argv[1] == "etmlx":
    import backends.mlx  # noqa: F401  (loads the GEMM route before MLX's first matmul)
import mlx.core as mx
rows, k, n = (int(v) for v in sys.argv[3:6])
dtype = getattr(mx, sys.argv[2])
a = mx.random.normal((rows, k)).astype(dtype)
w = mx.random.normal((n, k)).astype(dtype)
mx.eval(a, w)
if sys.argv[1] == "etmlx":
    # What the interpreter's device_matmul does on the CPU: half precision computed in float32, and a
    # one-row product written as a one-column one (which the route sends to sgemv).
    def product():
        a32, w32 = a.astype(mx.float32), w.astype(mx.float32)
        out = (w32 @ a32.T).T if rows == 1 else a32 @ w32.T
        return out.astype(dtype)
else:
    product = lambda: a @ w.T
for _ in range(2):
    mx.eval(product())
times = []
deadline = time.perf_counter() + 2.0
while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
    start = time.perf_counter()
    mx.eval(product())
    times.append(time.perf_counter() - start)
times.sort()
print(json.dumps({"ms": 1e3 * times[len(times) // 2]}))
"""


def _time(variant: str, dtype: str, rows: int, k: int, n: int) -> float:
    proc = subprocess.run([sys.executable, "-c", _TIMER, variant, dtype, str(rows), str(k), str(n)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"timing {variant} {dtype} {rows}x{k}x{n} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["ms"]


def main(json_path: str | None = None) -> int:
    rows_out = []
    print(f"{'dtype':<9} {'rows x in x out':<18} {'mlx wheel ms':>13} {'etmlx ms':>9} {'speedup':>8}")
    for dtype in DTYPES:
        for rows, k, n in SHAPES:
            stock = _time("stock", dtype, rows, k, n)
            ours = _time("etmlx", dtype, rows, k, n)
            rows_out.append({"dtype": dtype, "rows": rows, "in": k, "out": n, "stock_ms": stock, "etmlx_ms": ours,
                             "speedup": stock / ours})
            print(f"{dtype:<9} {f'{rows}x{k}x{n}':<18} {stock:>13.3f} {ours:>9.3f} {stock / ours:>7.1f}x", flush=True)
    if json_path:
        from pathlib import Path

        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
