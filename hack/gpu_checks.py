"""The trainer's checks that need a CUDA device, run on a GPU machine (CI has none):

1. `tetrad run` trains a debug job on one GPU over NCCL, bf16, and exits 0 with CUDA figures;
2. the preflight's device check names the visible GPU count when nprocPerNode asks for more;
3. a real CUDA out-of-memory error exits 77 (EXIT_OOM) with the step, the memory and the knobs;
4. a worker SIGKILLed mid-run restarts in place, its new round forked from the spare interpreter (torch
   imported, CUDA not yet touched), and resumes from the checkpoint to the end.

    python hack/gpu_checks.py [--workdir DIR]     # prints PASS/FAIL per check; exits 1 on a failure
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
import yaml

from tetrad.api import parse
from tetrad.api.contract import EXIT_OOM
from tetrad.launch.local import kill_rank_at, logged_steps
from tetrad.node.checks import node_problems
from tetrad.node.environment import NodeEnv
from tetrad.node.spare import READY
from tetrad.render.env import job_env
from tetrad.resolve import resolve


def job(name: str, nproc: int, model: dict, batch: int, steps: int) -> dict:
    return {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": name},
            "spec": {"nodes": 1, "nprocPerNode": nproc, "parallelism": {"dpShard": nproc}, "model": model,
                     "resources": {"gpu": nproc},
                     "training": {"steps": steps, "globalBatch": batch, "microBatch": batch // nproc,
                                  "precision": "bf16", "warmupSteps": 1}}}


def tetrad_run(doc: dict, work: Path) -> subprocess.CompletedProcess[str]:
    path = work / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return subprocess.run([sys.executable, "-m", "tetrad.cli", "run", str(path),
                           "--workdir", str(work / path.stem),
                           "--jsonl", str(work / f"{path.stem}.jsonl")],
                          capture_output=True, text=True, timeout=300)


def trains_on_one_gpu(work: Path) -> str | None:
    done = tetrad_run(job("gpu-debug", 1, {"preset": "debug"}, 8, 6), work)
    rows = ([json.loads(line) for line in (work / "gpu-debug.jsonl").read_text().splitlines()]
            if done.returncode == 0 else [])
    steps = [r for r in rows if "tokens_per_second" in r]
    if done.returncode != 0 or not steps:
        return f"exit {done.returncode}, {len(steps)} step rows: {(done.stdout + done.stderr)[-1500:]}"
    print(f"  last step row: {json.dumps(steps[-1])[:400]}")
    return None


def preflight_names_the_device_count(_: Path) -> str | None:
    have = torch.cuda.device_count()
    parsed, problems = parse(job("gpu-count", have + 1, {"preset": "debug"}, 8 * (have + 1), 2))
    assert parsed is not None, problems
    pods = job_env(resolve(parsed), master_addr="", master_port=29500, config_path="/unused", rdzv_timeout=60)
    found = node_problems(NodeEnv.read(pods))  # what the node's supervisor checks, from the pod's environment
    want = f"devices: {have} CUDA devices visible, the job runs nprocPerNode={have + 1}"
    print(f"  {found}")
    return None if any(p.startswith(want) for p in found) else f"expected {want!r}"


def out_of_memory_exits_77(work: Path) -> str | None:
    # llama3-125m with 64 x 8192 tokens: its bf16 logits alone are 64 x 8192 x 32768 x 2 bytes = 32 GiB, the
    # fp32 copy and its gradient 128 GiB more: more than any single GPU has.
    done = tetrad_run(job("gpu-oom", 1, {"preset": "llama3-125m", "seqLen": 8192}, 64, 2), work)
    log = done.stdout + done.stderr
    print("  " + next((line for line in log.splitlines() if "out of memory" in line.lower()),
                      "(no OOM line)")[:600])
    if done.returncode != EXIT_OOM:
        return f"exit {done.returncode}, expected {EXIT_OOM}: {log[-1500:]}"
    return None if "microBatch" in log else "the message names no knob (microBatch)"


def kill_the_worker_at(step: int, work: Path, jsonl: Path) -> threading.Thread:
    """SIGKILL the run's worker (rank 0, the only one) once it has logged `step`, as a crash would."""
    thread = threading.Thread(target=kill_rank_at, args=(work, jsonl, 0, step, 240), daemon=True)
    thread.start()
    return thread


def restarts_in_place_from_the_spare(work: Path, gpus: int = 1) -> str | None:
    """`gpus` 0: the same check on the CPU (fp32: a CPU's bf16 matmuls are slow), which CI runs."""
    doc = job("gpu-in-place", 1, {"preset": "debug"}, 8, 10)
    spec = doc["spec"]
    spec |= {"checkpoint": {"enabled": True, "path": str(work / "gpu-in-place-ckpt"), "interval": 4},
             "runPolicy": {"maxRestarts": 1, "backoffSeconds": 0}}
    if not gpus:
        del spec["resources"]
        spec["training"]["precision"] = "fp32"
    watcher = kill_the_worker_at(6, work / "gpu-in-place", work / "gpu-in-place.jsonl")
    done = tetrad_run(doc, work)
    watcher.join()
    log = (work / "gpu-in-place" / "node-0.log").read_text()
    steps = logged_steps(work / "gpu-in-place.jsonl")
    print(f"  steps {steps}; {next((line for line in log.splitlines() if 'in place, round 1' in line), '')}")
    if done.returncode != 0:
        return f"exit {done.returncode}: {log[-1500:]}"
    again = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), None)
    if again is None or steps[again:] != list(range(5, 11)) or steps[again - 1] < 6:
        return f"expected steps 1 to at least 6, then 5 to 10 after resuming from step 4: {steps}"
    if log.count(READY) != 1 or "no spare interpreter" in log:
        return f"round 1 did not fork from the spare: {log[-1500:]}"
    return None


CHECKS = (trains_on_one_gpu, preflight_names_the_device_count, out_of_memory_exits_77,
          restarts_in_place_from_the_spare)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: these checks need one")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {torch.cuda.device_count()} visible",
          flush=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tetrad-gpu-checks-"))
    work.mkdir(parents=True, exist_ok=True)
    failed = 0
    for check in CHECKS:
        try:
            error = check(work)
        except Exception as e:  # noqa: BLE001 - a check that raises fails, the next still runs
            error = f"{type(e).__name__}: {e}"
        failed += error is not None
        print(f"{'FAIL' if error else 'PASS'} {check.__name__}" + (f": {error}" if error else ""), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
