"""Start-up and CPU-precision costs a CPU user pays in every run, each against its baseline in the same run.

    python bench/startup.py [--repeats 5]

Rows:
- the trainer's imports in a fresh process (`import tetrad_trainer.train`): as shipped (pipelining imported
  only by pipelined jobs) against the same plus `torch.distributed.pipelining`, which every process
  imported before (it pulls in torch._dynamo);
- one training step of the debug model on one CPU process, bf16 against fp32 (a CPU without AVX-512 has
  no fast bf16 matmul; tetrad.node.host).
Medians of --repeats fresh processes, alternating the two systems.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "trainer-image"),
                                      os.environ.get("PYTHONPATH", "")])}

IMPORT = """
import time, sys
t = time.perf_counter()
import tetrad_trainer.train
{extra}
print(time.perf_counter() - t)
"""

STEP = """
import json, sys, time, torch
from tetrad.api import parse
from tetrad.resolve import resolve
from tetrad_trainer.models.loader import definition_of
torch.set_num_threads(1)
doc = {{"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {{"name": "b"}},
       "spec": {{"nodes": 1, "nprocPerNode": 1, "parallelism": {{"dpShard": 1}}, "model": {{"preset": "debug", "seqLen": 64}},
                "training": {{"globalBatch": 2, "precision": "{precision}"}}}}}}
cfg = resolve(parse(doc)[0])
model = definition_of(cfg.model).build(cfg.model)
x = torch.randint(0, cfg.model.vocab, (2, 64))
times = []
for _ in range(4):
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled="{precision}" == "bf16"):
        loss = model(x).float().logsumexp(-1).mean()
    loss.backward()
    times.append(time.perf_counter() - t)
print(sorted(times[1:])[1])
"""  # noqa: E501


def timed(code: str) -> float:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          check=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rows = []
    pairs = [("trainer imports", "baseline: + torch.distributed.pipelining",
              IMPORT.format(extra=""), IMPORT.format(extra="import torch.distributed.pipelining")),
             ("debug step, fp32", "baseline: bf16 autocast", STEP.format(precision="fp32"),
              STEP.format(precision="bf16"))]
    for name, baseline, code, base_code in pairs:
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(timed(code))
            theirs.append(timed(base_code))
        a, b = statistics.median(ours), statistics.median(theirs)
        rows.append({"row": name, "seconds": a, "baseline": baseline, "baseline_seconds": b, "ratio": b / a})
    print(json.dumps(rows, indent=1))
    print("\n| row | s | baseline | s | baseline / row |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['seconds']:.2f} | {r['baseline']} | {r['baseline_seconds']:.2f} "
              f"| {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
