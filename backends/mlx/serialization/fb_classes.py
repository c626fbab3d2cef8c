"""Short access to the flatc-generated object-API classes."""

from __future__ import annotations

import importlib

from backends.mlx.serialization.fb.Constant import ConstantT
from backends.mlx.serialization.fb.Graph import GraphT
from backends.mlx.serialization.fb.Instruction import InstructionT
from backends.mlx.serialization.fb.IntOrVid import IntOrVidT
from backends.mlx.serialization.fb.IoSpec import IoSpecT
from backends.mlx.serialization.fb.MutableBuffer import MutableBufferT
from backends.mlx.serialization.fb.Slot import SlotT
from backends.mlx.serialization.fb.Tid import TidT
from backends.mlx.serialization.fb.Vid import VidT

__all__ = ["ConstantT", "GraphT", "InstructionT", "IntOrVidT", "IoSpecT", "MutableBufferT", "SlotT", "TidT", "VidT", "node_class"]


def node_class(kind: str):
    module = importlib.import_module(f"backends.mlx.serialization.fb.{kind}")
    return getattr(module, f"{kind}T")
