"""Checkpoints that survive anything: DCP save and resume with an atomic commit.

What `checkpoint.path` holds (one job per path):

    latest                  "step-00000040": the newest committed checkpoint. Replacing this file
                            (tmp file, fsync, os.replace, fsync of the directory) IS the commit.
    step-00000040/
        .metadata           DCP metadata, written by rank 0
        __R_0.distcp        DCP data of rank R: its shards of the model and optimizer, as they live
        rank-0000R.pt       rank R's own state: RNG, data loader position, LR schedulers, extras
        MANIFEST.json       step, layout, resolved config, every rank's coordinates, and the size
                            and CRC32 of every file above. Written last; verified before loading.
    .tmp-step-00000050/     a save in progress, or one killed mid-way; never loaded, removed by the
                            next save
    .trash-*/               a checkpoint being deleted by retention, or a leftover of one

A checkpoint is committed when `latest` names it or a newer committed one; retention keeps the
newest `keep_last` committed checkpoints and deletes older ones only after a newer one is
committed. On resume the `latest` checkpoint is verified against its manifest by all ranks (each
checks a share of the files); a damaged one is refused with the reason and the next older
committed checkpoint is tried.

Model and optimizer state go through the distributed state-dict API, keyed by the full model's
fully-qualified names (optimizer state flattened per parameter FQN), so a checkpoint saved with one
layout (pp, dp, tp, cp) loads into any other layout of the same model.

The writing, hashing and commit run in a background thread when `async` is on: the training
thread only blocks for a copy of the state into CPU memory.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import io
import json
import logging
import os
import random
import re
import shutil
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tetrad.api.contract import ENV_RESTART
from tetrad.api.resolved import Layout, ModelConfig, ResolvedConfig

log = logging.getLogger("tetrad.checkpoint")

FORMAT = "tetrad-checkpoint/1"
LATEST = "latest"
MANIFEST = "MANIFEST.json"
STEP_DIR = re.compile(r"^step-(\d{8,})$")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_CHUNK = 8 << 20
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

# Model dims that must match for a checkpoint to load; everything else (layout, batch, lr, steps)
# may change between runs.
MODEL_KEYS = ("dim", "layers", "heads", "kv_heads", "vocab", "ffn_dim")

# Test seam: called with (phase, step) at each phase of a save, on the ranks that pass through it
# (the commit phases are rank 0's); the kill tests SIGKILL a rank there.
phase_hook: Callable[[str, int], None] | None = None


def _phase(name: str, step: int) -> None:
    if phase_hook is not None:
        phase_hook(name, step)


def _reason(e: BaseException, rank: int) -> str:
    """`rank N: Type: message` per cause; DCP's exception (a BaseException) carries each failed rank's own."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items()))
    return f"rank {rank}: {type(e).__name__}: {e}"


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint belongs to a different model; no layout change can fix it (a config error)."""


class NoGoodCheckpoint(CheckpointError):
    """Checkpoints exist but every one of them is damaged."""


class ResumableLoader(Protocol):
    """What the checkpointer needs from a data loader.

    `state_dict()` is this DP rank's position (plain ints, lists and tensors). When the DP degree
    is unchanged, each DP rank gets its own state back through `load_state_dict`. When it changed,
    a loader with `load_resharded_state(states)` receives the saved state of every old DP rank, in
    DP-rank order, and rebuilds its position from the global sample index; a loader without it
    must save the same, layout-independent state on every DP rank (e.g. the next global sample
    index), which is then loaded as is.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ---------------------------------------------------------------------------------------------
# Files: durable writes, checksums, manifests. No torch.distributed here.


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write `path` so that after a crash it holds either its old content or `data`, never a mix."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
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


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


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
            problems.append(f"{name}: {size} bytes, the manifest says {want['size']} (truncated or overwritten)")
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


class CheckpointDir:
    """The directory of one job's checkpoints: listing, publishing and pruning (rank 0 only)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

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
            if not any(s == latest for s, _ in older):  # refused below with "manifest missing"
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
        Returns the deleted steps."""
        latest, _ = self.latest()
        if latest is None:
            return []
        deleted = []
        committed = []
        for entry in self.root.iterdir():
            m = STEP_DIR.match(entry.name)
            if not (m and entry.is_dir()):
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


# ---------------------------------------------------------------------------------------------
# Per-rank state that is not sharded: RNG, data loader, LR schedulers.


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np.asarray(np_state[1]).astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


# ---------------------------------------------------------------------------------------------
# The distributed part.


@dataclass
class Resumed:
    step: int
    path: Path
    saved_layout: str
    layout: str
    restart: int
    extra: dict[str, Any]
    refused: list[str] = field(default_factory=list)


@dataclass
class SaveStats:
    step: int
    stall_s: float  # time the training thread was blocked
    total_s: float = 0.0  # from the call until the commit
    bytes: int = 0
    async_save: bool = False


class Checkpointer:
    """Saves and resumes one job's training state. Every method is collective: call it on all ranks.

    model_parts: the modules this rank holds (several pipeline stages give several); optimizers:
    one per part, or one for all of them. lr_schedulers: stepped identically on every rank.
    data_loader: see ResumableLoader. dp_rank: this rank's data-parallel coordinate (the degree is
    the config's). restart: the operator's restart count, by default $TETRAD_RESTART. path:
    overrides config.checkpoint.path. logger: receives rank 0's messages (default: logging).
    """

    def __init__(
        self,
        config: ResolvedConfig,
        *,
        model_parts: Sequence[torch.nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        lr_schedulers: Sequence[Any] = (),
        data_loader: ResumableLoader | None = None,
        dp_rank: int = 0,
        restart: int | None = None,
        path: str | Path | None = None,
        logger: Callable[[str], None] | None = None,
    ):
        if len(optimizers) == len(model_parts):
            self.pairs = list(zip(model_parts, optimizers, strict=True))
        elif len(optimizers) == 1:  # one optimizer over several pipeline stages
            self.pairs = [(merged_view(model_parts), optimizers[0])]
        else:
            raise ValueError(f"need one optimizer, or one per model part: {len(model_parts)} parts, "
                             f"{len(optimizers)} optimizers")
        self.config = config
        self.settings = config.checkpoint
        self.layout: Layout = config.layout
        self.dir = CheckpointDir(path if path is not None else config.checkpoint.path)
        self.lr_schedulers = list(lr_schedulers)
        self.data_loader = data_loader
        self.dp_rank, self.dp = dp_rank, config.layout.dp
        self.restart = int(os.environ.get(ENV_RESTART, "0")) if restart is None else restart
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        # A group of our own: async saves run collectives from a background thread, which must
        # never interleave with the training collectives on the default group.
        self.pg = dist.new_group(backend="gloo") if self.distributed else None
        self._say = logger or log.info
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[SaveStats] | None = None
        self._stager: Any = None
        self.last_saved_step: int | None = None
        self.last_stats: SaveStats | None = None

    # -- collectives on our group -------------------------------------------------------------

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.pg)

    def _info(self, msg: str) -> None:
        if self.rank == 0:
            self._say(f"checkpoint: {msg}")

    # -- state ----------------------------------------------------------------------------------

    def _tensor_state(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for part, opt in self.pairs:
            for src, dst in ((get_model_state_dict(part), model),
                             (get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS), optim)):
                if clash := src.keys() & dst.keys():
                    raise CheckpointError(f"model parts share state keys, e.g. {sorted(clash)[0]!r}; "
                                          "each pipeline stage must keep the full model's FQNs for its own modules")
                dst.update(src)
        return {"model": model, "optim": optim}

    def _rank_state(self, step: int, extra: dict[str, Any] | None) -> bytes:
        state = {
            "step": step,
            "rank": self.rank,
            "dp_rank": self.dp_rank,
            "rng": rng_state(),
            "lr_schedulers": [s.state_dict() for s in self.lr_schedulers],
            "data": self.data_loader.state_dict() if self.data_loader is not None else None,
            "extra": extra or {},
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    # -- saving ---------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.settings.enabled and step % self.settings.interval == 0

    def save(self, step: int, *, extra: dict[str, Any] | None = None, blocking: bool = False) -> SaveStats | None:
        """Checkpoint the state after `step`. Asynchronous when `async` is on unless `blocking`.

        Waits for the previous asynchronous save first (raising its error, if it failed).
        """
        if not self.settings.enabled:
            return None
        self.wait()
        if self.last_saved_step == step:
            return None
        t0 = time.perf_counter()
        async_save = self.settings.async_save and not blocking
        if self.rank == 0:
            self.dir.root.mkdir(parents=True, exist_ok=True)
            self.dir.clean_garbage()
        self._barrier()  # nobody writes into a directory rank 0 is still clearing
        state = self._tensor_state()
        blob = self._rank_state(step, extra)
        if async_save:
            state = self._stage(state)
            _phase("staged", step)
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tetrad-ckpt")
            stall = time.perf_counter() - t0
            self._pending = self._executor.submit(self._write_and_commit, step, state, blob, t0, stall, True)
            self.last_saved_step = step
            return None
        stats = self._write_and_commit(step, state, blob, t0, 0.0, False)
        self.last_saved_step = step
        return stats

    def wait(self) -> SaveStats | None:
        """Block until the asynchronous save in flight (if any) is committed; raise if it failed."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        return pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of the state, so training may change the live tensors while it is written."""
        if self._stager is None:
            from torch.distributed.checkpoint._state_dict_stager import StateDictStager

            self._stager = StateDictStager(pin_memory=torch.cuda.is_available(), share_memory=False)
        return self._stager.stage(state, non_blocking=False)

    def _write_and_commit(self, step: int, state: dict[str, Any], blob: bytes, t0: float,
                          stall: float, async_save: bool) -> SaveStats:
        tmp = self.dir.root / f"{TMP_PREFIX}{step_dir_name(step)}"
        report: dict[str, Any] = {"rank": self.rank, "dp_rank": self.dp_rank}
        try:
            writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True)
            with _quiet_single_process(self.distributed):
                dcp.save(state, storage_writer=writer, process_group=self.pg, no_dist=not self.distributed)
            _phase("dcp-written", step)
            own = tmp / rank_file_name(self.rank)
            with open(own, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            _phase("rank-file-written", step)
            mine = [own.name] + [p.name for p in tmp.iterdir() if p.name.startswith(f"__{self.rank}_")]
            report["files"] = {n: dict(zip(("size", "crc32"), file_digest(tmp / n), strict=True)) for n in mine}
        except (Exception, CheckpointException) as e:  # every rank must still reach the gather below
            report["error"] = _reason(e, self.rank)
        reports = self._all_gather(report)
        errors = list(dict.fromkeys(r["error"] for r in reports if "error" in r))  # DCP reports a cause on every rank
        size = 0
        if self.rank == 0 and not errors:
            try:
                size = self._commit(step, tmp, reports)
            except Exception as e:
                errors.append(f"rank 0: {type(e).__name__}: {e}")
        errors, size = self._broadcast((errors, size))
        if errors:
            if self.rank == 0:  # every rank is done with it: give a full disk its space back
                shutil.rmtree(tmp, ignore_errors=True)
            full = any(f"[Errno {errno.ENOSPC}]" in e or f"[Errno {errno.EFBIG}]" in e for e in errors)
            raise CheckpointError(f"saving step {step} to {tmp} failed: " + "; ".join(errors)
                                  + "; nothing was committed: `latest` still names the last good checkpoint"
                                  + ("; free space on the checkpoint volume or lower checkpoint.keepLast" if full else ""))
        total = time.perf_counter() - t0
        stats = SaveStats(step=step, stall_s=stall if async_save else total, total_s=total, bytes=size,
                          async_save=async_save)
        self.last_stats = stats
        _phase("committed", step)
        self._info(f"committed step {step} at {self.dir.root / step_dir_name(step)} "
                   f"({stats.bytes / 1e6:.1f} MB, layout {self.layout.label()}, {stats.total_s:.2f} s, "
                   f"training stalled {stats.stall_s:.2f} s{', async' if async_save else ''})")
        return stats

    def _commit(self, step: int, tmp: Path, reports: list[dict[str, Any]]) -> int:
        """Rank 0: manifest, rename, publish, prune. Returns the checkpoint's size in bytes."""
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
                        f"{'no such file' if size is None else f'{size} bytes'}: {self.dir.root} must be one "
                        "filesystem shared by every node (e.g. a ReadWriteMany volume)")
                files[name] = digest
        for entry in tmp.iterdir():  # what no rank claimed, e.g. DCP's .metadata
            if entry.name not in files and entry.name != MANIFEST:
                size, crc = file_digest(entry)
                files[entry.name] = {"size": size, "crc32": crc}
        manifest = {
            "format": FORMAT,
            "step": step,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "layout": self.layout.model_dump(),
            "layout_label": self.layout.label(),
            "world_size": self.world,
            "restart": self.restart,
            "config": json.loads(self.config.to_json()),
            "ranks": [{"rank": r["rank"], "dp_rank": r["dp_rank"]} for r in reports],
            "files": files,
        }
        with open(tmp / MANIFEST, "wb") as f:
            f.write(seal_manifest(manifest))
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        _phase("manifest-written", step)
        final = self.dir.root / step_dir_name(step)
        if final.exists():  # left by a save killed before its publication, or a run with resume off
            self.dir.discard(final)
        os.rename(tmp, final)
        fsync_dir(self.dir.root)
        _phase("renamed", step)
        self.dir.publish(step)
        _phase("published", step)
        deleted = self.dir.prune(self.settings.keep_last)
        if deleted:
            self._info(f"retention (keepLast={self.settings.keep_last}) removed steps {deleted}")
        _phase("pruned", step)
        return sum(f["size"] for f in files.values())

    # -- resuming -------------------------------------------------------------------------------

    def resume(self) -> Resumed | None:
        """Load the newest good checkpoint, if resuming is on and one exists; else None.

        Damaged checkpoints are refused with the reason and older ones tried. Raises
        CheckpointMismatch when the checkpoint belongs to another model, NoGoodCheckpoint when
        checkpoints exist but all are damaged.
        """
        if not (self.settings.enabled and self.settings.resume):
            return None
        candidates = self._broadcast(self.dir.candidates() if self.rank == 0 else None)
        refused: list[str] = []
        for cand in candidates:
            if cand.note:
                self._info(cand.note)
            manifest, problems = self._verify(cand)
            if problems:
                msg = f"refusing {cand.path}: " + "; ".join(problems[:5])
                if len(problems) > 5:
                    msg += f"; and {len(problems) - 5} more"
                self._info(msg)
                refused.append(msg)
                continue
            if refused:
                self._info(f"falling back to the previous good checkpoint {cand.path}")
            assert manifest is not None
            resumed = self._load(cand.path, manifest)
            resumed.refused = refused
            self._info(f"resumed step {resumed.step} from {cand.path} (saved with layout {resumed.saved_layout}, "
                       f"now {resumed.layout}; restart {self.restart})")
            return resumed
        if refused:
            raise NoGoodCheckpoint(f"every checkpoint in {self.dir.root} is damaged: " + " | ".join(refused)
                                   + "; remove them (or set checkpoint.resume: false) to start over")
        self._info(f"no checkpoint in {self.dir.root}; starting from step 0 (restart {self.restart})")
        return None

    def _verify(self, cand: Candidate) -> tuple[dict[str, Any] | None, list[str]]:
        """All ranks check a share of the candidate's files. Returns (manifest, problems)."""
        manifest: dict[str, Any] | None = None
        problem = None
        if self.rank == 0:
            try:
                manifest = read_manifest(cand.path)
                if manifest["step"] != cand.step:
                    problem = f"the manifest says step {manifest['step']}, the directory step {cand.step}"
            except CheckpointError as e:
                problem = str(e)
        manifest, problem = self._broadcast((manifest, problem))
        if problem:
            return None, [problem]
        assert manifest is not None
        names = sorted(manifest["files"])
        mine = {n: manifest["files"][n] for n in names[self.rank :: self.world]}
        problems = [p for ps in self._all_gather(verify_files(cand.path, mine)) for p in ps]
        return manifest, problems

    def _check_model(self, manifest: dict[str, Any]) -> None:
        saved = ModelConfig.model_validate(manifest["config"]["model"]).model_dump()
        now = self.config.model.model_dump()
        diff = [f"{k} {saved[k]} -> {now[k]}" for k in MODEL_KEYS if saved[k] != now[k]]
        if diff:
            raise CheckpointMismatch(
                f"checkpoint step {manifest['step']} was saved by a different model (layout "
                f"{manifest['layout_label']}); this job's model (layout {self.layout.label()}) differs in "
                f"{', '.join(diff)}. A checkpoint reshards across layouts, not across model dims")

    def _load(self, path: Path, manifest: dict[str, Any]) -> Resumed:
        self._check_model(manifest)
        saved_label, label = manifest["layout_label"], self.layout.label()
        state = self._tensor_state()
        requested = self._all_gather(sorted(state["model"]))
        problem = None
        if self.rank == 0:
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
            saved_keys = {k.split(".", 1)[1] for k in metadata.state_dict_metadata if k.startswith("model.")}
            wanted = {k for keys in requested for k in keys}
            if saved_keys != wanted:
                missing, unknown = sorted(wanted - saved_keys), sorted(saved_keys - wanted)
                problem = (f"checkpoint step {manifest['step']} (layout {saved_label}) and this job (layout {label}) "
                           f"disagree on the model's parameters: missing in the checkpoint {missing[:3]}, "
                           f"not in this job {unknown[:3]}")
        if problem := self._broadcast(problem):
            raise CheckpointMismatch(problem)
        try:
            with _quiet_single_process(self.distributed):
                dcp.load(state, checkpoint_id=str(path), process_group=self.pg, no_dist=not self.distributed)
        except Exception as e:
            raise CheckpointMismatch(f"cannot load checkpoint step {manifest['step']} saved with layout {saved_label} "
                                     f"into layout {label}: {e}") from e
        for part, opt in self.pairs:
            mkeys = get_model_state_dict(part).keys()
            set_model_state_dict(part, {k: state["model"][k] for k in mkeys})
            okeys = get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS).keys()
            set_optimizer_state_dict(part, opt, {k: state["optim"][k] for k in okeys}, options=_OPTIM_OPTIONS)
        own = self._load_rank_states(path, manifest, same_layout=saved_label == label
                                     and manifest["world_size"] == self.world)
        self.last_saved_step = manifest["step"]
        return Resumed(step=manifest["step"], path=path, saved_layout=saved_label, layout=label,
                       restart=self.restart, extra=own["extra"])

    def _load_rank_states(self, path: Path, manifest: dict[str, Any], *, same_layout: bool) -> dict[str, Any]:
        """RNG, schedulers, data loader. Returns the rank state this rank resumed from."""

        def read(rank: int) -> dict[str, Any]:
            return torch.load(path / rank_file_name(rank), weights_only=True)

        ranks = manifest["ranks"]
        own = read(self.rank if same_layout else 0)
        if same_layout:
            set_rng_state(own["rng"])
        for i, sched in enumerate(self.lr_schedulers):
            saved = own["lr_schedulers"]
            if saved:
                sched.load_state_dict(saved[min(i, len(saved) - 1)])
        if self.data_loader is not None:
            saved_dp = Layout.model_validate(manifest["layout"]).dp
            first_of: dict[int, int] = {}
            for r in ranks:
                first_of.setdefault(r["dp_rank"], r["rank"])
            if saved_dp == self.dp:
                self.data_loader.load_state_dict(read(first_of[self.dp_rank])["data"])
            else:
                self._reshard_data([read(first_of[d])["data"] for d in range(saved_dp)], manifest)
        if not same_layout:
            self._info(f"layout changed ({manifest['layout_label']} -> {self.layout.label()}): model and optimizer "
                       "resharded; RNG states start fresh" + ("; data loader rebuilt from the global sample index"
                                                              if self.data_loader is not None else ""))
        return own

    def _reshard_data(self, states: list[dict[str, Any]], manifest: dict[str, Any]) -> None:
        assert self.data_loader is not None
        reshard = getattr(self.data_loader, "load_resharded_state", None)
        if reshard is not None:
            reshard(states)
        elif all(_serialized(s) == _serialized(states[0]) for s in states):
            # Every old DP rank saved the same position (e.g. the next global sample index): the
            # state does not depend on the DP degree.
            self.data_loader.load_state_dict(states[0])
        else:
            raise CheckpointMismatch(
                f"the data loader's state differs per DP rank and it cannot reshard it from dp={len(states)} "
                f"(layout {manifest['layout_label']}) to dp={self.dp} (layout {self.layout.label()})")


@contextlib.contextmanager
def _quiet_single_process(distributed: bool) -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process, which is our intent."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _serialized(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def merged_view(parts: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """One module holding several pipeline stages under the full model's names.

    Stages are copies of the full model with the blocks they do not own removed, so their
    children can be joined: ModuleDicts (e.g. `layers`, keyed by global index) are merged, any
    other child must come from one stage only. The view shares the stages' modules.
    """
    if len(parts) == 1:
        return parts[0]
    view = torch.nn.Module()
    for part in parts:
        if own := [n for n, _ in part.named_parameters(recurse=False)]:
            raise CheckpointError(f"a pipeline stage holds parameters of its own ({own[0]}); expected only submodules")
        for name, child in part.named_children():
            have = view._modules.get(name)
            if isinstance(child, torch.nn.ModuleDict):
                if have is None:
                    have = torch.nn.ModuleDict()
                    view.add_module(name, have)
                if not isinstance(have, torch.nn.ModuleDict) or have.keys() & child.keys():
                    raise CheckpointError(f"pipeline stages overlap in {name!r}")
                have.update(child)
            elif have is not None:
                raise CheckpointError(f"pipeline stages both hold {name!r}")
            else:
                view.add_module(name, child)
    return view
