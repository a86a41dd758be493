"""Run `tetrad_trainer.train.main` (or another `main(argv)`) on N local gloo ranks, as torchrun would,
cheaply.

Ranks are forked from a forkserver that imported torch and the trainer once, so a 16-rank world
starts in seconds instead of paying torch's import per rank on a 2-core machine. Each rank gets
the environment torchrun gives a worker (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) and
runs the same `main(argv)` as `python -m tetrad_trainer.train`. The real torchrun path is tested
end to end through `tetrad run` (test_launch.py).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tetrad.api import ResolvedConfig, parse
from tetrad.api.contract import step_dir_name
from tetrad.resolve import resolve

PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.pipelining",
           "torch.distributed.tensor.parallel", "tetrad_trainer.train"]
_ctx: Any = None


def _context() -> Any:
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_block(n: int) -> int:
    """A base port p with p..p+n-1 free right now (for the ranks' metrics endpoints)."""
    for _ in range(100):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports")


def _rank_main(target: str, argv: list[str], env: dict[str, str], log: str) -> None:
    os.environ.update(env)
    # A worker that torchrun starts reads PYTHONPATH at start-up; one forked from the server is told here.
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import importlib

    import torch

    torch.set_num_threads(1)
    module, function = target.split(":")
    code = 1
    try:
        code = getattr(importlib.import_module(module), function)(argv)
    except BaseException:  # noqa: BLE001 - the traceback goes to the rank's log
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class Run:
    codes: list[int]
    out: Path
    seconds: float

    @property
    def records(self) -> list[dict[str, Any]]:
        """Rank 0's step records among its JSON lines (the preflight gate's line is not one)."""
        lines = (self.out / "rank-0.log").read_text().splitlines()
        return [r for r in (json.loads(line) for line in lines if line.startswith("{")) if "step" in r]

    def log(self, rank: int = 0) -> str:
        path = self.out / f"rank-{rank}.log"
        return path.read_text() if path.exists() else "(no log: the rank did not start)"

    def logs(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{self.log(r)[-3000:]}" for r in range(len(self.codes)))


def rewind(ckpt: Path, step: int) -> Path:
    """The checkpoint directory `ckpt` as if its run had stopped after saving `step`: the later steps gone,
    `latest` naming `step` again."""
    for later in ckpt.glob("step-*"):
        if later.name > step_dir_name(step):
            shutil.rmtree(later)
    (ckpt / "latest").write_text(step_dir_name(step) + "\n")
    return ckpt


def run_trainer(cfg: ResolvedConfig, out: Path, *, args: tuple[str, ...] = (), timeout: float = 300,
                env: dict[str, str] | None = None, target: str = "tetrad_trainer.train:main") -> Run:
    """Write cfg to out/config.json and run target(["--config", it, *args]) on cfg.world_size ranks."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.json"
    config.write_text(cfg.to_json())
    return run_ranks(target, ["--config", str(config), *args], cfg.nodes, cfg.nproc_per_node, out,
                     timeout=timeout, env=env)


def run_ranks(target: str, argv: list[str], nodes: int, nproc: int, out: Path, *, timeout: float = 300,
              env: dict[str, str] | None = None) -> Run:
    """Run target ("module:function", called with argv) on nodes*nproc ranks; waits for all of them."""
    out.mkdir(parents=True, exist_ok=True)
    world = nodes * nproc
    port, metrics = free_port(), free_port_block(world)
    ctx = _context()
    procs = []
    for rank in range(world):
        rank_env = {
            "RANK": str(rank), "LOCAL_RANK": str(rank % nproc), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(rank // nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            # Each node's ranks serve on its base port + LOCAL_RANK: give every node its own block.
            "TETRAD_METRICS_PORT": str(metrics + rank // nproc * nproc), **(env or {}),
        }
        procs.append(ctx.Process(target=_rank_main,
                                 args=(target, argv, rank_env, str(out / f"rank-{rank}.log")),
                                 daemon=False))  # a daemon may not start children (compile workers)
    start = time.monotonic()
    for p in procs:
        p.start()
    deadline, failed_at = start + timeout, None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now  # like torchrun: once a rank failed, the rest are stopped
        if now > deadline or (failed_at is not None and now - failed_at > 10):
            for p in procs:
                if p.is_alive():
                    p.kill()
        time.sleep(0.05)
    for p in procs:
        p.join()
    return Run(codes=[p.exitcode for p in procs], out=out, seconds=time.monotonic() - start)


def job(parallelism: dict[str, Any], *, nproc: int, nodes: int = 1, model: dict[str, Any] | None = None,
        training: dict[str, Any] | None = None, **spec: Any) -> ResolvedConfig:
    """A resolved config of the debug model from a manifest's parallelism (camelCase) and overrides."""
    doc = {
        "apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": "test"},
        "spec": {
            "nodes": nodes, "nprocPerNode": nproc,
            "parallelism": {"dpShard": 1, **parallelism},
            "model": model or {},  # the debug preset unless it names a preset or a module
            "training": training or {},
            **spec,
        },
    }
    parsed, problems = parse(doc)
    assert parsed is not None, problems
    return resolve(parsed)
