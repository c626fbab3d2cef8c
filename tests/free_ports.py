"""Runs of consecutive free loopback ports, for tests of mlx.launch's hostfile (its ring ports count up from
--starting-port one per rank and ip)."""

from __future__ import annotations

import socket

from backends.mlx.llm.distributed.hosts import free_ports


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def consecutive_free_ports(count: int) -> int:
    """The first of `count` consecutive ports free on the loopback now."""
    for _ in range(50):
        first = free_ports(1)[0]
        if first + count <= 65535 and all(_free(first + i) for i in range(1, count)):
            return first
    raise RuntimeError(f"no run of {count} free loopback ports")
