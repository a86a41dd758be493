"""Checkpoint cost: save and load time, sync and async, and the training stall each causes, in one run.

For each model, torchrun starts the real trainer (`tetrad_trainer.train.Trainer`, FSDP over
--procs ranks, fp32) and, on every rank:

    step       time of a training step without checkpointing, measured (--steps steps) right
               before each save: that save's reference
    sync save  `Checkpointer.save(blocking=True)`: the stall is the whole save (write, fsync,
               checksums, commit)
    async save `Checkpointer.save()` with async on: the training thread blocks only for the CPU
               copy (staging); the write, checksums and commit run in a background thread while
               training continues. Its stall = staging + the extra time of the steps that
               overlapped the background write (their time beyond the reference)
    load       `Checkpointer.resume()`: verify every file against the manifest, DCP load, set state

Sync and async rounds alternate (--rounds of each), so the drift of a shared machine hits both
alike. Times are the slowest rank's medians; a stall ratio is stall / reference step (1.0: the
checkpoint costs as much training time as one step). The page cache is warm for loads (the files
were just written), so load times are the CPU side (checksums, deserialisation, copies), not the
disk's read speed.

    python bench/checkpoint.py [--procs 2] [--threads N] [--models debug:256,llama3-125m:64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tetrad.api import ResolvedConfig, parse
from tetrad.resolve import resolve


def config(preset: str, seq_len: int, procs: int, path: Path, async_save: bool,
           batch_per_rank: int) -> ResolvedConfig:
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
           "metadata": {"name": f"bench-{preset}"},
           "spec": {"nodes": 1, "nprocPerNode": procs, "parallelism": {"dpShard": procs},
                    "model": {"preset": preset, "seqLen": seq_len},
                    "training": {"steps": 100000, "globalBatch": batch_per_rank * procs,
                                 "microBatch": batch_per_rank,
                                 "precision": "fp32", "warmupSteps": 2},
                    "checkpoint": {"enabled": True, "path": str(path), "interval": 100000, "keepLast": 2,
                                   "async": async_save},
                    "metrics": {"port": 29700}}}
    job, problems = parse(doc)
    assert job is not None, problems
    return resolve(job)


# --- on every rank, under torchrun -----------------------------------------------------------------

def worker(config_path: str, out: str, rounds: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from tetrad_trainer.mesh import init_distributed
    from tetrad_trainer.train import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = ResolvedConfig.load(config_path)
    trainer = Trainer(cfg, init_distributed(), jsonl=None)
    ckpt = trainer.checkpointer
    flag = torch.zeros(1)

    def step() -> float:
        t = time.perf_counter()
        trainer.step += 1
        trainer.train_step()
        return time.perf_counter() - t

    def all_done(done: bool) -> bool:  # every rank must run the same number of steps
        flag.fill_(0.0 if done else 1.0)
        dist.all_reduce(flag)
        return flag.item() == 0.0

    def reference() -> float:
        """The step time right now: the machine may be shared, so each save gets its own reference."""
        return statistics.median(step() for _ in range(steps))

    def sync_round() -> tuple[float, float]:
        ref = reference()
        dist.barrier()
        t = time.perf_counter()
        ckpt.save(trainer.step, blocking=True)
        return time.perf_counter() - t, ref

    def async_round() -> tuple[float, float, float, int]:
        ref = reference()
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save(trainer.step)
        staging = time.perf_counter() - t0
        overlapped = []
        while not all_done(ckpt._pending is None or ckpt._pending.done()):
            overlapped.append(step())
        ckpt.wait()
        stall = staging + sum(max(0.0, s - ref) for s in overlapped)
        return stall, ref, time.perf_counter() - t0, len(overlapped)

    assert ckpt.settings.async_save, "the bench config turns async on; blocking=True gives the sync saves"
    step()  # warm-up: lazy initialisation, first all-gathers
    sync, asyn = [], []
    for _ in range(rounds):  # alternate, so drift of a shared machine hits both alike
        sync.append(sync_round())
        asyn.append(async_round())
    assert ckpt.last_stats is not None
    loads = []
    for _ in range(rounds):
        dist.barrier()
        t = time.perf_counter()
        resumed = ckpt.resume()
        loads.append(time.perf_counter() - t)
        assert resumed is not None
    ckpt.close()
    med = statistics.median
    mine = {"reference_step_s": med([r for _, r in sync] + [r for _, r, _, _ in asyn]),
            "sync_save_s": med(s for s, _ in sync), "sync_ratio": med(s / r for s, r in sync),
            "async_stall_s": med(s for s, _, _, _ in asyn), "async_ratio": med(s / r for s, r, _, _ in asyn),
            "async_commit_s": med(t for _, _, t, _ in asyn),
            "async_overlapped_steps": float(med(n for _, _, _, n in asyn)),
            "load_s": med(loads), "bytes": ckpt.last_stats.bytes}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        slowest: dict[str, Any] = {k: max(g[k] for g in gathered) for k in mine}
        Path(out).write_text(json.dumps(slowest))
    trainer.metrics.close()
    dist.destroy_process_group()


# --- the driver --------------------------------------------------------------------------------------

def measure(preset: str, seq_len: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cfg = config(preset, seq_len, args.procs, work / f"ckpt-{preset}", True, args.batch_per_rank)
    path = work / f"{preset}.json"
    path.write_text(cfg.to_json())
    out = work / f"{preset}-result.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or max(1, (os.cpu_count() or 1) // args.procs))}
    # --no-python runs this file as the workers' script.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.procs}",
           "--no-python", sys.executable, "-P", __file__, "--worker", "--config", str(path),
           "--out", str(out), "--rounds", str(args.rounds), "--steps", str(args.steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result |= {"model": preset, "params_m": cfg.model.num_params() / 1e6, "seq_len": seq_len}
    return result


def table(rows: list[dict[str, Any]], procs: int, threads: int) -> str:
    ranks = f"FSDP x{procs}" if procs > 1 else "1 process"
    lines = [
        f"| model ({ranks}, {threads} thread(s) each, fp32) | checkpoint | step | sync save (stall) "
        "| stall/step | async stall | stall/step "
        "| async commit | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        step = r["reference_step_s"]
        lines.append(
            f"| {r['model']} ({r['params_m']:.0f}M, seq {r['seq_len']}) | {r['bytes'] / 1e6:,.0f} MB "
            f"| {step:.2f} s "
            f"| {r['sync_save_s']:.2f} s | {r['sync_ratio']:.2f} | {r['async_stall_s']:.2f} s "
            f"| {r['async_ratio']:.2f} | {r['async_commit_s']:.2f} s "
            f"({r['async_overlapped_steps']:.0f} steps) "
            f"| {r['load_s']:.2f} s |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--models", default="debug:256,llama3-125m:64", help="comma-separated PRESET:SEQ_LEN")
    p.add_argument("--threads", type=int, default=0,
                   help="compute threads per rank (default: all cores shared among the ranks; fewer leave a "
                        "core to the background write, as a GPU job does)")
    p.add_argument("--batch-per-rank", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3,
                   help="steps without checkpointing before each save (its reference)")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.config, str(args.out), args.rounds, args.steps)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="tetrad-bench-ckpt-") as tmp:
        for item in args.models.split(","):
            preset, seq = item.split(":")
            rows.append(measure(preset, int(seq), args, Path(tmp)))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows, args.procs, args.threads or max(1, (os.cpu_count() or 1) // args.procs)))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
