"""Every validation rule, each with a failing and a passing case."""

from __future__ import annotations

import pytest

from tests.api.helpers import manifest
from tetrad.api import InvalidJob, parse
from tetrad.resolve import resolve, validate_document

# (name, failing manifest, passing manifest, field named by the problem, words the message must contain)
RULES = [
    ("degree product", manifest(parallelism={"tp": 4}), manifest(),
     "spec.parallelism", ["= 16", "nodes*nprocPerNode = 2*4 = 8", "dpShard: auto"]),
    ("degree >= 1", manifest(parallelism={"cp": 0}), manifest(parallelism={"cp": 1}),
     "spec.parallelism.cp", ["cp=0", ">= 1"]),
    ("tp divides heads", manifest(nodes=1, nprocPerNode=6, parallelism={"pp": 1, "tp": 3, "dpShard": 2},
                                  training={"globalBatch": 6}),
     manifest(nodes=1, nprocPerNode=6, parallelism={"pp": 1, "tp": 2, "dpShard": 3},
              training={"globalBatch": 6}),
     "spec.parallelism.tp", ["tp=3", "heads=8", "kvHeads=4", "[1, 2, 4]"]),
    ("seqLen divisible by tp*2*cp", manifest(model={"seqLen": 102}), manifest(model={"seqLen": 128}),
     "spec.model.seqLen", ["seqLen=102", "tp*2*cp = 2*2*1 = 4", "use seqLen 100 or 104"]),
    ("pipeline stages <= layers + 2",
     manifest(nodes=1, nprocPerNode=8, parallelism={"pp": 8, "dpShard": 1, "tp": 1}),
     manifest(nodes=1, nprocPerNode=6, parallelism={"pp": 6, "dpShard": 1, "tp": 1},
              training={"globalBatch": 6}),
     "spec.parallelism.pp", ["8*1 = 8 stages", "layers=4 + 2", "at most 6 stages"]),
    ("microbatches >= stages", manifest(parallelism={"ppMicrobatches": 1}),
     manifest(parallelism={"ppMicrobatches": 2}),
     "spec.parallelism.ppMicrobatches", ["ppMicrobatches=1", "2 pipeline stages"]),
    ("interleaved needs stages per rank",
     manifest(parallelism={"ppSchedule": "Interleaved1F1B", "ppStagesPerRank": 1}),
     manifest(parallelism={"ppSchedule": "Interleaved1F1B"}), "spec.parallelism.ppStagesPerRank",
     ["Interleaved1F1B", "2"]),
    ("stages per rank within layers + 2",
     manifest(parallelism={"ppSchedule": "Interleaved1F1B", "ppStagesPerRank": 4},
              training={"globalBatch": 12}),
     manifest(parallelism={"ppSchedule": "Interleaved1F1B", "ppStagesPerRank": 3},
              training={"globalBatch": 12}),
     "spec.parallelism.ppStagesPerRank", ["2*4 = 8 stages", "layers=4 + 2"]),
    ("global batch divisible by dp", manifest(training={"globalBatch": 7}),
     manifest(training={"globalBatch": 8}),
     "spec.training.globalBatch", ["globalBatch=7", "dpReplicate*dpShard = 2", "use 8"]),
    ("micro batch divides local batch", manifest(nodes=1, parallelism={"pp": 1, "tp": 2, "dpShard": 2},
                                                 training={"globalBatch": 8, "microBatch": 3}),
     manifest(nodes=1, parallelism={"pp": 1, "tp": 2, "dpShard": 2},
              training={"globalBatch": 8, "microBatch": 2}),
     "spec.training.microBatch", ["microBatch=3", "= 4"]),
    ("pipeline batch splits", manifest(training={"globalBatch": 6}, parallelism={"ppMicrobatches": 2}),
     manifest(training={"globalBatch": 8}, parallelism={"ppMicrobatches": 2}), "spec.training.globalBatch",
     ["= 3", "ppMicrobatches=2", "multiple of 4"]),
    ("kvHeads divides heads", manifest(model={"kvHeads": 3}, parallelism={"tp": 1, "dpShard": 4}),
     manifest(model={"kvHeads": 2}, parallelism={"tp": 1, "dpShard": 4}),
     "spec.model.kvHeads", ["kvHeads=3", "heads=8"]),
    ("dim multiple of heads", manifest(model={"dim": 250}), manifest(model={"dim": 512}), "spec.model.dim",
     ["dim=250", "heads=8"]),
    ("unknown preset", manifest(model={"preset": "gpt5"}), manifest(model={"preset": "debug"}),
     "spec.model.preset", ["gpt5", "llama3-8b"]),
    ("gpu equals nproc", manifest(resources={"gpu": 2}), manifest(resources={"gpu": 4}), "spec.resources.gpu",
     ["gpu=2", "nprocPerNode=4"]),
    ("data path", manifest(data={"source": "tokens"}),
     manifest(data={"source": "tokens", "path": "/data/t.bin"}), "spec.data.path", ["tokens"]),
    ("jsonl path", manifest(data={"source": "jsonl", "tokenizer": "/data/tok"}),
     manifest(data={"source": "jsonl", "path": "/data/train.jsonl", "tokenizer": "/data/tok"}),
     "spec.data.path", ["data.source=jsonl needs data.path"]),
    ("jsonl tokenizer", manifest(data={"source": "jsonl", "path": "/data/train.jsonl"}),
     manifest(data={"source": "jsonl", "path": "/data/train.jsonl", "tokenizer": "/data/tok"}),
     "spec.data.tokenizer",
     ["data.source=jsonl needs a Hugging Face tokenizer", "tokenizer.json and tokenizer_config.json"]),
    ("byte tokenizer needs vocab 256",
     manifest(model={"vocab": 200}, data={"source": "text", "path": "/data/c.txt"}),
     manifest(model={"vocab": 256}, data={"source": "text", "path": "/data/c.txt"}), "spec.model.vocab",
     ["vocab=200 is below the 256 ids of the byte tokenizer", "data.tokenizer: byte, the default",
      "name a Hugging Face tokenizer in data.tokenizer"]),
    ("empty data path", manifest(data={"source": "text", "path": ""}),
     manifest(data={"source": "text", "path": "/data/c.txt"}), "spec.data.path", ["at least 1 character"]),
    ("kueue queue", manifest(gang={"scheduler": "kueue"}),
     manifest(gang={"scheduler": "kueue", "queue": "team-a"}), "spec.gang.queue", ["LocalQueue"]),
    ("topology key", manifest(gang={"topologyKey": "rack label"}),
     manifest(gang={"scheduler": "workload", "topologyKey": "tetrad.dev/rack"}),
     "spec.gang.topologyKey", ["node label key", "tetrad.dev/rack"]),
    ("metrics port range", manifest(metrics={"port": 65534}), manifest(metrics={"port": 9400}),
     "spec.metrics.port", ["65534", "65535"]),
    ("ports collide", manifest(rendezvous={"port": 9401}), manifest(rendezvous={"port": 29500}),
     "spec.rendezvous.port", ["9400..9403"]),
    ("minLr <= lr", manifest(training={"globalBatch": 8, "lr": 1e-4, "minLr": 1e-3}),
     manifest(training={"globalBatch": 8, "lr": 1e-3, "minLr": 1e-4}),
     "spec.training.minLr", ["minLr=0.001"]),
    ("offload needs FSDP", manifest(parallelism={"pp": 2, "dpShard": 1, "dpReplicate": 2},
                                    training={"globalBatch": 8, "fsdp": {"offload": "cpu"}}),
     manifest(training={"globalBatch": 8, "fsdp": {"offload": "cpu"}}), "spec.training.fsdp.offload",
     ["offload=cpu", "dpShard*cp = 1*1 = 1", "dpShard >= 2 or offload: none"]),
    ("bad offload", manifest(training={"fsdp": {"offload": "nvme"}}),
     manifest(training={"fsdp": {"offload": "none"}}), "spec.training.fsdp.offload", ["none", "cpu"]),
    ("collective timeout floor", manifest(runPolicy={"collectiveTimeoutSeconds": 1}),
     manifest(runPolicy={"collectiveTimeoutSeconds": 5}), "spec.runPolicy.collectiveTimeoutSeconds", ["5"]),
    ("always-retried code made permanent", manifest(runPolicy={"permanentExitCodes": [75, 78]}),
     manifest(runPolicy={"permanentExitCodes": [78]}), "spec.runPolicy.permanentExitCodes",
     ["[75]", "always retried"]),
    ("exit code in both lists", manifest(runPolicy={"retryableExitCodes": [3, 77]}),
     manifest(runPolicy={"retryableExitCodes": [3, 77], "permanentExitCodes": [78]}),
     "spec.runPolicy.retryableExitCodes",
     ["[77]", "permanentExitCodes is [77, 78]", "remove it from one of the lists"]),
    ("elastic minNodes within nodes", manifest(nodes=2, elastic={"minNodes": 3}),
     manifest(nodes=2, elastic={"minNodes": 1}), "spec.elastic.minNodes", ["minNodes=3", "nodes=2"]),
    ("elastic on the builtin gang", manifest(nodes=2, elastic={"minNodes": 1}, gang={"scheduler": "volcano"}),
     manifest(nodes=2, elastic={"minNodes": 1}), "spec.elastic", ["gang.scheduler: builtin"]),
    ("elastic minNodes must run",
     manifest(nodes=4, elastic={"minNodes": 3}, parallelism={"dpShard": "auto"}, training={"globalBatch": 8}),
     manifest(nodes=4, elastic={"minNodes": 2}, parallelism={"dpShard": "auto"}, training={"globalBatch": 8}),
     "spec.elastic.minNodes",
     ["at minNodes=3", "globalBatch=8 must be divisible by dpReplicate*dpShard = 3"]),
    ("elastic minNodes the fixed degrees divide",
     manifest(nodes=8, nprocPerNode=1, elastic={"minNodes": 2}, parallelism={"dpShard": "auto"}),
     manifest(nodes=8, nprocPerNode=1, elastic={"minNodes": 4}, parallelism={"dpShard": "auto"}),
     "spec.elastic.minNodes", ["at minNodes=2, tp x cp x pp = 4 does not divide 2 processes; use a"]),
    ("exit code above 255", manifest(runPolicy={"retryableExitCodes": [300]}),
     manifest(runPolicy={"retryableExitCodes": [255]}),
     "spec.runPolicy.retryableExitCodes.0", ["less than or equal to 255", "300"]),
    ("exit code 0", manifest(runPolicy={"permanentExitCodes": [0]}),
     manifest(runPolicy={"permanentExitCodes": [1]}),
     "spec.runPolicy.permanentExitCodes.0", ["greater than or equal to 1"]),
    ("backoff cap below the first delay", manifest(runPolicy={"backoffSeconds": 60, "backoffMaxSeconds": 30}),
     manifest(runPolicy={"backoffSeconds": 60, "backoffMaxSeconds": 60}), "spec.runPolicy.backoffMaxSeconds",
     ["backoffMaxSeconds=30 is below backoffSeconds=60", "at least backoffSeconds"]),
    ("initFrom absolute", manifest(training={"initFrom": "models/hf"}),
     manifest(training={"initFrom": "/models/hf"}),
     "spec.training.initFrom", ["absolute, normalized path", "/models/llama-hf"]),
    ("unknown field", manifest(paralelism={"tp": 2}), manifest(), "spec.paralelism", ["unknown field"]),
    ("bad type", manifest(nodes="two"), manifest(nodes=2), "spec.nodes", ["integer"]),
    ("bad enum", manifest(parallelism={"ppSchedule": "1F2B"}), manifest(parallelism={"ppSchedule": "GPipe"}),
     "spec.parallelism.ppSchedule", ["1F1B"]),
    ("no fitting layout", manifest(nodes=1, nprocPerNode=1,
                                   parallelism={"pp": 1, "tp": "auto", "dpShard": "auto"},
                                   model={"preset": "llama3-70b"}, resources={"gpu": 1, "gpuMemoryGiB": 80},
                                   training={"globalBatch": 1}),
     manifest(nodes=1, nprocPerNode=1, parallelism={"pp": 1, "tp": "auto", "dpShard": "auto"},
              model={"preset": "debug"}, resources={"gpu": 1, "gpuMemoryGiB": 80},
              training={"globalBatch": 1}),
     "spec.parallelism", ["no layout fits 80 GiB", "closest is pp1.dpr1.dps1.cp1.tp1"]),
]


@pytest.mark.parametrize("name,bad,good,field,words", RULES, ids=[r[0] for r in RULES])
def test_rule(name, bad, good, field, words):
    problems = [p for p in validate_document(bad) if p.severity == "error"]
    assert any(p.field == field for p in problems), f"{name}: expected a problem on {field}, got {problems}"
    message = next(str(p) for p in problems if p.field == field)
    for word in words:
        assert word in message, f"{name}: {word!r} not in {message!r}"
    assert [p for p in validate_document(good) if p.severity == "error"] == []


def test_wrong_kind_and_version():
    doc = manifest()
    assert "kind" in str(validate_document({**doc, "kind": "Job"})[0])
    assert "apiVersion" in str(validate_document({**doc, "apiVersion": "tetrad.dev/v2"})[0])
    assert "mapping" in str(validate_document([1, 2])[0])


def test_tp_across_nodes_is_only_a_warning():
    problems = validate_document(
        manifest(nodes=4, nprocPerNode=1, parallelism={"pp": 1, "tp": 2, "dpShard": 2}))
    assert [p.severity for p in problems] == ["warning"]
    assert "spans nodes" in problems[0].message


def test_reshard_after_forward_without_fsdp_is_only_a_warning():
    problems = validate_document(manifest(nodes=1, parallelism={"pp": 1, "tp": 4, "dpShard": 1},
                                          training={"globalBatch": 8,
                                                    "fsdp": {"reshardAfterForward": False}}))
    assert [(p.field, p.severity) for p in problems] == [
        ("spec.training.fsdp.reshardAfterForward", "warning")]
    assert "no effect" in problems[0].message


def test_packing_and_truncate_without_jsonl_are_only_warnings():
    problems = validate_document(manifest(data={"source": "synthetic", "packing": True, "truncate": False}))
    assert [(p.field, p.severity) for p in problems] == [("spec.data.packing", "warning"),
                                                         ("spec.data.truncate", "warning")]
    assert "acts on data.source=jsonl alone, this job reads synthetic data: remove it" in problems[0].message
    jsonl = {"source": "jsonl", "path": "/data/train.jsonl", "tokenizer": "/data/tok", "packing": True,
             "truncate": True}
    assert validate_document(manifest(data=jsonl)) == []


def test_offload_steers_auto_degrees_to_fsdp():
    """With offload the solver skips layouts that shard nothing: tp=auto on 4 processes keeps dpShard > 1."""
    doc = manifest(nodes=1, parallelism={"pp": 1, "tp": "auto", "dpShard": "auto"}, resources={"gpu": 4},
                   training={"globalBatch": 8, "fsdp": {"offload": "cpu"}})
    job, _ = parse(doc)
    assert resolve(job).layout.dp_shard > 1


def test_resolve_raises_with_every_problem():
    job, _ = parse(manifest(parallelism={"tp": 3}, training={"globalBatch": 7}))
    with pytest.raises(InvalidJob) as e:
        resolve(job)
    fields = {p.field for p in e.value.problems}
    assert {"spec.parallelism", "spec.parallelism.tp"} <= fields


def test_resolve_expands_preset_and_overrides():
    job, _ = parse(manifest(model={"preset": "debug", "seqLen": 128}))
    cfg = resolve(job)
    assert (cfg.model.name, cfg.model.seq_len, cfg.model.dim) == ("debug (seqLen 128)", 128, 256)
    assert cfg.layout.label() == "pp2.dpr1.dps2.cp1.tp2"
    assert cfg.pp_microbatches == 2 and cfg.pp_stages_per_rank == 1


def test_a_stall_timeout_not_above_the_collective_timeout_is_a_warning():
    def warnings(**run_policy):
        return [p for p in validate_document(manifest(runPolicy=run_policy)) if p.severity == "warning"]

    (problem,) = warnings(stallTimeoutSeconds=200)
    assert problem.field == "spec.runPolicy.stallTimeoutSeconds"
    assert "stallTimeoutSeconds=200 is not above collectiveTimeoutSeconds=240" in problem.message
    assert warnings(stallTimeoutSeconds=200, collectiveTimeoutSeconds=100) == []
    assert warnings(stallTimeoutSeconds=0) == warnings() == []  # detection off, or the default that follows


def test_checkpoint_warnings():
    def warnings(**checkpoint):
        return [p for p in validate_document(manifest(checkpoint=checkpoint)) if p.severity == "warning"]

    unmounted = warnings(enabled=True, path="/ckpt")
    assert [p.field for p in unmounted] == ["spec.checkpoint.volume"] and "/ckpt" in unmounted[0].message
    assert warnings(enabled=True, path="/ckpt", volume={"persistentVolumeClaim": {"claimName": "c"}}) == []
    mounted_by_template = validate_document(manifest(
        checkpoint={"enabled": True, "path": "/ckpt"},
        template={"volumes": [{"name": "v", "emptyDir": {}}],
                  "volumeMounts": [{"name": "v", "mountPath": "/ckpt"}]}))
    assert mounted_by_template == []
    assert [p.field for p in warnings(enabled=True, keepLast=1, volume={"emptyDir": {}})] == [
        "spec.checkpoint.keepLast"]


def test_checkpoints_on_the_pods_scratch_volume_are_said_to_be_wiped_by_every_restart():
    def warning(path):
        (problem,) = [p for p in validate_document(manifest(checkpoint={"enabled": True, "path": path}))
                      if p.severity == "warning"]
        assert problem.field == "spec.checkpoint.volume"
        return problem.message

    for path, volume, at in (("/tmp/ckpt", "tmp", "/tmp"),
                             ("/home/tetrad/.cache/ckpt", "cache", "/home/tetrad/.cache"),
                             ("/dev/shm", "dshm", "/dev/shm")):
        message = warning(path)
        assert message.startswith(
            f"checkpoints go to {path}, in the pod's own {volume} volume at {at} (an emptyDir"), message
        assert "saves succeed there, but every restart makes new pods, which wipes them" in message, message
        assert "fails the first save" not in message, message
    assert "in memory: the checkpoints count against resources.memory" in warning("/dev/shm/ckpt")
    assert "read-only root filesystem fails the first save" in warning("/tmpx/ckpt")  # not under /tmp
