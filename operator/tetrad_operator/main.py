"""Run the operator: `tetrad operator` calls run_operator(); tests call serve() in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
from typing import Any

import kopf

from tetrad_operator.controller import FINALIZER
from tetrad_operator.settings import OperatorSettings


class NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf builds a deep copy of every watched object on every event to detect spec changes for
    on.create/on.update handlers. The operator has none (it reconciles levels, not diffs), and
    those copies were most of its CPU time with large gangs: skip them."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()


def kopf_settings(config: OperatorSettings) -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    s.persistence.diffbase_storage = NoDiffBase()
    s.peering.lifetime = config.peering_lifetime_seconds
    s.posting.level = logging.WARNING  # our own Events describe the jobs; kopf posts only problems
    s.scanning.disabled = True  # exact namespaces: no RBAC to list namespaces or CRDs
    s.persistence.finalizer = FINALIZER  # kopf's daemons hold it so a job's loop stops before it goes
    s.watching.server_timeout = 300
    s.watching.client_timeout = 330
    s.watching.connect_timeout = 10
    s.networking.request_timeout = 60
    return s


async def serve(namespaces: list[str], all_namespaces: bool, metrics_port: int, peering: str | None,
                standalone: bool, *, config: OperatorSettings | None = None, priority: int | None = None,
                stop_flag: threading.Event | asyncio.Event | None = None,
                ready_flag: threading.Event | asyncio.Event | None = None,
                memo: kopf.Memo | None = None) -> None:
    from tetrad_operator import handlers  # noqa: F401  (registers the handlers)

    memo = memo if memo is not None else kopf.Memo()
    memo.config = config = config or OperatorSettings.from_env()
    memo.namespaces = None if all_namespaces else list(namespaces)
    memo.metrics_port = metrics_port
    await kopf.operator(
        clusterwide=all_namespaces, namespaces=[] if all_namespaces else list(namespaces),
        standalone=True if standalone else None, peering_name=peering, priority=priority,
        settings=kopf_settings(config), memo=memo, stop_flag=stop_flag, ready_flag=ready_flag,
        liveness_endpoint=os.environ.get("TETRAD_OPERATOR_LIVENESS") or None,
    )


def run_operator(namespaces: list[str], all_namespaces: bool, metrics_port: int, peering: str | None,
                 standalone: bool) -> int:
    """The `tetrad operator` command. Returns the process exit code.

    With --peering, replicas elect the active one through kopf's peering object: each takes a
    random priority (or TETRAD_OPERATOR_PRIORITY), the highest runs, the others stay paused
    until its keep-alive expires.
    """
    logging.basicConfig(level=os.environ.get("TETRAD_OPERATOR_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # not one line per handled event
    log = logging.getLogger("tetrad_operator")
    if peering and standalone:
        log.error("--peering and --standalone exclude each other")
        return 2
    if all_namespaces and namespaces:
        log.error("--all-namespaces and --namespace exclude each other")
        return 2
    try:
        config = OperatorSettings.from_env()
    except ValueError as e:
        log.error("%s", e)
        return 2
    priority: int | None = None
    if peering:
        raw = os.environ.get("TETRAD_OPERATOR_PRIORITY")
        priority = int(raw) if raw else random.SystemRandom().randint(1, 2**31 - 1)
        log.info("peering %r with priority %d", peering, priority)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(namespaces, all_namespaces, metrics_port, peering, standalone, config=config,
                              priority=priority))
    except Exception as e:
        if (cause := permanent_cause(e)) is None:
            raise
        log.error("stopped at start-up: %s", cause)  # e.g. an RBAC rule missing (handlers.start)
        return 1
    return 0


def permanent_cause(error: BaseException) -> kopf.PermanentError | None:
    """The kopf.PermanentError a failed start-up handler raised, behind kopf's own wrapper of it."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, kopf.PermanentError):
        cause = cause.__cause__
    return cause


def main(argv: list[str] | None = None) -> Any:
    """`python -m tetrad_operator`: the same flags as `tetrad operator`, without the CLI's dependencies."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tetrad_operator")
    p.add_argument("-n", "--namespace", action="append", default=[])
    p.add_argument("-A", "--all-namespaces", action="store_true")
    p.add_argument("--metrics-port", type=int, default=8080)
    p.add_argument("--peering")
    p.add_argument("--standalone", action="store_true")
    a = p.parse_args(argv)
    if not a.namespace and not a.all_namespaces:
        p.error("give --namespace NAME (repeatable) or --all-namespaces")
    return run_operator(a.namespace, a.all_namespaces, a.metrics_port, a.peering, a.standalone)
