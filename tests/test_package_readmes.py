"""The docs stay true where a list can be checked: each package folder's README names every module in it, the
sampler README lists the knob table's knobs in order, the README's command table has a row for every `etmlx`
subcommand and `bench` target (and no row for one that does not exist), and every relative link in README.md,
docs/ and the package READMEs reaches an existing file and heading."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from backends.mlx.cli.main import build_parser
from backends.mlx.llm.sampler.knobs import KNOBS

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "backends" / "mlx"
# folder (from the repository root) -> what its README must name: Python modules, C++ headers, or subfolders
FOLDERS = {f"backends/mlx/{folder}": kind for folder, kind in {
    "llm": "py", "llm/decoder": "py", "llm/sampler": "py", "llm/quantize": "py", "llm/vision": "py", "custom_kernel_ops": "py",
    "serialization": "py", "runtime": "py", "runtime/kernels": "h", "serve": "py", "cli": "py",
    "exporter": "py", "exporter/fusion": "py", "tools": "dir",
}.items()} | {"benchmarks": "py"}  # benchmarks/: outside the package


def _units(folder: Path, kind: str) -> list[str]:
    if kind == "dir":
        return sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__")
    return sorted(p.name for p in folder.glob(f"*.{kind}") if p.name != "__init__.py")


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_package_readme_names_every_unit(folder):
    directory = REPO / folder
    readme = directory / "README.md"
    assert readme.is_file(), f"{readme} missing"
    text = readme.read_text()
    missing = [unit for unit in _units(directory, FOLDERS[folder]) if f"`{unit}" not in text and f"{unit}`" not in text
               and unit not in text]
    assert not missing, f"{readme.relative_to(REPO)} does not mention {missing}"


def test_sampler_readme_lists_the_knob_table_in_order():
    text = (PACKAGE / "llm" / "sampler" / "README.md").read_text()
    block = text.split("<!-- knobs -->", 1)[1].split("<!-- /knobs -->", 1)[0]
    listed = re.findall(r"^- `([a-z_]+)`", block, flags=re.M)
    assert listed == [knob.name for knob in KNOBS]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _readme_table_commands() -> list[str]:
    """The first cell of every row of the README's command table, as `etmlx WORD [WORD]`."""
    text = (REPO / "README.md").read_text()
    table = text.split("## Command line", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return [line.split("|")[1] for line in rows]


def test_readme_command_table_matches_the_parser():
    subcommands = _subcommands(build_parser())
    cells = _readme_table_commands()
    named = {m for cell in cells for m in re.findall(r"`etmlx ([a-z][a-z-]*)", cell)}
    assert named == set(subcommands), (f"README table rows without a subcommand: {named - set(subcommands)}; "
                                       f"subcommands without a row: {set(subcommands) - named}")


def test_benchmarks_readme_table_matches_the_bench_parser():
    """benchmarks/README.md has a row `etmlx bench NAME` for every benchmark subcommand and none other."""
    bench = _subcommands(_subcommands(build_parser())["bench"])
    text = (REPO / "benchmarks" / "README.md").read_text()
    benched = set(re.findall(r"^\| `etmlx bench ([a-z][a-z-]*)", text, flags=re.M))
    assert benched == set(bench), set(bench) ^ benched


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            anchors.add(_anchor(line.lstrip("#")))
    return anchors


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted(PACKAGE.rglob("README.md")),
            REPO / "benchmarks" / "README.md", REPO / "results" / "README.md"]


def test_relative_links_reach_a_file_and_heading():
    broken = []
    for page in _markdown_files():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file_part, _, anchor = target.partition("#")
            destination = (page.parent / file_part).resolve() if file_part else page
            if not destination.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


README_LINES = 150


def test_readme_is_a_front_page():
    """README.md stays short (history goes to docs/log.md), with no table row a screen can't show."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines (limit {README_LINES})"
    long = [f"{i + 1}: {len(line)} chars" for i, line in enumerate(lines) if len(line) > 240]
    assert not long, long


def test_docs_hold_no_result_dumps():
    """Raw measurements live in results/, not docs/."""
    assert [p.name for p in (REPO / "docs").rglob("*") if p.suffix not in (".md", "")] == []
