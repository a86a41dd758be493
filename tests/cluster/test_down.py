"""`hack/cluster.sh down` leaves no processes or listening ports behind.

Uses its own small cluster instance (own name, state dir and ports), so the
session cluster other tests share is not touched.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.cluster_fixtures import cluster_script, start_cluster

pytestmark = pytest.mark.cluster

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
