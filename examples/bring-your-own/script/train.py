"""A plain PyTorch DDP script, nothing from Tetrad (level 1): Tetrad's launcher runs it under torchrun
in every pod, with the gang, the rendezvous, whole-gang restarts and the exit-code policy. It saves its
own checkpoint every --save-every steps where the job mounts spec.checkpoint ($TETRAD_CHECKPOINT_DIR)
and resumes from it after a restart.

    python -m torch.distributed.run --nproc-per-node 2 train.py --steps 40      # anywhere, or under Tetrad
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM = 256, 64, 128


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long a step (to watch it)")
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, VOCAB))
    model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ckpt = Path(os.environ.get("TETRAD_CHECKPOINT_DIR", "checkpoints")) / "ddp.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        print(f"[train] rank {rank}: resumed from step {step}", flush=True)

    while step < args.steps:
        step += 1
        g = torch.Generator().manual_seed(step * 1000 + rank)
        tokens = torch.randint(0, VOCAB, (args.batch // world, SEQ + 1), generator=g)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_seconds)
        if rank == 0:
            print(f"[train] step {step} loss {loss.item():.4f}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            if rank == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step},
                           ckpt.with_suffix(".tmp"))
                os.replace(ckpt.with_suffix(".tmp"), ckpt)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
