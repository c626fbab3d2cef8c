"""`etmlx demo --classifier`: export a small classifier, run its .pte on MLX, compare with eager PyTorch."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from backends.mlx.exporter.export import export_to_pte
from backends.mlx.runtime.runner import load_method


class TinyClassifier(torch.nn.Module):
    """A deterministic two-layer MLP whose head returns log-probabilities and the top 3 classes."""

    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 10):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                        torch.nn.Linear(hidden, classes))

    def forward(self, x):
        logp = torch.log_softmax(self.body(x), dim=-1)
        top = torch.topk(logp, 3, dim=-1)
        return logp, top.values, top.indices


def main(out: Path, batch: int = 4) -> int:
    model = TinyClassifier().eval()
    x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    result = export_to_pte(model, (x,))
    export_s = time.perf_counter() - t0
    path = result.save(out)
    print(f"exported {type(model).__name__} to {path} ({len(result.pte)} bytes) in {export_s:.1f}s")
    print(f"  {result.summary()}")

    method = load_method(path)
    t0 = time.perf_counter()
    outputs = method.execute([x])
    run_ms = (time.perf_counter() - t0) * 1e3
    with torch.no_grad():
        expected = model(x)
    max_err = (outputs[0] - expected[0]).abs().max().item()
    same_top = torch.equal(outputs[2], expected[2])
    print(f"ran it in the ExecuTorch runtime on MLX in {run_ms:.2f} ms (first call)")
    print(f"  max |log-prob difference| vs eager PyTorch: {max_err:.2e}")
    print(f"  top-3 classes per row (etmlx): {outputs[2].tolist()}")
    print(f"  same top-3 as eager: {same_top}")
    return 0 if (same_top and max_err < 1e-4) else 1
