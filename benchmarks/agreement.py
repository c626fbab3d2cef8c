"""`etmlx bench agreement`: how often the host reference reproduces the device's token ids.

Random logits (normal, scaled 0.5/2/8), temperatures 0.3..1.5 and 0, fresh seeds; every row
where the two disagree is reported with the gap between its two best scores (a near-tie
from the platform's log rounding, or a real bug if the gap is large).
"""

from __future__ import annotations

import torch

from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head
from backends.mlx.custom_kernel_ops.reference.sample import sample_with_margins
from backends.mlx.runtime.runner import load_method

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(rows: int = 2000, vocab: int = 32000, batch: int = 8) -> int:
    gen = torch.Generator().manual_seed(2024)
    worst = 0
    for name, dtype in DTYPES.items():
        method = load_method(export_sampling_head(LogitsInput(), (torch.zeros(batch, vocab, dtype=dtype),)).pte)
        agree = total = 0
        gaps = []
        for call in range(max(1, rows // batch)):
            logits = (torch.randn(batch, vocab, generator=gen) * (0.5, 2.0, 8.0)[call % 3]).to(dtype)
            temperature = torch.tensor((0.3, 0.7, 1.0, 1.5, 0.0)[call % 5])
            seed = torch.tensor(call * 104729 + vocab)
            device = method.execute([logits, temperature, seed])[0]
            ref, margins = sample_with_margins(logits, temperature, seed)
            same = device == ref
            agree += int(same.sum())
            total += batch
            gaps += [float(margins[r]) for r in (~same).nonzero().flatten().tolist()]
        worst = max(worst, len(gaps))
        detail = f"; disagreement score gaps: {sorted(gaps)}" if gaps else ""
        print(f"{name:>9}: host reference == device on {agree}/{total} rows ({agree / total:.4%}) at V={vocab}{detail}")
    return 0
