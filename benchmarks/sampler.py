"""`etmlx bench sampler`: on-device sampling vs host sampling vs one read of the logits.

For each vocabulary size and batch, in the same run:
  etmlx       the SamplingHead .pte: logits in, token ids out (temperature 0.8, seeded)
  host_torch  copy the logits out, then torch.softmax + torch.multinomial on the host
  read_once   a .pte that reads the logits once on the device (a max) - the floor for any sampler
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from backends.mlx.exporter.export import export_to_pte
from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head
from benchmarks import sampler_features
from benchmarks.timing import ReadOnce, median_ms
from backends.mlx.runtime.runner import load_method

VOCABS = (32000, 128256, 262144)
BATCHES = (1, 8)


def measure(vocab: int, batch: int, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(vocab + batch)
    logits = torch.randn(batch, vocab, generator=gen)
    temperature = torch.tensor(0.8)
    sampler = load_method(export_sampling_head(LogitsInput(), (torch.zeros(batch, vocab),)).pte)
    reader = load_method(export_to_pte(ReadOnce(), (torch.zeros(batch, vocab),)).pte)
    step = iter(range(10**9))

    def etmlx():
        sampler.execute([logits, temperature, torch.tensor(next(step))])

    def host_torch():
        copied = logits.clone()  # what a host sampler pays to get the logits out
        torch.multinomial(torch.softmax(copied / temperature, -1), 1)

    def read_once():
        reader.execute([logits])

    config = f"V={vocab} B={batch}"
    return [
        {"config": config, "logits": "normal", "vocab": vocab, "batch": batch, "impl": name,
         "median_ms": median_ms(fn, repeats)}
        for name, fn in (("etmlx", etmlx), ("host_torch", host_torch), ("read_once", read_once))
    ]


def main(json_path: str | None = None, repeats: int = 30, vocabs=VOCABS, batches=BATCHES,
         suite: str = "all") -> int:
    records = []
    if suite in ("all", "features"):
        records += sampler_features.main(repeats=repeats)
    if suite == "features":
        return _write(json_path, records)
    print(f"{'config':<18}{'etmlx ms':>10}{'host ms':>10}{'read ms':>10}{'host/etmlx':>12}{'etmlx/read':>12}")
    for vocab in vocabs:
        for batch in batches:
            rows = measure(vocab, batch, repeats)
            records.extend(rows)
            ms = {r["impl"]: r["median_ms"] for r in rows}
            print(f"{rows[0]['config']:<18}{ms['etmlx']:>10.3f}{ms['host_torch']:>10.3f}{ms['read_once']:>10.3f}"
                  f"{ms['host_torch'] / ms['etmlx']:>12.2f}{ms['etmlx'] / ms['read_once']:>12.2f}")
    return _write(json_path, records)


def _write(json_path, records) -> int:
    if json_path:
        Path(json_path).write_text(json.dumps(records, indent=1))
        print(f"wrote {len(records)} records to {json_path}")
    return 0
