"""The preflight gate's shared pieces: the termination message both sides read, the slow-node rule,
and the renderer's anti-affinity for excluded nodes."""

from __future__ import annotations

import json

from tests.api.helpers import manifest
from tetrad.api import parse
from tetrad.api.contract import ENV_NODE_NAME, TERMINATION_MESSAGE_MAX
from tetrad.api.slow_nodes import slow_nodes
from tetrad.api.termination import NodeFailure, TerminationMessage
from tetrad.render import render
from tetrad.render.objects import avoiding


def termination_message(failures: list[NodeFailure]) -> str:
    return TerminationMessage(preflight=tuple(failures)).encode()


def parse_termination_message(text: str | None) -> list[NodeFailure]:
    return list(TerminationMessage.parse(text).preflight)


def test_the_termination_message_round_trips_and_fits_kubernetes_limit() -> None:
    failures = [NodeFailure("node-a", 1, "cpu: too few"), NodeFailure(None, None, "the all-reduce timed out")]
    assert parse_termination_message(termination_message(failures)) == failures
    many = [NodeFailure(f"node-{i}", i, "x" * 200) for i in range(100)]
    text = termination_message(many)
    assert len(text.encode()) <= TERMINATION_MESSAGE_MAX
    kept = parse_termination_message(text)
    assert 0 < len(kept) < 100 and kept == many[:len(kept)]
    huge = termination_message([NodeFailure("n", 0, "y" * 10000)])
    assert len(huge.encode()) <= TERMINATION_MESSAGE_MAX and parse_termination_message(huge)[0].node == "n"


def test_other_termination_messages_name_no_failure() -> None:
    for text in (None, "", "Error: OOMKilled", json.dumps({"checkpointStep": 4}),
                 json.dumps({"preflight": "x"}), json.dumps([1, 2])):
        assert parse_termination_message(text) == []
    odd = parse_termination_message(json.dumps({"preflight": [{"node": 3, "nodeRank": True}, "junk"]}))
    assert odd == [NodeFailure(None, None, "preflight failed")]


def test_a_node_below_the_fraction_of_the_median_is_slow() -> None:
    bandwidth = {"a": 10.0, "b": 9.0, "c": 11.0, "d": 4.0}  # median 9.5: below 4.75 is slow
    assert slow_nodes(bandwidth, 0.5) == ["d"]
    assert slow_nodes(bandwidth, 0.3) == []
    assert slow_nodes(bandwidth, 0.0) == [], "0 disables the report"
    assert slow_nodes({"a": 1.0}, 0.5) == [], "one node has no peers to be slower than"


def test_pods_avoid_excluded_nodes_in_every_required_term_of_the_users_affinity() -> None:
    users = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]},
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}]}},
        "podAntiAffinity": {"x": 1}}
    out = avoiding(users, ["n2", "n1", "n2"])
    assert out is not None and out["podAntiAffinity"] == {"x": 1}
    terms = out["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 2
    for term in terms:
        assert term["matchFields"] == [{"key": "metadata.name", "operator": "NotIn", "values": ["n1", "n2"]}]
        assert term["matchExpressions"][0]["key"] == "gpu"
    assert "matchFields" not in users["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0], "the spec's affinity is copied, not changed"
    assert avoiding(None, []) is None and avoiding(users, []) == users


def test_rendered_pods_carry_the_exclusion_and_their_node_name() -> None:
    j, problems = parse(manifest())
    assert j is not None, problems
    pods = render(j, restart=1, excluded_nodes=["bad-node"]).pods
    for p in pods:
        (term,) = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert term == {
            "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["bad-node"]}]}
        env = {e["name"]: e for e in p["spec"]["containers"][0]["env"]}
        assert env[ENV_NODE_NAME]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "affinity" not in render(j, restart=0).pods[0]["spec"], "nothing excluded: no affinity"


def test_the_preflight_buffer_must_fit_the_pods_memory_or_the_gpu() -> None:
    from tetrad.resolve import validate_spec

    def fields(**spec: object) -> dict[str, str]:
        job, problems = parse(manifest(**spec))
        assert job is not None, problems
        return {p.field: p.message for p in validate_spec(job.spec) if p.severity == "error"}

    cpu = {"nodes": 1, "nprocPerNode": 4, "parallelism": {"dpShard": 2, "tp": 2, "pp": 1}}
    refused = fields(**cpu, preflight={"allReduceMiB": 1024}, resources={"memory": "3Gi"})
    assert refused.keys() == {"spec.preflight.allReduceMiB"}, refused
    assert refused["spec.preflight.allReduceMiB"].startswith(
        "allReduceMiB=1024 per process x nprocPerNode=4 is 4.0 GiB of host memory, above memory=3Gi; lower "
        "allReduceMiB")
    assert not fields(**cpu, preflight={"allReduceMiB": 512}, resources={"memory": "3Gi"})
    assert not fields(**cpu, preflight={"enabled": False, "allReduceMiB": 1024}, resources={"memory": "3Gi"})
    gpu = {"nodes": 1, "nprocPerNode": 1, "parallelism": {"dpShard": 1, "tp": 1, "pp": 1},
           "model": {"preset": "debug"}, "resources": {"gpu": 1, "gpuMemoryGiB": 2}}
    assert fields(**gpu, preflight={"allReduceMiB": 4096}).keys() == {"spec.preflight.allReduceMiB"}
    assert not fields(**gpu, preflight={"allReduceMiB": 64})
