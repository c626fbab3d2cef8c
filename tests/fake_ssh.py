"""Stands in for ssh in the tests of ranks on other machines (there is no ssh server here): `fake_ssh.py LOG HOST
SCRIPT` appends HOST to LOG and runs SCRIPT with /bin/sh (on Debian: dash, so the launch script must be POSIX) in
a child process of its own, forwarding stdin/stdout, as an ssh client and the remote sshd do: killing this client
does not kill the command."""

import subprocess
import sys

log, host, script = sys.argv[1:4]
with open(log, "a") as out:
    out.write(host + "\n")
sys.exit(subprocess.run(["/bin/sh", "-c", script], start_new_session=True).returncode)
