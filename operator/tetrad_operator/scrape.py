"""Read live training figures from rank 0's Prometheus endpoint into status.training, its checkpoint
figures into status.checkpoint, the preflight gate's into status.preflight, the slowest ranks into
status.stragglers and its account of its time into status.trainerTime.

The contract's SCRAPED tables name the status field each gauge fills; its key and type are the
model's (tetrad_operator.status.field). A sample that is not finite (a gauge not set yet: NaN) is
left out, so a merge patch of what was read keeps the last incarnation's figure until this one sets
its own: a restart never erases the last committed checkpoint.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tetrad.api.contract import (
    LABEL_REQUEST_TOKEN,
    LABEL_ROUND_CAUSE,
    METRIC_PREFLIGHT_BUS_BANDWIDTH,
    METRIC_PREFLIGHT_SECONDS,
    METRIC_RANK_LAG,
    METRIC_RANK_OWN,
    METRIC_RANK_OWN_MEDIAN,
    METRIC_ROUND,
    SCRAPED,
    SCRAPED_CHECKPOINT,
    SCRAPED_REQUEST,
    SCRAPED_TRAINER_TIME,
    SCRAPED_UNSET_AT_ZERO,
    step_path,
)
from tetrad.api.spec import (
    CheckpointRequestStatus,
    CheckpointStatus,
    ParallelTrainingJobStatus,
    PreflightNode,
    PreflightStatus,
    StragglerRank,
    StragglersStatus,
    TrainerAccount,
    TrainerTimeStatus,
    TrainingStatus,
)
from tetrad_operator import status
from tetrad_operator.observed import format_time


class Figures(NamedTuple):
    """What `fetch` reads: each status object's fields, camelCase; empty where nothing was read."""

    training: dict[str, Any]
    checkpoint: dict[str, Any]
    request: dict[str, Any]  # the checkpoint-now request committed
    preflight: dict[str, Any]
    stragglers: dict[str, Any]
    trainer_time: dict[str, Any]


def parse(text: str, fields: Mapping[str, str] = SCRAPED) -> dict[str, Any]:
    """The figures `fields` names (metric -> status field, one of the contract's SCRAPED tables) in a
    Prometheus text exposition, camelCase as stored; a sample labelled rank="0" wins."""
    return parse_each(text, fields)[0]


def parse_each(text: str, *field_maps: Mapping[str, str]) -> list[dict[str, Any]]:
    """`parse` for each of `field_maps`, reading the exposition once."""
    samples = samples_of(text)
    return [_pick(samples, fields) for fields in field_maps]


def samples_of(text: str) -> list[Sample]:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def request_committed(samples: list[Sample]) -> dict[str, Any]:
    """status.checkpoint.requestCommitted: the checkpoint-now token rank 0 served, with the step and
    time of the checkpoint that committed it; empty before the first."""
    token: str | None = None
    values: dict[str, Any] = {}
    for sample in samples:
        path = SCRAPED_REQUEST.get(sample.name)
        label = sample.labels.get(LABEL_REQUEST_TOKEN)
        if path is not None and label and math.isfinite(sample.value):
            token = label
            filled = status.field(path)
            values[filled.name] = _value(filled.kind, sample.value)
    return status.wire(CheckpointRequestStatus(token=token, **values)) if token else {}


def preflight(samples: list[Sample]) -> dict[str, Any]:
    """status.preflight from rank 0's preflight gauges (every node's bus bandwidth, labelled node and
    node_rank, and their median); empty while the gate has not reported."""
    nodes: dict[int, PreflightNode] = {}
    for sample in samples:
        rank = sample.labels.get("node_rank", "")
        if sample.name == METRIC_PREFLIGHT_BUS_BANDWIDTH and rank.isdigit() and math.isfinite(sample.value):
            nodes[int(rank)] = PreflightNode(node=sample.labels.get("node") or f"node-rank-{rank}",
                                             node_rank=int(rank), bus_bandwidth_g_bps=sample.value / 1e9)
    if not nodes:
        return {}
    listed = [nodes[r] for r in sorted(nodes)]
    median = statistics.median(n.bus_bandwidth_g_bps for n in listed)
    return status.wire(PreflightStatus(bus_bandwidth_g_bps=median, nodes=listed))


def stragglers(samples: list[Sample]) -> dict[str, Any]:
    """status.stragglers from rank 0's straggler gauges (the slowest ranks, labelled rank and node, largest
    lag first, and the median rank's own time); empty until rank 0 first gathered them."""
    lag: dict[int, tuple[str, float]] = {}
    own: dict[int, float] = {}
    median: float | None = None
    for sample in samples:
        rank = sample.labels.get("rank", "")
        if not math.isfinite(sample.value):
            continue
        if sample.name == METRIC_RANK_OWN_MEDIAN:
            median = sample.value
        elif sample.name == METRIC_RANK_LAG and rank.isdigit():
            lag[int(rank)] = (sample.labels.get("node", ""), sample.value)
        elif sample.name == METRIC_RANK_OWN and rank.isdigit():
            own[int(rank)] = sample.value
    if not lag:
        return {}
    ranks = [StragglerRank(rank=r, node=node, lag=value, own_seconds=own.get(r))
             for r, (node, value) in sorted(lag.items(), key=lambda kv: (-kv[1][1], kv[0]))]
    return status.wire(StragglersStatus(median_own_seconds=median, ranks=ranks))


def trainer_time(samples: list[Sample]) -> dict[str, Any]:
    """status.trainerTime's figures: rank 0's time account (SCRAPED_TRAINER_TIME), the preflight
    gate's wall time on its slowest node, and the failure that began its round of restarts in place."""
    out = _pick(samples, SCRAPED_TRAINER_TIME)
    gate = [s.value for s in samples if s.name == METRIC_PREFLIGHT_SECONDS and math.isfinite(s.value)]
    if gate:
        out[status.field("trainer_time.preflight_seconds").key] = max(gate)
    cause = next((s.labels[LABEL_ROUND_CAUSE] for s in samples
                  if s.name == METRIC_ROUND and s.labels.get(LABEL_ROUND_CAUSE)), None)
    if cause:
        out[status.field("trainer_time.round_cause").key] = cause
    return out


def previous_round(account: TrainerTimeStatus, stored: TrainerTimeStatus | None) -> TrainerAccount | None:
    """Rank 0's account of the round before `account`'s, when the gang restarted in place: the stored one
    (the last scrape's) of an earlier round of the same incarnation, or the one it kept."""
    if stored is None or stored.restart != account.restart:
        return None
    if (account.round or 0) > (stored.round or 0):
        return stored.account()
    return stored.previous_round if account.round == stored.round else None


def _pick(samples: list[Sample], fields: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    chosen_rank0: set[str] = set()
    for sample in samples:
        metric = sample.name if sample.name in fields else sample.name.removesuffix("_total")
        if metric not in fields or not math.isfinite(sample.value):
            continue
        filled = status.field(fields[metric])
        if filled.key in chosen_rank0 or (metric in SCRAPED_UNSET_AT_ZERO and sample.value <= 0):
            continue  # rank 0's is in; or not set yet in this process
        rank0 = sample.labels.get("rank") == "0"
        if filled.key in out and not rank0:
            continue
        out[filled.key] = _value(filled.kind, sample.value)
        if rank0:
            chosen_rank0.add(filled.key)
    return out


def _value(kind: type, value: float) -> int | float | str:
    """A sample as its status field holds it: a text field holds a Unix time as RFC 3339."""
    if kind is str:
        return format_time(datetime.fromtimestamp(value, UTC))
    return int(value) if kind is int else float(value)


def checkpoint(figures: Mapping[str, Any], checkpoint_path: str | None, restart: int) -> dict[str, Any]:
    """status.checkpoint from the parsed SCRAPED_CHECKPOINT figures of incarnation `restart`: the
    committed step's directory named as the trainer's store names it, and which restart resumed."""
    read = CheckpointStatus.model_validate(figures)
    if read.step is not None and checkpoint_path:
        read.path = step_path(checkpoint_path, read.step)
    if read.resumed_from is not None:
        read.resumed_at_restart = restart
    return status.wire(read)


def status_patch(figures: Figures, checkpoint_path: str | None, restart: int,
                 now: datetime, stored: TrainerTimeStatus | None = None) -> dict[str, Any]:
    """The merge patch of status that writes what a scrape of incarnation `restart` read (`fetch`)
    into status.training, .checkpoint, .preflight and .stragglers, stamped `now`: a field not read
    stays; and status.trainerTime, which it replaces whole (`stored`, the one it replaces, gives its
    previousRound)."""
    training, saved, request, measured, slowest, account = figures
    read = TrainingStatus.model_validate(training)
    read.updated = format_time(now)
    scraped = ParallelTrainingJobStatus(training=read)  # the objects set are the patch's
    if measured:  # the preflight gate's bandwidth, of this incarnation
        scraped.preflight = status.merged(PreflightStatus(restart=restart, updated=read.updated), measured)
    if slowest:  # this incarnation's slowest ranks, at the step rank 0 last logged
        scraped.stragglers = status.merged(StragglersStatus(restart=restart, step=read.step,
                                                            updated=read.updated), slowest)
    committed = CheckpointStatus.model_validate(checkpoint(saved, checkpoint_path, restart))
    if request:
        committed.request_committed = CheckpointRequestStatus.model_validate(request)
    if status.wire(committed):
        scraped.checkpoint = committed
    time_spent = status.merged(TrainerTimeStatus(restart=restart, updated=read.updated), account)
    time_spent.previous_round = previous_round(time_spent, stored)
    return status.wire(scraped) | {status.field("trainer_time").key: status.whole(time_spent)}


def judged_at_once(patch: Mapping[str, Any], held: Mapping[str, Any]) -> bool:
    """Whether the job's loop judges a scrape's status `patch` at once rather than at its next timed pass
    (up to a scrape interval later), against the status `held` before it: a new round of restarts in
    place (counted, with its Event and goodput cut, now), or no step since the last read (rank 0's
    heartbeat did not move: a stall may be due now, and the pass that judges it should not wait)."""
    read_round = (patch.get("trainerTime") or {}).get("round")
    beat = (patch.get("training") or {}).get("lastStepTime")
    return ((isinstance(read_round, int) and read_round > (held.get("round") or 0))
            or (beat is not None and beat == (held.get("training") or {}).get("lastStepTime")))


async def fetch(session: aiohttp.ClientSession, host: str, port: int, timeout: float) -> Figures | None:
    """The Figures read, or None when the endpoint cannot be read in time (never raises)."""
    url = f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as rsp:
            if rsp.status != 200:
                return None
            samples = samples_of(await rsp.text())
            return Figures(_pick(samples, SCRAPED), _pick(samples, SCRAPED_CHECKPOINT),
                           request_committed(samples), preflight(samples), stragglers(samples),
                           trainer_time(samples))
    except (TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError):
        return None
