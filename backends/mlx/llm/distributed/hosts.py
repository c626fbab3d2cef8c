"""Where each rank of an N-rank run lives: read from `--hostfile`, in either of MLX's two formats.

- The ring backend's own file (what MLX_HOSTFILE names): a JSON list with one list of "ip:port" addresses per
  rank. It says nothing about how to reach a host, so every rank is started on this machine.
- `mlx.launch`'s hostfile: a JSON list (or {"hosts": [...]}) of {"ssh": NAME, "ips": [IP, ...]} per rank. A rank
  whose `ssh` names another machine is started there over ssh (llm/distributed/remote.py), as mlx.launch does;
  its ring addresses are its ips with ports counted up from `starting_port`, one per rank and ip (mlx.launch's
  rule, so both launchers give a host the same ports).
"""

from __future__ import annotations

import json
import socket
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

# mlx.launch's default --starting-port for the ring backend.
DEFAULT_STARTING_PORT = 32323
DEFAULT_SSH = "ssh"


@dataclass(frozen=True)
class RankHost:
    addresses: tuple[str, ...]  # the ring's "ip:port" addresses of this rank
    ssh: str | None = None  # the machine to start it on over ssh; None: this machine


@dataclass(frozen=True)
class RankPlacement:
    """Where a server starts an N-rank program's ranks (`etmlx serve --hostfile --ssh --starting-port`)."""
    hostfile: Path | None = None  # None: every rank here, over the loopback on free ports
    ssh: str = DEFAULT_SSH  # the command (and options) that reaches another machine
    starting_port: int = DEFAULT_STARTING_PORT

    def hosts(self, ranks: int) -> list[RankHost] | None:
        """The hostfile's ranks, rank 0 on this machine (it is fed by the server); None without a hostfile."""
        if self.hostfile is None:
            return None
        hosts = read_hostfile(self.hostfile, ranks, self.starting_port)
        if hosts[0].ssh is not None:
            raise ValueError(f"--hostfile {self.hostfile} puts rank 0 on {hosts[0].ssh}: rank 0 runs beside the "
                             "server, so list this machine first (ssh \"127.0.0.1\" or its host name)")
        return hosts


def this_machine(name: str) -> bool:
    """Whether an ssh host name means the machine this runs on (mlx.launch starts 127.0.0.1 without ssh)."""
    names = {"127.0.0.1", "::1", "localhost", socket.gethostname(), socket.getfqdn()}
    return name in names


def read_hostfile(path: Path, ranks: int, starting_port: int = DEFAULT_STARTING_PORT) -> list[RankHost]:
    """Each rank's place from `path`; ValueError (one line naming the file) for anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--hostfile {path}: not a readable JSON hostfile ({exc})") from None
    entries = data.get("hosts") if isinstance(data, dict) else data
    if isinstance(entries, list) and entries and all(isinstance(e, dict) for e in entries):
        hosts = _launch_hosts(path, entries, starting_port)
    elif isinstance(entries, list) and all(isinstance(e, list) and e and all(isinstance(a, str) for a in e)
                                           for e in entries):
        hosts = [RankHost(tuple(e)) for e in entries]
    else:
        raise ValueError(f"--hostfile {path}: expected MLX's ring hostfile (a JSON list with one list of "
                         "\"ip:port\" addresses per rank) or mlx.launch's (one {\"ssh\": host, \"ips\": [...]} per "
                         "rank)")
    if len(hosts) != ranks:
        raise ValueError(f"--hostfile {path} lists {len(hosts)} ranks but the program runs on {ranks}")
    for rank, host in enumerate(hosts):
        for address in host.addresses if host.ssh is None else ():
            ip = address.rsplit(":", 1)[0].strip("[]")
            if not _bindable(ip):  # the ring would wait for a listener that can never start
                raise ValueError(f"--hostfile {path}: rank {rank} would run here, but {ip} is not an address of this "
                                 "machine (name other machines in mlx.launch's format: {\"ssh\": host, \"ips\": "
                                 "[...]})")
    return hosts


def _bindable(ip: str) -> bool:
    """Whether this machine can listen on `ip` (one of its addresses, or the loopback)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((ip, 0))
    except (OSError, UnicodeError):
        return False
    return True


def _launch_hosts(path: Path, entries: list[dict], starting_port: int) -> list[RankHost]:
    hosts, port = [], starting_port
    for rank, entry in enumerate(entries):
        name, ips = entry.get("ssh"), entry.get("ips")
        if not isinstance(name, str) or not name:
            raise ValueError(f"--hostfile {path}: rank {rank}'s entry has no \"ssh\" host name")
        if not isinstance(ips, list) or not ips or not all(isinstance(ip, str) and ip for ip in ips):
            # The ring connects by address: a host name alone gives it nothing to bind (mlx.launch refuses it too).
            raise ValueError(f"--hostfile {path}: rank {rank} ({name}) lists no \"ips\" for the ring to use")
        addresses = []
        for ip in ips:
            addresses.append(f"{ip}:{port}")
            port += 1
        hosts.append(RankHost(tuple(addresses), None if this_machine(name) else name))
    return hosts


def ring_hostfile(hosts: list[RankHost]) -> str:
    """The ring backend's MLX_HOSTFILE text for `hosts`."""
    return json.dumps([list(host.addresses) for host in hosts])


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on the loopback now (bound to port 0, then released)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def loopback_hosts(ranks: int) -> list[RankHost]:
    """`ranks` ranks on this machine, over the loopback on free ports."""
    return [RankHost((f"127.0.0.1:{port}",)) for port in free_ports(ranks)]


def loopback_hostfile(ranks: int, directory: Path) -> Path:
    """MLX's ring hostfile for `ranks` ranks on this machine, written in `directory`."""
    path = directory / "hosts.json"
    path.write_text(ring_hostfile(loopback_hosts(ranks)))
    return path
