"""`etmlx bench qmm`: the CPU quantized matmul (QuantizedLinearNode) of the cpu kernel set against
MLX's own (mx::quantized_matmul, what the device kernel set runs), on exported programs.

Shape: a Qwen2.5-0.5B MLP projection, [rows x 896] x [896 x 4864], 4-bit, group 64, float32 activations,
at 1 row (decode) and 64 rows (prefill). Each program holds `layers` independent linears on the same
input: with 1 the weights stay in the CPU's caches, with 16 (43 MB) they must come from memory on
every call, as a decoder's do. Reported per linear: median milliseconds, and for the cpu set the
weight bytes read per second, next to the machine's read bandwidth measured here (numpy sums over a
512 MB array, on 1 thread and on as many threads as the pool uses).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from benchmarks.timing import median_ms

K, N, BITS, GROUP = 896, 4864, 4, 64


def read_bandwidth_gbs(threads: int, megabytes: int = 512) -> float:
    """Best of 5 passes of numpy sums over one array, split among `threads` (numpy releases the GIL)."""
    data = np.ones(megabytes * 2 ** 20 // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, data.nbytes / (time.perf_counter() - start) / 1e9)
    return best


class _Linears(torch.nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        from backends.mlx.llm.quantize.affine import quantize_tensor
        from backends.mlx.llm.quantize.modules import QuantizedLinear

        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            QuantizedLinear(*quantize_tensor(torch.randn(N, K) * 0.05, GROUP, BITS), GROUP, BITS) for _ in range(layers))

    def forward(self, x):
        return tuple(layer(x) for layer in self.layers)


def _weight_bytes(model: _Linears) -> int:
    lin = model.layers[0]
    return len(model.layers) * sum(t.numel() * t.element_size() for t in (lin.weight, lin.scales, lin.biases))


def _load(pte: bytes, kernels: str):
    from backends.mlx.runtime import options
    from backends.mlx.runtime.runner import load_method

    with options.overridden("ETMLX_KERNELS", kernels):  # read when the program is loaded
        return load_method(pte)


def main(json_path: str | None = None, repeats: int | None = None) -> int:
    from backends.mlx.exporter.export import export_to_pte
    from backends.mlx.runtime import kernels_info

    info = kernels_info()
    threads = info["threads"]
    floor1, floor_n = read_bandwidth_gbs(1), read_bandwidth_gbs(threads)
    print(f"quantized rows variant {info['isa']}, {info['activations']} activations, {threads} threads; "
          f"read bandwidth (numpy sum, 512 MB): "
          f"{floor1:.1f} GB/s on 1 thread, {floor_n:.1f} GB/s on {threads}")
    print(f"{'rows':>4} {'layers':>6} {'weights MB':>10} {'mlx ms':>8} {'etmlx ms':>9} {'speedup':>8} {'etmlx GB/s':>10}")
    records = []
    for layers in (1, 16):
        model = _Linears(layers)
        weight_bytes = _weight_bytes(model)
        for rows in (1, 64):
            x = torch.randn(rows, K)
            pte = export_to_pte(model, (x,)).pte
            times = {}
            for kernels in ("device", "cpu"):
                method = _load(pte, kernels)
                count = repeats or (20 if kernels == "cpu" or rows == 1 else 3)
                times[kernels] = median_ms(lambda: method.execute([x]), count, warmup=2) / layers
            gbs = weight_bytes / layers / (times["cpu"] * 1e-3) / 1e9
            record = {"rows": rows, "layers": layers, "weight_mb": weight_bytes / 1e6, "mlx_ms": times["device"],
                      "etmlx_ms": times["cpu"], "speedup": times["device"] / times["cpu"], "etmlx_gbs": gbs}
            records.append(record)
            print(f"{rows:>4} {layers:>6} {record['weight_mb']:>10.1f} {times['device']:>8.3f} {times['cpu']:>9.3f} "
                  f"{record['speedup']:>7.1f}x {gbs:>10.1f}", flush=True)
    if json_path:
        from pathlib import Path

        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"isa": info["isa"], "activations": info["activations"],
                                               "threads": threads, "read_gbs_1": floor1,
                                               "read_gbs_n": floor_n, "records": records}, indent=1))
    return 0
