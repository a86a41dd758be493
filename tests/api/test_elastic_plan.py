"""An elastic job's sizes (tetrad.plan.elastic): tp, cp and pp kept, the data-parallel degrees shrunk, and the
resolver judging each size."""

from __future__ import annotations

import pytest

from tetrad.api import parse
from tetrad.api.resolved import Layout
from tetrad.plan.elastic import degrees, resized
from tetrad.resolve import resolve

from .helpers import manifest


@pytest.mark.parametrize(("layout", "world", "expected"), [
    (Layout(dp_shard=8), 4, Layout(dp_shard=4)),
    (Layout(dp_replicate=4, dp_shard=2), 4, Layout(dp_replicate=2, dp_shard=2)),  # HSDP keeps its shards
    (Layout(dp_replicate=2, dp_shard=4), 6, Layout(dp_replicate=2, dp_shard=3)),  # or its replicas
    (Layout(dp_replicate=2, dp_shard=4), 5, Layout(dp_replicate=1, dp_shard=5)),
    (Layout(tp=2, pp=2, dp_shard=4), 8, Layout(tp=2, pp=2, dp_shard=2)),
    (Layout(tp=2, cp=2, dp_shard=2), 6, None),  # tp x cp = 4 does not divide 6
])
def test_the_data_parallel_degrees_shrink_and_the_others_stay(layout, world, expected):
    assert degrees(layout, world) == expected


def test_a_resized_job_resolves_with_the_same_global_batch_and_more_accumulation():
    job, problems = parse(manifest(nodes=4, nprocPerNode=2, elastic={"minNodes": 1},
                                   parallelism={"tp": 2, "pp": 1, "dpShard": "auto"},
                                   training={"globalBatch": 8}))
    assert job is not None, problems
    full = resolve(job)
    assert full.layout == Layout(tp=2, dp_shard=4)
    half = resolve(resized(job, full.layout, 2))
    assert (half.nodes, half.layout, half.training.global_batch) == (2, Layout(tp=2, dp_shard=2), 8)
    assert resized(job, full.layout, 4) is job
