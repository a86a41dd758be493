"""Operator tunables, read once from the environment (TETRAD_OPERATOR_<FIELD>).

The lifecycle's own tunables (node loss, stuck deletions, pod creation attempts) and their
defaults live in `lifecycle.Settings`; they are read here under the same prefix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from tetrad_operator.lifecycle import Settings as LifecycleSettings

PREFIX = "TETRAD_OPERATOR_"


@dataclass(frozen=True)
class OperatorSettings:
    resync_seconds: float = 30.0  # reconcile every job at least this often
    # A job's loop waits this long after a wake-up, so a burst of pod events makes one pass; the
    # admission's round waits as long after an ask.
    batch_seconds: float = 0.3
    api_concurrency: int = 16  # parallel API calls (pod creations, deletions, ungates)
    admission_retry_seconds: float = 5.0  # re-try waiting gangs this often even without events
    scrape_interval_seconds: float = 15.0  # read rank 0's metrics this often while Running
    scrape_timeout_seconds: float = 2.0
    scrape_host: str = ""  # tests: read metrics from this host instead of the pod IP
    peering_lifetime_seconds: int = 60  # a silent replica is presumed dead after this long
    lifecycle: LifecycleSettings = field(default_factory=LifecycleSettings)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        """TETRAD_OPERATOR_RESYNC_SECONDS=5, TETRAD_OPERATOR_NODE_LOST_SECONDS=20 etc.; malformed values
        raise ValueError."""
        env = dict(os.environ if env is None else env)
        own = _read(cls(), env, exclude={"lifecycle"})
        return cls(**own, lifecycle=LifecycleSettings(**_read(LifecycleSettings(), env)))


def _read(defaults: Any, env: dict[str, str],
          exclude: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
    """The fields of the dataclass instance `defaults` that the environment sets, typed like their
    defaults."""
    values: dict[str, Any] = {}
    for f in fields(defaults):
        raw = env.get(PREFIX + f.name.upper())
        if f.name in exclude or raw is None:
            continue
        kind = type(getattr(defaults, f.name))
        try:
            values[f.name] = kind(raw)
        except ValueError:
            raise ValueError(f"{PREFIX}{f.name.upper()}={raw!r} is not a valid {kind.__name__}") from None
    return values
