"""Download the macOS arm64 wheels of wheels.txt and unpack them into one site-packages folder.

    python cmake/macos/fetch.py build-macos

writes build-macos/wheels/*.whl and build-macos/site-packages/ (as pip would lay them out on a Mac, without
installing anything). Only the wheels' files are used: nothing here runs on this machine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PLATFORM = "macosx_14_0_arm64"
PYTHON_VERSION = "3.11"


def pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line (extras and environment markers dropped)."""
    found = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;#]+)\s*(?:;\s*(.*))?$", line)
        if m and "linux" not in (m.group(3) or ""):
            found[m.group(1).lower().replace("_", "-")] = m.group(2)
    return found


def main(out: Path) -> int:
    wanted = pins(HERE / "wheels.txt")
    pinned = pins(REPO / "requirements.txt")
    drift = [f"{name}=={version} (requirements.txt: {pinned[name]})"
             for name, version in wanted.items() if name in pinned and pinned[name] != version]
    if drift:
        print(f"fetch.py: cmake/macos/wheels.txt disagrees with requirements.txt: {', '.join(drift)}", file=sys.stderr)
        return 1
    wheels = out / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--platform", PLATFORM, "--python-version", PYTHON_VERSION, "--dest", str(wheels),
                    *(f"{name}=={version}" for name, version in wanted.items())], check=True)
    site = out / "site-packages"
    shutil.rmtree(site, ignore_errors=True)
    for name, version in wanted.items():
        stem = f"{name.replace('-', '_')}-{version}-"
        found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(stem.lower())]
        if len(found) != 1:
            print(f"fetch.py: expected one {stem}*.whl in {wheels}, found {len(found)}", file=sys.stderr)
            return 1
        with zipfile.ZipFile(found[0]) as archive:
            archive.extractall(site)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
