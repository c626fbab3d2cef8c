"""The CI check on commit subjects (.ci/check-commit-subjects) fails on a new subject over 72 characters."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ".ci/check-commit-subjects"

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="needs a git checkout")


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("clone") / "repo"
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(ROOT), str(repo)], check=True)
    _git(repo, "fetch", "--quiet", str(ROOT), "HEAD")  # the checkout's commit, on a branch or detached
    _git(repo, "checkout", "--quiet", "-B", "base", "FETCH_HEAD")
    (repo / ".ci" / "check-commit-subjects").write_bytes((ROOT / CHECK).read_bytes())  # the working copy's rule
    return repo


def _check(repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", CHECK], cwd=repo, capture_output=True, text=True)


def test_the_history_passes(clone):
    assert _check(clone).returncode == 0


@pytest.mark.parametrize("length, passes", [(72, True), (73, False), (200, False)])
def test_a_new_subject_is_held_to_72_characters(clone, length, passes):
    branch = f"subject-{length}"
    _git(clone, "checkout", "--quiet", "-B", branch, "base")
    _git(clone, "commit", "--quiet", "--allow-empty", "-m", "x" * length, "-m", "a body may be any length " * 10)
    result = _check(clone)
    assert (result.returncode == 0) == passes, result.stderr
    if not passes:
        assert "x" * length in result.stderr
