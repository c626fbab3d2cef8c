"""Short access to the flatc-generated object-API classes."""

from __future__ import annotations

import importlib

from backends.mlx.serialization.generated.fb.Constant import ConstantT
from backends.mlx.serialization.generated.fb.Graph import GraphT
from backends.mlx.serialization.generated.fb.Instruction import InstructionT
from backends.mlx.serialization.generated.fb.IntOrVid import IntOrVidT
from backends.mlx.serialization.generated.fb.IoSpec import IoSpecT
from backends.mlx.serialization.generated.fb.MutableBuffer import MutableBufferT
from backends.mlx.serialization.generated.fb.Slot import SlotT
from backends.mlx.serialization.generated.fb.Tid import TidT
from backends.mlx.serialization.generated.fb.Vid import VidT

__all__ = ["ConstantT", "GraphT", "InstructionT", "IntOrVidT", "IoSpecT", "MutableBufferT", "SlotT", "TidT", "VidT", "node_class"]


def node_class(kind: str):
    module = importlib.import_module(f"backends.mlx.serialization.generated.fb.{kind}")
    return getattr(module, f"{kind}T")
