"""What loads what: the serializer, the package itself and the CLI's front door load neither torch nor the
etmlx backend library (each ~2 s and a few hundred MB); only running or exporting a program does.

Each check runs in a fresh interpreter: this test process has long since imported everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# After the snippet runs: which heavy pieces are in the process.
PROBE = """
import json, sys
maps = open('/proc/self/maps').read() if sys.platform.startswith('linux') else ''
print(json.dumps({
    'torch': 'torch' in sys.modules,
    'executorch': any(m.startswith('executorch') for m in sys.modules),
    'mlx': 'mlx.core' in sys.modules,
    'backend_lib': 'libetmlx_backend' in maps,
}))
"""


def _loaded(snippet: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    ran = subprocess.run([sys.executable, "-c", snippet + "\n" + PROBE], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


NOTHING = {"torch": False, "executorch": False, "mlx": False, "backend_lib": False}


@pytest.mark.parametrize("module", [
    "backends.mlx",
    "backends.mlx.serialization",
    "backends.mlx.serialization.serializer",
    "backends.mlx.runtime",  # the package: load() registers the backend, importing it does not
    "backends.mlx.runtime.pte_metadata",
    "backends.mlx.cli.main",
])
def test_import_loads_neither_torch_nor_the_backend(module):
    assert _loaded(f"import {module}") == NOTHING


@pytest.mark.parametrize("argv", [
    ["generate", "--help"],
    ["serve", "--help"],
    ["export", "--help"],
    ["generate", "/no/such/model.pte", "-p", "hi"],
    ["serve", "/no/such/model.pte"],
])
def test_cli_front_door_is_light(argv):
    """Help and a mistyped path answer without the ~2 s of torch."""
    snippet = ("import contextlib, io\nfrom backends.mlx.cli.main import main\n"
               "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:\n"
               "    try:\n"
               f"        code = main({argv!r})\n"
               "    except SystemExit as exc:\n"
               "        code = exc.code\n"
               "assert code == (0 if '--help' in " + repr(argv) + " else 2), (code, err.getvalue())\n"
               "assert '--help' in " + repr(argv) + " or 'model.pte does not exist' in err.getvalue(), err.getvalue()\n")
    assert _loaded(snippet) == NOTHING


@pytest.mark.subprocess
def test_running_a_program_loads_the_backend_on_demand():
    """The other side of the laziness: the runner still registers the backend before loading a program."""
    snippet = ("from backends.mlx.runtime import runner\n"
               "names = runner._bindings()._get_registered_backend_names()\n"
               "assert 'EtmlxBackend' in names, names\n")
    loaded = _loaded(snippet)
    assert loaded["torch"] and loaded["backend_lib"], loaded


OPS = ("sample", "sample_fused", "allowed_mask", "drawn_or_none", "filter_threshold", "quantized_linear",
       "quantized_embedding")


@pytest.mark.subprocess
def test_exporting_registers_the_custom_ops_it_lowers():
    """The exporter's mlx:: ops are defined by importing it, without anything else imported first."""
    snippet = ("import torch\nimport backends.mlx.exporter.export\n"
               f"missing = [name for name in {OPS!r} if not hasattr(torch.ops.mlx, name)]\n"
               "assert not missing, missing\n")
    assert _loaded(snippet)["torch"]
