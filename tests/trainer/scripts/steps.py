"""A stand-in for a training script in tests/trainer/test_launch.py: no torch, no process group; rank 0
reports its steps as JSON lines ($TETRAD_JSONL, as the runtime library does), and SIGTERM ends every rank
with 75 (after rank 0 reports its step, with --report-at-sigterm)."""

import argparse
import json
import os
import signal
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=0, help="steps to run; 0: until SIGTERM")
p.add_argument("--step-seconds", type=float, default=0.2)
p.add_argument("--report-at-sigterm", type=int, default=None, help="report no step but this one, at SIGTERM")
p.add_argument("--started-dir", default=None,
               help="each rank leaves rank-R here once its SIGTERM handler is set")
args = p.parse_args()
rank = int(os.environ["RANK"])


def report(step: int) -> None:
    if rank == 0 and os.environ.get("TETRAD_JSONL"):
        with open(os.environ["TETRAD_JSONL"], "a") as f:
            f.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")


def stop(signum: int, frame: object) -> None:
    if args.report_at_sigterm is not None:
        report(args.report_at_sigterm)
    sys.exit(75)


signal.signal(signal.SIGTERM, stop)
if args.started_dir:
    with open(os.path.join(args.started_dir, f"rank-{rank}"), "w") as f:
        f.write("started")
step = 0
while args.steps == 0 or step < args.steps:
    time.sleep(args.step_seconds)
    step += 1
    if args.report_at_sigterm is None:
        report(step)
