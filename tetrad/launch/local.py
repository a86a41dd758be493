"""`tetrad run`: a job on this machine, started exactly as the operator starts it in a cluster.

One torchrun agent per node, each a local process with the node's environment from
`tetrad.render.env.torchrun_env` and the pod's command from `tetrad.render.command` (the same launcher
zip, written into WORKDIR, with this interpreter), so a job behaves the same here and in Kubernetes. Agents log to WORKDIR/node-N.log; rank 0's JSON lines
drive a live progress bar and the summary.

Stopping: SIGTERM, SIGHUP and SIGINT, and the death of the process that started `tetrad run`
(its parent), stop the run as Kubernetes stops a pod: SIGTERM to each node's supervisor (which
torchrun turns into SIGTERM to the workers: finish the step, save, exit 75), the job's
terminationGracePeriodSeconds to finish, then SIGKILL to every process of the run. A second
signal during that grace skips the rest of it. If a node fails, the others are stopped with a
short grace (a gang with a dead rank cannot save). Nothing is left running, and torchrun's own
log tree lives in WORKDIR/torchelastic, not in the temp directory.

This module imports neither torch nor the trainer: the trainer runs in the agents' processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tetrad.api import InvalidJob, ParallelTrainingJob, ResolvedConfig, contract
from tetrad.api.contract import ENV_JSONL, EXIT_CONFIG_ERROR
from tetrad.node.bundle import launcher
from tetrad.render import names
from tetrad.render.command import node_command
from tetrad.render.env import torchrun_env
from tetrad.render.objects import shutdown_timeout
from tetrad.resolve import resolve

MASTER_ADDR = "127.0.0.1"
FAILED_STOP_GRACE_S = 10.0  # the other nodes of a failed run: nothing to save with a rank gone
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((MASTER_ADDR, 0))
        return int(s.getsockname()[1])


def node_metrics_port(cfg: ResolvedConfig, node: int) -> int:
    """Nodes share this machine: each gets its own block of nprocPerNode metrics ports."""
    return cfg.metrics.port + node * cfg.nproc_per_node


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, without importing torch: the driver's list, cut by CUDA_VISIBLE_DEVICES."""
    driver = Path("/proc/driver/nvidia/gpus")
    count = len(list(driver.iterdir())) if driver.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return count if visible is None else min(count, len([d for d in visible.split(",") if d.strip()]))


def preflight(cfg: ResolvedConfig) -> tuple[list[str], list[str]]:
    """Errors and warnings about this machine, said in the terminal before anything starts.

    A job asking for GPUs is refused on a machine without enough of them (it would silently train on
    CPU); a busy metrics port is a warning (that rank trains without its endpoint).
    """
    errors, warnings = [], []
    if cfg.use_gpu and (have := visible_gpus()) < (need := cfg.world_size):
        errors.append(f"spec.resources.gpu: the job needs {need} GPUs here ({cfg.nodes} nodes x {cfg.nproc_per_node}),"
                      f" this machine has {have} visible; set resources.gpu: 0 to train on CPU with gloo")
    for node in range(cfg.nodes):
        for local in range(cfg.nproc_per_node):
            port = node_metrics_port(cfg, node) + local
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError as e:
                    warnings.append(f"spec.metrics.port: port {port} is in use ({e.strerror}): rank"
                                    f" {node * cfg.nproc_per_node + local} trains without its metrics endpoint;"
                                    " set spec.metrics.port to a free port")
    return errors, warnings


def local_command(cfg: ResolvedConfig, workdir: Path) -> list[str]:
    """The pod's command with this interpreter, the launcher and config in `workdir`."""
    return node_command(cfg, python=sys.executable, launcher=[str(workdir / contract.LAUNCHER_FILE)],
                        config_path=str(workdir / contract.CONFIG_FILE))


@dataclass
class Agent:
    node: int
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Records:
    """Rank 0's JSON lines, read incrementally from the file it appends to."""

    path: Path
    offset: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)

    def poll(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        new = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
        self.rows += new
        return new


def start_agents(cfg: ResolvedConfig, config_path: Path, workdir: Path, jsonl: Path, *, rdzv_timeout: int,
                 shutdown_timeout: int) -> list[Agent]:
    """One torchrun agent per node, each in its own session so it can be stopped as a group."""
    master_port = free_port()
    threads = max(1, (os.cpu_count() or 1) // cfg.world_size)
    agents = []
    for node in range(cfg.nodes):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
            **torchrun_env(cfg, node_rank=node, master_addr=MASTER_ADDR, master_port=master_port,
                           rdzv_id=names.rendezvous_id(cfg.job_name, None, 0), restart=0,
                           config_path=str(config_path), rdzv_timeout=rdzv_timeout, shutdown_timeout=shutdown_timeout,
                           # Nodes share this machine: give each its own block of metrics ports.
                           metrics_port=node_metrics_port(cfg, node)),
            # torchrun's per-run log tree (by default a torchelastic_* directory left in /tmp).
            "PET_LOG_DIR": str(workdir / "torchelastic" / f"node-{node}"),
        }
        if node == 0:
            env[ENV_JSONL] = str(jsonl)
        log = workdir / f"node-{node}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(local_command(cfg, workdir), env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        agents.append(Agent(node, proc, log))
    return agents


def _descendants(roots: list[int]) -> list[int]:
    """Every live descendant of roots (Linux /proc; torchrun starts each worker in its own session)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text[text.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class StopSignals:
    """While active, SIGTERM, SIGHUP and SIGINT are recorded instead of ending this process; so is the
    death of its parent (seen as a change of the parent pid), which counts as a SIGHUP."""

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        self._parent = os.getppid()
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signal.Signals(signum))

    def poll(self) -> int:
        """How many stop requests so far (signals, and the parent's death once)."""
        if os.getppid() != self._parent:
            self._parent = os.getppid()
            self.received.append(signal.SIGHUP)
        return len(self.received)


def stop_agents(agents: list[Agent], grace: float, signals: StopSignals | None = None) -> bool:
    """SIGTERM each node's supervisor (torchrun stops its workers), wait up to `grace` seconds, then
    SIGKILL every process of the run, workers included. A new stop request (`signals`) during the
    grace ends it at once. Returns whether every node exited within the grace."""
    running = [a for a in agents if a.proc.poll() is None]
    everyone = {a.proc.pid for a in running} | set(_descendants([a.proc.pid for a in running]))
    requests = signals.poll() if signals is not None else 0
    for a in running:  # the supervisor only: it forwards to torchrun, which must see one SIGTERM
        with contextlib.suppress(ProcessLookupError):
            os.kill(a.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(a.proc.poll() is None for a in running):
        if signals is not None and signals.poll() > requests:
            break
        everyone |= set(_descendants([a.proc.pid for a in running if a.proc.poll() is None]))
        time.sleep(0.1)
    clean = all(a.proc.poll() is not None for a in running)
    for pid in everyone:  # agents and workers lead their own process groups
        _signal_group(pid, signal.SIGKILL)
    for a in agents:
        a.proc.wait()
    return clean


def progress_line(row: dict[str, Any]) -> str:
    """A step record as the progress bar shows it; a figure a script did not report is left out."""
    parts = [("loss", "loss {:.4f}"), ("tokens_per_second", "{:,.0f} tok/s"), ("mfu", "MFU {:.1%}")]
    return "  ".join(fmt.format(row[key]) for key, fmt in parts if row.get(key) is not None)


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    known = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(known) if known else None


def _summary(cfg: ResolvedConfig, rows: list[dict[str, Any]], wall_s: float, jsonl: Path, workdir: Path) -> Table:
    table = Table(title=f"tetrad run: {cfg.job_name}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("mesh", f"{cfg.layout.label()} ({cfg.nodes} nodes x {cfg.nproc_per_node} processes)")
    if cfg.model is not None:
        table.add_row("model", f"{cfg.model.name}, {cfg.model.num_params() / 1e6:.1f}M parameters")
    if cfg.script is not None:
        table.add_row("script", cfg.script.describe())
    if rows:
        steady = rows[1:] or rows  # the first step includes warm-up (lazy init, shape inference)
        table.add_row("steps", f"{rows[-1]['step']}" + (f" / {cfg.training.steps}" if cfg.script is None else ""))
        if losses := [r["loss"] for r in rows if r.get("loss") is not None]:
            table.add_row("loss", f"{losses[0]:.4f} → {losses[-1]:.4f}")
        if (tokens := _median(steady, "tokens_per_second")) is not None:
            table.add_row("tokens/s", f"{tokens:,.0f} (median)")
        if (mfu := _median(steady, "mfu")) is not None:
            table.add_row("MFU", f"{mfu:.2%}  ({_median(steady, 'tflops') or 0:.3g} TFLOPS per device)")
        if (step_time := _median(steady, "step_time_s")) is not None:
            table.add_row("step time", f"{step_time:.3f} s (median)")
        table.add_row("peak memory", f"{max(r['peak_memory_bytes'] for r in rows) / 2**30:.2f} GiB (rank 0)")
        if rows[0].get("startup_s") is not None:
            table.add_row("start-up", f"{rows[0]['startup_s']:.1f} s (worker start to the end of its first step)")
    table.add_row("wall time", f"{wall_s:.1f} s")
    table.add_row("metrics", str(jsonl))
    table.add_row("logs", str(workdir))
    return table


# The lines of a node's log that say why it failed: the trainer's own errors, the last line of each
# worker traceback (torchrun prefixes them with [rankN]:), and torchrun's exit-code summary.
_CAUSE = re.compile(r"^\[tetrad rank \d+\] .*error|^\[rank\d+\]: [\w.]*(Error|Exception)\b|^\s*exitcode\s*:", re.IGNORECASE)


def failure_excerpt(path: Path, fallback_lines: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    causes = list(dict.fromkeys(line.strip() for line in lines if _CAUSE.search(line)))
    return "\n".join(causes[-20:] if causes else lines[-fallback_lines:])


def run_local(job: ParallelTrainingJob, *, steps: int | None = None, jsonl: Path | None = None,
              workdir: Path | None = None) -> int:
    """Run job on this machine; returns 0 on success, the failing node's exit code, or 128 + N when
    stopped by signal N (130 on Ctrl-C; the parent's death counts as SIGHUP, 129)."""
    console = Console(stderr=True, highlight=False)
    try:
        cfg = resolve(job)
    except InvalidJob as e:
        for problem in e.problems:
            console.print(f"[red]error[/red] {problem}")
        return EXIT_CONFIG_ERROR
    if steps is not None:
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": steps})})
    errors, warnings = preflight(cfg)
    for line in warnings:
        console.print(f"[yellow]warning[/yellow] {line}", soft_wrap=True)
    if errors:
        for line in errors:
            console.print(f"[red]error[/red] {line}", soft_wrap=True)
        return EXIT_CONFIG_ERROR

    workdir = Path(tempfile.mkdtemp(prefix=f"tetrad-{cfg.job_name}-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / contract.CONFIG_FILE
    config_path.write_text(cfg.to_json())
    (workdir / contract.LAUNCHER_FILE).write_bytes(launcher())
    jsonl = jsonl if jsonl is not None else workdir / "metrics.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("")
    records = Records(jsonl)

    steps = None if cfg.script is not None else cfg.training.steps  # a script's steps are its own
    what = f"{steps} steps" if steps is not None else f"script {cfg.script.describe() if cfg.script else ''}"
    console.print(f"tetrad run: {cfg.job_name}: {cfg.nodes} node(s) x {cfg.nproc_per_node} process(es),"
                  f" mesh {cfg.layout.label()}, {what}; logs in {workdir}")
    start = time.monotonic()
    grace = job.spec.run_policy.termination_grace_period_seconds
    failed: Agent | None = None
    code = 0
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                        TimeElapsedColumn(), console=console, transient=False)
    with StopSignals() as signals:
        agents = start_agents(cfg, config_path, workdir, jsonl, rdzv_timeout=job.spec.rendezvous.timeout_seconds,
                              shutdown_timeout=shutdown_timeout(job.spec))
        try:
            with progress:
                task = progress.add_task("starting", total=steps)
                while not signals.poll():
                    for row in records.poll():
                        progress.update(task, completed=row["step"], description=progress_line(row))
                    codes = [a.proc.poll() for a in agents]
                    failed = next((a for a, c in zip(agents, codes, strict=True) if c not in (None, 0)), None)
                    if failed is not None or all(c == 0 for c in codes):
                        break
                    time.sleep(0.2)
        finally:
            if signals.poll():
                sig = signals.received[0]
                code, failed = 128 + sig, None
                console.print(f"[yellow]{sig.name}: stopping every node (SIGTERM, then SIGKILL after the"
                              f" {grace} s grace period; signal again to skip it)[/yellow]")
                clean = stop_agents(agents, grace, signals)
                exits = sorted({a.proc.returncode for a in agents})
                console.print(f"[yellow]stopped: the nodes exited {exits}"
                              + ("" if clean else " (SIGKILLed: not every node stopped within the grace)")
                              + (f"; exit {contract.EXIT_PREEMPTED} means saved" if contract.EXIT_PREEMPTED in exits else "")
                              + "[/yellow]")
            else:
                stop_agents(agents, FAILED_STOP_GRACE_S)
        records.poll()
    if failed is not None:
        rc = failed.proc.returncode
        code = rc if rc > 0 else 128 - rc  # -N: killed by signal N
        reason = " (a config error: the job cannot run as written)" if code == EXIT_CONFIG_ERROR else ""
        console.print(f"[red]node {failed.node} exited with code {code}{reason}; the other nodes were stopped."
                      f" From {failed.log}:[/red]")
        console.print(failure_excerpt(failed.log), markup=False)
    console.print(_summary(cfg, records.rows, time.monotonic() - start, jsonl, workdir))
    return code
