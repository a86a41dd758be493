"""Child processes of a node: none outlives the one that started it, and stop signals reach them.

The supervisor gets SIGTERM when its parent dies (`tetrad run` SIGKILLed), torchrun gets SIGTERM when
the supervisor dies, and a worker gets SIGKILL when torchrun dies (PR_SET_PDEATHSIG), so no process of
a node outlives the one that started it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
ABORT_POLL_S = 0.1


class StopRequested(Exception):
    """A stop signal (its number) that ends what was about to run."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def die_with_parent(sig: signal.Signals) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return


def with_variable(name: str, value: str) -> list[int]:
    """The processes (pids) whose environment has `name`=`value`: those started under it, and theirs."""
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and has_variable(int(entry.name), name, value)]


def has_variable(pid: int, name: str, value: str) -> bool:
    """Whether process `pid`'s environment has `name`=`value` (False once it is gone)."""
    try:
        return f"{name}={value}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def kill_all_with(name: str, value: str, timeout_s: float) -> list[int]:
    """SIGKILL every process whose environment has `name`=`value` until none is left; the pids still there
    after `timeout_s` (stuck in the kernel)."""
    give_up = time.monotonic() + timeout_s
    while (left := with_variable(name, value)) and time.monotonic() < give_up:
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return left


def exit_code(returncode: int) -> int:
    """A process's exit code as a shell reports it: -N (killed by signal N) is 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def run_forwarding(command: list[str], env: dict[str, str] | None = None) -> int:
    """Run `command` as a child that dies with this process; a stop signal (SIGTERM, SIGINT, SIGHUP) is
    passed on as one SIGTERM (a second would interrupt a graceful stop, as torchrun's wait for its
    workers). Returns the child's return code (negative: killed by that signal)."""
    code, _ = _run(command, env, None)
    assert code is not None
    return code


def run_abortable(command: list[str], env: dict[str, str] | None,
                  abort: Callable[[int], float | None] | None,
                  stopped: Callable[[], int | None] = lambda: None) -> int | None:
    """`run_forwarding`, and None when `abort` (asked every ABORT_POLL_S, with the child's pid) said to stop
    the child: it is SIGKILLed, at once when `abort` said 0, else after a SIGTERM and at most that many
    seconds more. A stop signal that came while the child ran or was aborted is raised again once the
    caller's handlers are back: the caller's to act on (a node told to stop does not go on to the next
    round). One the caller's handler already had (`stopped`, read once this function's handlers are in
    place, so none falls between the two) starts no child: StopRequested."""
    code, stopped_by = _run(command, env, abort, stopped)
    if stopped_by is not None:
        signal.raise_signal(stopped_by)
    return code


def _run(command: list[str], env: dict[str, str] | None, abort: Callable[[int], float | None] | None,
         stopped: Callable[[], int | None] = lambda: None) -> tuple[int | None, int | None]:
    """The child's return code (None: aborted), and the first stop signal this process got meanwhile."""
    child: subprocess.Popen[bytes] | None = None
    received: list[int] = []
    forwarded = False

    def forward_once() -> None:
        nonlocal forwarded
        if child is not None and received and not forwarded:
            forwarded = True
            child.send_signal(signal.SIGTERM)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        forward_once()

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        if (signum := stopped()) is not None:
            raise StopRequested(signum)
        child = subprocess.Popen(command, env=env, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        forward_once()  # a signal that came before the child existed
        while True:
            try:
                code: int | None = child.wait(timeout=None if abort is None else ABORT_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if abort is not None and (grace := abort(child.pid)) is not None:
                    forwarded = True  # a stop signal from now on would cut the child's grace short
                    stop(child, grace)
                    code = None
                    break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, received[0] if received else None


def stop(child: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM `child` and give it `grace` seconds to exit (none: SIGKILL at once), then SIGKILL it."""
    if grace > 0:
        child.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=grace)
            return
    child.kill()
    child.wait()
