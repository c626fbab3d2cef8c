"""Export speed: torch.export materialises every CompositeImplicitAutograd op once per op namespace per export.

`torch._export.utils._collect_all_valid_cia_ops` calls `_materialize_cpp_cia_ops` for each of ~40 op namespaces,
and each call walks every CIA registration of the C++ dispatcher with three `getattr`s (torch 2.11: ~2 ms a
call, ~0.25 s a collection, two collections per `to_edge_transform_and_lower`): about a third of the time to
export a small program. The walk only makes `torch.ops` attributes exist; once done for a given set of
registrations, doing it again changes nothing. `remember_materialized_cia_ops()` wraps it so that it walks only
when the set of registrations differs from the last one it walked (a new custom op, a library loaded later).
Torch's comment there says why it does not cache: Python may add registrations; the key here is the
registrations themselves, so an added one is walked. Where the function is missing (another torch), nothing is
wrapped.
"""

from __future__ import annotations

import torch

_KEY = "CompositeImplicitAutograd"


def remember_materialized_cia_ops() -> bool:
    """Wraps torch's `_materialize_cpp_cia_ops` once per process; True when it is (or already was) wrapped."""
    import torch._export.utils as export_utils

    original = getattr(export_utils, "_materialize_cpp_cia_ops", None)
    if original is None:
        return False
    if getattr(original, "_etmlx_remembers", False):
        return True
    walked: list[frozenset[str]] = []

    def materialize() -> None:
        registrations = frozenset(torch._C._dispatch_get_registrations_for_dispatch_key(_KEY))
        if walked and walked[0] == registrations:
            return
        original()
        walked[:] = [registrations]

    materialize._etmlx_remembers = True  # type: ignore[attr-defined]
    export_utils._materialize_cpp_cia_ops = materialize
    return True
