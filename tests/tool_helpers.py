"""Shared by the tool-calling tests: the tiny tool program (benchmarks/tool_model.py: every family's markers,
templates in each family's format), exported once per run, and test tools."""

from __future__ import annotations

from benchmarks.tool_model import TEMPLATES, export_tool_model, tool_tokenizer, use_format  # noqa: F401
from run_once import exclusive, shared_dir

MAX_SEQ_LEN = 1536
BATCH = 4

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers", "strict": True,
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]


def tool_pte(tmp_path_factory):
    """Exported once per run (other xdist workers wait on the lock)."""
    directory = shared_dir(tmp_path_factory, "tools_tiny")
    path = directory / "tools.pte"
    with exclusive(directory):
        if not path.is_file():
            export_tool_model(path, MAX_SEQ_LEN, BATCH)
    return path
