"""Collective timeouts: every process group waits at most spec.runPolicy.collectiveTimeoutSeconds
for a collective's peers; a rank whose collective times out says which collective and which peers
did not answer, then exits EXIT_COLLECTIVE_TIMEOUT (79, retryable).

- gloo (CPU): the collective raises in the training thread. The rank reads torch's flight recorder
  (its last recorded collective: the op, the process group, the sequence number, the sizes),
  publishes that position in the job's TCPStore and waits up to PEER_WAIT_S for the group's other
  ranks to publish theirs: a peer that published no position, or another collective's, did not
  answer. The rank logs one JSON line (`"event": "collective_timeout"`) and leaves its summary for
  the node's supervisor (tetrad.node.exits), which puts the first one in the pod's termination message.
- NCCL (CUDA): the watchdog thread finds the timeout, dumps the flight recorder into the node's exit
  directory (TORCH_NCCL_DUMP_ON_TIMEOUT) and aborts the process; the supervisor reads the dumps,
  logs the same JSON line from each (`not_answering` null: one rank's recorder cannot tell) and exits
  79. This path is not exercised by the tests: they run without a GPU.

Tetrad's trainer and a script under the launcher alike: the worker (tetrad.node.worker) sets the timeout
before the entry point creates its process groups, and reports a timed-out collective that reaches it.
torch is imported inside the functions that use it: the launcher runs without it.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from tetrad.api.contract import ENV_EXIT_DIR
from tetrad.api.termination import TerminationMessage
from tetrad.node import exits

FLIGHT_RECORDER_ENTRIES = "2000"  # collectives each rank remembers (torch's default, made explicit)
PEER_WAIT_S = 10.0  # how long a timed-out rank waits for its peers' positions (at most half the timeout)
DUMP_PREFIX = "nccl-trace-rank-"  # NCCL's flight recorder dump in the exit directory (CUDA)
STORE_PREFIX = "tetrad/collective-timeout"
# What torch says when a collective timed out: gloo's transport, and NCCL's watchdog.
TIMEOUT_MESSAGES = ("Timed out waiting", "Watchdog caught collective operation timeout")


def configure(timeout_s: int) -> timedelta:
    """Before the process group exists: the flight recorder on, NCCL's dump on timeout into the exit
    directory, and `timeout_s` as the default of every process group created from now on (the mesh's,
    its flattened views', the preemption and checkpoint groups'), not only the world's."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    os.environ.setdefault(flight_recorder_variable(torch.__version__), FLIGHT_RECORDER_ENTRIES)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if exit_dir := os.environ.get(ENV_EXIT_DIR):
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(Path(exit_dir) / DUMP_PREFIX))
    timeout = timedelta(seconds=timeout_s)
    # torch gives new_group and split_group its built-in default (30 min gloo, 10 min NCCL), not the world's.
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout  # type: ignore[attr-defined]
    return timeout


def flight_recorder_variable(torch_version: str) -> str:
    """The variable that sizes the flight recorder: torch 2.8 renamed it, and warns on every rank (twice)
    for the old name, which a script's older torch still needs."""
    major, minor = (int(part) for part in re.findall(r"\d+", torch_version)[:2])
    return "TORCH_FR_BUFFER_SIZE" if (major, minor) >= (2, 8) else "TORCH_NCCL_TRACE_BUFFER_SIZE"


def is_timeout(error: BaseException) -> bool:
    """A collective timed out somewhere in `error`'s chain."""
    seen: BaseException | None = error
    while seen is not None:
        if any(m in str(seen) for m in TIMEOUT_MESSAGES):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def last_collective(trace: dict[str, Any]) -> dict[str, Any] | None:
    """The collective a rank waits in: the newest flight-recorder entry not completed (gloo never
    marks one completed: its newest, the one the training thread entered last)."""
    entries = trace.get("entries") or []
    pending = [e for e in entries if e.get("state") != "completed"]
    newest: dict[str, Any] | None = (pending or entries or [None])[-1]
    return newest


def group_of(name: str) -> tuple[str, list[int]]:
    """(description, global ranks) of this process's group called `name`."""
    import torch.distributed.distributed_c10d as c10d

    for pg, pg_name in c10d._world.pg_names.items():
        if pg_name == name:
            return pg.group_desc, sorted(c10d._world.pg_group_ranks[pg])
    return name, []


def position(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {"collective": entry.get("profiling_name"), "group": str(entry["process_group"][0]),
            "sequence": entry.get("collective_seq_id")}


def describe(p: dict[str, Any]) -> str:
    return f"{p['collective']} #{p['sequence']} of group {p['group']}"


def exchange(rank: int, mine: dict[str, Any], peers: list[int], wait_s: float) -> dict[str, Any]:
    """Publish this rank's position; the peers' within `wait_s`: who waits in the same collective,
    who did not answer (no position, or another collective's, in `elsewhere`)."""
    import torch.distributed.distributed_c10d as c10d

    store = c10d.PrefixStore(STORE_PREFIX, c10d._get_default_store())
    store.set(str(rank), json.dumps(mine))
    deadline, theirs = time.monotonic() + wait_s, {}
    while True:
        for peer in peers:
            if peer not in theirs and store.check([str(peer)]):
                theirs[peer] = json.loads(store.get(str(peer)))
        if len(theirs) == len(peers) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    same = [p for p in peers if theirs.get(p) == mine]
    return {"not_answering": [p for p in peers if p not in same], "waiting_too": same,
            "elsewhere": {str(p): describe(theirs[p]) for p in peers if p in theirs and p not in same
                          and theirs[p] is not None}}


def report(error: BaseException, rank: int, timeout_s: float) -> dict[str, Any]:
    """This rank's account of a timed-out collective (gloo): the collective from the flight recorder,
    the peers from the exchange."""
    from torch._C._distributed_c10d import _dump_fr_trace_json

    entry = last_collective(json.loads(_dump_fr_trace_json(True, False)))
    out: dict[str, Any] = {"event": "collective_timeout", "rank": rank, "timeout_s": timeout_s,
                           "error": (str(error).strip().splitlines()[-1][:500] if str(error).strip()
                                     else type(error).__name__)}
    mine = position(entry)
    if entry is None or mine is None:
        return out | {"collective": None, "not_answering": None}
    desc, ranks = group_of(mine["group"])
    out |= {"collective": mine["collective"], "sequence": mine["sequence"], "group": desc,
            "group_ranks": ranks,
            "input_sizes": entry.get("input_sizes"),
            "waited_s": round(time.time() - int(entry["time_created_ns"]) / 1e9, 1)}
    peers = [r for r in ranks if r != rank]
    try:
        out |= exchange(rank, mine, peers, min(PEER_WAIT_S, timeout_s / 2))
    except (RuntimeError, ValueError) as e:  # the store is gone too: the peers cannot be told apart
        out |= {"not_answering": None, "peers_error": str(e).strip().splitlines()[-1][:300]}
    return out


def summary(r: dict[str, Any]) -> str:
    """One line for the job's Event: the collective, its group and the peers that did not answer."""
    if r.get("collective") is None:
        return f"rank {r['rank']}: a collective timed out after {r['timeout_s']:g}s ({r.get('error')})"
    ranks = r.get("group_ranks") or []
    group = f"{r['group']} (ranks {','.join(map(str, ranks))})" if ranks else str(r["group"])
    missing = r.get("not_answering")
    peers = ("not answering: unknown" if missing is None else
             f"not answering: rank {','.join(map(str, missing))}" if missing else
             "every peer waits in it too")
    return f"rank {r['rank']}: {r['collective']} #{r['sequence']} in process group {group} timed out after " \
           f"{r['timeout_s']:g}s; {peers}"


def log_report(r: dict[str, Any]) -> None:
    """The JSON line on the pod log, and the summary for the node's supervisor."""
    print(json.dumps(r), flush=True)
    exits.leave(TerminationMessage(collective_timeout=summary(r)))


def from_dump(path: Path, timeout_s: float | None = None) -> dict[str, Any]:
    """A rank's report from its NCCL flight recorder dump (CUDA: the rank itself aborted)."""
    trace = pickle.loads(path.read_bytes())  # noqa: S301 - written by this node's own worker
    entry = last_collective(trace)
    rank = int(path.name.removeprefix(DUMP_PREFIX))
    mine = position(entry)
    out: dict[str, Any] = {"event": "collective_timeout", "rank": rank, "source": "nccl flight recorder"}
    if entry is None or mine is None:
        return out | {"collective": None, "timeout_s": timeout_s, "not_answering": None}
    config = (trace.get("pg_config") or {}).get(mine["group"]) or {}
    ranks = json.loads(config["ranks"]) if isinstance(config.get("ranks"), str) else []
    return out | {"collective": mine["collective"], "sequence": mine["sequence"],
                  "group": config.get("desc") or entry["process_group"][1], "group_ranks": ranks,
                  "input_sizes": entry.get("input_sizes"), "state": entry.get("state"),
                  "timeout_s": (entry.get("timeout_ms") or 0) / 1000, "not_answering": None}


def dumped(exit_dir: Path) -> dict[int, str]:
    """The supervisor, after torchrun: the summary of each worker that aborted in NCCL (its flight recorder
    dump), by rank, each also logged as that worker's JSON line."""
    found = {}
    for path in exit_dir.glob(f"{DUMP_PREFIX}*"):
        try:
            r = from_dump(path)
        except (OSError, ValueError, KeyError, pickle.UnpicklingError) as e:
            print(f"[tetrad] unreadable flight recorder dump {path.name}: {e}", file=sys.stderr, flush=True)
            continue
        print(json.dumps(r), flush=True)
        found[r["rank"]] = summary(r)
    return found
