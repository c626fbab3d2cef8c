"""A request's tools and tool choice (the server, the CLI and the Python API share them): the checked tool
definitions, the mode, and the Constraint that guarantees the calls (tool_formats.py has the syntaxes).

Modes: "auto" (text or calls; with the mask input the calls are constrained once their marker is written),
"required" (calls only), a named function (calls of it only), "none" (no constraint, no parsing).
`parallel` False allows one call. A tool's `strict` makes the whole call schema compile strictly: a keyword
llguidance cannot enforce is then an error instead of being ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from backends.mlx.llm.decoder.constraints import Constraint
from backends.mlx.llm.decoder.grammar_limits import ConstraintError, GrammarLimits, precheck
from backends.mlx.llm.decoder.tool_formats import (FORMATS, Tool, ToolError, added_tokens, call_grammar,
                                                   detect_format)

MAX_TOOLS = 128  # as OpenAI
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("auto", "none", "required")


def parse_tools(raw, where: str = "tools", legacy: bool = False) -> list[Tool]:
    """OpenAI's `tools` ([{"type": "function", "function": {...}}]) or, legacy, `functions` ([{...}]) as Tools;
    ToolError names the bad entry."""
    if not isinstance(raw, list):
        raise ToolError(f"'{where}' must be a list")
    if len(raw) > MAX_TOOLS:
        raise ToolError(f"'{where}' has {len(raw)} entries; at most {MAX_TOOLS} are allowed")
    tools, seen = [], set()
    for i, entry in enumerate(raw):
        path = f"{where}[{i}]"
        if not legacy:
            if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(entry.get("function"), dict):
                raise ToolError(f"'{path}' must be {{\"type\": \"function\", \"function\": {{...}}}}")
            entry, path = entry["function"], f"{path}.function"
        if not isinstance(entry, dict):
            raise ToolError(f"'{path}' must be an object")
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"'{path}.name' must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in seen:
            raise ToolError(f"'{path}.name': the function {name!r} is defined twice")
        seen.add(name)
        description = entry.get("description", "")
        if not isinstance(description, str):
            raise ToolError(f"'{path}.description' must be a string")
        params = entry.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"'{path}.parameters' must be a JSON schema object")
        strict = entry.get("strict", False)
        if not isinstance(strict, bool) and strict is not None:
            raise ToolError(f"'{path}.strict' must be a boolean")
        tools.append(Tool(name, description, params, bool(strict)))
    return tools


@dataclass(frozen=True)
class ToolRequest:
    tools: list[Tool] = field(default_factory=list)
    choice: str = "auto"  # auto | none | required | function
    function: str | None = None  # the named function (choice "function")
    parallel: bool = True
    fmt: str = "generic"

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ToolError(f"unknown tool-call format {self.fmt!r}")
        if self.choice not in CHOICES + ("function",):
            raise ToolError(f"tool_choice must be one of {', '.join(CHOICES)} or a function, got {self.choice!r}")
        if self.choice in ("required", "function") and not self.tools:
            raise ToolError(f"tool_choice {self.choice!r} needs tools")
        if self.choice == "function" and self.function not in self.names:
            raise ToolError(f"tool_choice names the function {self.function!r}, which is not among the tools")

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    @property
    def parses(self) -> bool:
        """Whether the answer is read for calls (tools given, choice not "none")."""
        return bool(self.tools) and self.choice != "none"

    @property
    def must_call(self) -> bool:
        return self.choice in ("required", "function")

    def callable_names(self) -> set[str]:
        return {self.function} if self.choice == "function" else self.names

    def check_limits(self, limits: GrammarLimits) -> None:
        """ConstraintError for a parameters schema over the structured-output limits (cheap: nothing compiled);
        run before the prompt is rendered, which holds the schemas too."""
        for tool in self.tools:
            try:
                precheck("json_schema", tool.parameters, limits)
            except ConstraintError as exc:
                raise ConstraintError(f"function {tool.name!r} parameters: {exc}") from None

    def constraint(self, tokenizer) -> Constraint | None:
        """The grammar of the answer (None for "none"); ConstraintError (one line) for a schema that cannot be used.
        Call check_limits first (once: it walks every schema)."""
        if not self.parses:
            return None
        memo = self.__dict__.get("_constraint")  # the same request again (the server keeps recent ones)
        if memo is not None and memo[0] is tokenizer:
            return memo[1]
        tools = [t for t in self.tools if t.name in self.callable_names()]
        try:
            grammar = call_grammar(tools, self.fmt, "required" if self.must_call else "auto", self.parallel,
                                   added_tokens(tokenizer) if tokenizer is not None else {})
        except ToolError as exc:
            raise ConstraintError(str(exc)) from None
        constraint = Constraint("grammar", grammar)
        object.__setattr__(self, "_constraint", (tokenizer, constraint))  # frozen: a memo, not state
        return constraint


def tool_format(meta, tokenizer) -> str:
    """The program's call syntax: stored at export, else (older programs) detected from the chat template."""
    stored = getattr(meta, "tool_call_format", "")
    return stored or detect_format(getattr(tokenizer, "chat_template", None))
