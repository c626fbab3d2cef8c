"""Start one rank's process on another machine over ssh, and kill it there (what mlx.launch does for its ranks).

As mlx.launch assumes, every machine has this project at the same path with the same Python, and the program's
files at the same paths. The remote shell (sh, bash or zsh: POSIX only) records its pid in a file, changes to
this process's working directory, writes the ring's hostfile to a temporary file, sets the rank's environment
and replaces itself with the command, so the recorded pid is the rank's. ssh runs without a terminal: the
command's stdin and stdout are the caller's binary pipes (ssh given a command allocates no terminal unless told
to with -t, which would rewrite their bytes). A rank whose ssh connection drops sees its stdin close; a rank
stuck in a collective is killed through its pid file.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import uuid
from dataclasses import dataclass, field

KILL_TIMEOUT_S = 15.0


@dataclass
class RemoteRank:
    host: str  # what ssh is given
    ring: str  # the ring backend's hostfile text (MLX_HOSTFILE's content, llm/distributed/hosts.py)
    ssh: list[str]  # the ssh command and its options
    pidfile: str = field(default_factory=lambda: f"/tmp/etmlx-rank-{uuid.uuid4().hex}.pid")

    def command(self, argv: list[str], env: dict[str, str]) -> list[str]:
        """The local command that runs `argv` on the host with `env` and MLX_HOSTFILE naming the ring's file."""
        exports = "".join(f"export {key}={shlex.quote(value)}; " for key, value in env.items())
        script = (f"echo $$ > {shlex.quote(self.pidfile)}; cd {shlex.quote(os.getcwd())} || exit 126; "
                  f"MLX_HOSTFILE=$(mktemp) || exit 126; printf '%s' {shlex.quote(self.ring)} > \"$MLX_HOSTFILE\"; "
                  f"export MLX_HOSTFILE; {exports}exec {shlex.join(argv)}")
        return [*self.ssh, self.host, script]

    def kill(self) -> None:
        """SIGKILL the rank on its host (best effort: an unreachable host keeps it until its ring breaks)."""
        pidfile = shlex.quote(self.pidfile)
        script = f"if [ -f {pidfile} ]; then kill -9 $(cat {pidfile}) 2>/dev/null; rm -f {pidfile}; fi"
        try:
            subprocess.run([*self.ssh, self.host, script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=KILL_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass
