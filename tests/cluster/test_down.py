"""`hack/cluster.sh down` leaves no processes or listening ports behind, and
refuses a cluster it does not know.

Uses its own small cluster instance (own name, state dir and ports), so the
session cluster other tests share is not touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster_fixtures import HACK, cluster_script, start_cluster

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def listening_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def process_group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


@pytest.mark.cluster
def test_down_leaves_no_processes_or_ports() -> None:
    if os.environ.get("TETRAD_SKIP_CLUSTER") == "1":
        pytest.skip("TETRAD_SKIP_CLUSTER=1")
    name = f"pytest-down-{os.getpid()}"
    c = start_cluster(name, extra_env={"TETRAD_NODES": "2"})
    try:
        state = Path(c.env["TETRAD_CLUSTER_STATE"])
        pids = {comp: int((state / "run" / f"{comp}.pid").read_text().split()[0]) for comp in COMPONENTS}
        ports = {int(v) for k, v in c.env.items() if k.endswith("_PORT")}
        assert len(ports) == 6
        assert ports <= listening_ports()
        for comp, pid in pids.items():
            assert process_group_members(pid), f"{comp} is not running"
        assert c.kubectl("get", "--raw", "/readyz").strip() == "ok"
    finally:
        down = cluster_script("down", name=name, timeout=300)
    assert down.returncode == 0, down.stderr

    assert not (ports & listening_ports()), f"still listening: {sorted(ports & listening_ports())}"
    for comp, pid in pids.items():
        assert not process_group_members(pid), f"{comp} (process group {pid}) survived down"
    status = cluster_script("status", name=name)
    assert status.returncode != 0 and "stopped" in status.stdout
    # down is idempotent
    assert cluster_script("down", name=name).returncode == 0
    shutil.rmtree(state)  # logs are kept only when the test fails


def _script(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HACK / args[0]), *args[1:]], env=env, capture_output=True, text=True, timeout=60
    )


def test_down_of_an_unknown_cluster_fails_and_lists_the_known_ones(tmp_path: Path) -> None:
    """A cluster started under another cache must not look stopped (issue 12)."""
    known = tmp_path / "clusters" / "alpha"
    known.mkdir(parents=True)
    (known / "cluster.env").write_text("TETRAD_CLUSTER_NAME=alpha\n")
    env = {**os.environ, "TETRAD_CACHE": str(tmp_path)}
    down = _script(["cluster.sh", "down", "--name", "ghost"], env)
    assert down.returncode == 1
    assert "no such cluster" in down.stderr and "known clusters: alpha" in down.stderr, down.stderr
    assert str(tmp_path / "clusters") in down.stderr
    status = _script(["cluster.sh", "status", "--name", "ghost"], env)
    assert status.returncode == 3 and "known: alpha" in status.stdout, status.stdout


def test_one_cache_default_for_make_test_and_ci(tmp_path: Path) -> None:
    """Without TETRAD_CACHE the binaries live under XDG_CACHE_HOME (else ~/.cache), never in the clone."""
    base = {k: v for k, v in os.environ.items() if k not in ("TETRAD_CACHE", "XDG_CACHE_HOME")}
    xdg = _script(["k8s-tools.sh", "bindir"], {**base, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert xdg.stdout.strip() == str(tmp_path / "xdg" / "tetrad" / "bin")
    home = _script(["k8s-tools.sh", "bindir"], {**base, "HOME": str(tmp_path)})
    assert home.stdout.strip() == str(tmp_path / ".cache" / "tetrad" / "bin")
    ci = (HACK.parent / ".ci" / "run").read_text()
    assert "TETRAD_CACHE=" not in ci  # .ci/run and `make test` share the script's default
