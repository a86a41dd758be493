"""Resource vectors: node allocatable and pod requests in integer units (cpu in millicores)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tetrad.api.quantity import parse_quantity

CPU = "cpu"
MEMORY = "memory"
GPU = "nvidia.com/gpu"
PODS = "pods"


@functools.lru_cache(maxsize=4096)  # every pod event parses its requests; few distinct quantities exist
def to_units(resource: str, value: Any) -> int:
    """A Kubernetes quantity in the integer unit the scheduler compares: millicores for cpu."""
    q = parse_quantity(value)
    return math.ceil(q * 1000) if resource == CPU else math.ceil(q)


@dataclass(frozen=True)
class Resources:
    """An immutable resource vector; missing entries are zero."""

    items: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, values: Mapping[str, int]) -> Resources:
        return cls(tuple(sorted((k, v) for k, v in values.items() if v)))

    @classmethod
    def from_map(cls, quantities: Mapping[str, Any]) -> Resources:
        return cls.of({k: to_units(k, v) for k, v in quantities.items()})

    @functools.cached_property
    def _map(self) -> dict[str, int]:  # a gang plan compares and subtracts these thousands of times
        return dict(self.items)

    def get(self, resource: str) -> int:
        return self._map.get(resource, 0)

    def __sub__(self, other: Resources) -> Resources:
        out = dict(self._map)
        for k, v in other.items:
            out[k] = out.get(k, 0) - v
        return Resources.of(out)

    def fits_in(self, free: Resources) -> bool:
        have = free._map
        for k, v in self.items:  # noqa: SIM110 (a loop is faster than all(): this runs for every node a plan tries)
            if v > have.get(k, 0):
                return False
        return True

    def key(self) -> tuple[int, int, int]:
        """Sort key for first-fit-decreasing: GPUs dominate, then cpu, then memory."""
        return self.get(GPU), self.get(CPU), self.get(MEMORY)


def _sum(maps: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in maps:
        for k, v in m.items():
            out[k] = out.get(k, 0) + to_units(k, v)
    return out


def pod_requests(spec: Mapping[str, Any]) -> Resources:
    """The scheduler's view of a pod's requests: max(sum of containers, largest init container) + overhead.

    A container that sets only limits requests its limits (the API server defaults them so).
    Every pod also takes one of the node's `pods` slots.
    """
    def requests(c: Mapping[str, Any]) -> Mapping[str, Any]:
        r = c.get("resources") or {}
        return {**(r.get("limits") or {}), **(r.get("requests") or {})}

    main = _sum(requests(c) for c in spec.get("containers") or [])
    for init in spec.get("initContainers") or []:
        for k, v in _sum([requests(init)]).items():
            main[k] = max(main.get(k, 0), v)
    for k, v in _sum([spec.get("overhead") or {}]).items():
        main[k] = main.get(k, 0) + v
    main[PODS] = main.get(PODS, 0) + 1
    return Resources.of(main)
