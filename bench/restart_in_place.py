"""Restart in place under `tetrad run`: from a worker's SIGKILL to the gang's next completed step, against a
baseline in the same run.

    .venv/bin/python bench/restart_in_place.py [--rounds 3] [--nodes 2]

Every system trains the debug model (fp32, CPU/gloo, `--nodes` nodes of one process, a checkpoint every 5
steps) and SIGKILLs rank 1's worker once rank 0 has logged step 8:
- in place, the spares ready: `maxRestarts: 2, backoffSeconds: 0`; the gang restarts inside the same nodes
  (tetrad.node.rounds), and the kill waits until every node's spare interpreter has imported torch
  (tetrad.node.spare: it starts 60 s into a round), as for a failure long after the start. Phases: the
  kill to node 0's "restarting the gang in place" line (the failure seen, every node's workers stopped),
  then to the next completed step (the round's torchrun and workers forked from the spares, rendezvous,
  the checkpoint loaded, the step);
- in place, an early failure: the same at step 8, before the spares started (they start at the restart,
  and the round's processes wait for their imports);
- baseline, a restart from outside: `maxRestarts: 0`; the run fails, and a new `tetrad run` resumes from
  the same checkpoint at once (what recreating the nodes costs on one machine, without a cluster).
  Phases: the kill to the failed run's exit, then to the new run's first step.
Each figure is the median of --rounds, the systems alternating; a run is stopped once it has measured.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tetrad.launch.local import kill_rank_at, logged_steps  # noqa: E402
from tetrad.node.rounds import RESTARTING  # noqa: E402
from tetrad.node.spare import READY  # noqa: E402

KILL_AT, STEPS, POLL_S = 8, 100000, 0.02
TETRAD = [sys.executable, "-m", "tetrad.cli"]


def manifest(path: Path, name: str, nodes: int, ckpt: Path, max_restarts: int) -> Path:
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": name},
           "spec": {"nodes": nodes, "nprocPerNode": 1, "parallelism": {"dpShard": nodes},
                    "model": {"preset": "debug", "seqLen": 64},
                    "training": {"steps": STEPS, "globalBatch": 2 * nodes, "precision": "fp32"},
                    "checkpoint": {"enabled": True, "path": str(ckpt), "interval": 5},
                    "runPolicy": {"maxRestarts": max_restarts, "backoffSeconds": 0}}}
    path.write_text(yaml.safe_dump(doc))
    return path


def until(done: Callable[[], bool], timeout_s: float = 600) -> float:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not get there in time")
        time.sleep(POLL_S)
    return time.monotonic()


def start(job: Path, workdir: Path, jsonl: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*TETRAD, "run", str(job), "--workdir", str(workdir), "--jsonl", str(jsonl)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def spares_ready(workdir: Path, nodes: int) -> bool:
    logs = [workdir / f"node-{n}.log" for n in range(nodes)]
    return all(log.exists() and READY in log.read_text(errors="replace") for log in logs)


def kill_rank_1(workdir: Path, jsonl: Path) -> float:
    """SIGKILL rank 1's worker once rank 0 has logged KILL_AT; when."""
    if not kill_rank_at(workdir, jsonl, rank=1, step=KILL_AT, timeout_s=600):
        raise RuntimeError("rank 1's worker was not found")
    return time.monotonic()


def stop(run: subprocess.Popen[bytes], workdir: Path) -> None:
    """End a run that has measured what it had to: SIGTERM, which it must obey at once."""
    run.send_signal(signal.SIGTERM)
    if run.wait(timeout=120) not in (0, 75, 143):
        raise RuntimeError(f"the run did not stop cleanly ({run.returncode}); see {workdir}")


def in_place(tmp: Path, nodes: int, spares_first: bool) -> tuple[float, float]:
    job = manifest(tmp / "job.yaml", "in-place", nodes, tmp / "ckpt", max_restarts=2)
    work, jsonl = tmp / "work", tmp / "out.jsonl"
    run = start(job, work, jsonl)
    if spares_first:
        until(lambda: spares_ready(work, nodes))
    killed = kill_rank_1(work, jsonl)
    seen = until(lambda: RESTARTING in (work / "node-0.log").read_text(errors="replace"))
    first = until(lambda: (s := logged_steps(jsonl)) != sorted(s))  # a step again: the next round's first
    stop(run, work)
    return seen - killed, first - seen


def in_place_ready(tmp: Path, nodes: int) -> tuple[float, float]:
    return in_place(tmp, nodes, spares_first=True)


def in_place_early(tmp: Path, nodes: int) -> tuple[float, float]:
    return in_place(tmp, nodes, spares_first=False)


def from_outside(tmp: Path, nodes: int) -> tuple[float, float]:
    job = manifest(tmp / "job.yaml", "outside", nodes, tmp / "ckpt", max_restarts=0)
    jsonl = tmp / "out.jsonl"
    run = start(job, tmp / "work", jsonl)
    killed = kill_rank_1(tmp / "work", jsonl)
    run.wait()
    exited = time.monotonic()
    again = start(job, tmp / "again", tmp / "again.jsonl")
    first = until(lambda: bool(logged_steps(tmp / "again.jsonl")))
    stop(again, tmp / "again")
    return exited - killed, first - exited


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nodes", type=int, default=2)
    a = p.parse_args()
    systems = {"in place, the spares ready": in_place_ready, "in place, an early failure": in_place_early,
               "from outside": from_outside}
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    for r in range(a.rounds):
        for name, system in systems.items():
            with tempfile.TemporaryDirectory(prefix="tetrad-bench-") as tmp:
                figures[name].append(system(Path(tmp), a.nodes))
            stopped, started = figures[name][-1]
            print(f"round {r + 1}, {name}: {stopped + started:.2f} s ({stopped:.2f} + {started:.2f})",
                  flush=True)
    base = statistics.median(sum(f) for f in figures["from outside"])
    print("\n| system | kill to the next step, s (each round) | stopped, s | to the next step, s"
          " | / baseline |")
    print("|---|---|---|---|---|")
    for name, runs in figures.items():
        total = statistics.median(sum(f) for f in runs)
        each = " / ".join(f"{sum(f):.2f}" for f in runs)
        print(f"| {name} | {total:.2f} ({each}) | {statistics.median(f[0] for f in runs):.2f} |"
              f" {statistics.median(f[1] for f in runs):.2f} | {total / base:.2f}x |")


if __name__ == "__main__":
    main()
