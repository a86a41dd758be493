"""Run a function on N gloo ranks, each a fresh process, and kill ranks at will.

Processes come from the trainer tests' forkserver (tests/trainer/harness.py), which imported torch
once, so a gang starts in about a second instead of paying torch's import per rank. Unlike the
harness's runs, a gang returns each rank's result (through files: a SIGKILLed rank must not be
able to corrupt a shared queue) and can be killed rank by rank. When one rank dies, the others
are killed, as torchrun does.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.trainer.harness import _context, free_port


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, env: dict[str, str],
           args: tuple[Any, ...]) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **env})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: tuple[str, Any]
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        result = ("ok", fn(rank, world, *args))
    except SystemExit as e:
        code = int(e.code or 0)
        result = ("exit", code)
    except BaseException:
        code = 1
        result = ("error", traceback.format_exc())
    path = Path(out) / f"result-{rank}.pkl"
    path.with_suffix(".tmp").write_bytes(pickle.dumps(result))
    path.with_suffix(".tmp").replace(path)
    if dist.is_initialized() and code == 0:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class GangError(AssertionError):
    pass


class Gang:
    def __init__(self, fn: Callable[..., Any], world: int, *args: Any, env: dict[str, str] | None = None):
        self.world = world
        self._dir = tempfile.TemporaryDirectory(prefix="tetrad-gang-")
        self.out = Path(self._dir.name)
        ctx = _context()
        port = free_port()
        self.procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(self.out), env or {}, args),
                                  daemon=True)
                      for r in range(world)]
        self.started = time.monotonic()
        for p in self.procs:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[rank].pid, sig)

    def wait(self, timeout: float = 180.0) -> list[int]:
        """Exit codes; once any rank fails, the others get 5 s and are then killed."""
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.is_alive() for p in self.procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in self.procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > 5):
                for p in self.procs:
                    if p.is_alive():
                        p.kill()
                if now > deadline:
                    for p in self.procs:
                        p.join(5)
                    raise GangError(f"gang timed out after {timeout:.0f} s")
            time.sleep(0.02)
        for p in self.procs:
            p.join()
        return [p.exitcode for p in self.procs]

    def results(self) -> dict[int, tuple[str, Any]]:
        found = {}
        for r in range(self.world):
            path = self.out / f"result-{r}.pkl"
            if path.exists():
                found[r] = pickle.loads(path.read_bytes())
        return found

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        self._dir.cleanup()


def run(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0,
        env: dict[str, str] | None = None) -> list[Any]:
    """Every rank's return value; raises with the ranks' tracebacks if any failed."""
    gang = Gang(fn, world, *args, env=env)
    try:
        codes = gang.wait(timeout)
        results = gang.results()
    finally:
        gang.close()
    errors = [f"rank {r}: {v}" for r, (kind, v) in sorted(results.items()) if kind != "ok"]
    if errors or any(codes):
        raise GangError(f"exit codes {codes}\n" + "\n".join(errors))
    return [results[r][1] for r in range(world)]
