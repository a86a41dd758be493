"""Trainer overhead: Tetrad's tokens/s against a minimal hand-written PyTorch loop, in one run.

Both sides train the same model (tetrad_trainer.model.Transformer, same init) on the same batches
(tetrad_trainer.data), under torchrun with the same process count and threads:

    single   1 process            Tetrad (all degrees 1)   vs  a plain loop
    ddp      N processes          Tetrad dpReplicate=N     vs  DistributedDataParallel
    fsdp     N processes          Tetrad dpShard=N         vs  fully_shard per block + root

Runs alternate (Tetrad, baseline, Tetrad, ...) so drift on a shared machine hits both; each side's
figure is the median over rounds of the median steady-state step (the first --warmup steps are
dropped). A ratio of 1.00 means no framework overhead.

    python bench/trainer.py [--procs 2] [--steps 30] [--rounds 2] [--out bench/trainer.json]
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

from tetrad.api import ResolvedConfig, parse, resolve

MODES = {"single": {}, "ddp": {"dpReplicate": "N"}, "fsdp": {"dpShard": "N"}}


def config(mode: str, procs: int, args: argparse.Namespace) -> ResolvedConfig:
    n = 1 if mode == "single" else procs
    parallelism = {"dpShard": 1, **{k: n for k in MODES[mode]}}
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": f"bench-{mode}"},
           "spec": {"nodes": 1, "nprocPerNode": n, "parallelism": parallelism,
                    "model": {"preset": args.model, **({"seqLen": args.seq_len} if args.seq_len else {})},
                    "training": {"steps": args.steps, "globalBatch": args.batch_per_rank * n,
                                 "microBatch": args.batch_per_rank, "precision": args.precision, "warmupSteps": 2},
                    "metrics": {"port": args.metrics_port}}}
    job, problems = parse(doc)
    assert job is not None, problems
    return resolve(job)


def torchrun(nproc: int, target: list[str], env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target]
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def steady_tokens_per_second(jsonl: Path, warmup: int) -> float:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return statistics.median(r["tokens_per_second"] for r in rows if r["step"] > warmup)


def measure(mode: str, procs: int, args: argparse.Namespace, work: Path) -> tuple[float, float]:
    cfg = config(mode, procs, args)
    n = cfg.world_size
    path = work / f"{mode}.json"
    path.write_text(cfg.to_json())
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
    tetrad, baseline = [], []
    for r in range(args.rounds):
        out = work / f"{mode}-tetrad-{r}.jsonl"
        torchrun(n, ["-m", "tetrad_trainer.train", "--config", str(path), "--jsonl", str(out)], env)
        tetrad.append(steady_tokens_per_second(out, args.warmup))
        out = work / f"{mode}-baseline-{r}.jsonl"
        torchrun(n, [__file__, "--worker", mode, "--config", str(path), "--jsonl", str(out)], env)
        baseline.append(steady_tokens_per_second(out, args.warmup))
    return statistics.median(tetrad), statistics.median(baseline)


# --- the hand-written baseline, run by torchrun on every rank -------------------------------------

def worker(mode: str, config_path: str, jsonl: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from tetrad_trainer.data import BatchLoader, build_source
    from tetrad_trainer.model import Transformer, init_weights
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    cfg = ResolvedConfig.load(config_path)
    cuda = torch.cuda.is_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    bf16 = cfg.training.precision.value == "bf16"

    with torch.device("meta"):
        model = Transformer(cfg.model)
    init_weights(model, device, cfg.training.seed)
    if mode == "ddp":
        model = DistributedDataParallel(model)
    elif mode == "fsdp":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for block in model.layers.values():
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    autocast = bf16 and mode != "fsdp"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr, betas=(0.9, 0.95), weight_decay=cfg.training.weight_decay)
    loader = BatchLoader(build_source(cfg), cfg.training.global_batch, dp_rank=rank, dp_size=world)
    tokens = cfg.training.global_batch * cfg.model.seq_len
    out = open(jsonl, "w") if rank == 0 else None  # noqa: SIM115
    for step in range(1, cfg.training.steps + 1):
        start = time.perf_counter()
        x, y = (t.to(device) for t in loader.next_batch())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip)
        opt.step()
        opt.zero_grad()
        loss_value = loss.detach().clone()
        dist.all_reduce(loss_value)  # what any real loop does to report the loss
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if out is not None:
            out.write(json.dumps({"step": step, "loss": loss_value.item() / world, "tokens_per_second": tokens / elapsed}) + "\n")
    if out is not None:
        out.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=2, help="processes of the ddp and fsdp modes")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps dropped from the statistics")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="debug")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-per-rank", type=int, default=4)
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--metrics-port", type=int, default=19400)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    p.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.config, args.jsonl)
        return
    if args.precision is None:
        import torch

        args.precision = "bf16" if torch.cuda.is_available() else "fp32"

    results = []
    with tempfile.TemporaryDirectory(prefix="tetrad-bench-") as tmp:
        for mode in args.modes.split(","):
            tetrad, baseline = measure(mode, args.procs, args, Path(tmp))
            n = 1 if mode == "single" else args.procs
            results.append({"mode": mode, "processes": n, "tetrad_tokens_per_second": tetrad,
                            "baseline_tokens_per_second": baseline, "ratio": tetrad / baseline})
            print(f"{mode}: tetrad {tetrad:,.0f} tok/s, baseline {baseline:,.0f} tok/s, ratio {tetrad / baseline:.3f}",
                  file=sys.stderr, flush=True)
    print(f"\nmodel {args.model}, {args.batch_per_rank} sequences per rank, {args.precision}, {args.steps} steps"
          f" ({args.warmup} warm-up dropped), median of {args.rounds} alternating rounds\n")
    print("| mode | processes | Tetrad tokens/s | hand-written tokens/s | Tetrad / hand-written |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['processes']} | {r['tetrad_tokens_per_second']:,.0f} | "
              f"{r['baseline_tokens_per_second']:,.0f} | {r['ratio']:.3f} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
