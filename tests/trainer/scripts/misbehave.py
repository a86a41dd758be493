"""A user's script that misbehaves on purpose, for tests/trainer/test_scripts.py: it joins the gang,
then does what its arguments say."""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--exit", default="", help="RANK:CODE,... exit with CODE on RANK (0 elsewhere)")
p.add_argument("--oom-on-rank", type=int, default=None)
p.add_argument("--ignore-sigterm", action="store_true", help="ignore SIGTERM and keep running")
p.add_argument("--hang-rank", type=int, default=None, help="this rank stops answering; the others all-reduce")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"[script] rank {rank} of {dist.get_world_size()}, mesh {os.environ.get('TETRAD_MESH')}", flush=True)
dist.barrier()
if args.oom_on_rank == rank:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (a test's)")
if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(os.environ["SCRIPT_STARTED_DIR"], f"rank-{rank}"), "w") as f:
        f.write("started")
    while True:
        time.sleep(1)
if args.hang_rank is not None:
    if rank == args.hang_rank:
        while True:
            time.sleep(1)
    dist.all_reduce(torch.ones(4))
codes = dict(item.split(":") for item in args.exit.split(",") if item)
sys.exit(int(codes.get(str(rank), 0)))
