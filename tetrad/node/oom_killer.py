"""The kernel's out-of-memory killer, as a node's supervisor sees it: its kills, and the room left before
it acts.

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


UNLIMITED = 1 << 60  # cgroup v1 reports no limit as a number near 2**63


def own_cgroup() -> str:
    """This process's /proc/self/cgroup ("" when it cannot be read)."""
    try:
        return Path("/proc/self/cgroup").read_text()
    except OSError:
        return ""


def memory_dirs(proc_cgroup: str, root: Path = CGROUP_ROOT) -> list[tuple[int, Path]]:
    """This process's memory cgroup directories with their cgroup version: v1's memory controller, v2's
    (at the root, or under unified/ on a hybrid host)."""
    dirs = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        relative = path.lstrip("/")
        if "memory" in controllers.split(","):
            dirs.append((1, root / "memory" / relative))
        elif controllers == "" and path:
            dirs += [(2, root / relative), (2, root / "unified" / relative)]
    return dirs


def counter_files(proc_cgroup: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """Where the kernel counts this process's cgroup's OOM kills, most specific first: cgroup v1's memory
    controller (memory.oom_control), cgroup v2 (memory.events, at the root or under unified/ on a hybrid
    host), then the machine's /proc/vmstat."""
    files = [d / ("memory.oom_control" if version == 1 else "memory.events")
             for version, d in memory_dirs(proc_cgroup, root)]
    return [*files, Path("/proc/vmstat")]


def room_bytes(proc_cgroup: str | None = None, root: Path = CGROUP_ROOT,
               meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """How much more memory this process's cgroup may take before the OOM killer acts (its limit less its
    usage, page cache included), else, without a limit, the machine's MemAvailable; None when unknown."""
    for version, d in memory_dirs(own_cgroup() if proc_cgroup is None else proc_cgroup, root):
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes") if version == 1 else (
            "memory.max", "memory.current")
        try:
            limit, usage = ((d / name).read_text().strip() for name in names)
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < UNLIMITED:
            return max(0, int(limit) - int(usage))
        break  # a cgroup without a limit: the machine's memory is the limit
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def oom_kills(proc_cgroup: str | None = None, root: Path = CGROUP_ROOT) -> tuple[int, Path] | None:
    """(processes the OOM killer has killed, where that was read), from the first counter that exists;
    None when none can be read."""
    for path in counter_files(own_cgroup() if proc_cgroup is None else proc_cgroup, root):
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
