"""The files of a `tetrad run`: its work directory, the locks that keep two runs apart, and --jsonl.

- The work directory is Tetrad's: a new temporary one, or `--workdir DIR` when DIR is missing, empty
  or marked as a work directory by an earlier run (MARKER). A run replaces the files it writes there
  (the config, the launcher, node logs, metrics.jsonl); a directory holding other files is refused,
  so a run never overwrites what it was not given.
- A run holds an flock on LOCK in its work directory, and in the checkpoint directory when it
  checkpoints, for its whole life: its node agents inherit the lock, so it is free again once every
  process of the run has exited, a SIGKILLed one included. A second run on either directory is refused,
  naming the first's PID.
- `--jsonl FILE` gets a copy of rank 0's JSON lines, appended: an existing file must be JSON lines
  already (never the manifest, never a file of the run's own), a pipe or a terminal (/dev/stdout) is
  written as a stream.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import IO

from tetrad.api.manifest import shorten

MARKER = ".tetrad-run"  # a work directory Tetrad made or took: a run may replace the files it wrote there
LOCK = ".tetrad-run.lock"  # flocked by the run using the directory; holds its PID
MARKER_TEXT = ("A `tetrad run` work directory: a run replaces the files it writes here"
               " (config, logs, metrics).\n")
FIRST_LINE_BYTES = 1 << 20  # how much of an existing --jsonl file is read to see that it holds JSON lines


class Refused(Exception):
    """The run cannot start: one line per reason, each naming the option or field and the fix."""

    def __init__(self, *lines: str):
        self.lines = list(lines)
        super().__init__("; ".join(lines))


def shown(path: Path) -> str:
    return shorten(str(path), 200)


def claim_workdir(path: Path | None, job_name: str) -> Path:
    """The run's work directory, created and marked as Tetrad's: a new temporary one, or `path`."""
    if path is None:
        try:
            path = Path(tempfile.mkdtemp(prefix=f"tetrad-{job_name}-"))
        except OSError as e:
            raise Refused(f"cannot create a work directory in {tempfile.gettempdir()}: {e.strerror or e};"
                          " give one with --workdir") from None
    else:
        try:
            if path.exists() and not path.is_dir():
                raise Refused(f"--workdir {shown(path)}: not a directory; give a new or empty directory")
            if path.is_dir() and not (path / MARKER).exists() and any(path.iterdir()):
                raise Refused(f"--workdir {shown(path)}: holds files that are not a tetrad run's"
                              f" (it has no {MARKER}); tetrad run would replace config.json, node-N.log"
                              " and metrics.jsonl there: give a new or empty directory")
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Refused(f"--workdir {shown(path)}: cannot create the directory:"
                          f" {e.strerror or e}") from None
    write_file(path, MARKER, MARKER_TEXT.encode())
    return path


def write_file(directory: Path, name: str, data: bytes) -> None:
    """One of the run's own files in its work directory; Refused (the cause named) when it cannot be
    written."""
    try:
        (directory / name).write_bytes(data)
    except OSError as e:
        raise Refused(f"the work directory {shown(directory)}: cannot write {name}: {e.strerror or e};"
                      " free some space or give another --workdir") from None


class DirectoryLock:
    """An exclusive flock on LOCK in a directory, released when every process holding it has exited."""

    def __init__(self, directory: Path, what: str):
        self.directory, self.what = directory, what
        self.fd = -1

    def acquire(self) -> None:
        path = self.directory / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise Refused(f"{self.what}: cannot create its lock {LOCK}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise Refused(f"{self.what} is in use by another tetrad run (PID {holder}); wait for it to end,"
                          " stop it, or choose another") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def checkpoint_lock(path: str, workdir: Path) -> DirectoryLock | None:
    """The lock of the checkpoint directory (created as the trainer would); None when it is the work
    directory (locked already) or cannot be created (the trainer names the path on every rank)."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if directory.resolve() == workdir.resolve():
            return None
    except OSError:
        return None
    return DirectoryLock(directory, f"spec.checkpoint.path {shown(directory)}")


def check_jsonl(path: Path, *, workdir: Path | None, manifest: Path | None) -> None:
    """Refuse a --jsonl that must not be written to: the manifest, a file of the work directory, a
    directory, a file that is not JSON lines."""
    flag = f"--jsonl {shown(path)}"
    if manifest is not None and _same_file(path, manifest):
        raise Refused(f"{flag}: is the manifest being run; give a new file for the JSON lines")
    if workdir is not None and path.resolve().is_relative_to(workdir.resolve()):
        raise Refused(f"{flag}: is inside the work directory {shown(workdir)}, whose files the run replaces;"
                      " rank 0's lines are in its metrics.jsonl already: give a file elsewhere")
    try:
        if path.is_dir():
            raise Refused(f"{flag}: is a directory; give a file")
        if path.is_file() and path.stat().st_size and not _json_lines(path):
            raise Refused(f"{flag}: exists and its first line is not a JSON object, so it is not a JSON-lines"
                          " file; tetrad run appends to JSON lines and never replaces a file: give a new"
                          " file")
    except OSError as e:
        raise Refused(f"{flag}: cannot read the file: {e.strerror or e}") from None


def open_jsonl(path: Path) -> IO[bytes]:
    """--jsonl (checked by check_jsonl) opened for appending, its directory made."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("ab")
    except OSError as e:
        raise Refused(f"--jsonl {shown(path)}: cannot write the file: {e.strerror or e}") from None


def appends(path: Path) -> bool:
    """Whether --jsonl is a non-empty regular file the lines go after (said at the start)."""
    with contextlib.suppress(OSError):
        return stat.S_ISREG(path.stat().st_mode) and path.stat().st_size > 0
    return False


def _json_lines(path: Path) -> bool:
    with path.open("rb") as f:
        first = f.readline(FIRST_LINE_BYTES)
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:
        return False


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False
