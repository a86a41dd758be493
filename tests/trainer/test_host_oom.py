"""A worker that the kernel's OOM killer ends dies of SIGKILL without a word: its node exits 77 (out of
memory, not retried) naming host memory, instead of torchrun's 1 (retried to no end). Against the real
kernel: `tetrad run` in a memory cgroup of its own with a limit the script outgrows. The counters' places
and arithmetic without a kernel: test_the_oom_killers_counter_is_read_from_the_nodes_cgroup."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.trainer.harness import free_port_block
from tetrad.api.contract import EXIT_OOM, REASON_HOST_OUT_OF_MEMORY
from tetrad.api.termination import TerminationMessage
from tetrad.node import oom_killer

HOG = Path(__file__).parent / "scripts" / "hog.py"
# tetrad run, a torchrun agent and a worker (each about 0.5 GiB with torch) fit; 3 GiB more does not
LIMIT = 1536 << 20


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Callable[[], None]]:
    """A child of this process's memory cgroup (v1, or v2) limited to `limit` bytes; yields a preexec_fn that
    moves the child process into it. Removed once its processes are gone."""
    own = Path("/proc/self/cgroup").read_text()
    v1 = [line.split(":", 2)[2] for line in own.splitlines() if "memory" in line.split(":")[1].split(",")]
    name = f"tetrad-test-{uuid.uuid4().hex[:8]}"
    if v1:
        group = Path("/sys/fs/cgroup/memory") / v1[0].lstrip("/") / name
        limit_file = "memory.limit_in_bytes"
    else:
        group = Path("/sys/fs/cgroup") / own.split("0::", 1)[1].split()[0].lstrip("/") / name
        limit_file = "memory.max"
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit))
    except OSError as e:
        pytest.fail(f"this test needs a memory cgroup it can create (root, cgroupfs writable): {group}: {e}")

    def join() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    try:
        yield join
    finally:
        for _ in range(100):
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            subprocess.run(["sleep", "0.1"], check=False)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_worker_the_oom_killer_ends_makes_its_node_exit_77_naming_host_memory(tmp_path: Path) -> None:
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": "hog"},
           "spec": {"nodes": 1, "nprocPerNode": 1,
                    "script": {"path": str(HOG), "args": ["--limit-mib", "3072"]},
                    "preflight": {"enabled": False}, "metrics": {"port": free_port_block(1)}}}
    job, work = tmp_path / "job.yaml", tmp_path / "work"
    job.write_text(yaml.safe_dump(doc))
    with memory_cgroup(LIMIT) as join:
        r = subprocess.run([sys.executable, "-m", "tetrad.cli", "run", str(job), "--workdir", str(work)],
                           capture_output=True, text=True, timeout=300,
                           preexec_fn=join,  # noqa: PLW1509 - cgroup only
                           env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})
    log = (work / "node-0.log").read_text()
    assert r.returncode == EXIT_OOM, r.stderr + log[-3000:]
    text = " ".join(r.stderr.split())
    assert "node 0 exited with code 77" in text, r.stderr
    assert ("HostOutOfMemory: the kernel's out-of-memory killer ended 1 process(es) in this node's memory "
            "cgroup" in text), r.stderr
    said = TerminationMessage.parse((work / "node-0.termination").read_text())
    assert (said.reason == REASON_HOST_OUT_OF_MEMORY
            and "Raise spec.resources.memory" in (said.message or "")), said


def test_the_oom_killers_counter_is_read_from_the_nodes_cgroup(tmp_path: Path) -> None:
    v1 = "12:pids:/pod\n4:memory:/kubepods/pod1/c1\n0::/\n"
    v2 = "0::/kubepods/pod1/c1\n"
    assert (oom_killer.counter_files(v1, tmp_path)[0]
            == tmp_path / "memory/kubepods/pod1/c1/memory.oom_control")
    assert oom_killer.counter_files(v2, tmp_path)[:2] == [tmp_path / "kubepods/pod1/c1/memory.events",
                                                          tmp_path / "unified/kubepods/pod1/c1/memory.events"]
    assert oom_killer.counter_files("", tmp_path) == [Path("/proc/vmstat")]
    events = tmp_path / "kubepods/pod1/c1/memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n")
    before = oom_killer.oom_kills(v2, tmp_path)
    assert before == (2, events)
    assert oom_killer.killed_since(before) == 0
    events.write_text("low 0\nhigh 0\nmax 5\noom 3\noom_kill 3\noom_group_kill 0\n")
    assert oom_killer.killed_since(before) == 1
    assert oom_killer.killed_since(None) == 0  # nothing could be read at the start: no claim
    v1_file = tmp_path / "memory/kubepods/pod1/c1/memory.oom_control"
    v1_file.parent.mkdir(parents=True)
    v1_file.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    assert oom_killer.oom_kills(v1, tmp_path) == (7, v1_file)
    assert oom_killer.oom_kills("", tmp_path) is not None  # /proc/vmstat's machine-wide count


def test_the_room_before_the_oom_killer_is_the_cgroups_limit_less_its_usage_else_the_machines(
        tmp_path: Path) -> None:
    v1, v2 = "4:memory:/pod1/c1\n", "0::/pod1/c1\n"
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2000000 kB\n")
    d1, d2 = tmp_path / "memory/pod1/c1", tmp_path / "pod1/c1"
    d1.mkdir(parents=True)
    d2.mkdir(parents=True)
    (d1 / "memory.limit_in_bytes").write_text(f"{3 << 30}\n")
    (d1 / "memory.usage_in_bytes").write_text(f"{(3 << 30) - (300 << 20)}\n")
    assert oom_killer.room_bytes(v1, tmp_path, meminfo) == 300 << 20
    (d1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1 without a limit
    assert oom_killer.room_bytes(v1, tmp_path, meminfo) == 2000000 * 1024
    (d2 / "memory.max").write_text(f"{4 << 30}\n")
    (d2 / "memory.current").write_text(f"{5 << 30}\n")  # above the limit (page cache): no room
    assert oom_killer.room_bytes(v2, tmp_path, meminfo) == 0
    (d2 / "memory.max").write_text("max\n")
    assert oom_killer.room_bytes(v2, tmp_path, meminfo) == 2000000 * 1024
    assert oom_killer.room_bytes("", tmp_path, tmp_path / "none") is None
