"""Child processes of a node: none outlives the one that started it, and stop signals reach them.

The supervisor gets SIGTERM when its parent dies (`tetrad run` SIGKILLed), torchrun gets SIGTERM when
the supervisor dies, and a worker gets SIGKILL when torchrun dies (PR_SET_PDEATHSIG), so no process of
a node outlives the one that started it.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
from types import FrameType

_PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def die_with_parent(sig: signal.Signals) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return


def exit_code(returncode: int) -> int:
    """A process's exit code as a shell reports it: -N (killed by signal N) is 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def run_forwarding(command: list[str], env: dict[str, str] | None = None) -> int:
    """Run `command` as a child that dies with this process; a stop signal (SIGTERM, SIGINT, SIGHUP) is
    passed on as one SIGTERM (a second would interrupt a graceful stop, as torchrun's wait for its
    workers). Returns the child's return code (negative: killed by that signal)."""
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
        child = subprocess.Popen(command, env=env, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        forward_once()  # a signal that came before the child existed
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
