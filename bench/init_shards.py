"""Time and memory of materializing one rank's shards of a large model (no process group needed).

Builds the model on the meta device and computes the FSDP shards of rank --rank of --shards
(dim 0 cut as FSDP2 cuts it: ceil(rows / shards) rows per rank) with `initial_slice`, the same
call `init_weights` makes per parameter. Prints the time, the values drawn and the process's peak
RSS growth, which is what one rank pays at start-up for its shard of the initial weights.

    python bench/init_shards.py [--model llama3-8b] [--shards 8] [--rank 0]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
from tetrad_trainer.model import Transformer, initial_slice

from tetrad.api.presets import PRESETS
from tetrad.api.resolved import ModelConfig


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig(name=args.model, **PRESETS[args.model])
    with torch.device("meta"):
        model = Transformer(cfg)
    before, start, cpu = rss_bytes(), time.perf_counter(), time.process_time()
    shards, drawn = {}, 0
    for name, param in model.named_parameters():
        per_rank = -(-param.shape[0] // args.shards)
        first = min(args.rank * per_rank, param.shape[0])
        rows = min(per_rank, param.shape[0] - first)
        offset, size = [first, *[0] * (param.dim() - 1)], [rows, *param.shape[1:]]
        shards[name] = initial_slice(name, param.shape, offset, size, cfg, seed=0)
        drawn += shards[name].numel()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    total = sum(p.numel() for p in model.parameters())
    print(f"{args.model} ({total / 1e9:.2f}B parameters), rank {args.rank} of {args.shards} FSDP shards,"
          f" torch {torch.__version__},"
          f" 1 thread: {drawn / 1e9:.3f}B values ({drawn * 4 / 2**30:.2f} GiB fp32) in {seconds:.1f} s"
          f" ({cpu:.1f} s CPU);"
          f" peak RSS grew by {(rss_bytes() - before) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
