"""Child process for test_blob_validation: load and run many corrupted copies of a .pte.

Prints one JSON line of counts. A crash of this process is what the parent test catches.
"""

import json
import random
import sys

import torch

from backends.mlx.exporter.inspect_pte import delegate_blobs
from backends.mlx.runtime.runner import load_method


def main(path, count, seed):
    pte = open(path, "rb").read()
    blob = delegate_blobs(pte)[0]
    start = pte.find(blob)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    inputs = [torch.randn(3, 4), torch.randn(4, 5), torch.randint(0, 5, (3, 2))]
    counts = {"tried": 0, "rejected_at_load": 0, "rejected_at_run": 0, "ran": 0, "unexpected": []}
    for i in range(count):
        bad = bytearray(pte)
        if i % 2:
            for _ in range(rng.randint(1, 8)):
                pos = start + rng.randrange(len(blob))
                bad[pos] ^= 1 << rng.randrange(8)
        else:
            pos = start + rng.randrange(len(blob))
            bad[pos] = rng.randrange(256)
        counts["tried"] += 1
        try:
            method = load_method(bytes(bad))
        except RuntimeError:
            counts["rejected_at_load"] += 1
            continue
        try:
            method.execute(inputs)
        except RuntimeError:
            counts["rejected_at_run"] += 1
            continue
        except Exception as exc:  # anything but an ExecuTorch error is a bug worth reporting
            counts["unexpected"].append(f"{type(exc).__name__}: {exc}"[:200])
            continue
        counts["ran"] += 1
    print(json.dumps(counts))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
