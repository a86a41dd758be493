"""The file protocol of a checkpoint directory: durable writes, checksummed manifests, the atomic
`latest`, retention. Plain files only: no torch, no torch.distributed.

Invariants:
- a step directory is renamed into place only after its manifest (the size and CRC32 of every
  file in it) is written and fsynced; `latest` is replaced (tmp file, fsync, os.replace, fsync of
  the directory) only after that rename: replacing `latest` IS the commit;
- retention deletes a checkpoint only after a newer one is committed, and renames it out of
  sight before deleting it, so a kill never leaves a half-deleted directory under a step name;
- a job deletes or replaces only its own checkpoints: those whose manifest names it (`job_of`);
- everything starting with `.tmp-` or `.trash-` is garbage: never loaded, removed by the next save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tetrad.api.contract import step_dir_name

FORMAT = "tetrad-checkpoint/1"
LATEST = "latest"
MANIFEST = "MANIFEST.json"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_CHUNK = 8 << 20

# Test seam: called with (phase, step) at each phase of a save, on the ranks that pass through it
# (the commit phases are rank 0's); the kill tests SIGKILL a rank there.
phase_hook: Callable[[str, int], None] | None = None


def phase(name: str, step: int) -> None:
    if phase_hook is not None:
        phase_hook(name, step)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint belongs to a different model; no layout change can fix it (a config error)."""


class NoGoodCheckpoint(CheckpointError):
    """Checkpoints exist but every one of them is damaged."""


class ForeignCheckpoint(CheckpointMismatch):
    """The checkpoint to resume was written by a job of another name (a config error)."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Write and fsync `path` (not atomic: for files inside a directory that is committed later)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_durably(path: Path, data: bytes) -> None:
    """Write `path` so that after a crash it holds either its old content or `data`, never a mix."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    write_file(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_digest(path: Path) -> tuple[int, str]:
    """(size, CRC32 as 8 hex digits) of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


def digests(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """name -> {size, crc32} of files in `directory`."""
    return {n: dict(zip(("size", "crc32"), file_digest(directory / n), strict=True)) for n in names}


def _json_crc(obj: Any) -> str:
    return f"{zlib.crc32(json.dumps(obj, sort_keys=True).encode()):08x}"


def seal_manifest(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return json.dumps({**body, "manifest_crc32": _json_crc(body)}, indent=1, sort_keys=True).encode()


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory; CheckpointError when it is missing or damaged."""
    path = step_dir / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint was never committed)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    if manifest.get("manifest_crc32") != _json_crc(body):
        raise CheckpointError(f"{path}: manifest checksum mismatch (the manifest itself is damaged)")
    return manifest


def job_of(manifest: dict[str, Any]) -> str | None:
    """The name of the job that wrote a checkpoint (its resolved config's jobName), None when it says none."""
    config = manifest.get("config")
    name = config.get("jobName") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def verify_files(step_dir: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """Problems found checking `files` (name -> {size, crc32}) in `step_dir`; empty when intact."""
    problems = []
    for name, want in sorted(files.items()):
        path = step_dir / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        if size != want["size"]:
            problems.append(f"{name}: {size} bytes, the manifest says {want['size']} "
                            "(truncated or overwritten)")
            continue
        _, crc = file_digest(path)
        if crc != want["crc32"]:
            problems.append(f"{name}: CRC32 {crc}, the manifest says {want['crc32']} (corrupted)")
    return problems


@dataclass
class Candidate:
    path: Path
    step: int
    note: str = ""


def candidate_manifest(cand: Candidate) -> tuple[dict[str, Any] | None, str | None]:
    """The candidate's manifest, or why it cannot be one (missing, damaged, another step's)."""
    try:
        manifest = read_manifest(cand.path)
    except CheckpointError as e:
        return None, str(e)
    if manifest["step"] != cand.step:
        return None, f"the manifest says step {manifest['step']}, the directory step {cand.step}"
    return manifest, None


def verified_here(cand: Candidate) -> tuple[dict[str, Any] | None, list[str]]:
    """(manifest, problems) of a candidate checked in this one process: its manifest, then every file."""
    manifest, problem = candidate_manifest(cand)
    if manifest is None:
        return None, [problem or "no manifest"]
    return manifest, verify_files(cand.path, manifest["files"])


def first_intact(candidates: list[Candidate],
                 verify: Callable[[Candidate], tuple[dict[str, Any] | None, list[str]]],
                 say: Callable[[str], None]) -> tuple[Candidate | None, dict[str, Any] | None, list[str]]:
    """The first candidate `verify` finds intact, its manifest and the refusals before it: the rule of resume
    and export. A damaged one (or one `latest` names that is missing) is refused with the reason and the next
    older one tried; `say` gets each candidate's note, each refusal and the fall-back."""
    refused: list[str] = []
    for cand in candidates:
        if cand.note:
            say(cand.note)
        manifest, problems = verify(cand)
        if problems:
            msg = f"refusing {cand.path}: " + "; ".join(problems[:5])
            if len(problems) > 5:
                msg += f"; and {len(problems) - 5} more"
            say(msg)
            refused.append(msg)
            continue
        if refused:
            say(f"falling back to the previous good checkpoint {cand.path}")
        return cand, manifest, refused
    return None, None, refused


class CheckpointDir:
    """The directory of one job's checkpoints: listing, committing and pruning (rank 0 only).

    job: the name of the job saving here; it deletes and replaces only the checkpoints it wrote (any,
    when None: a tool's view of the directory)."""

    def __init__(self, root: str | Path, job: str | None = None):
        self.root = Path(root)
        self.job = job

    def foreign(self, step_dir: Path) -> str | None:
        """The other job that wrote `step_dir`, or None when it is this job's (or its manifest does not
        say)."""
        try:
            other = job_of(json.loads((step_dir / MANIFEST).read_bytes()))
        except (OSError, ValueError, AttributeError):
            return None
        return other if self.job is not None and other is not None and other != self.job else None

    def tmp_dir(self, step: int) -> Path:
        return self.root / f"{TMP_PREFIX}{step_dir_name(step)}"

    def committed_dirs(self) -> list[tuple[int, Path]]:
        """Step directories with a manifest, oldest first (including any newer than `latest`)."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            if (m := STEP_DIR.match(entry.name)) and entry.is_dir() and (entry / MANIFEST).exists():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def latest(self) -> tuple[int | None, str]:
        """(step named by `latest`, a note when it is missing or unreadable)."""
        path = self.root / LATEST
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return None, ""
        except (OSError, UnicodeDecodeError) as e:
            return None, f"{path} unreadable ({e})"
        if m := STEP_DIR.match(text):
            return int(m.group(1)), ""
        return None, f"{path} holds {text[:40]!r}, not a step directory name"

    def candidates(self) -> list[Candidate]:
        """Checkpoints to try on resume, best first: `latest`, then older committed ones."""
        dirs = self.committed_dirs()
        latest, note = self.latest()
        if latest is None:
            if dirs and not note:
                note = f"{self.root / LATEST} missing"
            older = dirs
        else:
            older = [(s, p) for s, p in dirs if s <= latest]
            if not any(s == latest for s, _ in older):  # refused on resume with "manifest missing"
                older.append((latest, self.root / step_dir_name(latest)))
        out = [Candidate(p, s) for s, p in reversed(older)]
        if note and out:
            out[0].note = f"{note}; using the newest checkpoint with a manifest"
        return out

    def publish(self, step: int) -> None:
        write_durably(self.root / LATEST, f"{step_dir_name(step)}\n".encode())

    def discard(self, path: Path) -> None:
        """Remove a directory: first renamed out of sight (atomic), then deleted."""
        trash = self.root / f"{TRASH_PREFIX}{path.name}.{os.getpid()}.{time.monotonic_ns()}"
        os.rename(path, trash)
        fsync_dir(self.root)
        shutil.rmtree(trash, ignore_errors=True)

    def clean_garbage(self) -> None:
        """Delete leftovers of killed saves and deletions."""
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def prune(self, keep_last: int) -> list[int]:
        """Keep the newest `keep_last` committed checkpoints up to `latest`; delete the rest, and any
        step directory newer than `latest` (a save killed between its rename and its publication).
        Another job's checkpoints are neither counted nor deleted. Returns the deleted steps."""
        latest, _ = self.latest()
        if latest is None:
            return []
        deleted = []
        committed = []
        for entry in self.root.iterdir():
            m = STEP_DIR.match(entry.name)
            if not (m and entry.is_dir()) or self.foreign(entry):
                continue
            step = int(m.group(1))
            if step > latest:
                self.discard(entry)
                deleted.append(step)
            else:
                committed.append((step, entry))
        committed.sort()
        for step, entry in committed[: max(0, len(committed) - keep_last)]:
            self.discard(entry)
            deleted.append(step)
        return sorted(deleted)

    def commit(self, step: int, tmp: Path, reports: list[dict[str, Any]], manifest: dict[str, Any],
               keep_last: int) -> tuple[int, list[int]]:
        """Seal `tmp` as checkpoint `step` and publish it.

        reports: one per rank, {"rank", "files": name -> {size, crc32}} of the files it wrote;
        manifest: the fields to record besides format, step, time and files. Files no rank claimed
        (e.g. DCP's .metadata) are digested here. Returns (size in bytes, steps deleted by retention).
        """
        files: dict[str, dict[str, Any]] = {}
        for r in reports:
            for name, digest in r["files"].items():
                try:
                    size = (tmp / name).stat().st_size
                except FileNotFoundError:
                    size = None
                if size != digest["size"]:
                    raise CheckpointError(
                        f"rank {r['rank']} wrote {name} ({digest['size']} bytes) but rank 0 sees "
                        f"{'no such file' if size is None else f'{size} bytes'}: {self.root} must be one "
                        "filesystem shared by every node (e.g. a ReadWriteMany volume)")
                files[name] = digest
        unclaimed = [e.name for e in tmp.iterdir() if e.name not in files and e.name != MANIFEST]
        files.update(digests(tmp, unclaimed))
        body = {**manifest, "format": FORMAT, "step": step,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": files}
        write_file(tmp / MANIFEST, seal_manifest(body))
        fsync_dir(tmp)
        phase("manifest-written", step)
        final = self.root / step_dir_name(step)
        if other := self.foreign(final):
            raise CheckpointError(f"{final} is a checkpoint of the job {other!r}, which the job {self.job!r} "
                                  "does not replace; give each job its own checkpoint.path")
        if final.exists():  # left by a save killed before its publication, or a run with resume off
            self.discard(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        phase("renamed", step)
        self.publish(step)
        phase("published", step)
        deleted = self.prune(keep_last)
        phase("pruned", step)
        return sum(f["size"] for f in files.values()), deleted


def unwritable(root: str | Path) -> tuple[str, bool] | None:
    """Why this process cannot create files in the directory `root` (created if missing), and whether a
    file stands where the directory or one above it belongs; None when it can."""
    path = Path(root)
    existing = next((p for p in (path, *path.parents) if p.exists()), path)
    if existing.exists() and not existing.is_dir():
        return (f"{path} is a file, not a directory" if existing == path else
                f"{path} cannot be a directory: {existing} is a file"), True
    probe = path / f"{TMP_PREFIX}probe.{os.uname().nodename}.{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        write_file(probe, b"")
        probe.unlink()
    except OSError as e:
        return (f"{path} is not writable by uid {os.getuid()} on {os.uname().nodename} "
                f"({e.strerror or e})", False)
    return None


def writable_problem(root: str | Path) -> str | None:
    """Why this process cannot create files under `root` (created if missing), or None.

    Run by every rank before any collective, so that a bad path fails every rank the same way
    instead of one rank dying and the others reporting only a lost connection.
    """
    if (found := unwritable(root)) is None:
        return None
    why, file = found
    fix = ("move that file away or set checkpoint.path to a directory" if file else
           "mount a writable volume there (spec.checkpoint.volume, e.g. a ReadWriteMany claim) "
           "or choose another path")
    return f"spec.checkpoint.path: {why}; {fix}"
