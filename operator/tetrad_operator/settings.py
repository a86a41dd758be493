"""Operator tunables, read once from the environment (TETRAD_OPERATOR_*)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from tetrad_operator.lifecycle import Settings as LifecycleSettings

PREFIX = "TETRAD_OPERATOR_"


@dataclass(frozen=True)
class OperatorSettings:
    resync_seconds: float = 30.0  # reconcile every job at least this often
    batch_seconds: float = 0.05  # gather a burst of pod events into one reconcile
    api_concurrency: int = 16  # parallel API calls (pod creations, deletions, ungates)
    admission_retry_seconds: float = 5.0  # re-try waiting gangs this often even without events
    scrape_interval_seconds: float = 15.0  # read rank 0's metrics this often while Running
    scrape_timeout_seconds: float = 2.0
    scrape_host: str = ""  # tests: read metrics from this host instead of the pod IP
    node_lost_seconds: float = 60.0
    stuck_terminating_seconds: float = 30.0
    node_unknown_seconds: float = 10.0
    peering_lifetime_seconds: int = 60  # a silent replica is presumed dead after this long
    lifecycle: LifecycleSettings = field(default_factory=LifecycleSettings)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        """TETRAD_OPERATOR_RESYNC_SECONDS=5 etc.; unknown or malformed values raise ValueError."""
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        for f in fields(cls):
            if f.name == "lifecycle":
                continue
            raw = env.get(PREFIX + f.name.upper())
            if raw is None:
                continue
            kind = type(getattr(cls(), f.name))
            try:
                values[f.name] = kind(raw)
            except ValueError:
                raise ValueError(f"{PREFIX}{f.name.upper()}={raw!r} is not a valid {kind.__name__}") from None
        s = cls(**values)  # type: ignore[arg-type]
        return cls(**values, lifecycle=LifecycleSettings(  # type: ignore[arg-type]
            node_lost_seconds=s.node_lost_seconds, stuck_terminating_seconds=s.stuck_terminating_seconds,
            node_unknown_seconds=s.node_unknown_seconds))
