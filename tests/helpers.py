"""Shared test helpers: export a function to a .pte and run it in the ExecuTorch runtime."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import torch

from backends.mlx.exporter.export import export_to_pte
from backends.mlx.runtime.runner import run

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)
ALL = FLOATS + INTS

# Tolerances against eager PyTorch: float32 differs only by kernel rounding; the half types
# by one or two ulps of their 11- and 8-bit mantissas.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


class FnModule(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def export_fn(fn, inputs, **kw):
    return export_to_pte(FnModule(fn), tuple(inputs), **kw)


def assert_matches(actual, expected, dtype=None):
    actual = actual if isinstance(actual, (list, tuple)) else [actual]
    expected = expected if isinstance(expected, (list, tuple)) else [expected]
    assert len(actual) == len(expected), f"{len(actual)} outputs, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype, f"output {i}: dtype {a.dtype}, eager gives {e.dtype}"
        assert tuple(a.shape) == tuple(e.shape), f"output {i}: shape {tuple(a.shape)}, eager gives {tuple(e.shape)}"
        if e.dtype.is_floating_point:
            torch.testing.assert_close(a, e, equal_nan=True, **TOL.get(e.dtype, {}))
        else:
            assert torch.equal(a, e), f"output {i}: {a} != {e}"


def check_parity(fn, inputs, **kw):
    """Export fn, run the .pte, compare with eager; return the export result."""
    result = export_fn(fn, inputs, **kw)
    expected = fn(*inputs)
    assert_matches(run(result.pte, inputs), expected)
    return result


def run_cli(*args):
    """`etmlx ARGS` in this process (a subprocess per call would reload torch each time):
    an object with returncode, stdout and stderr."""
    import contextlib
    import io
    from types import SimpleNamespace

    from backends.mlx.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def etmlx_decode_json(pte, prompt, max_tokens, *flags, check=True):
    """`build/etmlx_decode PTE --prompt-ids PROMPT --max-tokens N --eos -1 --json FLAGS`: its last JSON line (EOS
    stops nothing), or with check=False the finished process (for its errors)."""
    import json
    import subprocess
    from pathlib import Path

    binary = Path(__file__).resolve().parents[1] / "build" / "etmlx_decode"
    done = subprocess.run([str(binary), str(pte), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens",
                           str(max_tokens), "--eos", "-1", "--json", *map(str, flags)],
                          capture_output=True, text=True, timeout=120)
    if not check:
        return done
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def eager_greedy(model, prompt, n):
    """The next n greedy tokens of a transformers causal LM after `prompt`, each from a full forward (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def tiny_llama(vocab: int, seed: int, head_scale: float, hidden: int = 32, layers: int = 2, max_positions: int = 128,
               eos=None):
    """A random Llama of a few layers (4 heads, 2 KV heads) for decoder exports; `head_scale` multiplies the LM head:
    below 1 flattens the logits, so that sampled runs differ from greedy."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=max_positions, eos_token_id=eos,
                                         bos_token_id=None)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def graph_node_kinds(dot: Path) -> Counter:
    """How many nodes of each kind an ETMLX_DOT file (a call's MLX graph as Graphviz) holds."""
    return Counter(re.findall(r'label ="([A-Za-z_]+)"', Path(dot).read_text()))


def rewrite_named_data(src: Path, dst: Path, changes: dict) -> Path:
    """Copy the .pte `src` to `dst` with its named data changed: key -> new bytes, or None to drop the key. Tests
    use it to build programs whose metadata disagrees with them, or that carry none (as old exports did)."""
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from executorch.exir._serialize._program import deserialize_pte_binary, serialize_pte_binary

    pte = deserialize_pte_binary(Path(src).read_bytes())
    store = NamedDataStore()
    old = pte.named_data
    for key, entry in (old.pte_data.items() if old else ()):
        if key not in changes:  # weights keep a 16-byte alignment (deserialization forgets the original one)
            store.add_named_data(key, bytes(old.buffers[entry.buffer_index]), alignment=16)
    for key, data in changes.items():
        if data is not None:
            store.add_named_data(key, data, alignment=16)
    pte.named_data = store.get_named_data_store_output()
    Path(dst).write_bytes(bytes(serialize_pte_binary(pte, extract_delegate_segments=True)))
    return Path(dst)
