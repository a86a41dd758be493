"""Peak memory of Tetrad's training steps per rank, measured tensor by tensor (CPU included).

Runs the last of --steps `Trainer.run_step`s under torch's MemTracker, which counts every live tensor storage per
device (parameters, gradients, optimizer states, activations, temporaries), so the figure is
exact and free of allocator noise, unlike the process RSS. For comparing FSDP wrappings and loss
variants on a CPU host; on a GPU, torch.cuda.max_memory_allocated says the same more cheaply.

    python bench/memory.py [--model llama3-125m] [--seq-len 256] [--procs 2] [--parallelism dpShard=2]
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def config(args: argparse.Namespace):
    from tetrad.api import parse
    from tetrad.resolve import resolve

    parallelism = {"dpShard": 1,
                   **{k: int(v) for k, v in (kv.split("=") for kv in args.parallelism.split(","))}}
    training = {"steps": args.steps, "globalBatch": args.batch, "microBatch": args.micro_batch,
                "precision": "fp32", "warmupSteps": 1, **json.loads(args.training)}
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
           "metadata": {"name": "bench-memory"},
           "spec": {"nodes": 1, "nprocPerNode": args.procs, "parallelism": parallelism,
                    "model": {"preset": args.model, "seqLen": args.seq_len}, "training": training,
                    "metrics": {"port": args.metrics_port}}}
    job, problems = parse(doc)
    assert job is not None, problems
    return resolve(job)


def worker(config_path: str, result: str) -> None:
    import contextlib
    import io

    import torch
    import torch.distributed as dist
    from tetrad_trainer.mesh import init_distributed
    from tetrad_trainer.train import Trainer
    from torch.distributed._tools.mem_tracker import MemTracker

    from tetrad.api import ResolvedConfig

    cfg = ResolvedConfig.load(config_path)
    device = init_distributed()
    trainer = Trainer(cfg, device, jsonl=None)
    with contextlib.redirect_stdout(io.StringIO()):
        for _ in range(cfg.training.steps - 1):  # warm-up: the optimizer states exist after the first step
            trainer.run_step()
        tracker = MemTracker()  # it tracks one iteration
        tracker.track_external(*trainer.model.parts, trainer.optimizer)
        with tracker:
            trainer.run_step()
    peak = tracker.get_tracker_snapshot("peak")
    peaks = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, max(v.get("Total", 0) for v in peak.values()))
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps({"peak_bytes_per_rank": peaks, "torch": torch.__version__}))
    trainer.checkpointer.close()
    trainer.metrics.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-125m")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--parallelism", default="dpShard=2", help="degrees, e.g. dpShard=2 or tp=2,dpShard=1")
    p.add_argument("--batch", type=int, default=2, help="globalBatch")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--training", default="{}",
                   help="further training fields as JSON, e.g. '{\"lossChunks\": 4}'")
    p.add_argument("--metrics-port", type=int, default=19500)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.config, args.result)
        return
    with tempfile.TemporaryDirectory(prefix="tetrad-memory-") as tmp:
        path, result = Path(tmp) / "config.json", Path(tmp) / "result.json"
        path.write_text(config(args).to_json())
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.procs}",
               __file__, "--worker", "--config", str(path), "--result", str(result)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                     f"{done.stderr[-3000:]}")
        r = json.loads(result.read_text())
    peaks = ", ".join(f"{b / 2**20:,.1f}" for b in r["peak_bytes_per_rank"])
    print(f"{args.model} seqLen {args.seq_len}, {args.parallelism} on {args.procs} processes,"
          f" globalBatch {args.batch}"
          f" microBatch {args.micro_batch}, fp32, {args.steps} steps, torch {r['torch']}:"
          f" peak MiB per rank {peaks}")


if __name__ == "__main__":
    main()
