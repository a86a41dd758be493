"""A stand-in for a script that outgrows its host memory (tests/trainer/test_host_oom.py): it touches 64 MiB
more every step until the kernel's OOM killer ends it; past --limit-mib it gives up (exit 3), so a machine
without the test's memory limit is never exhausted."""

import argparse
import time

p = argparse.ArgumentParser()
p.add_argument("--limit-mib", type=int, default=4096)
args = p.parse_args()
held = []
for _ in range(args.limit_mib // 64):
    held.append(bytearray(b"\1" * (64 << 20)))  # written, so resident
    time.sleep(0.01)
raise SystemExit(3)
