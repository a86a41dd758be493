"""`tetrad run`: a job on this machine, started exactly as the operator starts it in a cluster.

One torchrun agent per node, each a local process with the node's environment from
`tetrad.render.env.torchrun_env` and the pod's command from `tetrad.render.command` (the same launcher
zip, written into WORKDIR, with this interpreter), so a job behaves the same here and in Kubernetes.
Agents log to WORKDIR/node-N.log and leave their termination message in WORKDIR/node-N.termination;
rank 0's JSON lines (WORKDIR/metrics.jsonl, copied to --jsonl) drive a live progress bar and the
summary. The work directory and its locks: tetrad.launch.workdir.

Before anything starts, a run is refused (EXIT_REFUSED, one line per reason) for an invalid job, a
suspended one (runPolicy.suspend), GPUs this machine lacks, a --workdir or --jsonl it must not write,
a work directory or checkpoint path another run holds, or a work directory it cannot write. It says
where training starts: from step 0, or resumed from a checkpoint (rank 0's tetrad_resumed_from_step,
read from its metrics endpoint while it runs, else from node 0's termination message), and "nothing
to do" when the checkpoint is at the last step already. runPolicy.activeDeadlineSeconds stops the run
as the operator fails the job (EXIT_DEADLINE).

Stopping: SIGTERM, SIGHUP and SIGINT, and the death of the process that started `tetrad run`
(its parent), stop the run as Kubernetes stops a pod: SIGTERM to each node's supervisor (which
torchrun turns into SIGTERM to the workers: finish the step, save, exit 75), the job's
terminationGracePeriodSeconds to finish, then SIGKILL to every process of the run. A second
signal during that grace skips the rest of it. A failed worker restarts every node's workers in place,
as one gang resuming from the last checkpoint, within runPolicy.maxRestarts and its exit-code lists
(tetrad.node.rounds; node 0's log says each restart, and so does the terminal). A node that fails for
good stops the others with a short grace (a gang with a dead rank cannot save). Nothing is left
running, and torchrun's own log tree lives in WORKDIR/torchelastic, not in the temp directory.

This module imports neither torch nor the trainer: the trainer runs in the agents' processes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tetrad.api import InvalidJob, ParallelTrainingJob, ResolvedConfig, contract
from tetrad.api.contract import (
    ENV_JSONL,
    ENV_TERMINATION_LOG,
    EXIT_CONFIG_ERROR,
    EXIT_PREEMPTED,
    METRIC_RESUMED_FROM,
)
from tetrad.api.problems import counted
from tetrad.api.spec import Precision, RunPolicy
from tetrad.api.termination import TerminationMessage
from tetrad.launch.workdir import (
    DirectoryLock,
    Refused,
    appends,
    check_jsonl,
    checkpoint_lock,
    claim_workdir,
    open_jsonl,
    shown,
    write_file,
)
from tetrad.node import rounds
from tetrad.node.bundle import launcher
from tetrad.node.host import memory_bytes, slow_bf16_warning
from tetrad.node.process import has_variable, with_variable
from tetrad.plan.estimate import GiB, count_text
from tetrad.render import names
from tetrad.render.command import node_command
from tetrad.render.env import rounds_env, torchrun_env
from tetrad.render.objects import shutdown_timeout
from tetrad.resolve import resolve

MASTER_ADDR = "127.0.0.1"
FAILED_STOP_GRACE_S = 10.0  # the other nodes of a failed run: nothing to save with a rank gone
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
METRICS_FILE = "metrics.jsonl"  # rank 0's JSON lines in the work directory
SCRAPE_EVERY_S = 0.5  # how often rank 0's endpoint is asked where it started, until it says

# `tetrad run`'s exit codes (its --help and docs/input.md list them): 0 trained, or nothing left to train;
# a node's own code (75, 77, 78, 79, 69, a script's) when one failed; 128 + N when stopped by signal N.
EXIT_REFUSED = 1  # refused before anything started, saying why
EXIT_DEADLINE = 124  # runPolicy.activeDeadlineSeconds passed: every node was stopped (as timeout(1) exits)


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A free TCP port on MASTER_ADDR for a listener torchrun or the rounds open later: below the kernel's
    ephemeral range when there is room, where no outgoing connection on this machine takes it meanwhile
    (one did once, and torchrun's store failed with EADDRINUSE in every round)."""
    try:
        low = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    pick = secrets.SystemRandom()
    for _ in range(64 if low // 2 >= 1024 else 0):
        port = pick.randrange(low // 2, low)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind((MASTER_ADDR, port))
            return port
    with socket.socket() as s:
        s.bind((MASTER_ADDR, 0))
        return int(s.getsockname()[1])


def node_metrics_port(cfg: ResolvedConfig, node: int) -> int:
    """Nodes share this machine: each gets its own block of nprocPerNode metrics ports."""
    return cfg.metrics.port + node * cfg.nproc_per_node


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, without importing torch: the driver's list, cut by
    CUDA_VISIBLE_DEVICES."""
    driver = Path("/proc/driver/nvidia/gpus")
    count = len(list(driver.iterdir())) if driver.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return count if visible is None else min(count, len([d for d in visible.split(",") if d.strip()]))


def preflight(cfg: ResolvedConfig, *, suspended: bool = False) -> tuple[list[str], list[str]]:
    """Errors and warnings about this machine and job, said in the terminal before anything starts.

    A job asking for GPUs is refused on a machine without enough of them (it would silently train on
    CPU), a suspended one as a cluster would hold it; a busy metrics port is a warning (that rank trains
    without its endpoint).
    """
    errors, warnings = [], []
    if cfg.use_gpu and (have := visible_gpus()) < (need := cfg.world_size):
        errors.append(f"spec.resources.gpu: the job needs {need} GPUs here ({counted(cfg.nodes, 'node')} x"
                      f" {cfg.nproc_per_node}), this machine has {have} visible; set resources.gpu: 0 to"
                      " train on CPU with gloo")
    if suspended:
        errors.append("spec.runPolicy.suspend: true keeps the job from running (in a cluster its pods are not"
                      " created); set suspend: false to run it here")
    if not cfg.use_gpu and (short := host_memory_shortfall(cfg, memory_bytes())) is not None:
        errors.append(short)
    if (cfg.script is None and not cfg.use_gpu and cfg.training.precision == Precision.BF16
            and (slow := slow_bf16_warning())):
        warnings.append(slow)
    for node in range(cfg.nodes):
        for local in range(cfg.nproc_per_node):
            port = node_metrics_port(cfg, node) + local
            if (busy := port_in_use(port)) is not None:
                warnings.append(f"spec.metrics.port: port {port} is in use ({busy}): rank"
                                f" {node * cfg.nproc_per_node + local} trains without its metrics endpoint;"
                                " set spec.metrics.port to a free port")
    return errors, warnings


def host_memory_shortfall(cfg: ResolvedConfig, machine_bytes: int | None) -> str | None:
    """A CPU job's every process on this machine, by the planner's estimate, against its memory; None when it
    fits or cannot be told. The estimate leaves out torch's own memory, so a job refused here cannot run."""
    if cfg.predicted_peak_bytes is None or machine_bytes is None:
        return None
    need = cfg.predicted_peak_bytes * cfg.world_size
    if need <= machine_bytes:
        return None
    return (f"spec.resources.memory: the job keeps {need / GiB:.1f} GiB of training state and activations in"
            f" host memory by the planner's estimate ({counted(cfg.world_size, 'process')} x"
            f" {cfg.predicted_peak_bytes / GiB:.1f} GiB), more than this machine's"
            f" {machine_bytes / GiB:.1f} GiB: the kernel's OOM killer would end its processes; use a smaller"
            " model, batch or seqLen, or a cluster")


def port_in_use(port: int) -> str | None:
    """Why `port` cannot be bound here, or None when it is free. SO_REUSEADDR as the metrics server sets it:
    connections of an earlier run in TIME_WAIT (a scrape) do not make the port busy."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def local_command(cfg: ResolvedConfig, workdir: Path) -> list[str]:
    """The pod's command with this interpreter, the launcher and config in `workdir`."""
    return node_command(cfg, python=sys.executable, launcher=[str(workdir / contract.LAUNCHER_FILE)],
                        config_path=str(workdir / contract.CONFIG_FILE))


def run_processes(workdir: Path, rank: int | None = None) -> list[int]:
    """The pids of the run in `workdir` (their environment names its config), or of its worker of `rank`."""
    return [pid for pid in with_variable(contract.ENV_CONFIG, str(workdir / contract.CONFIG_FILE))
            if rank is None or has_variable(pid, "RANK", str(rank))]


def logged_steps(jsonl: Path) -> list[int]:
    """The steps rank 0 has logged to a run's JSON lines so far, in order: none before the file exists; a
    line still being written waits for the next read."""
    try:
        lines = jsonl.read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if "loss" in record:
                steps.append(record["step"])
    return steps


def kill_rank_at(workdir: Path, jsonl: Path, rank: int, step: int, timeout_s: float = 300) -> list[int]:
    """Once rank 0 has logged `step`, SIGKILL the run's worker of `rank` (as a crash or the kernel's OOM
    killer would) and answer the pids killed: for the tests, benchmarks and GPU checks of restarts."""
    deadline = time.monotonic() + timeout_s
    while max(logged_steps(jsonl), default=0) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{jsonl} did not log step {step} within {timeout_s:.0f} s")
        time.sleep(0.05)
    pids = run_processes(workdir, rank)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids


@dataclass
class Agent:
    node: int
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Tail:
    """The complete lines appended to a file since the last read."""

    path: Path
    offset: int = 0

    def read(self) -> bytes:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:  # not written yet, or unreadable for now: the next read tries again
            return b""
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self.offset += len(complete)
        return complete


@dataclass
class Records:
    """Rank 0's JSON lines, read incrementally from the file it appends to."""

    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)

    copy: IO[bytes] | None = None  # --jsonl: each complete line is appended there too
    copy_failed: str | None = None
    tail: Tail = field(init=False)

    def __post_init__(self) -> None:
        self.tail = Tail(self.path)

    def poll(self) -> list[dict[str, Any]]:
        complete = self.tail.read()
        self._copy(complete)
        new = [row for line in complete.splitlines() if (row := _step_row(line)) is not None]
        self.rows += new
        return new

    def _copy(self, data: bytes) -> None:
        if self.copy is None or not data or self.copy_failed is not None:
            return
        try:
            self.copy.write(data)
            self.copy.flush()
        except OSError as e:
            # a full disk, a closed pipe: training goes on, the lines stay in the work directory
            self.copy_failed = e.strerror or str(e)


def _step_row(line: bytes) -> dict[str, Any] | None:
    """A JSON line of a step (an object with an integer `step`); None for anything else."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def exposed_value(text: str, name: str) -> float | None:
    """An unlabelled gauge's value in Prometheus exposition text; None when absent or not a number (NaN)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            with contextlib.suppress(ValueError):
                number = float(value.split()[0])
                return None if math.isnan(number) else number
    return None


@dataclass
class ResumedFrom:
    """Where rank 0 started: the step of the checkpoint it resumed, 0 for a fresh start
    (tetrad_resumed_from_step), asked of its metrics endpoint while it runs, or read from node 0's termination
    message once it ended."""

    port: int | None  # rank 0's metrics endpoint; None when it cannot be asked (its port was busy)
    step: int | None = None
    _next: float = 0.0

    def poll(self) -> int | None:
        if self.step is not None or self.port is None or time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + SCRAPE_EVERY_S
        try:
            with urllib.request.urlopen(f"http://{MASTER_ADDR}:{self.port}/metrics", timeout=1) as answer:
                text = answer.read().decode(errors="replace")
        except (OSError, ValueError):  # not listening yet, or gone
            return None
        return self._found(exposed_value(text, METRIC_RESUMED_FROM))

    def read_termination(self, path: Path) -> int | None:
        if self.step is not None:
            return None
        try:
            figures = TerminationMessage.parse(path.read_text(errors="replace")).figures
        except OSError:
            return None
        return self._found(exposed_value(figures or "", METRIC_RESUMED_FROM))

    def _found(self, value: float | None) -> int | None:
        if value is None:
            return None
        self.step = int(value)
        return self.step


def start_agents(cfg: ResolvedConfig, config_path: Path, workdir: Path, jsonl: Path, *, rdzv_timeout: int,
                 shutdown_timeout: int, policy: RunPolicy, locks: tuple[int, ...] = ()) -> list[Agent]:
    """One node per agent (its supervisor around torchrun), each in its own session so it can be stopped as
    a group; a failure restarts them in place within `policy`'s maxRestarts. Each inherits the run's lock
    descriptors (`locks`): the run's directories stay locked while any node lives."""
    master_port = free_port()
    in_place = rounds_env(policy, host=MASTER_ADDR, port=free_port(), left=policy.max_restarts,
                          token=secrets.token_hex(16))
    threads = max(1, (os.cpu_count() or 1) // cfg.world_size)
    agents = []
    for node in range(cfg.nodes):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
            **torchrun_env(cfg, node_rank=node, master_addr=MASTER_ADDR, master_port=master_port,
                           rdzv_id=names.rendezvous_id(cfg.job_name, None, 0), restart=0,
                           config_path=str(config_path), rdzv_timeout=rdzv_timeout,
                           shutdown_timeout=shutdown_timeout,
                           # Nodes share this machine: give each its own block of metrics ports.
                           metrics_port=node_metrics_port(cfg, node)),
            # torchrun's per-run log tree (by default a torchelastic_* directory left in /tmp).
            "PET_LOG_DIR": str(workdir / "torchelastic" / f"node-{node}"),
            ENV_TERMINATION_LOG: str(termination_path(workdir, node)),
            **in_place,
        }
        if node == 0:
            env[ENV_JSONL] = str(jsonl)
        log = workdir / f"node-{node}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(local_command(cfg, workdir), env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, pass_fds=locks)
        agents.append(Agent(node, proc, log))
    return agents


def termination_path(workdir: Path, node: int) -> Path:
    return workdir / f"node-{node}.termination"


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


def where_it_started(cfg: ResolvedConfig, resumed: int | None) -> str | None:
    """The summary's and the terminal's word on the first step: resumed, fresh, or nothing left to train."""
    if cfg.script is not None:
        return None  # a script resumes as it sees fit
    ckpt = cfg.checkpoint
    if resumed is None:
        return (None if ckpt.enabled and ckpt.resume else "step 0 (checkpointing is off)" if not ckpt.enabled
                else "step 0 (checkpoint.resume is false)")
    if resumed >= cfg.training.steps:
        return (f"nothing to do: the checkpoint in {ckpt.path} is at step {resumed}, at or past the"
                f" {cfg.training.steps} steps to train; raise --steps (or training.steps) to train on")
    return f"resumed from step {resumed} (the checkpoint in {ckpt.path})" if resumed else \
        f"step 0 (no checkpoint in {ckpt.path} yet)"


def _summary(cfg: ResolvedConfig, rows: list[dict[str, Any]], wall_s: float, records: Records, workdir: Path,
             started: str | None, jsonl: Path | None, restarts: list[str]) -> Table:
    table = Table(title=f"tetrad run: {cfg.job_name}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("mesh", f"{cfg.layout.label()} ({counted(cfg.nodes, 'node')} x"
                          f" {counted(cfg.nproc_per_node, 'process')})")
    if cfg.model is not None:
        table.add_row("model", f"{cfg.model.name}, {count_text(cfg.model.num_params())} parameters")
    if cfg.script is not None:
        table.add_row("script", cfg.script.describe())
    if started is not None:
        table.add_row("start", started)
    if rows:
        steady = rows[1:] or rows  # the first step includes warm-up (lazy init, shape inference)
        table.add_row("steps",
                      f"{rows[-1]['step']}" + (f" / {cfg.training.steps}" if cfg.script is None else ""))
        if losses := [r["loss"] for r in rows if r.get("loss") is not None]:
            table.add_row("loss", f"{losses[0]:.4f} → {losses[-1]:.4f}")
        if (tokens := _median(steady, "tokens_per_second")) is not None:
            table.add_row("tokens/s", f"{tokens:,.0f} (median)")
        if (mfu := _median(steady, "mfu")) is not None:
            table.add_row("MFU", f"{mfu:.2%}  ({_median(steady, 'tflops') or 0:.3g} TFLOPS per device)")
        if (step_time := _median(steady, "step_time_s")) is not None:
            table.add_row("step time", f"{step_time:.3f} s (median)")
        if peaks := [r["peak_memory_bytes"] for r in rows
                     if isinstance(r.get("peak_memory_bytes"), int | float)]:
            table.add_row("peak memory", f"{max(peaks) / 2**30:.2f} GiB (rank 0)")
        if isinstance(rows[0].get("startup_s"), int | float):
            table.add_row("start-up",
                          f"{rows[0]['startup_s']:.1f} s (worker start to the end of its first step)")
    if restarts:
        table.add_row("restarts", restarts_row(restarts))
    table.add_row("wall time", f"{wall_s:.1f} s")
    copied = "" if jsonl is None else f", appended to {jsonl}" + (
        f" until it failed: {records.copy_failed}" if records.copy_failed else "")
    table.add_row("metrics", f"{records.path}{copied}")
    table.add_row("logs", str(workdir))
    return table


def restarts_row(restarts: list[str]) -> str:
    """The summary's count of restarts in place, each by its cause, from node 0's restart lines."""
    return f"{len(restarts)} in place: " + "; ".join(r.split(f": {rounds.RESTARTING}")[0] for r in restarts)


def describe_exit(code: int) -> str:
    """A node's exit status in words: 75 `stopped on SIGTERM`, -15 `killed by SIGTERM`, ..."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"{code} (killed by {signal.Signals(-code).name})"
        return f"{code} (killed by signal {-code})"
    return {0: "0 (finished)",
            EXIT_PREEMPTED: f"{EXIT_PREEMPTED} (stopped on SIGTERM, after saving if checkpointing is on)",
            EXIT_CONFIG_ERROR: f"{EXIT_CONFIG_ERROR} (a config error)"}.get(code, str(code))


# The lines of a node's log that say why it failed: the trainer's and the supervisor's own errors, the last
# line of each worker traceback (with or without torchrun's [rankN]: prefix), and torchrun's exit-code
# summary.
_CAUSE = re.compile(r"^\[tetrad(?: rank \d+)?\] .*error|^(?:\[rank\d+\]: )?[\w.]*(?:Error|Exception)\b"
                    r"|^\s*exitcode\s*:", re.IGNORECASE)
# Of those, what a rank that did nothing wrong says once a peer is gone, and torchrun's own wrapping: shown
# only when a log has nothing else.
_CONSEQUENCE = re.compile(r"Connection closed by peer|Connection reset by peer|GLHF|"
                          r"NCCL communicator was aborted|ChildFailedError|SignalException|^\s*exitcode\s*:")


def failure_causes(path: Path) -> tuple[list[str], list[str]]:
    """(the causes a node's log states, the consequences it shows), each in order, without repeats."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return [], []
    found = list(dict.fromkeys(line.strip() for line in lines if _CAUSE.search(line)))
    return [c for c in found if not _CONSEQUENCE.search(c)], [c for c in found if _CONSEQUENCE.search(c)]


def failure_excerpt(path: Path, fallback_lines: int = 40) -> str:
    causes, consequences = failure_causes(path)
    if causes or consequences:
        return "\n".join((causes or consequences)[-20:])
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-fallback_lines:])
    except OSError:
        return ""


def origin_of_failure(failed: Agent, agents: list[Agent]) -> Agent:
    """The node whose log states a cause: the failed one when it does, else the first other that does (a rank
    that only saw its peer vanish often exits first), else the failed one."""
    if failure_causes(failed.log)[0]:
        return failed
    return next((a for a in agents if a is not failed and failure_causes(a.log)[0]), failed)


def run_local(job: ParallelTrainingJob, *, steps: int | None = None, jsonl: Path | None = None,
              workdir: Path | None = None, manifest: Path | None = None) -> int:
    """Run job on this machine. Returns 0 when it trained (or had nothing left to train), EXIT_REFUSED
    when it could not start (said on stderr), the failing node's exit code, EXIT_DEADLINE when
    activeDeadlineSeconds stopped it, or 128 + N when stopped by signal N (130 on Ctrl-C; the parent's
    death counts as SIGHUP, 129). `manifest` is the file the job came from, never written to."""
    console = Console(stderr=True, highlight=False)
    locks: list[DirectoryLock] = []
    try:
        cfg = resolve(job)
        if steps is not None:
            cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": steps})})
        errors, warnings = preflight(cfg, suspended=job.spec.run_policy.suspend)
        if errors:
            raise Refused(*errors)
        if jsonl is not None:
            check_jsonl(jsonl, workdir=workdir, manifest=manifest)
        workdir = claim_workdir(workdir, cfg.job_name)
        locks.append(DirectoryLock(workdir, f"--workdir {shown(workdir)}"))
        if cfg.checkpoint.enabled and (ckpt := checkpoint_lock(cfg.checkpoint.path, workdir)) is not None:
            locks.append(ckpt)
        for lock in locks:
            lock.acquire()
        appending = jsonl is not None and appends(jsonl)
        copy = open_jsonl(jsonl) if jsonl is not None else None
        write_file(workdir, contract.CONFIG_FILE, cfg.to_json().encode())
        write_file(workdir, contract.LAUNCHER_FILE, launcher())
        write_file(workdir, METRICS_FILE, b"")
        for node in range(cfg.nodes):
            termination_path(workdir, node).unlink(missing_ok=True)  # the last run's word is not this one's
    except (InvalidJob, Refused) as e:
        for lock in locks:
            lock.release()
        lines = [str(p) for p in e.problems] if isinstance(e, InvalidJob) else e.lines
        for line in lines:
            console.print(f"error: {line}", markup=False, soft_wrap=True)
        return EXIT_REFUSED
    for line in warnings:  # for a run that starts; a refused one hears only why
        console.print(f"warning: {line}", markup=False, soft_wrap=True)
    try:
        return _run(job, cfg, console, workdir, Records(workdir / METRICS_FILE, copy=copy), jsonl, appending,
                    tuple(lock.fd for lock in locks))
    finally:
        if copy is not None:
            with contextlib.suppress(OSError):
                copy.close()
        for lock in locks:
            lock.release()


def _run(job: ParallelTrainingJob, cfg: ResolvedConfig, console: Console, workdir: Path, records: Records,
         jsonl: Path | None, appending: bool, locks: tuple[int, ...]) -> int:
    steps = None if cfg.script is not None else cfg.training.steps  # a script's steps are its own
    what = f"{steps} steps" if steps is not None else f"script {cfg.script.describe() if cfg.script else ''}"
    console.print(f"tetrad run: {cfg.job_name}: {counted(cfg.nodes, 'node')} x"
                  f" {counted(cfg.nproc_per_node, 'process')}, mesh {cfg.layout.label()}, {what}; logs in"
                  f" {workdir}", markup=False)
    if jsonl is not None:
        console.print(f"metrics: rank 0's JSON lines"
                      f" {'appended to the lines already in' if appending else 'go to'} {jsonl}",
                      markup=False)
    if (started := where_it_started(cfg, None)) is not None:
        console.print(f"start: {started}", markup=False)
    resumed = ResumedFrom(None if cfg.script is not None or port_in_use(node_metrics_port(cfg, 0)) else
                          node_metrics_port(cfg, 0))
    start = time.monotonic()
    policy = job.spec.run_policy
    grace, deadline = policy.termination_grace_period_seconds, policy.active_deadline_seconds
    failed: Agent | None = None
    code = 0
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                        transient=False)
    task = progress.add_task("starting", total=steps)

    node0 = Tail(workdir / "node-0.log")  # its supervisor says when the gang restarts in place
    restarts: list[str] = []

    def show(rows: list[dict[str, Any]]) -> None:
        for line in node0.read().decode(errors="replace").splitlines():
            if rounds.RESTARTING in line:
                restarts.append(line.removeprefix("[tetrad] "))
                console.print(restarts[-1], markup=False, soft_wrap=True)
        if (step := resumed.poll()) is not None and (said := where_it_started(cfg, step)) is not None:
            console.print(f"start: {said}", markup=False)
            progress.update(task, completed=min(step, steps or step), description=said.split(" (")[0])
        for row in rows:
            progress.update(task, completed=row["step"], description=progress_line(row))

    with StopSignals() as signals, progress:
        agents = start_agents(cfg, workdir / contract.CONFIG_FILE, workdir, records.path,
                              rdzv_timeout=job.spec.rendezvous.timeout_seconds,
                              shutdown_timeout=shutdown_timeout(job.spec), policy=job.spec.run_policy,
                              locks=locks)
        try:
            while not signals.poll():
                show(records.poll())
                codes = [a.proc.poll() for a in agents]
                failed = next((a for a, c in zip(agents, codes, strict=True) if c not in (None, 0)), None)
                if failed is not None or all(c == 0 for c in codes):
                    break
                if deadline is not None and time.monotonic() - start > deadline:
                    code = EXIT_DEADLINE
                    break
                time.sleep(0.2)
        finally:
            if signals.poll():
                sig = signals.received[0]
                code, failed = 128 + sig, None
                console.print(f"{sig.name}: stopping every node: SIGTERM now, so each finishes its step,"
                              f" saves if checkpointing is on and exits; SIGKILL after the {grace} s grace"
                              " period (runPolicy.terminationGracePeriodSeconds). Signal again (Ctrl-C) to"
                              " kill them at once, losing what is not saved", markup=False, soft_wrap=True)
                clean = stop_agents(agents, grace, signals)
                if len(signals.received) > 1:
                    console.print(f"{signals.received[1].name} again: killed every node without waiting",
                                  markup=False)
                console.print(_stopped(agents, clean), markup=False, soft_wrap=True)
            elif code == EXIT_DEADLINE:
                failed = None
                console.print(f"spec.runPolicy.activeDeadlineSeconds: {deadline} s passed: stopping every"
                              f" node (SIGTERM, SIGKILL after the {grace} s grace period), as the operator"
                              " fails the job", markup=False, soft_wrap=True)
                console.print(_stopped(agents, stop_agents(agents, grace, signals)), markup=False,
                              soft_wrap=True)
            else:
                stop_agents(agents, FAILED_STOP_GRACE_S)
            show(records.poll())
            # rank 0 may have ended before its endpoint was asked (nothing to do): its termination message
            # says
            if (step := resumed.read_termination(termination_path(workdir, 0))) is not None and \
                    (said := where_it_started(cfg, step)) is not None:
                console.print(f"start: {said}", markup=False)
    started = where_it_started(cfg, resumed.step)
    if failed is not None:
        rc = failed.proc.returncode
        code = rc if rc > 0 else 128 - rc  # -N: killed by signal N
        reason = " (a config error: the job cannot run as written)" if code == EXIT_CONFIG_ERROR else ""
        console.print(f"node {failed.node} exited with code {code}{reason}; the other nodes were stopped.",
                      style="red", markup=False)
        for line in termination_lines(termination_path(workdir, failed.node)):
            console.print(line, markup=False, soft_wrap=True)
        origin = origin_of_failure(failed, agents)
        if origin is not failed:
            console.print(f"node {failed.node} only lost its peers; the cause is in node {origin.node}'s"
                          " log.", markup=False)
        console.print(f"From {origin.log}:", markup=False)
        console.print(failure_excerpt(origin.log), markup=False)
    if records.copy_failed is not None:
        console.print(f"warning: --jsonl {jsonl}: writing failed ({records.copy_failed}); every line is in"
                      f" {records.path}", markup=False, soft_wrap=True)
    console.print(_summary(cfg, records.rows, time.monotonic() - start, records, workdir, started, jsonl,
                           restarts))
    return code


def termination_lines(path: Path) -> list[str]:
    """What a failed node said in its termination message, as the operator would show it: the cause it
    named, the collective that timed out (the peer that did not answer), the nodes its checks failed."""
    try:
        said = TerminationMessage.parse(path.read_text(errors="replace"))
    except OSError:
        return []
    lines = [f"{said.reason}: {said.message}"] if said.reason and said.message else []
    if said.collective_timeout:
        lines.append(f"collective timeout: {said.collective_timeout}")
    lines += [f"preflight: {f.reason}" + (f" (node {f.node}, node rank {f.node_rank})" if f.node else "")
              for f in said.preflight]
    return lines


def _stopped(agents: list[Agent], clean: bool) -> str:
    """`stopped: every node exited 75 (stopped on SIGTERM, ...)`, or each node's exit when they differ."""
    codes = {a.proc.returncode for a in agents}
    exits = (f"every node exited {describe_exit(codes.pop())}" if len(codes) == 1 else
             ", ".join(f"node {a.node} {describe_exit(a.proc.returncode)}" for a in agents))
    return f"stopped: {exits}" + ("" if clean
                                  else " (SIGKILLed: not every node stopped within the grace period)")
