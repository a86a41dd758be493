"""A worker: what torchrun starts in each training process, around the entry point.

    tetrad-node.pyz worker (--trainer | --path FILE | --module MODULE | --command) [--workdir DIR] -- ARGS

In order: die with torchrun; check that the entry point is in the image (else exit 78 naming the
field); give every process group the job's collective timeout; run the preflight gate's gang check
(tetrad.node.gang); then run the entry point in this process, as `python FILE` or `python -m MODULE`
would (a command runs as a child). How it ended becomes the worker's exit code, reported to the node's
supervisor (tetrad.node.exits) with the cause: a CUDA out-of-memory error 77, a collective that timed
out 79, a `sys.exit(n)` n, an uncaught exception 1 after its traceback.

Tetrad's own modules leave the interpreter before the entry point starts: an image that has Tetrad
installed (the trainer, a script using the runtime library) imports its own copy, not the launcher's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import runpy
import shutil
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from tetrad.api.contract import (
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREFLIGHT,
    REASON_ENTRY_POINT,
    REASON_OUT_OF_MEMORY,
)
from tetrad.api.termination import TerminationMessage
from tetrad.node import collective, exits, gang
from tetrad.node.environment import WorkerEnv
from tetrad.node.process import die_with_parent, exit_code, run_forwarding

TRAINER_MODULE = "tetrad_trainer.train"


@dataclass(frozen=True)
class Entry:
    """What a worker runs: exactly one of path, module or command, with its arguments."""

    path: str | None = None
    module: str | None = None
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    field: str = "spec.script"  # what a user changes when it is not in the image

    @classmethod
    def trainer(cls, args: tuple[str, ...] = ()) -> Entry:
        return cls(module=TRAINER_MODULE, args=args, field="spec.image")

    def missing(self) -> str | None:
        """Why the entry point is not in the image, naming the field; None when it is."""
        if self.path is not None:
            if not Path(self.path).is_file():
                return (f"{self.field}.path: {self.path} is not a file in the image"
                        f" (working directory {os.getcwd()})")
        elif self.module is not None:
            try:
                found = importlib.util.find_spec(self.module) is not None
            except ModuleNotFoundError:  # its package is missing
                found = False
            except (ImportError, ValueError) as e:
                return f"{self._module_field()}: {self.module} cannot be imported in the image: {e}"
            if not found:
                return (f"{self._module_field()}: no module {self.module} in the image's Python"
                        f" ({sys.executable})")
        elif self.command:
            exe = self.command[0]
            where = exe if "/" in exe else shutil.which(exe)
            if where is None or not Path(where).is_file():
                return f"{self.field}.command: {exe} is not in the image (PATH={os.environ.get('PATH', '')})"
            if not os.access(where, os.X_OK):
                return f"{self.field}.command: {exe} is not executable"
        return None

    def _module_field(self) -> str:
        if self.module == TRAINER_MODULE and self.field == "spec.image":
            return "spec.image: Tetrad's trainer (tetrad_trainer)"
        return f"{self.field}.module"


def _leave_interpreter() -> None:
    """Forget the launcher's modules and its zip: the entry point imports the image's own Tetrad, if any.
    Paths are compared resolved: in a pod the zip is a ConfigMap key, a symlink into the volume's data."""
    bundle = next((p for p in Path(__file__).resolve().parents if p.suffix == ".pyz"), None)
    if bundle is None:  # run from an installed tetrad (tests, `python -m tetrad.node`): nothing to hide
        return

    def inside(path: str | None) -> bool:
        resolved = Path(path).resolve() if path else None
        return resolved is not None and (resolved == bundle or bundle in resolved.parents)

    for name in [n for n, m in sys.modules.items() if inside(getattr(m, "__file__", None))]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if not inside(p)]


def run_in_process(entry: Entry, env: WorkerEnv) -> int:
    """Run a Python entry point in this process as `python FILE ARGS` or `python -m MODULE ARGS` would."""
    target = entry.path if entry.path is not None else entry.module
    assert target is not None
    sys.argv = [target, *entry.args]
    try:
        if entry.path is not None:
            sys.path.insert(0, str(Path(entry.path).resolve().parent))
            runpy.run_path(entry.path, run_name="__main__")
        else:
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr, flush=True)
        return 1
    except BaseException as e:  # noqa: BLE001 - whatever the entry point raised ends the worker, with its cause
        return ended_by(e, env)


def ended_by(error: BaseException, env: WorkerEnv) -> int:
    """The exit code of a worker whose entry point raised `error`, with the cause left for the supervisor."""
    if type(error).__name__ == "OutOfMemoryError" and type(error).__module__.startswith("torch"):
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        message = (f"rank {env.rank} ran out of device memory: {first}; lower the batch or"
                   " the sequence per device, or shard more")
        print(f"[tetrad] {message}", file=sys.stderr, flush=True)
        exits.leave(TerminationMessage(reason=REASON_OUT_OF_MEMORY, message=message))
        return EXIT_OOM
    traceback.print_exception(type(error), error, error.__traceback__)
    if collective.is_timeout(error):
        rank = env.rank
        timeout = env.node.collective_timeout_s or 0
        try:
            report = collective.report(error, rank, timeout)
        except Exception as e:  # noqa: BLE001 - the process group may be gone: say what is known
            report = {"event": "collective_timeout", "rank": rank, "timeout_s": timeout, "collective": None,
                      "error": f"{error} (no flight recorder: {e})", "not_answering": None}
        collective.log_report(report)
        return EXIT_COLLECTIVE_TIMEOUT
    return 1


def run_command(entry: Entry) -> int:
    """A command that is not Python: a child that gets the stop signals and dies with this worker."""
    return exit_code(run_forwarding([*entry.command, *entry.args]))


def run_worker(entry: Entry, worker: WorkerEnv, workdir: str | None = None) -> int:
    die_with_parent(signal.SIGKILL)  # torchrun gone: nobody waits for this worker any more
    _leave_interpreter()
    if workdir is not None:
        os.chdir(workdir)
    if (why := entry.missing()) is not None:
        print(f"[tetrad] {why}", file=sys.stderr, flush=True)
        exits.leave(TerminationMessage(reason=REASON_ENTRY_POINT, message=why))
        return EXIT_CONFIG_ERROR
    env = worker.node
    if env.collective_timeout_s is not None:
        collective.configure(env.collective_timeout_s)
    if env.preflight is not None:
        try:
            gang.leave_figures(gang.gang_check(env.preflight, worker), worker)
        except gang.PreflightFailed as e:
            print(f"[tetrad] preflight failed on the gang: {e}", file=sys.stderr, flush=True)
            exits.leave(TerminationMessage(preflight=tuple(e.failures)))
            return EXIT_PREFLIGHT
    exits.report_start()
    report_on_exit()
    if entry.command:
        return run_command(entry)
    return run_in_process(entry, worker)


def report_on_exit() -> None:
    """Have os._exit in this process (an entry point's way to skip its teardown) report its code first, as
    a return does: the supervisor reads a worker that ended without a report as killed (tetrad.node.failure).
    A child forked from it (a data loader's worker) exits without reporting."""
    real_exit, worker = os._exit, os.getpid()

    def exit_reported(status: int) -> NoReturn:
        if os.getpid() == worker:
            with contextlib.suppress(OSError):
                exits.report_exit(status)
        real_exit(status)

    os._exit = exit_reported
