"""backends/mlx/exporter/cia_registry.py: torch.export's walk over the CompositeImplicitAutograd registrations
runs again only when they change (a new op defined after the last walk is walked)."""

from __future__ import annotations

import torch
import torch._export.utils as export_utils

from backends.mlx.exporter.cia_registry import remember_materialized_cia_ops


def test_walks_again_only_when_the_registrations_change(monkeypatch):
    walks = []
    monkeypatch.setattr(export_utils, "_materialize_cpp_cia_ops", lambda: walks.append(1))
    assert remember_materialized_cia_ops()
    assert remember_materialized_cia_ops()  # wrapped once, not twice
    for _ in range(3):
        export_utils._materialize_cpp_cia_ops()
    assert len(walks) == 1
    lib = torch.library.Library("etmlx_cia_registry_test", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
    export_utils._materialize_cpp_cia_ops()
    assert len(walks) == 2  # the new registration was walked
    export_utils._materialize_cpp_cia_ops()
    assert len(walks) == 2


def test_a_torch_without_the_function_is_left_alone(monkeypatch):
    monkeypatch.delattr(export_utils, "_materialize_cpp_cia_ops")
    assert remember_materialized_cia_ops() is False
