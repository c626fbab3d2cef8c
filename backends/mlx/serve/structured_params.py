"""Structured-output request fields as a Constraint (llm/decoder/constraints.py), for both endpoints and LMTP.

OpenAI: `response_format` = {"type": "text"} | {"type": "json_object"} |
{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}.
vLLM: `structured_outputs` = one of {"json": schema}, {"regex": R}, {"choice": [...]}, {"grammar": G}.
LMTP GENERATE takes the same two fields. Here only the fields' shape is checked (on the event loop,
cheaply); the limits, the compile and whether the program has the mask input are checked off the loop
by serve/grammar_compiler.py, before anything runs: a 400 naming the problem.
"""

from __future__ import annotations

from backends.mlx.llm.decoder.constraints import Constraint, ConstraintError
from backends.mlx.serve.api_errors import ApiError

_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def constraint_from_body(body: dict) -> Constraint | None:
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and so is not None:
        raise ApiError("give 'response_format' or 'structured_outputs', not both", param="response_format")
    try:
        constraint = _structured_outputs(so) if so is not None else _response_format(fmt) if fmt is not None else None
        if constraint is not None:
            constraint.check_shape()
        return constraint
    except ConstraintError as exc:
        raise ApiError(str(exc), param="structured_outputs" if so is not None else "response_format") from None


def _response_format(fmt) -> Constraint | None:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}",
                       param="response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return Constraint("json_object")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ApiError("'response_format.json_schema.schema' must be a JSON schema object", param="response_format")
    return Constraint("json_schema", spec["schema"])


def _structured_outputs(so) -> Constraint:
    given = [k for k in _VLLM_KINDS if isinstance(so, dict) and so.get(k) is not None]
    if len(given) != 1:
        raise ApiError("'structured_outputs' must have exactly one of 'json', 'regex', 'choice', 'grammar'",
                       param="structured_outputs")
    return Constraint(_VLLM_KINDS[given[0]], so[given[0]])


async def structured_rows(service, constraint: Constraint | None, count: int, body: dict) -> list[dict]:
    """The EngineRequest fields of each of `count` rows: the constraint and a matcher of its own, compiled
    off the event loop by the service's GrammarCompiler; ApiError (400, one line) for a refused grammar."""
    if constraint is None:
        return [{} for _ in range(count)]
    if service.grammar is None:  # no compiler: the engine compiles (Engine.check)
        return [{"constraint": constraint} for _ in range(count)]
    try:
        matchers = await service.grammar.matchers(constraint, count)
    except ConstraintError as exc:
        raise ApiError(str(exc), param="structured_outputs" if body.get("structured_outputs") is not None
                       else "response_format") from None
    return [{"constraint": constraint, "matcher": m} for m in matchers]
