"""The checkpointer: one job's save and resume, composed of the file protocol (store.py) and the
per-rank state (state.py). Every public method is collective: call it on all ranks.

Saving: rank 0 clears garbage; every rank writes its DCP shards and its rank file into
`.tmp-step-N/` and reports their digests (or its error) to rank 0 through an all-gather on the
checkpointer's own gloo group; rank 0 commits (store.CheckpointDir.commit) only when no rank
failed, and broadcasts the outcome, so every rank raises the same CheckpointError or none does.

Asynchronous saves: the training thread only takes a CPU copy of the tensors (staging, with
torch's public DefaultStager; on CUDA into persistent pinned buffers on a side stream, which the
next optimizer step waits for) and the rank file; the write, checksums and commit run in one
background thread, on the checkpointer's group, never interleaving with the training collectives.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from tetrad.api.resolved import Layout, ModelConfig, ResolvedConfig
from tetrad.node.environment import WorkerEnv
from tetrad_trainer.checkpoint import state as rank_state
from tetrad_trainer.checkpoint.state import ResumableLoader
from tetrad_trainer.checkpoint.store import (
    Candidate,
    CheckpointDir,
    CheckpointError,
    CheckpointMismatch,
    ForeignCheckpoint,
    NoGoodCheckpoint,
    candidate_manifest,
    digests,
    first_intact,
    job_of,
    phase,
    step_dir_name,
    verify_files,
    write_file,
)

log = logging.getLogger("tetrad.checkpoint")

# Model dims that must match for a checkpoint to load; everything else (layout, batch, lr, steps)
# may change between runs.
MODEL_KEYS = ("dim", "layers", "heads", "kv_heads", "head_dim", "vocab", "ffn_dim", "qkv_bias", "qk_norm",
              "tie_embeddings")


def _reason(e: BaseException, rank: int) -> str:
    """`rank N: Type: message` per cause; DCP's exception (a BaseException) carries each failed rank's own."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}"
                         for r, (exc, _) in sorted(e.failures.items()))
    return f"rank {rank}: {type(e).__name__}: {e}"


# Errors that mean the checkpoint volume has no room: a full disk or quota (said so), a file-size limit.
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
NO_ROOM = (*FULL_DISK, errno.EFBIG)


def no_room(e: BaseException | None) -> int | None:
    """The errno of NO_ROOM anywhere in e's chain (causes, contexts, DCP's per-rank failures), or None."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in NO_ROOM:
            return x.errno
        if isinstance(x, CheckpointException):
            stack += [exc for exc, _ in x.failures.values()]
        stack += [x.__cause__, x.__context__]
    return None


@contextlib.contextmanager
def _room_named(path: str | os.PathLike[str]) -> Iterator[None]:
    """An error caused by a full disk raised as that OSError: torch's serializer reports ENOSPC as a cryptic
    RuntimeError ("enforce fail at inline_container.cc") whose cause DCP loses gathering it across ranks."""
    try:
        yield
    except Exception as e:
        code = no_room(e)
        if code is None or isinstance(e, OSError):
            raise
        raise OSError(code, os.strerror(code), str(path)) from e


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, a full disk reported as such."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        with _room_named(self.path):
            return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        with _room_named(self.path):
            super().finish(metadata, results)


@dataclass
class Resumed:
    step: int
    path: Path
    saved_layout: str
    layout: str
    restart: int
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
    one per part, or one for all of them. data_loader: see state.ResumableLoader. dp_rank: this
    rank's data-parallel coordinate (the degree is the config's). logger: receives rank 0's
    messages (default: logging). The restart count is the operator's, $TETRAD_RESTART.
    """

    def __init__(
        self,
        config: ResolvedConfig,
        *,
        model_parts: Sequence[torch.nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        data_loader: ResumableLoader | None = None,
        dp_rank: int = 0,
        logger: Callable[[str], None] | None = None,
        on_commit: Callable[[int, float], None] | None = None,
        restart: int | None = None,
    ):
        self.pairs = rank_state.pair_parts(model_parts, optimizers)
        self.config = config
        self.settings = config.checkpoint
        self.layout: Layout = config.layout
        self.dir = CheckpointDir(config.checkpoint.path, job=config.job_name)
        self.data_loader = data_loader
        self.dp_rank, self.dp = dp_rank, config.layout.dp
        self.restart = restart if restart is not None else WorkerEnv.read().restart
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        # A group of our own: async saves run collectives from a background thread, which must
        # never interleave with the training collectives on the default group.
        self.pg = dist.new_group(backend="gloo") if self.distributed else None
        self._say = logger or log.info
        self._on_commit = on_commit  # (step, Unix time of the commit), on every rank, from the saving thread
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[SaveStats] | None = None
        self._stager: DefaultStager | None = None
        self._staging: concurrent.futures.Future[Any] | None = None
        self.last_saved_step: int | None = None  # saved or being saved
        self.last_committed_step: int | None = None
        self.last_stats: SaveStats | None = None
        if self.settings.enabled and self.settings.async_save:
            for opt in {id(o): o for _, o in self.pairs}.values():
                opt.register_step_pre_hook(lambda *_: self.wait_staged())

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

    # -- saving ---------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.settings.enabled and step % self.settings.interval == 0

    def save(self, step: int, *, blocking: bool = False) -> SaveStats | None:
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
        state: Any = rank_state.tensor_state(self.pairs)
        blob = rank_state.rank_state_bytes(step, self.rank, self.dp_rank, self.data_loader)
        need = rank_state.state_bytes(state) + len(blob)  # what this rank writes, about
        if async_save:
            state = self._stage(state)
            phase("staged", step)
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tetrad-ckpt")
            stall = time.perf_counter() - t0
            self._pending = self._executor.submit(self._write_and_commit, step, state, blob, need, t0, stall,
                                                  True)
            self.last_saved_step = step
            return None
        stats = self._write_and_commit(step, state, blob, need, t0, 0.0, False)
        self.last_saved_step = step
        return stats

    @property
    def saving(self) -> bool:
        """Whether an asynchronous save is in flight."""
        return self._pending is not None

    def wait(self) -> SaveStats | None:
        """Block until the asynchronous save in flight (if any) is committed; raise if it failed."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        try:
            return pending.result()
        except BaseException:
            self.last_saved_step = self.last_committed_step
            raise

    def wait_staged(self) -> None:
        """Block until the copy of the last asynchronous save is taken (before tensors change)."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            staging.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _stage(self, state: dict[str, Any]) -> Any:
        """A CPU copy of the state, so training may change the live tensors while it is written.

        On CUDA: into pinned buffers kept from save to save, copied on a side stream; returns a
        future the writer thread and the next optimizer step wait for. On the CPU: a plain copy.
        """
        if self._stager is None:
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=cuda, use_non_blocking_copy=cuda))
        staged = self._stager.stage(state)
        if isinstance(staged, concurrent.futures.Future):
            self._staging = staged
        return staged

    def _write_and_commit(self, step: int, state: Any, blob: bytes, need: int, t0: float,
                          stall: float, async_save: bool) -> SaveStats:
        tmp = self.dir.tmp_dir(step)
        report: dict[str, Any] = {"rank": self.rank, "dp_rank": self.dp_rank, "bytes": need}
        try:
            if isinstance(state, concurrent.futures.Future):
                state = state.result()
            writer = _Writer(str(tmp), single_file_per_rank=True, sync_files=True)
            with _quiet_single_process(self.distributed):
                dcp.save(state, storage_writer=writer, process_group=self.pg, no_dist=not self.distributed)
            phase("dcp-written", step)
            own = rank_state.rank_file_name(self.rank)
            write_file(tmp / own, blob)
            phase("rank-file-written", step)
            mine = [own] + [p.name for p in tmp.iterdir() if p.name.startswith(f"__{self.rank}_")]
            report["files"] = digests(tmp, mine)
        except (Exception, CheckpointException) as e:  # every rank must still reach the gather below
            report["error"], report["no_room"] = _reason(e, self.rank), no_room(e)
        reports = self._all_gather(report)
        # DCP reports a cause on every rank
        errors = list(dict.fromkeys(r["error"] for r in reports if "error" in r))
        codes = {r["no_room"] for r in reports if r.get("no_room")}
        size = 0
        if self.rank == 0 and not errors:
            try:
                size, deleted = self.dir.commit(step, tmp, reports, self._manifest(reports),
                                                self.settings.keep_last)
                if deleted:
                    self._info(f"retention (keepLast={self.settings.keep_last}) removed steps {deleted}")
            except Exception as e:
                errors.append(f"rank 0: {type(e).__name__}: {e}")
                codes.add(no_room(e))
        latest = self.dir.latest()[0] if self.rank == 0 and errors else None
        errors, codes, size, latest = self._broadcast((errors, codes, size, latest))
        if errors:
            if self.rank == 0:  # every rank is done with it: give a full disk its space back
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(self._save_failure(step, tmp, errors, codes,
                                                     sum(r["bytes"] for r in reports), latest))
        total = time.perf_counter() - t0
        stats = SaveStats(step=step, stall_s=stall if async_save else total, total_s=total, bytes=size,
                          async_save=async_save)
        self.last_stats = stats
        self.last_committed_step = step
        if self._on_commit is not None:
            self._on_commit(step, time.time())
        phase("committed", step)
        self._info(f"committed step {step} at {self.dir.root / step_dir_name(step)} "
                   f"({stats.bytes / 1e6:.1f} MB, layout {self.layout.label()}, {stats.total_s:.2f} s, "
                   f"training stalled {stats.stall_s:.2f} s{', async' if async_save else ''})")
        return stats

    def _save_failure(self, step: int, tmp: Path, errors: list[str], codes: set[int | None], need: int,
                      latest: int | None) -> str:
        """Why a save failed: each rank's cause, a full disk said so, and the checkpoint a restart resumes."""
        full = f"the disk holding {self.dir.root} is full (this checkpoint needs about {need:,} bytes): " \
            if codes & set(FULL_DISK) else ""
        kept = (f": `latest` still names step {latest} ({self.dir.root / step_dir_name(latest)})"
                if latest is not None else f", and no checkpoint was committed in {self.dir.root} before it")
        hint = "; free space on the checkpoint volume or lower checkpoint.keepLast" if codes - {None} else ""
        return (f"saving step {step} to {tmp} failed: {full}" + "; ".join(errors)
                + f"; nothing was committed{kept}{hint}")

    def _manifest(self, reports: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "layout": self.layout.model_dump(),
            "layout_label": self.layout.label(),
            "world_size": self.world,
            "restart": self.restart,
            "config": json.loads(self.config.to_json()),
            "ranks": [{"rank": r["rank"], "dp_rank": r["dp_rank"]} for r in reports],
        }

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
        cand, manifest, refused = first_intact(candidates, self._verify, self._info)
        if cand is not None:
            assert manifest is not None
            resumed = self._load(cand.path, manifest)
            resumed.refused = refused
            self._info(f"resumed step {resumed.step} from {cand.path} (saved with layout "
                       f"{resumed.saved_layout}, now {resumed.layout}; restart {self.restart})")
            return resumed
        if refused:
            raise NoGoodCheckpoint(f"every checkpoint in {self.dir.root} is damaged: " + " | ".join(refused)
                                   + "; remove them (or set checkpoint.resume: false) to start over")
        self._info(f"no checkpoint in {self.dir.root}; starting from step 0 (restart {self.restart})")
        return None

    def _verify(self, cand: Candidate) -> tuple[dict[str, Any] | None, list[str]]:
        """All ranks check a share of the candidate's files. Returns (manifest, problems)."""
        manifest, problem = self._broadcast(candidate_manifest(cand) if self.rank == 0 else None)
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

    def _check_job(self, manifest: dict[str, Any]) -> None:
        """A checkpoint another job wrote is resumed only when checkpoint.allowForeign says so."""
        other = job_of(manifest)
        if other is None or other == self.config.job_name:
            return
        if not self.settings.allow_foreign:
            raise ForeignCheckpoint(
                f"spec.checkpoint.path: {self.dir.root} holds checkpoint step {manifest['step']} of the job "
                f"{other!r}, not of this job {self.config.job_name!r}; give this job its own "
                "checkpoint.path, or set checkpoint.allowForeign: true to resume it (e.g. after renaming "
                "the job)")
        self._info(f"resuming step {manifest['step']} of the job {other!r} (checkpoint.allowForeign); its "
                   "checkpoints stay, retention deletes only this job's")

    def _load(self, path: Path, manifest: dict[str, Any]) -> Resumed:
        self._check_job(manifest)
        self._check_model(manifest)
        saved_label, label = manifest["layout_label"], self.layout.label()
        state = rank_state.tensor_state(self.pairs)
        requested = self._all_gather(sorted(state["model"]))
        problem = None
        if self.rank == 0:
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
            saved_keys = {k.split(".", 1)[1] for k in metadata.state_dict_metadata if k.startswith("model.")}
            wanted = {k for keys in requested for k in keys}
            if saved_keys != wanted:
                missing, unknown = sorted(wanted - saved_keys), sorted(saved_keys - wanted)
                problem = (f"checkpoint step {manifest['step']} (layout {saved_label}) "
                           f"and this job (layout {label}) disagree on the model's parameters: "
                           f"missing in the checkpoint {missing[:3]}, not in this job {unknown[:3]}")
        if problem := self._broadcast(problem):
            raise CheckpointMismatch(problem)
        try:
            with _quiet_single_process(self.distributed):
                dcp.load(state, checkpoint_id=str(path), process_group=self.pg, no_dist=not self.distributed)
        except Exception as e:
            raise CheckpointMismatch(f"cannot load checkpoint step {manifest['step']} saved with layout "
                                     f"{saved_label} into layout {label}: {e}") from e
        rank_state.set_tensor_state(self.pairs, state)
        self._load_rank_state(path, manifest,
                              same_layout=saved_label == label and manifest["world_size"] == self.world)
        self.last_saved_step = self.last_committed_step = manifest["step"]
        return Resumed(step=manifest["step"], path=path, saved_layout=saved_label, layout=label,
                       restart=self.restart)

    def _load_rank_state(self, path: Path, manifest: dict[str, Any], *, same_layout: bool) -> None:
        """RNG (same layout only) and the data loader's position."""

        def read(rank: int) -> dict[str, Any]:
            loaded: dict[str, Any] = torch.load(path / rank_state.rank_file_name(rank), weights_only=True)
            return loaded

        if same_layout:
            rank_state.set_rng_state(read(self.rank)["rng"])
        if self.data_loader is not None:
            first_of: dict[int, int] = {}
            for r in manifest["ranks"]:
                first_of.setdefault(r["dp_rank"], r["rank"])
            rank_state.load_data_position(
                self.data_loader, lambda d: read(first_of[d])["data"],
                Layout.model_validate(manifest["layout"]).dp,
                self.dp, self.dp_rank, (manifest["layout_label"], self.layout.label()))
        if not same_layout:
            self._info(f"layout changed ({manifest['layout_label']} -> {self.layout.label()}): model and "
                       "optimizer resharded; RNG states start fresh"
                       + ("; data loader rebuilt from the global sample index"
                          if self.data_loader is not None else ""))


@contextlib.contextmanager
def _quiet_single_process(distributed: bool) -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process, which is our intent."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
