"""A spare interpreter: Python with torch already imported, that forks the next round's processes.

A restart in place starts torchrun and every worker again, and on a node each of them spends seconds
importing torch before it does anything. So with each round, the supervisor starts a spare for the
next one (`Spare`): a process that imports torch and waits on a Unix socket. When the next round
starts, its torchrun and its workers are relays (`relay`): each sends its command line, environment,
working directory and standard streams to the spare, which forks a child that becomes that process,
as `python ARGS` would run it. The relay passes on every signal it gets and exits as its child did, so
torchrun and the supervisor see the same processes, codes and signals as without a spare; a SIGKILLed
relay takes its child with it. Without a spare to reach, a relay runs its command itself.

The spare is started with the next round's exit directory in its environment, so every process of
that round, forked or not, carries it where `process.kill_all_with` looks (/proc/PID/environ). A spare
serves one round and is killed at its end. It must not touch CUDA (a forked child could not use it):
torch asks NVML, not the driver, whether there is a GPU, and a spare that finds CUDA initialized after
its imports serves nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from tetrad.api.contract import ENV_EXIT_DIR
from tetrad.node.process import die_with_parent

ENV_SPARE_SOCKET = "TETRAD_SPARE_SOCKET"  # where a relay finds the spare; only the round's processes have it
PRELOAD = ("torch", "torch.distributed.run", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "torch.distributed.pipelining")
READY = "spare for the next round ready"  # its log line
STREAMS = (0, 1, 2)
REQUEST_MAX = 1 << 20
RELAYED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                   signal.SIGUSR2)
_SIGNAL = struct.Struct("!i")  # relay -> child: a signal to raise
_NEWS = struct.Struct("!ci")  # spare -> relay: b"S" the child's pid (started), then b"E" its exit code, or
# b"K" the signal that killed it


def launcher() -> list[str]:
    """The arguments after `python` that run this launcher: its zip, or the installed package. The zip's path
    as given, not resolved: in a pod it is a ConfigMap key, whose resolved path changes with the volume."""
    bundle = next((p for p in Path(__file__).parents if p.suffix == ".pyz"), None)
    return [str(bundle)] if bundle is not None else ["-m", "tetrad.node"]


def runnable(args: Sequence[str]) -> bool:
    """Whether a spare can run `python ARGS`: `[-u] -m MODULE ...` or `[-u] FILE ...`, no other options."""
    args = _unbuffered(args)[1]
    if not args:
        return False
    return (args[0] == "-m" and len(args) > 1) or not args[0].startswith("-")


def own_args() -> list[str]:
    """This process's `python ARGS`: sys.orig_argv's (3.10+), else sys.argv (no interpreter options)."""
    orig = getattr(sys, "orig_argv", None)
    return list(orig[1:]) if orig else list(sys.argv)


def _unbuffered(args: Sequence[str]) -> tuple[bool, Sequence[str]]:
    """Whether `python ARGS` asks for unbuffered streams (-u: torchrun's workers), and the rest."""
    return (True, args[1:]) if list(args[:1]) == ["-u"] else (False, args)


class Spare:
    """The next round's spare: its exit directory and socket, and the process behind them."""

    def __init__(self, python: str = sys.executable) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="tetrad-exit-")
        self.exit_dir = self._dir.name
        self._socket_dir = tempfile.TemporaryDirectory(prefix="tetrad-spare-")
        self.socket = os.path.join(self._socket_dir.name, "socket")
        env = {**os.environ, ENV_EXIT_DIR: self.exit_dir, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        # Bound here, so a relay can connect as soon as the round starts: it waits in the backlog until
        # the spare has imported torch and accepts.
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
            listener.bind(self.socket)
            listener.listen(64)
            fd = listener.fileno()
            self.process = subprocess.Popen([python, *launcher(), "spare", str(fd)], env=env,
                                            stdin=subprocess.DEVNULL, pass_fds=(fd,),
                                            preexec_fn=lambda: die_with_parent(signal.SIGKILL))

    def command(self, command: Sequence[str]) -> list[str]:
        """`command` (python ARGS, `runnable`) run by the spare through a relay."""
        return [command[0], *launcher(), "relay", "--", *command[1:]]

    def close(self) -> None:
        """Kill the spare (its round is over: none of its children is left) and remove its files."""
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        self._socket_dir.cleanup()
        self._dir.cleanup()


# The spare's side.

def serve(fd: int) -> int:
    """Import torch, then accept relays on the listening socket `fd`: fork a child for each, and tell it how
    the child ended. Runs until killed; a child returns from here only by raising SystemExit, as a script's
    end would."""
    die_with_parent(signal.SIGKILL)
    listener = socket.socket(fileno=fd)
    began = time.monotonic()
    preload = threading.Thread(target=_preload, name="tetrad-preload")
    preload.start()
    preload.join()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        print("[tetrad] spare: CUDA was initialized while importing, so no child could use it: the round"
              " starts cold", file=sys.stderr, flush=True)
        return 0
    print(f"[tetrad] {READY} (torch imported in {time.monotonic() - began:.1f}s)", file=sys.stderr,
          flush=True)
    ended_r, ended_w = os.pipe()  # SIGCHLD wakes the loop through it: no polling while a round trains
    for fd in (ended_r, ended_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(ended_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    relays: dict[int, socket.socket] = {}
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(ended_r, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj == ended_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(ended_r, 4096)
                    continue
                try:
                    conn, _ = listener.accept()
                except OSError:  # the relay is already gone
                    continue
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError) as e:
                    print(f"[tetrad] spare: a relay's request was unreadable: {e}", file=sys.stderr,
                          flush=True)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (ended_r, ended_w):
                        os.close(fd)
                    selector.close()
                    listener.close()
                    for other in relays.values():
                        other.close()
                    _become(conn, request, fds)  # returns only by raising SystemExit
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):  # a relay gone already: its child follows it
                    conn.send(_NEWS.pack(b"S", pid))
                relays[pid] = conn
            _reap(relays)


def _preload() -> None:
    """Import PRELOAD in this thread at the lowest priority (on Linux a thread's own), so the round that
    runs meanwhile keeps the CPUs; the thread that forks, and so every child, keeps the spare's."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    for module in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(module)


def _receive(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, REQUEST_MAX, len(STREAMS))
    if len(fds) != len(STREAMS):
        for fd in fds:
            os.close(fd)
        raise ValueError(f"{len(fds)} streams, not {len(STREAMS)}")
    return json.loads(data), list(fds)


def _reap(relays: dict[int, socket.socket]) -> None:
    while relays:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = relays.pop(pid, None)
        if conn is None:
            continue
        ended = (_NEWS.pack(b"K", os.WTERMSIG(status)) if os.WIFSIGNALED(status)
                 else _NEWS.pack(b"E", os.waitstatus_to_exitcode(status)))
        with contextlib.suppress(OSError):
            conn.send(ended)
        conn.close()


def _become(conn: socket.socket, request: dict[str, object], fds: list[int]) -> NoReturn:
    """In the forked child: take the relay's streams, environment and directory, then run its command
    as `python ARGS` does. It ends as a script ends: SystemExit, or an uncaught exception's traceback."""
    for stream, fd in enumerate(fds):  # STREAMS, in order
        os.dup2(fd, stream)
        os.close(fd)
    env = request["env"]
    args = request["args"]
    assert isinstance(env, dict) and isinstance(args, list)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(str(request["cwd"]))
    _match_threads()
    threading.Thread(target=_follow_relay, args=(conn,), daemon=True, name="tetrad-relay").start()
    unbuffered, command = _unbuffered(args)
    if unbuffered:
        for text in (sys.stdout, sys.stderr):
            if isinstance(text, io.TextIOWrapper):
                text.reconfigure(write_through=True)
    if command[0] == "-m":
        sys.modules.pop(command[1], None)  # preloaded (torch.distributed.run): runs afresh as __main__
        sys.argv = [command[1], *command[2:]]
        sys.path[0:0] = [os.getcwd()]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(command)
        sys.path[0:0] = [os.path.dirname(os.path.abspath(command[0])) if not command[0].endswith(".pyz")
                         else command[0]]
        runpy.run_path(command[0], run_name="__main__")
    sys.exit(0)


def _match_threads() -> None:
    """torch read OMP_NUM_THREADS when the spare imported it; the child's own value wins, as it would."""
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _follow_relay(conn: socket.socket) -> None:
    """Raise in this process each signal the relay passes on; die when the relay is gone (SIGKILLed)."""
    while True:
        try:
            data = conn.recv(_SIGNAL.size)
        except OSError:
            data = b""
        if len(data) != _SIGNAL.size:
            os.kill(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), _SIGNAL.unpack(data)[0])


# The relay's side.

def relay(path: str, args: Sequence[str], env: dict[str, str]) -> NoReturn:
    """Have the spare at `path` run `python ARGS` with `env`, pass it this process's signals, and end as
    it ended. Without a spare to reach, or one that is gone before it forked, exec `python ARGS` here."""
    die_with_parent(signal.SIGKILL)  # as a worker would: torchrun gone, nobody waits for it
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    request = json.dumps({"args": list(args), "env": env, "cwd": os.getcwd()}).encode()
    try:
        if not runnable(args) or len(request) > REQUEST_MAX:
            raise OSError("not for a spare")
        conn.connect(path)
        socket.send_fds(conn, [request], list(STREAMS))
    except OSError:
        conn.close()
        os.execve(sys.executable, [sys.executable, *args], env)
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        with contextlib.suppress(OSError):  # the child raises it once forked
            conn.send(_SIGNAL.pack(signum))

    for sig in RELAYED_SIGNALS:
        signal.signal(sig, on_signal)
    started = _news(conn)
    if started is None:  # the spare died before it forked: nothing of the command ran yet
        conn.close()
        if received:
            _end_by_signal(received[0])
        os.execve(sys.executable, [sys.executable, *args], env)
    kind, value = _news(conn) or (b"K", int(signal.SIGKILL))  # the spare gone: so is its child
    if kind == b"E":
        sys.stdout.flush()
        os._exit(value)
    _end_by_signal(value)


def _news(conn: socket.socket) -> tuple[bytes, int] | None:
    """The spare's next message, or None when it is gone."""
    try:
        data = conn.recv(_NEWS.size)
    except OSError:
        return None
    if len(data) != _NEWS.size:
        return None
    kind, value = _NEWS.unpack(data)
    return bytes(kind), int(value)


def _end_by_signal(signum: int) -> NoReturn:
    with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    time.sleep(1)
    os._exit(128 + signum)
