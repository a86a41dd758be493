"""The linters the Makefile's `lint` target runs are part of the suite: ruff over every Python tree,
mypy in strict mode over the core (`tetrad`) and the operator (pyproject.toml [tool.mypy]), and
shellcheck over every shell script (hack/, .ci/run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_is_clean() -> None:
    proc = run(str(BIN / "ruff"), "check", "tetrad", "operator", "trainer-image", "tests", "bench", "hack")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_line_length_is_enforced(tmp_path: Path) -> None:
    """pyproject's line-length is a rule, not a hint: a longer line fails `ruff check`."""
    long = tmp_path / "long.py"
    long.write_text(f"X = {'1' * 120}\n")
    proc = run(str(BIN / "ruff"), "check", "--config", str(REPO / "pyproject.toml"), str(long))
    assert proc.returncode != 0 and "E501" in proc.stdout, proc.stdout + proc.stderr


def test_mypy_strict_is_clean_for_the_core_and_the_operator() -> None:
    proc = run(str(BIN / "mypy"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Both packages were checked, not just found: mypy names how many files it read.
    assert "Success: no issues found in" in proc.stdout
    files = int(proc.stdout.split("found in ")[1].split()[0])
    assert files >= 50, proc.stdout


SHELL_SCRIPTS = sorted([*REPO.glob("hack/*.sh"), *REPO.glob("hack/cluster/*.sh"), REPO / ".ci" / "run"])


def test_shellcheck_is_clean_for_every_script() -> None:
    assert len(SHELL_SCRIPTS) >= 8
    proc = run(str(BIN / "shellcheck"), "--external-sources", *map(str, SHELL_SCRIPTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_reports_a_bad_script(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\nrm -rf $1/*\n')  # unquoted: SC2086
    proc = run(str(BIN / "shellcheck"), str(bad))
    assert proc.returncode != 0 and "SC2086" in proc.stdout, proc.stdout


USAGE_SCRIPTS = ["hack/cluster.sh", "hack/e2e.sh", "hack/images.sh", "hack/k8s-tools.sh",
                 "hack/node-images.sh"]


def test_every_hack_script_prints_its_header_as_its_usage() -> None:
    """Usage is the leading comment block, whatever its length (not a line range that drifts)."""
    for script in USAGE_SCRIPTS:
        lines = (REPO / script).read_text().splitlines()[1:]
        header = [line.removeprefix("#").removeprefix(" ") for line in lines[:next(
            i for i, line in enumerate(lines) if not line.startswith("#"))]]
        proc = subprocess.run(["bash", script, "no-such-verb"], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, (script, proc.stderr)
        assert (proc.stdout + proc.stderr).splitlines()[-len(header):] == header, script
