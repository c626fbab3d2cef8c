"""One table of environment settings: every ETMLX_* variable is read in backends/mlx/runtime/options.h (C++) or
backends/mlx/runtime/options.py (Python) and nowhere else, docs/options.md lists exactly those names, and a bad
value is one line on stderr with the default kept (or, for ETMLX_KERNELS, a refused load)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OPTIONS_H = REPO / "backends" / "mlx" / "runtime" / "options.h"
OPTIONS_PY = REPO / "backends" / "mlx" / "runtime" / "options.py"
TABLE = REPO / "docs" / "options.md"
SOURCES = [REPO / "backends", REPO / "etmlx"]
SUFFIXES = {".py", ".cpp", ".cc", ".h", ".hpp"}

NAME = r"_?ETMLX_[A-Z0-9_]+"
# A read of an ETMLX_ variable: getenv("ETMLX_X") in C++; os.getenv / os.environ.get / .pop / .setdefault /
# os.environ["ETMLX_X"] (not assigned) in Python.
READS = [
    re.compile(rf"getenv\(\s*\"({NAME})\""),
    re.compile(rf"(?:os\.getenv|environ\.get|environ\.pop|environ\.setdefault)\(\s*[\"']({NAME})[\"']"),
    re.compile(rf"environ\[\s*[\"']({NAME})[\"']\s*\](?!\s*=[^=])"),
]


def _reads(text: str) -> list[str]:
    return sorted({m.group(1) for pattern in READS for m in pattern.finditer(text)})


def _sources():
    for root in SOURCES:
        for path in sorted(root.rglob("*")):
            if path.suffix in SUFFIXES and "generated" not in path.parts and path not in (OPTIONS_H, OPTIONS_PY):
                yield path


def test_the_scanner_sees_each_form_of_read():
    # The control: each way a read could be written is caught, a write for a child is not.
    snippets = ['std::getenv("ETMLX_A")', 'os.environ.get("ETMLX_B")', "os.environ['ETMLX_C']",
                'os.getenv("ETMLX_D", "1")', 'os.environ.pop("_ETMLX_E", None)', 'x = os.environ["ETMLX_F"] == "1"']
    assert [_reads(s) for s in snippets] == [["ETMLX_A"], ["ETMLX_B"], ["ETMLX_C"], ["ETMLX_D"], ["_ETMLX_E"],
                                             ["ETMLX_F"]]
    assert _reads('os.environ["ETMLX_G"] = "1"') == [] and _reads('dict(os.environ, ETMLX_H="1")') == []


def test_no_file_but_the_options_modules_reads_an_etmlx_variable():
    found = {str(path.relative_to(REPO)): names for path in _sources()
             if (names := _reads(path.read_text(errors="replace")))}
    assert found == {}


def _code_names() -> set[str]:
    cpp = set(re.findall(rf"(?:value_of|switch_of)\(\"({NAME})\"\)", OPTIONS_H.read_text()))
    py = set(re.findall(rf"^[A-Z_]+ = \"({NAME})\"", OPTIONS_PY.read_text(), re.MULTILINE))
    assert cpp and py
    return cpp | py


def _table_names() -> set[str]:
    return set(re.findall(rf"^\| `({NAME})` \|", TABLE.read_text(), re.MULTILINE))


def test_the_docs_table_lists_exactly_the_names_the_code_reads():
    code, table = _code_names(), _table_names()
    assert table - code == set(), "in docs/options.md but read nowhere"
    assert code - table == set(), "read but missing from docs/options.md"


def test_a_bad_python_value_warns_and_keeps_the_default():
    from backends.mlx.runtime import options

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert options.allocator({"ETMLX_ALLOCATOR": "jemalloc"}) == "mimalloc"
        assert options.allocator({"ETMLX_ALLOCATOR": "system"}) == "system"
        assert options.allocator({}) == "mimalloc"
    assert [str(w.message) for w in caught] == ["ETMLX_ALLOCATOR=jemalloc is not one of mimalloc, system; using mimalloc"]


def test_overridden_restores_the_value_it_found(monkeypatch):
    from backends.mlx.runtime import options

    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    with options.overridden("ETMLX_KERNELS", None):
        assert "ETMLX_KERNELS" not in os.environ
    assert os.environ["ETMLX_KERNELS"] == "cpu"
    monkeypatch.delenv("ETMLX_KERNELS")
    with options.overridden("ETMLX_KERNELS", "device"):
        assert os.environ["ETMLX_KERNELS"] == "device"
    assert "ETMLX_KERNELS" not in os.environ


_RUN = """
import sys, torch
from backends.mlx.exporter.export import export_to_pte
from backends.mlx.runtime.runner import load_method
torch.manual_seed(0)
lin = torch.nn.Linear(8, 4)
x = torch.randn(3, 8)
out = load_method(export_to_pte(lin, (x,)).pte).execute([x])[0]
print(repr(out.flatten().tolist()))
"""


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ETMLX_")}, **env_extra,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", _RUN], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


@pytest.mark.subprocess  # fresh interpreters loading torch and the backend
def test_a_bad_cpp_value_is_one_line_and_the_default():
    plain = _run({})
    assert plain.returncode == 0, plain.stderr[-2000:]
    bad = _run({"ETMLX_HOST_FOLD": "yes", "ETMLX_NUM_THREADS": "0", "ETMLX_QMM_ISA": "sse2"})
    assert bad.returncode == 0, bad.stderr[-2000:]
    assert bad.stdout == plain.stdout
    assert "etmlx: ETMLX_HOST_FOLD=yes is not 0 or 1; using the default" in bad.stderr
    assert "etmlx: ETMLX_NUM_THREADS=0 is not a thread count from 1 to 1024" in bad.stderr
    # The control: without a bad value nothing is said.
    assert "is not" not in plain.stderr
    refused = _run({"ETMLX_KERNELS": "gpu"})
    assert refused.returncode != 0 and 'ETMLX_KERNELS=gpu is not "cpu" or "device"' in refused.stderr
