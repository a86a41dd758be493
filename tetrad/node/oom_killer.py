"""The kernel's out-of-memory killer, as a node's supervisor sees it.

A worker the OOM killer ends dies of SIGKILL without a word; torchrun then exits 1, which alone would
read as an ordinary failure and be retried. The supervisor counts the OOM killer's kills before and
after torchrun: in its own memory cgroup (the container's, or a local run's), where the kernel counts
every process of the cgroup it killed, else machine-wide (/proc/vmstat). More kills after a failed
torchrun whose workers named no cause of their own: the node exits EXIT_OOM, saying so.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _counter(text: str, key: str = "oom_kill") -> int | None:
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def counter_files(proc_cgroup: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """Where the kernel counts this process's cgroup's OOM kills, most specific first: cgroup v1's memory
    controller (memory.oom_control), cgroup v2 (memory.events, at the root or under unified/ on a hybrid
    host), then the machine's /proc/vmstat."""
    files = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        relative = path.lstrip("/")
        if "memory" in controllers.split(","):
            files.append(root / "memory" / relative / "memory.oom_control")
        elif controllers == "" and path:
            files += [root / relative / "memory.events", root / "unified" / relative / "memory.events"]
    return [*files, Path("/proc/vmstat")]


def oom_kills(proc_cgroup: str | None = None, root: Path = CGROUP_ROOT) -> tuple[int, Path] | None:
    """(processes the OOM killer has killed, where that was read), from the first counter that exists;
    None when none can be read."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = ""
    for path in counter_files(proc_cgroup, root):
        try:
            count = _counter(path.read_text())
        except OSError:
            continue
        if count is not None:
            return count, path
    return None


def killed_since(before: tuple[int, Path] | None) -> int:
    """How many processes the OOM killer has killed since `before` (read from the same counter)."""
    if before is None:
        return 0
    count, path = before
    try:
        now = _counter(path.read_text())
    except OSError:
        return 0
    return max(0, (now or 0) - count)
