"""The launcher's command line: `supervise` (a pod's first process) and `worker` (each training process),
and the supervisor's own `spare` and `relay` (tetrad.node.spare).

    python3 tetrad-node.pyz supervise -- python3 -m torch.distributed.run ... tetrad-node.pyz worker ...
    python3 tetrad-node.pyz worker (--trainer | --path FILE | --module MODULE | --command) [--workdir DIR]
        -- ARGS
    python3 tetrad-node.pyz spare FD
    python3 tetrad-node.pyz relay -- PYTHON-ARGS

After `--` come the entry point's arguments; for --command, the executable and all of its arguments.
A worker started with the spare's socket in its environment is a relay of itself.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from tetrad.node import exits, spare
from tetrad.node.environment import NodeEnv, WorkerEnv
from tetrad.node.process import die_with_parent
from tetrad.node.supervisor import supervise
from tetrad.node.worker import Entry, run_worker


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's own arguments, what follows the first --)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def worker_entry(argv: list[str]) -> tuple[Entry, str | None]:
    own, rest = _split(argv)
    p = argparse.ArgumentParser(prog="tetrad-node.pyz worker")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--trainer", action="store_true",
                      help="Tetrad's trainer (python -m tetrad_trainer.train)")
    what.add_argument("--path", help="a Python file, run as __main__")
    what.add_argument("--module", help="a Python module, run as python -m MODULE")
    what.add_argument("--command", action="store_true",
                      help="an executable: the first of the arguments after --")
    p.add_argument("--workdir", help="the working directory")
    a = p.parse_args(own)
    if a.trainer:
        return Entry.trainer(tuple(rest)), a.workdir
    if a.command:
        if not rest:
            p.error("--command needs the executable after --")
        return Entry(command=(rest[0],), args=tuple(rest[1:])), a.workdir
    return Entry(path=a.path, module=a.module, args=tuple(rest)), a.workdir


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb, args = (argv[0], argv[1:]) if argv else ("", [])
    if verb == "supervise":
        die_with_parent(signal.SIGTERM)
        command = _split(args)[1] or args
        if not command:
            print("usage: tetrad-node.pyz supervise -- COMMAND...", file=sys.stderr)
            return 2
        return supervise(command, NodeEnv.read())
    if verb == "worker" and (socket := os.environ.get(spare.ENV_SPARE_SOCKET)):
        env = {k: v for k, v in os.environ.items() if k != spare.ENV_SPARE_SOCKET}
        spare.relay(socket, spare.own_args(), env)
    if verb == "relay":
        return spare.relay(os.environ.get(spare.ENV_SPARE_SOCKET, ""), _split(args)[1], dict(os.environ))
    if verb == "spare" and len(args) == 1 and args[0].isdigit():
        return spare.serve(int(args[0]))
    if verb == "worker":
        entry, workdir = worker_entry(args)
        code = run_worker(entry, WorkerEnv.read(), workdir)
        exits.report_exit(code)
        return code
    print("usage: tetrad-node.pyz supervise -- COMMAND... | worker ENTRY -- ARGS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
