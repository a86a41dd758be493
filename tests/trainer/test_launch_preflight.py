"""`tetrad run` says in the terminal, before anything starts, what would otherwise only reach node-0.log:
a GPU job on a machine without the GPUs is refused (exit 1, as any refusal before the start), a busy metrics
port is a warning, and so is bf16 on a CPU without a fast bf16 matmul (tetrad.node.host)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.trainer.harness import free_port_block
from tetrad.launch.local import EXIT_REFUSED
from tetrad.node.host import cpu_flags, slow_bf16_warning

ROOT = Path(__file__).parents[2]


def write_job(tmp_path: Path, **spec: object) -> str:
    doc = {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
           "metadata": {"name": "preflight"},
           "spec": {"nodes": 1, "nprocPerNode": 2, "parallelism": {"dpShard": 2},
                    "model": {"preset": "debug", "seqLen": 64}, "training": {"steps": 2, "globalBatch": 2},
                    **spec}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def tetrad_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tetrad.cli", "run", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_a_gpu_job_without_gpus_is_refused_in_the_terminal(tmp_path: Path) -> None:
    job = write_job(tmp_path, resources={"gpu": 2}, metrics={"port": free_port_block(2)})
    r = tetrad_run(job, "--workdir", str(tmp_path / "w"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert (r.stderr.startswith("error: spec.resources.gpu: the job needs 2 GPUs here")
            and "resources.gpu: 0" in r.stderr)
    assert not (tmp_path / "w" / "node-0.log").exists(), "nothing may start"


@pytest.mark.distributed
@pytest.mark.slow
def test_a_busy_metrics_port_is_a_warning_in_the_terminal(tmp_path: Path) -> None:
    port = free_port_block(2)
    with socket.socket() as busy:
        busy.bind(("", port + 1))
        busy.listen()
        r = tetrad_run(write_job(tmp_path, metrics={"port": port}), "--workdir", str(tmp_path / "w"))
    assert r.returncode == 0, r.stderr
    assert f"spec.metrics.port: port {port + 1} is in use" in r.stderr and "rank 1 trains without" in r.stderr
    assert f"port {port} is" not in r.stderr
    # The job trains in bf16 on the CPU: said in the terminal and in rank 0's log exactly when this CPU is
    # slow at it.
    slow = slow_bf16_warning()
    assert (slow is not None) == ("spec.training.precision: bf16 on this CPU" in r.stderr), r.stderr
    assert (slow is not None) == (f"warning: {slow}" in (tmp_path / "w" / "node-0.log").read_text())


AVX2 = ("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
        "processor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n")
AVX512 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 amx_bf16\n"


def test_bf16_is_slow_on_an_x86_cpu_without_avx512_and_nowhere_this_cannot_tell() -> None:
    assert cpu_flags(AVX2) == {"fpu", "sse2", "avx", "avx2", "fma"}
    warning = slow_bf16_warning("x86_64", AVX2)
    assert warning is not None and "training.precision: fp32" in warning
    assert slow_bf16_warning("x86_64", AVX512) is None
    assert slow_bf16_warning("x86_64", AVX512.replace(" avx512bw", "")) is not None  # oneDNN needs all four
    assert slow_bf16_warning("aarch64", AVX2) is None  # not x86: no claim
    assert slow_bf16_warning("x86_64", "processor\t: 0\n") is None  # no flags line: no claim
