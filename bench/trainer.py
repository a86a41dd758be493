"""Trainer overhead: Tetrad's tokens/s against a minimal hand-written PyTorch loop, in one run.

Both sides train the same model (tetrad_trainer.model.Transformer, same init) on the same batches
(tetrad_trainer.data) in the same torchrun world:

    single   1 process    Tetrad (all degrees 1)   vs  a plain loop
    ddp      N processes  Tetrad dpReplicate=N     vs  torch.nn.parallel.DistributedDataParallel
    fsdp     N processes  Tetrad dpShard=N         vs  fully_shard per block + root

Each process holds both and alternates them step by step (Tetrad's full step: `Trainer.run_step`,
with its loss all-reduce, metrics and JSON line; then one baseline step with a loss all-reduce).
On a shared machine the load then hits both sides alike. Figures are medians of the per-step
times after --warmup steps; a ratio of 1.00 means no framework overhead. Each step is timed by the
wall clock (tokens/s) and by this process's CPU time: on a CPU host shared with other work the
CPU-time ratio is the steadier measure of overhead (it leaves out time spent waiting for a core).

    python bench/trainer.py [--procs 2] [--steps 40] [--warmup 5] [--out results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tetrad.api import ResolvedConfig, parse
from tetrad.resolve import resolve

MODES = {"single": "", "ddp": "dpReplicate", "fsdp": "dpShard"}


def config(mode: str, procs: int, args: argparse.Namespace) -> ResolvedConfig:
    n = 1 if mode == "single" else procs
    parallelism = {"dpShard": 1, **({MODES[mode]: n} if MODES[mode] else {})}
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
           "metadata": {"name": f"bench-{mode}"},
           "spec": {"nodes": 1, "nprocPerNode": n, "parallelism": parallelism,
                    "model": {"preset": args.model, **({"seqLen": args.seq_len} if args.seq_len else {})},
                    "training": {"steps": args.steps, "globalBatch": args.batch_per_rank * n,
                                 "microBatch": args.batch_per_rank, "precision": args.precision,
                                 "warmupSteps": 2},
                    "metrics": {"port": args.metrics_port}}}
    job, problems = parse(doc)
    assert job is not None, problems
    return resolve(job)


def measure(mode: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    cfg = config(mode, args.procs, args)
    path, result = work / f"{mode}.json", work / f"{mode}-result.json"
    path.write_text(cfg.to_json())
    n = cfg.world_size
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__,
           "--worker", "--config", str(path), "--result", str(result), "--warmup", str(args.warmup)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(result.read_text())


# --- run by torchrun on every rank ---------------------------------------------------------------

def worker(config_path: str, result: str, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from tetrad_trainer.data import BatchLoader, build_source
    from tetrad_trainer.mesh import init_distributed
    from tetrad_trainer.model import Transformer, init_weights
    from tetrad_trainer.train import Trainer
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    cfg = ResolvedConfig.load(config_path)
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    tetrad = Trainer(cfg, device, jsonl=None)

    # The hand-written side: what a minimal loop of the same model looks like.
    bf16 = cfg.training.precision.value == "bf16"
    with torch.device("meta"):
        model = Transformer(cfg.model)
    init_weights(model, device, cfg.training.seed)
    if cfg.layout.dp_replicate > 1:
        model = DistributedDataParallel(model)
    elif cfg.layout.dp_shard > 1:
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
        for block in model.layers.values():
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    autocast = bf16 and cfg.layout.dp_shard == 1
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.training.weight_decay)
    loader = BatchLoader(build_source(cfg), cfg.training.global_batch, dp_rank=rank, dp_size=world)

    def baseline_step() -> None:
        x, y = (t.to(device) for t in loader.next_batch())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip)
        opt.step()
        opt.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported)  # what any real loop does to report the loss
        reported.item()

    def timed(fn) -> tuple[float, float]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - wall, time.process_time() - cpu

    times: dict[str, list[tuple[float, float]]] = {"tetrad": [], "baseline": []}
    tetrad.last_log = time.perf_counter()
    # Tetrad's JSON lines are part of its cost, not of the report
    with contextlib.redirect_stdout(io.StringIO()):
        for step in range(cfg.training.steps):
            first = step % 2 == 0  # alternate which side goes first
            for side in ("tetrad", "baseline") if first else ("baseline", "tetrad"):
                times[side].append(timed(tetrad.run_step if side == "tetrad" else baseline_step))
    tetrad.checkpointer.close()
    tetrad.metrics.close()
    if rank == 0:
        tokens = cfg.training.global_batch * cfg.model.seq_len
        wall = {side: statistics.median(w for w, _ in t[warmup:]) for side, t in times.items()}
        cpu = {side: statistics.median(c for _, c in t[warmup:]) for side, t in times.items()}
        Path(result).write_text(json.dumps({
            "processes": world,
            "tetrad_tokens_per_second": tokens / wall["tetrad"],
            "baseline_tokens_per_second": tokens / wall["baseline"],
            "ratio": wall["baseline"] / wall["tetrad"],
            "tetrad_cpu_s_per_step": cpu["tetrad"],
            "baseline_cpu_s_per_step": cpu["baseline"],
            "cpu_ratio": cpu["baseline"] / cpu["tetrad"],
        }))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=2, help="processes of the ddp and fsdp modes")
    p.add_argument("--steps", type=int, default=40, help="steps of each side")
    p.add_argument("--warmup", type=int, default=5, help="steps dropped from the statistics")
    p.add_argument("--model", default="debug")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-per-rank", type=int, default=4)
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None,
                   help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--metrics-port", type=int, default=19400)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.config, args.result, args.warmup)
        return
    if args.precision is None:
        import torch

        args.precision = "bf16" if torch.cuda.is_available() else "fp32"

    results = []
    with tempfile.TemporaryDirectory(prefix="tetrad-bench-") as tmp:
        for mode in args.modes.split(","):
            r = {"mode": mode, **measure(mode, args, Path(tmp))}
            results.append(r)
            print(f"{mode}: tetrad {r['tetrad_tokens_per_second']:,.0f} tok/s, baseline "
                  f"{r['baseline_tokens_per_second']:,.0f} tok/s, ratio {r['ratio']:.3f}, CPU-time ratio "
                  f"{r['cpu_ratio']:.3f}", file=sys.stderr, flush=True)
    print(f"\nmodel {args.model}, {args.batch_per_rank} sequences per rank, {args.precision},"
          f" {args.steps} steps"
          f" per side alternating step by step, medians after {args.warmup} warm-up steps\n")
    print("| mode | processes | Tetrad tokens/s | hand-written tokens/s | throughput ratio "
          "| CPU-time ratio |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['processes']} | {r['tetrad_tokens_per_second']:,.0f} | "
              f"{r['baseline_tokens_per_second']:,.0f} | {r['ratio']:.3f} | {r['cpu_ratio']:.3f} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
