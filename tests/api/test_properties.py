"""Property-based tests over random specs."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.helpers import rendered_env
from tetrad.api import parse
from tetrad.render import render
from tetrad.resolve import validate_document

degree = st.one_of(st.sampled_from([1, 1, 2, 4, 8, 3]), st.just("auto"), st.integers(-2, 64))


@st.composite
def documents(draw):
    spec = {
        "nodes": draw(st.integers(1, 8)),
        "nprocPerNode": draw(st.sampled_from([1, 2, 4, 8])),
        "parallelism": {k: draw(degree) for k in ("dpReplicate", "dpShard", "tp", "cp", "pp")}
        | {"ppSchedule": draw(st.sampled_from(["GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble"]))},
        "model": {
            "preset": draw(st.sampled_from(["debug", "llama3-125m", "llama3-1b", "llama3-8b", "nope"]))},
        "training": {"globalBatch": draw(st.integers(1, 64)), "microBatch": draw(st.integers(1, 4))},
        "resources": {"gpu": draw(st.sampled_from([0, 0, 1, 8]))},
        "gang": {"scheduler": draw(st.sampled_from(["builtin", "volcano", "coscheduling", "kueue"])),
                 "queue": "q"},
    }
    if draw(st.booleans()):
        spec["parallelism"]["ppMicrobatches"] = draw(st.integers(-1, 16))
    if draw(st.booleans()):
        spec["model"]["seqLen"] = draw(st.integers(-1, 4096))
    return {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
            "metadata": {"name": "p", "namespace": "n", "uid": "u"}, "spec": spec}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
def test_validation_never_crashes_and_admitted_jobs_render(doc):
    problems = validate_document(doc)
    if any(p.severity == "error" for p in problems):
        return
    job, _ = parse(doc)
    rendered = render(job)
    spec = job.spec
    ranks = sorted(int(p["metadata"]["labels"]["tetrad.dev/node-rank"]) for p in rendered.pods)
    assert ranks == list(range(spec.nodes))
    env_ranks = sorted(int(next(e["value"] for e in p["spec"]["containers"][0]["env"]
                                if e["name"] == "PET_NODE_RANK"))
                       for p in rendered.pods)
    assert env_ranks == list(range(spec.nodes))
    layout = rendered.config.layout
    for rank in range(spec.nodes):
        env = rendered_env(rendered, rank)
        assert int(env["WORLD_SIZE"]) == math.prod(layout.shape) == spec.nodes * spec.nproc_per_node
    assert len({p["metadata"]["name"] for p in rendered.pods}) == spec.nodes
