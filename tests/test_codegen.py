"""Derived files match schema.fbs and decoder_meta.fbs, and the node union is wired end to end."""

import re
from pathlib import Path

from backends.mlx.serialization import generate
from backends.mlx.serialization.generated.node_table import NODE_FIELDS, NODE_TAGS, SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[1]


def test_no_derived_file_is_stale():
    stale = generate.stale_files()
    assert stale == [], f"run `make regenerate`; stale: {stale}"


def test_stale_detection_notices_an_edit(tmp_path, monkeypatch):
    # A schema with one more node must make the checked-in files stale.
    schema = tmp_path / "schema.fbs"
    text = generate.SCHEMA.read_text().replace("union Node {", "table ExtraNode { x: Tid (required); }\nunion Node {")
    text = re.sub(r"(union Node \{[^}]*?)\n\}", r"\1\n  ExtraNode,\n}", text)
    schema.write_text(text)
    monkeypatch.setattr(generate, "SCHEMA", schema)
    assert any("node_dispatch.inc" in s for s in generate.stale_files())


def test_every_union_member_has_a_dispatch_case_and_an_exec_function():
    dispatch = (REPO / "backends/mlx/runtime/generated/node_dispatch.inc").read_text()
    sources = "".join(p.read_text() for p in (REPO / "backends/mlx/runtime").glob("*.cpp"))
    for name in NODE_TAGS:
        fn = generate.exec_name(name)
        assert f"case fb::Node::{name}:" in dispatch
        assert re.search(rf"\b{fn}\s*\(", sources), f"no {fn}() in the runtime sources"


def test_tags_follow_union_order_and_fields_are_known():
    members, tables = generate.parse_schema(generate.SCHEMA.read_text())
    assert list(NODE_TAGS) == members
    assert list(NODE_TAGS.values()) == list(range(1, len(members) + 1))
    assert NODE_FIELDS["BinaryNode"] == {"op": "BinaryOp", "a": "Tid", "b": "Tid", "out": "Tid"}
    assert SCHEMA_VERSION == generate.SCHEMA_VERSION


def test_stale_detection_notices_a_decoder_meta_edit(tmp_path, monkeypatch):
    # A new decoder metadata field must make flatc's Python class and C++ header stale.
    schema = tmp_path / "decoder_meta.fbs"
    schema.write_text(generate.DECODER_META_SCHEMA.read_text().replace("  propose_tokens: long;\n",
                                                                       "  propose_tokens: long;\n  extra: string;\n"))
    monkeypatch.setattr(generate, "DECODER_META_SCHEMA", schema)
    stale = generate.stale_files()
    assert any(s.endswith("DecoderMeta.py") for s in stale) and any("decoder_meta_generated.h" in s for s in stale)
