"""The spare interpreter (tetrad.node.spare): a relay's command runs in a child forked from a Python that
already imported torch, and to torchrun and the supervisor the relay is that process: its output, exit
code, signals and death."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tetrad.api.contract import ENV_EXIT_DIR
from tetrad.node.process import with_variable
from tetrad.node.spare import ENV_SPARE_SOCKET, Spare, runnable

# What the relayed script says of itself: torch was imported before it ran (forked from the spare), its
# parent, arguments, environment and directory; then it does what its first argument says.
SCRIPT = """\
import os, signal, sys, time
print("warm" if "torch" in sys.modules else "cold", os.getppid(), sys.argv[1:], os.environ.get("SEEN"),
      os.getcwd(), flush=True)
print("to stderr", file=sys.stderr, flush=True)
what = sys.argv[1]
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "raise":
    raise ValueError("the script failed")
if what == "threads":
    import torch
    print("threads", torch.get_num_threads(), flush=True)
if what == "term":
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(3)))
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(60)
if what == "wait":
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def spare() -> Iterator[Spare]:
    spare = Spare()
    try:
        yield spare
    finally:
        spare.close()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return path


def relay(socket: str, args: list[str], **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tetrad.node", "relay", "--", *args],
                            env={**os.environ, ENV_SPARE_SOCKET: socket, "SEEN": "yes", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def pid_in(path: Path, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, "the relayed script did not start"
        time.sleep(0.05)
    return int(path.read_text())


def gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and b") Z " not in Path(f"/proc/{pid}/stat").read_bytes():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_relayed_script_runs_forked_from_the_spare_as_python_would_run_it(spare: Spare, script: Path,
                                                                           tmp_path: Path) -> None:
    r = relay(spare.socket, [str(script), "exit", "7"])
    out, err = r.communicate(timeout=120)
    assert r.returncode == 7, err
    assert out.split("\n")[0] == f"warm {spare.process.pid} ['exit', '7'] yes {os.getcwd()}"
    assert "to stderr" in err
    cold = subprocess.run([sys.executable, str(script), "exit", "7"], env={**os.environ, "SEEN": "yes"},
                          capture_output=True, text=True, timeout=60)
    assert (cold.returncode, cold.stdout.split()[0]) == (7, "cold"), "the test tells a fork from a start"


def test_a_module_and_the_unbuffered_option_run_in_the_spare_and_other_options_run_as_they_are(
        spare: Spare, script: Path) -> None:
    module = subprocess.run(  # python -m finds the module in the relay's working directory
        [sys.executable, "-m", "tetrad.node", "relay", "--", "-u", "-m", "script", "exit", "4"],
        env={**os.environ, ENV_SPARE_SOCKET: spare.socket}, cwd=script.parent, capture_output=True, text=True,
        timeout=120)
    assert module.returncode == 4 and module.stdout.startswith("warm"), module.stderr
    assert runnable(["-u", str(script)]) and runnable(["-m", "x"]) and not runnable(["-c", "pass"])
    option = relay(spare.socket, ["-c", "import sys; print('torch' in sys.modules); sys.exit(5)"])
    assert option.wait(timeout=60) == 5 and option.communicate()[0].strip() == "False"


def test_an_uncaught_exception_ends_the_relay_with_1_and_the_traceback(spare: Spare, script: Path) -> None:
    r = relay(spare.socket, [str(script), "raise"])
    out, err = r.communicate(timeout=120)
    assert r.returncode == 1
    assert "ValueError: the script failed" in err and out.startswith("warm")


def test_the_childs_thread_count_is_its_own_environments(spare: Spare, script: Path) -> None:
    r = relay(spare.socket, [str(script), "threads"], OMP_NUM_THREADS="1")
    out, err = r.communicate(timeout=120)
    assert r.returncode == 0, err
    assert out.startswith("warm") and "threads 1" in out


def test_a_signal_to_the_relay_reaches_the_child_and_the_relay_exits_as_it_did(
        spare: Spare, script: Path, tmp_path: Path) -> None:
    r = relay(spare.socket, [str(script), "term", str(tmp_path / "pid")])
    child = pid_in(tmp_path / "pid")
    r.send_signal(signal.SIGTERM)
    out, _ = r.communicate(timeout=60)
    assert r.returncode == 3 and "got SIGTERM" in out
    assert gone(child)


def test_a_child_killed_by_a_signal_ends_its_relay_by_the_same_signal(spare: Spare, script: Path,
                                                                     tmp_path: Path) -> None:
    r = relay(spare.socket, [str(script), "wait", str(tmp_path / "pid")])
    os.kill(pid_in(tmp_path / "pid"), signal.SIGKILL)
    assert r.wait(timeout=60) == -signal.SIGKILL, r.communicate()


def test_a_sigkilled_relay_takes_its_child_with_it(spare: Spare, script: Path, tmp_path: Path) -> None:
    r = relay(spare.socket, [str(script), "wait", str(tmp_path / "pid")])
    child = pid_in(tmp_path / "pid")
    r.kill()
    r.wait(timeout=60)
    assert gone(child), "the child outlived its SIGKILLed relay"


def test_the_rounds_processes_carry_its_exit_directory_where_the_supervisor_looks(
        spare: Spare, script: Path, tmp_path: Path) -> None:
    r = relay(spare.socket, [str(script), "wait", str(tmp_path / "pid")])
    try:
        child = pid_in(tmp_path / "pid")
        assert {spare.process.pid, child} <= set(with_variable(ENV_EXIT_DIR, spare.exit_dir))
    finally:
        r.kill()
        r.wait()


def test_without_a_spare_to_reach_the_relay_runs_its_command_itself(script: Path, tmp_path: Path) -> None:
    r = relay(str(tmp_path / "no-spare"), [str(script), "exit", "6"])
    out, err = r.communicate(timeout=120)
    assert r.returncode == 6, err
    assert out.startswith("cold") and "to stderr" in err


def test_a_spare_gone_before_it_forked_leaves_the_relay_to_run_its_command_itself(
        script: Path, tmp_path: Path) -> None:
    path = str(tmp_path / "socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as dying:  # takes the request, then dies
        dying.bind(path)
        dying.listen(1)
        r = relay(path, [str(script), "exit", "6"])
        conn, _ = dying.accept()
        conn.recv(1 << 20)
        conn.close()
    out, err = r.communicate(timeout=120)
    assert r.returncode == 6, err
    assert out.startswith("cold"), "the command did not run, or ran twice"
    assert out.count("cold") == 1


def test_a_closed_spare_leaves_no_process_and_no_file() -> None:
    spare = Spare()
    spare.close()
    assert spare.process.returncode is not None
    assert not Path(spare.socket).parent.exists() and not Path(spare.exit_dir).exists()
