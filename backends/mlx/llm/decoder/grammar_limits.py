"""Limits on a client's grammar, checked in plain Python before llguidance ever sees it.

llguidance recurses on the structure it compiles (a JSON schema's $ref chain of ~2,500 definitions or a
Lark rule chain of ~10,000 rules overflows an 8 MiB stack: SIGSEGV, the whole process), and its compile
time and memory grow with the grammar (a 50,000-item choice list: ~6 s and ~1 GB). These checks bound
the input first; every walk here is iterative (an explicit stack), so a hostile document cannot
overflow Python's stack either. What they cannot see (a Lark rule chain, a pathological regex) is
caught by the isolated compile in grammar_guard.py. Each refusal is a one-line ConstraintError naming
the limit and the `etmlx serve` flag that sets it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


class ConstraintError(ValueError):
    """A constraint that cannot be used (bad schema, regex or grammar; one over a limit; a program without
    the mask input), or a generation the grammar cannot continue. The message names the problem in one line."""


_PANIC = ("panicked", "backtrace", "RUST_BACKTRACE", "PanicException")


def one_line(message, limit: int = 300) -> str:
    """A library's message (possibly multi-line, with a source excerpt) as one short line; a Rust panic
    (llguidance reports some as messages, with a backtrace) becomes a plain sentence."""
    text = " ".join(str(message).split())
    if any(word in text for word in _PANIC):
        return "llguidance failed on this grammar (an internal error; a smaller or simpler grammar may work)"
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class GrammarLimits:
    """Bounds on one request's grammar; `etmlx serve` sets each with the flag of the same name
    (--max-schema-bytes, ...), the CLI uses these defaults."""

    max_schema_bytes: int = 256 * 1024  # a JSON schema as JSON text
    max_schema_depth: int = 64  # nesting of the schema document (objects and lists)
    max_ref_depth: int = 64  # the longest chain of $refs followed from the schema's root
    max_choices: int = 4096  # items of a choice list (10,000 take ~0.5 s to compile, 50,000 ~6 s)
    max_grammar_bytes: int = 512 * 1024  # the llguidance grammar text (regex, Lark, choices, converted schema)
    grammar_compile_timeout: float = 10.0  # seconds the isolated compile may take
    grammar_memory_mb: int = 1024  # address space the isolated compile may add to its worker
    grammar_workers: int = 2  # isolated compile processes (started on the first constrained request)

    def check(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be > 0, got {value!r}")


def _flag(name: str) -> str:
    return f"etmlx serve --{name.replace('_', '-')}"


def _over(what: str, value: int, name: str, limit) -> ConstraintError:
    return ConstraintError(f"{what} is {value}; the limit is {limit} ({_flag(name)})")


def precheck(kind: str, spec, limits: GrammarLimits) -> None:
    """Refuse a spec over a limit before it is converted or compiled (ConstraintError, one line)."""
    if kind == "json_schema":
        if isinstance(spec, str):
            size = len(spec.encode("utf-8", "surrogatepass"))
            if size > limits.max_schema_bytes:
                raise _over("the JSON schema's size in bytes", size, "max_schema_bytes", limits.max_schema_bytes)
            try:
                spec = json.loads(spec)
            except (json.JSONDecodeError, RecursionError):
                return  # Constraint.grammar() reports malformed text
        _check_schema(spec, limits)
    elif kind == "choice" and isinstance(spec, (list, tuple)) and len(spec) > limits.max_choices:
        raise _over("the number of choices", len(spec), "max_choices", limits.max_choices)


def check_grammar_size(grammar: str, limits: GrammarLimits) -> None:
    size = len(grammar.encode("utf-8", "surrogatepass"))
    if size > limits.max_grammar_bytes:
        raise _over("the grammar's size in bytes", size, "max_grammar_bytes", limits.max_grammar_bytes)


def _check_schema(schema, limits: GrammarLimits) -> None:
    size = _size_and_depth(schema, limits)
    if size > limits.max_schema_bytes:
        raise _over("the JSON schema's size in bytes", size, "max_schema_bytes", limits.max_schema_bytes)
    depth = _ref_depth(schema, limits.max_ref_depth)
    if depth > limits.max_ref_depth:
        raise ConstraintError(f"the JSON schema's $ref chain is longer than {limits.max_ref_depth} "
                              f"(the limit; {_flag('max_ref_depth')})")


def _size_and_depth(document, limits: GrammarLimits) -> int:
    """The document's size as compact JSON (estimated per node, without building the text: no recursion),
    refusing nesting deeper than max_schema_depth on the way."""
    size, stack = 0, [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_schema_depth:
            raise ConstraintError(f"the JSON schema is nested deeper than {limits.max_schema_depth} levels "
                                  f"(the limit; {_flag('max_schema_depth')})")
        if isinstance(node, dict):
            size += 2 + max(0, len(node) - 1)
            for key, value in node.items():
                size += len(json.dumps(str(key))) + 1
                stack.append((value, depth + 1))
        elif isinstance(node, (list, tuple)):
            size += 2 + max(0, len(node) - 1)
            stack.extend((item, depth + 1) for item in node)
        else:
            size += len(json.dumps(node))
        if size > limits.max_schema_bytes:  # stop walking a huge document early
            break
    return size


_CONTAINERS = ("$defs", "definitions")


def _resolve(root, ref: str):
    """The node a local JSON pointer ref ("#", "#/$defs/a", "#/properties/x/items") names, or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _refs_in(node) -> list[str]:
    """The $refs a subschema uses itself (not those inside the definitions it merely holds)."""
    refs, stack = [], [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                refs.append(ref)
            stack.extend(v for k, v in item.items() if k not in _CONTAINERS)
        elif isinstance(item, list):
            stack.extend(item)
    return refs


def _ref_depth(root, limit: int) -> int:
    """The longest chain of $refs followed from the root (a ref back into a chain being followed, a
    recursive schema, counts once), computed depth-first with an explicit stack; stops past `limit`."""
    depth: dict[str, int] = {}  # ref -> the longest chain starting with it
    children: dict[str, list[str]] = {}
    best = 0
    for start in _refs_in(root):
        stack, on_path = [start], {start}
        while stack:
            ref = stack[-1]
            if ref not in children:
                target = _resolve(root, ref)
                children[ref] = _refs_in(target) if target is not None else []
            pending = [c for c in children[ref] if c not in depth and c not in on_path]
            if pending and len(stack) <= limit:
                stack.append(pending[0])
                on_path.add(pending[0])
                continue
            if pending:  # deeper than the limit: no need to measure exactly
                return len(stack) + 1
            depth[ref] = 1 + max((depth.get(c, 0) for c in children[ref]), default=0)
            stack.pop()
            on_path.discard(ref)
        best = max(best, depth[start])
        if best > limit:
            break
    return best
