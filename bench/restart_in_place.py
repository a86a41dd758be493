"""Restart in place under `tetrad run`: from a worker's SIGKILL to the gang's next completed step, against a
baseline in the same run.

    .venv/bin/python bench/restart_in_place.py [--rounds 3] [--nodes 2]

Both systems train the debug model (fp32, CPU/gloo, `--nodes` nodes of one process, a checkpoint every 5
steps) and SIGKILL rank 1's worker once rank 0 has logged step 8:
- in place: `maxRestarts: 1, backoffSeconds: 0`; the gang restarts inside the same nodes
  (tetrad.node.rounds). Phases: the kill to node 0's "restarting the gang in place" line (the failure
  seen, every node's workers stopped), then to the next completed step (a new torchrun, rendezvous,
  the checkpoint loaded, the step);
- baseline, a restart from outside: `maxRestarts: 0`; the run fails, and a new `tetrad run` resumes from
  the same checkpoint at once (what recreating the nodes costs on one machine, without a cluster).
  Phases: the kill to the failed run's exit, then to the new run's first step.
Each figure is the median of --rounds, the two systems alternating.
"""

from __future__ import annotations

import argparse
import json
import os
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

from tetrad.node.process import with_variable  # noqa: E402
from tetrad.node.rounds import RESTARTING  # noqa: E402

KILL_AT, STEPS, POLL_S = 8, 12, 0.02
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


def steps(jsonl: Path) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in jsonl.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


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


def kill_rank_1(workdir: Path, jsonl: Path) -> float:
    """SIGKILL rank 1's worker once rank 0 has logged KILL_AT; when."""
    until(lambda: max(steps(jsonl), default=0) >= KILL_AT)
    pids = [p for p in with_variable("TETRAD_CONFIG", str(workdir / "config.json"))
            if b"RANK=1" in Path(f"/proc/{p}/environ").read_bytes().split(b"\0")]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    if not pids:
        raise RuntimeError("rank 1's worker was not found")
    return time.monotonic()


def in_place(tmp: Path, nodes: int) -> tuple[float, float]:
    job = manifest(tmp / "job.yaml", "in-place", nodes, tmp / "ckpt", max_restarts=1)
    work, jsonl = tmp / "work", tmp / "out.jsonl"
    run = start(job, work, jsonl)
    killed = kill_rank_1(work, jsonl)
    seen = until(lambda: RESTARTING in (work / "node-0.log").read_text(errors="replace"))
    first = until(lambda: (s := steps(jsonl)) != sorted(s))  # a step again: the next round's first
    if run.wait() != 0:
        raise RuntimeError(f"the in-place run failed; see {work}")
    return seen - killed, first - seen


def from_outside(tmp: Path, nodes: int) -> tuple[float, float]:
    job = manifest(tmp / "job.yaml", "outside", nodes, tmp / "ckpt", max_restarts=0)
    jsonl = tmp / "out.jsonl"
    run = start(job, tmp / "work", jsonl)
    killed = kill_rank_1(tmp / "work", jsonl)
    run.wait()
    exited = time.monotonic()
    again = start(job, tmp / "again", tmp / "again.jsonl")
    first = until(lambda: bool(steps(tmp / "again.jsonl")))
    if again.wait() != 0:
        raise RuntimeError(f"the resumed run failed; see {tmp / 'again'}")
    return exited - killed, first - exited


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nodes", type=int, default=2)
    a = p.parse_args()
    figures: dict[str, list[tuple[float, float]]] = {"in place": [], "from outside": []}
    for r in range(a.rounds):
        for name, system in (("in place", in_place), ("from outside", from_outside)):
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
