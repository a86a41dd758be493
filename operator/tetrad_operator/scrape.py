"""Read live training figures from rank 0's Prometheus endpoint into status.training, and its
checkpoint figures into status.checkpoint.

A sample that is not finite (a gauge not set yet: NaN) is left out, so a merge patch of what was
read keeps the last incarnation's figure until this one sets its own: a restart never erases the
last committed checkpoint.
"""

from __future__ import annotations

import math
import statistics
from datetime import UTC, datetime
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tetrad.api.contract import (
    LABEL_REQUEST_TOKEN,
    METRIC_PREFLIGHT_BUS_BANDWIDTH,
    SCRAPED,
    SCRAPED_CHECKPOINT,
    SCRAPED_INTEGERS,
    SCRAPED_REQUEST,
    SCRAPED_TIMES,
    SCRAPED_UNSET_AT_ZERO,
    step_path,
)
from tetrad_operator.state import format_time


def parse(text: str, fields: dict[str, str] = SCRAPED) -> dict[str, Any]:
    """The figures `fields` names (metric -> status key) in a Prometheus text exposition; a sample
    labelled rank="0" wins."""
    return parse_each(text, fields)[0]


def parse_each(text: str, *field_maps: dict[str, str]) -> list[dict[str, Any]]:
    """`parse` for each of `field_maps`, reading the exposition once."""
    samples = _samples(text)
    return [_pick(samples, fields) for fields in field_maps]


def _samples(text: str) -> list[Sample]:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def request_committed(samples: list[Sample]) -> dict[str, Any]:
    """status.checkpoint.requestCommitted: the checkpoint-now token rank 0 served, with the step and
    time of the checkpoint that committed it; empty before the first."""
    out: dict[str, Any] = {}
    for sample in samples:
        key = SCRAPED_REQUEST.get(sample.name)
        token = sample.labels.get(LABEL_REQUEST_TOKEN)
        if key is not None and token and math.isfinite(sample.value):
            out["token"] = token
            out[key] = _value(key, sample.value)
    return out


def preflight(samples: list[Sample]) -> dict[str, Any]:
    """status.preflight from rank 0's preflight gauges (every node's bus bandwidth, labelled node and
    node_rank, and their median); empty while the gate has not reported."""
    nodes: dict[int, dict[str, Any]] = {}
    for sample in samples:
        rank = sample.labels.get("node_rank", "")
        if sample.name == METRIC_PREFLIGHT_BUS_BANDWIDTH and rank.isdigit() and math.isfinite(sample.value):
            nodes[int(rank)] = {"node": sample.labels.get("node") or f"node-rank-{rank}", "nodeRank": int(rank),
                                "busBandwidthGBps": sample.value / 1e9}
    if not nodes:
        return {}
    listed = [nodes[r] for r in sorted(nodes)]
    return {"busBandwidthGBps": statistics.median(n["busBandwidthGBps"] for n in listed), "nodes": listed}


def _pick(samples: list[Sample], fields: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    chosen_rank0: set[str] = set()
    for sample in samples:
        key = fields.get(sample.name) or fields.get(sample.name.removesuffix("_total"))
        if key is None or not math.isfinite(sample.value) or key in chosen_rank0:
            continue
        if key in SCRAPED_UNSET_AT_ZERO and sample.value <= 0:
            continue  # not set yet in this process
        rank0 = sample.labels.get("rank") == "0"
        if key in out and not rank0:
            continue
        out[key] = _value(key, sample.value)
        if rank0:
            chosen_rank0.add(key)
    return out


def _value(key: str, value: float) -> int | float | str:
    if key in SCRAPED_TIMES:
        return format_time(datetime.fromtimestamp(value, UTC))
    return int(value) if key in SCRAPED_INTEGERS else float(value)


def checkpoint(figures: dict[str, Any], checkpoint_path: str | None, restart: int) -> dict[str, Any]:
    """status.checkpoint from the parsed SCRAPED_CHECKPOINT figures of incarnation `restart`: the
    committed step's directory named as the trainer's store names it, and which restart resumed."""
    out = dict(figures)
    if "step" in out and checkpoint_path:
        out["path"] = step_path(checkpoint_path, out["step"])
    if "resumedFrom" in out:
        out["resumedAtRestart"] = restart
    return out


async def fetch(session: aiohttp.ClientSession, host: str, port: int,
                timeout: float) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]] | None:
    """(training figures, checkpoint figures, the checkpoint-now request committed, the preflight
    gate's figures), or None when the endpoint cannot be read in time (never raises)."""
    url = f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as rsp:
            if rsp.status != 200:
                return None
            samples = _samples(await rsp.text())
            return (_pick(samples, SCRAPED), _pick(samples, SCRAPED_CHECKPOINT), request_committed(samples),
                    preflight(samples))
    except (TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError):
        return None
