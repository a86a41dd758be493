"""A training script of your own with Tetrad's runtime library (level 2): live figures in the job's
status, stall detection, a checkpoint on SIGTERM or on a checkpoint-now request, exit 75 after it, and a
resume from its own checkpoint. Plain PyTorch otherwise: a small MLP language model, data parallel with
DDP over the job's data-parallel ranks, its own checkpoint files.

    python -m torch.distributed.run --nproc-per-node 2 train.py --steps 40      # anywhere, or under Tetrad
"""

import argparse
import os
import time
from pathlib import Path

import tetrad_trainer.runtime as tetrad
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM = 256, 64, 128


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.out(h + self.mlp(h))


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic tokens: each data-parallel rank its own part of the global batch."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep this long a step (to watch it)")
    args = p.parse_args()

    run = tetrad.init()
    dp = run.mesh["dp_shard"]  # the data-parallel dim of the job's mesh (spec.parallelism.dpShard)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(TinyLM(), process_group=dp.get_group())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = sum(p.numel() for p in model.parameters())

    ckpt = Path(run.checkpoint_dir or "checkpoints") / "tinylm.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        if run.rank == 0:
            print(f"[train] resumed from step {step}", flush=True)

    def save() -> None:
        if run.rank == 0:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
        torch.distributed.barrier()
        run.saved(step)
        if run.rank == 0:
            print(f"[train] saved step {step}", flush=True)

    local = args.batch // dp.size()
    while step < args.steps:
        step += 1
        inputs, labels = batch(step, dp.get_local_rank(), local)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_seconds)
        global_loss = loss.detach().clone()
        torch.distributed.all_reduce(global_loss, group=dp.get_group())
        run.report(step, loss=global_loss / dp.size(), tokens=args.batch * SEQ, flops_per_token=6 * params)
        action = run.poll()
        if action.save:
            save()
        if action.stop:
            run.exit_preempted()
    save()
    run.close()


if __name__ == "__main__":
    main()
