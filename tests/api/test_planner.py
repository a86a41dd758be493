"""The auto-degree solver's rules and the planner's estimates."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from tests.api.helpers import manifest
from tetrad.api import InvalidJob, Layout, parse
from tetrad.api.accelerators import ACCELERATORS
from tetrad.api.presets import PRESETS
from tetrad.api.resolved import ModelConfig
from tetrad.api.spec import ActivationCheckpointing, Precision
from tetrad.cli.report import plan_job, print_plan
from tetrad.plan.estimate import FSDP, GiB, Workload, count_text, estimate
from tetrad.plan.solver import CLEARLY_FASTER
from tetrad.plan.timing import (
    HOST,
    HOST_ADAMW_PARAMS_PER_S,
    HOST_LINK_GBPS,
    MATMUL_EFFICIENCY,
    OVERLAPPED,
    attention_efficiency,
    crosses_nodes,
    step_time,
)
from tetrad.resolve import check_spec, resolve

AUTO = {"dpReplicate": "auto", "dpShard": "auto", "tp": "auto", "cp": "auto", "pp": "auto"}


def solved(**spec):
    spec.setdefault("parallelism", AUTO)
    job, problems = parse(manifest(**spec))
    assert job is not None, problems
    return resolve(job).layout


def model(name):
    return ModelConfig(name=name, **PRESETS[name])


def test_small_model_gets_pure_fsdp():
    layout = solved(nodes=2, nprocPerNode=8, model={"preset": "llama3-8b"}, resources={"gpu": 8},
                    training={"globalBatch": 32})
    assert layout == Layout(dp_shard=16)


def test_tp_stays_inside_a_node():
    # one sample per DP rank at most: 64 processes with globalBatch 8 need 8-way model parallelism
    layout = solved(nodes=8, nprocPerNode=8, model={"preset": "llama3-8b"}, resources={"gpu": 8},
                    training={"globalBatch": 8})
    assert layout.tp <= 8 and layout.dp <= 8 and layout.world_size == 64


def test_pp_only_when_the_model_does_not_fit():
    # FSDP already shards weights, grads and optimizer over every rank, so PP stays off while the model fits
    assert solved(nodes=4, nprocPerNode=8, model={"preset": "llama3-70b", "seqLen": 4096},
                  resources={"gpu": 8},
                  training={"globalBatch": 32, "activationCheckpointing": "full"}).pp == 1
    # with the data-parallel degrees fixed to 1 (no FSDP), a 70B model needs pipeline stages on top of tp=8
    layout = solved(nodes=4, nprocPerNode=8, model={"preset": "llama3-70b", "seqLen": 4096},
                    resources={"gpu": 8}, parallelism={**AUTO, "dpShard": 1, "dpReplicate": "auto", "cp": 1},
                    training={"globalBatch": 8, "activationCheckpointing": "full"})
    assert layout.pp > 1 and layout.tp == 8


def test_nothing_fits_names_the_closest_layout():
    job, _ = parse(manifest(nodes=1, nprocPerNode=8, parallelism=AUTO, model={"preset": "llama3-70b"},
                            resources={"gpu": 8},
                            training={"globalBatch": 8, "activationCheckpointing": "full"}))
    with pytest.raises(InvalidJob, match=r"no layout fits 80 GiB .* the closest is pp\d"):
        resolve(job)


def reason(**spec):
    """The planner's one error about the layout (`spec.parallelism` or its explicit layout's no-fit)."""
    job, problems = parse(manifest(**spec))
    assert job is not None, problems
    report = plan_job(job)
    assert not report["fits"] and "problems" in report, report
    return report["reason"] or report["problems"][0]


def test_no_fit_advice_when_the_model_state_alone_does_not_fit():
    # 70B on two 40 GiB GPUs: parameters, gradients and AdamW alone are over, whatever the activations
    text = reason(nodes=1, nprocPerNode=2, parallelism={"pp": "auto", "tp": "auto", "dpShard": "auto"},
                  model={"preset": "llama3-70b"}, resources={"gpu": 2, "gpuMemoryGiB": 40},
                  training={"globalBatch": 2})
    assert "optimizer state alone take" in text and "cannot make it fit" in text
    assert "add nodes" in text and "offload: cpu" in text and "set activationCheckpointing" not in text


def test_no_fit_advice_when_the_activations_put_it_over():
    text = reason(nodes=1, nprocPerNode=1, parallelism=AUTO, model={"preset": "debug", "seqLen": 131072},
                  resources={"gpu": 1, "gpuMemoryGiB": 2}, training={"globalBatch": 2, "microBatch": 2})
    assert "the activations" in text and "set activationCheckpointing: full (now none)" in text
    assert "lower microBatch (now 2)" in text and "alone take" not in text


@pytest.mark.parametrize(("schedule", "advice"),
                         [("1F1B", "raise ppMicrobatches (now 2)"), ("GPipe", "ppSchedule 1F1B")])
def test_no_fit_advice_under_a_pipeline_names_its_microbatches_not_microbatch(schedule, advice):
    text = reason(nodes=1, nprocPerNode=2, parallelism={"pp": 2, "dpShard": 1, "ppSchedule": schedule},
                  model={"preset": "debug", "seqLen": 131072}, resources={"gpu": 2, "gpuMemoryGiB": 2},
                  training={"globalBatch": 2, "microBatch": 1, "activationCheckpointing": "full"})
    assert "needs" in text and advice in text and "microBatch" not in text.replace("ppMicrobatches", "")
    assert "set activationCheckpointing" not in text, "it is full already"


@pytest.mark.parametrize(("spec", "named"), [
    ({"nprocPerNode": 4, "parallelism": {"pp": 1, "tp": 3, "dpShard": "auto"}}, "tp=1 or 2 or 4"),
    ({"nprocPerNode": 4, "parallelism": {"pp": 1, "tp": 1, "dpShard": "auto"},
      "training": {"globalBatch": 7}},
     "globalBatch=4 or 8"),
    ({"nprocPerNode": 6, "parallelism": {"pp": 1, "tp": 3, "dpShard": "auto"},
      "training": {"globalBatch": 7}},
     "tp=2 with globalBatch=6 or 9"),
])
def test_no_layout_names_the_nearest_values_that_would_give_one(spec, named):
    text = reason(nodes=1, **spec)
    assert "no layout of 1x" in text and "any one of these would give one" in text and named in text, text


def test_plan_json_keeps_the_problems_when_nothing_fits():
    job, _ = parse(manifest(nodes=1, nprocPerNode=2,
                            parallelism={"pp": "auto", "tp": "auto", "dpShard": "auto"},
                            model={"preset": "llama3-70b"}, resources={"gpu": 2, "gpuMemoryGiB": 40},
                            training={"globalBatch": 2}))
    assert job is not None
    report = plan_job(job)
    assert report["layout"] is None and report["problems"][0].startswith(
        "spec.parallelism: no layout fits 40 GiB")


def test_plan_prints_sizes_in_readable_units():
    assert [count_text(n) for n in (950, 4_196_608, 125e6, 8.03e9, 405.8e9, 1.2e12)] == [
        "950", "4.2M", "125M", "8.03B", "406B", "1.2T"]
    job, _ = parse(manifest())
    assert job is not None
    console = Console(record=True, width=200)
    print_plan(plan_job(job), console)
    assert "debug, 4.2M params" in console.export_text()


def test_cp_for_long_sequences():
    short = solved(nodes=1, nprocPerNode=8, model={"preset": "llama3-8b", "seqLen": 4096},
                   resources={"gpu": 8}, training={"globalBatch": 8, "activationCheckpointing": "full"})
    long = solved(nodes=1, nprocPerNode=8, model={"preset": "llama3-8b", "seqLen": 131072},
                  resources={"gpu": 8}, training={"globalBatch": 8, "activationCheckpointing": "full"})
    assert short.cp == 1 and long.cp > 1


def test_explicit_degrees_are_kept():
    job, _ = parse(manifest(parallelism={"pp": 2, "tp": 2, "dpShard": "auto"}))
    assert resolve(job).layout == Layout(pp=2, tp=2, dp_shard=2)


def test_memory_shrinks_with_sharding_and_checkpointing():
    m = model("llama3-8b")
    w = Workload(global_batch=16, micro_batch=1)
    one = estimate(m, Layout(dp_shard=1), w)
    eight = estimate(m, Layout(dp_shard=8), w)
    assert eight.params_bytes == pytest.approx(one.params_bytes / 8)
    assert eight.optimizer_bytes == pytest.approx(2 * eight.params_bytes)
    full = estimate(m, Layout(dp_shard=8), Workload(16, 1, ac=ActivationCheckpointing.FULL))
    sel = estimate(m, Layout(dp_shard=8), Workload(16, 1, ac=ActivationCheckpointing.SELECTIVE))
    assert full.activations_bytes < sel.activations_bytes < eight.activations_bytes
    assert full.hardware_flops == pytest.approx(eight.model_flops * 4 / 3)
    tp = estimate(m, Layout(dp_shard=4, tp=2), w)
    assert "tp" in tp.comm_bytes and tp.activations_bytes < eight.activations_bytes


def test_params_and_flops_match_known_sizes():
    assert model("llama3-8b").num_params() / 1e9 == pytest.approx(8.03, abs=0.01)
    assert model("llama3-70b").num_params() / 1e9 == pytest.approx(70.55, abs=0.05)
    m = model("llama3-8b")
    n = m.num_params(include_embedding=False)
    assert m.flops_per_token(2048) == pytest.approx(6 * n + 12 * 32 * 32 * 128 * 2048)


def test_total_flops_independent_of_layout():
    m = model("llama3-1b")
    w = Workload(global_batch=16, micro_batch=1, precision=Precision.BF16)
    a, b = estimate(m, Layout(dp_shard=8), w), estimate(m, Layout(dp_shard=2, tp=4), w)
    assert a.model_flops * 8 == pytest.approx(b.model_flops * 8)
    assert a.peak_bytes / GiB < 80


def test_groups_cross_nodes_only_past_the_node():
    layout = Layout(tp=8, dp_shard=8)  # 8 nodes x 8: TP inside a node, FSDP across nodes
    assert not crosses_nodes(layout, "tp", 8) and crosses_nodes(layout, FSDP, 8)
    one_node = Layout(tp=2, cp=2, dp_shard=2)
    assert not any(crosses_nodes(one_node, dim, 8) for dim in ("tp", "cp", FSDP))
    assert crosses_nodes(Layout(pp=2, tp=4), "pp", 4) and not crosses_nodes(Layout(pp=2, tp=4), "tp", 4)


def test_step_time_charges_network_speed_and_exposes_only_model_parallel_traffic():
    cfg = model("llama3-8b")
    w = Workload(global_batch=16, micro_batch=1)
    h100 = ACCELERATORS["H100"]
    inside, across = (
        step_time(estimate(cfg, Layout(tp=2, dp_shard=8), w), w, n, "H100", h100, 1.0) for n in (16, 8))
    assert across.comm_s[FSDP] == pytest.approx(
        inside.comm_s[FSDP] * h100.intra_node_gbps / h100.inter_node_gbps)
    assert inside.comm_s["tp"] == across.comm_s["tp"]  # TP stays inside the node either way
    # FSDP traffic hides behind compute; TP traffic is on the critical path
    assert inside.exposed_comm_s == pytest.approx(inside.comm_s["tp"])
    assert across.exposed_comm_s == pytest.approx(
        max(across.comm_s[FSDP] - across.compute_s, 0) + across.comm_s["tp"])
    est = estimate(cfg, Layout(tp=2, dp_shard=8), w)
    assert inside.compute_s == pytest.approx(
        (est.hardware_flops - est.attention_flops) / (989e12 * MATMUL_EFFICIENCY)
        + est.attention_flops / (989e12 * attention_efficiency(cfg.seq_len))
        + (est.elementwise_bytes + est.optimizer_step_bytes) / 3350e9)


def test_offload_adds_overlapped_host_copies_and_a_cpu_optimizer_step():
    cfg = model("llama3-8b")
    h100 = ACCELERATORS["H100"]
    w, off = Workload(global_batch=16, micro_batch=1), Workload(global_batch=16, micro_batch=1, offload=True)
    kept, moved = (step_time(estimate(cfg, Layout(dp_shard=8), x), x, 8, "H100", h100, 1.0) for x in (w, off))
    shard_params = cfg.num_params() / 8
    # per microbatch (2): the fp32 shard in for the forward's and the backward's all-gathers, the fp32
    # gradient out
    assert moved.comm_s[HOST] == pytest.approx(2 * 3 * 4 * shard_params / (HOST_LINK_GBPS * 1e9))
    assert HOST in OVERLAPPED and HOST not in kept.comm_s
    assert (moved.host_optimizer_s == pytest.approx(shard_params / HOST_ADAMW_PARAMS_PER_S)
            and kept.host_optimizer_s == 0)
    hidden = moved.comm_s[FSDP] + moved.comm_s[HOST]
    assert moved.total_s == pytest.approx(
        moved.compute_s + max(hidden - moved.compute_s, 0) + moved.host_optimizer_s)


def test_pipeline_bubble_shrinks_with_microbatches():
    cfg = model("llama3-8b")
    bubbles = []
    for n_micro in (4, 16):
        w = Workload(global_batch=16, micro_batch=1, pp_microbatches=n_micro)
        t = step_time(estimate(cfg, Layout(pp=4, dp_shard=2), w), w, 8, "H100", ACCELERATORS["H100"], 1.0)
        bubbles.append(t.bubble_s / t.compute_s)
    assert bubbles == pytest.approx([3 / 4, 3 / 16])


def test_model_parallelism_only_when_clearly_faster():
    # 70B over 64 GPUs: pure FSDP moves the whole model across the network for every microbatch,
    # and TP inside the node pays for itself; 8B over 16 GPUs stays pure FSDP.
    job, problems = parse(manifest(nodes=8, nprocPerNode=8, parallelism=AUTO, model={"preset": "llama3-70b"},
                                   resources={"gpu": 8, "gpuType": "H100"},
                                   training={"globalBatch": 64, "activationCheckpointing": "full"}))
    assert job is not None, problems
    solution = check_spec(job.spec).solution
    assert solution is not None and solution.layout is not None and solution.time is not None
    assert solution.layout.pp == 1 and 1 < solution.layout.tp <= 8
    fsdp_only = check_spec(job.spec.model_copy(update={"parallelism": job.spec.parallelism.model_copy(
        update={"tp": 1, "cp": 1, "pp": 1})})).solution
    assert fsdp_only is not None and fsdp_only.time is not None
    assert solution.time.total_s * (1 + CLEARLY_FASTER) < fsdp_only.time.total_s
    assert solved(nodes=2, nprocPerNode=8, model={"preset": "llama3-8b"}, resources={"gpu": 8},
                  training={"globalBatch": 32}) == Layout(dp_shard=16)


def test_cpu_jobs_have_no_time_model():
    job, problems = parse(manifest(nodes=1, nprocPerNode=4, parallelism=AUTO))
    assert job is not None, problems
    solution = check_spec(job.spec).solution
    assert solution is not None and solution.time is None and solution.layout == Layout(dp_shard=4)


def test_offload_fits_a_model_whose_sharded_state_does_not_and_the_pod_must_hold_it():
    """70B on 8 x 80 GiB: 16 bytes per parameter / 8 is 140 GB per GPU; offloaded it sits in host memory."""
    spec = {"nodes": 1, "nprocPerNode": 8, "parallelism": AUTO, "model": {"preset": "llama3-70b"},
            "resources": {"gpu": 8}, "training": {"globalBatch": 8, "activationCheckpointing": "full"}}
    job, _ = parse(manifest(**spec))
    assert not check_spec(job.spec).ok  # as test_nothing_fits_names_the_closest_layout
    offloaded = {**spec, "training": {**spec["training"], "fsdp": {"offload": "cpu"}}}
    job, _ = parse(manifest(**offloaded))
    checked = check_spec(job.spec)
    assert checked.ok, checked.problems
    est = checked.solution.estimate
    # no model parallelism needed: the device holds gathered blocks and activations
    assert est.layout == Layout(dp_shard=8)
    assert est.params_bytes == est.grads_bytes == est.optimizer_bytes == 0
    assert est.host_bytes == pytest.approx(16 * model("llama3-70b").num_params() / 8)
    job, _ = parse(manifest(**{**offloaded, "resources": {"gpu": 8, "memory": "512Gi"}}))
    problems = [p for p in check_spec(job.spec).problems if p.severity == "error"]
    assert [p.field for p in problems] == ["spec.resources.memory"]
    assert ("offload=cpu keeps its sharded parameters, gradients and AdamW state in host memory"
            in problems[0].message)
    assert "GiB per pod (8 processes), above memory=512Gi" in problems[0].message
    job, _ = parse(manifest(**{**offloaded, "resources": {"gpu": 8, "memory": "2Ti"}}))
    assert check_spec(job.spec).ok


@pytest.mark.parametrize(("preset", "nproc", "memory"), [("llama3-1b", 1, "3Gi"), ("llama3-405b", 8, "1Ti")])
def test_a_cpu_job_whose_processes_cannot_fit_the_pods_memory_is_refused(preset, nproc, memory):
    """On CPU the training state and activations live in host memory: the kernel's OOM killer would end the
    workers."""
    spec = {"nodes": 1, "nprocPerNode": nproc, "parallelism": {"dpShard": nproc, "tp": 1, "pp": 1, "cp": 1},
            "model": {"preset": preset, "seqLen": 512},
            "training": {"globalBatch": nproc}, "resources": {"memory": memory}}
    job, problems = parse(manifest(**spec))
    assert job is not None, problems
    checked = check_spec(job.spec)
    errors_ = [p for p in checked.problems if p.severity == "error"]
    assert [p.field for p in errors_] == ["spec.resources.memory"], checked.problems
    message = errors_[0].message
    assert ("keeps its parameters, gradients, AdamW state and activations in host memory (a CPU job)"
            in message)
    assert (f"above memory={memory}, where the kernel's OOM killer would end them; raise resources.memory "
            "above" in message)
    per_pod = float(message.split(" GiB per pod")[0].rsplit(" ", 1)[1])
    raised = {**spec, "resources": {"memory": f"{math.ceil(per_pod) + 1}Gi"}}
    job, _ = parse(manifest(**raised))
    assert check_spec(job.spec).ok, "the memory the message names is enough"


def test_the_examples_cpu_jobs_fit_their_pods_memory():
    for path in sorted((Path(__file__).parents[2] / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "ParallelTrainingJob":
                job, _ = parse(doc)
                if job is not None:
                    assert not [
                        p for p in check_spec(job.spec).problems if p.field == "spec.resources.memory"], path


def test_the_guide_quotes_the_plan_for_zero2_and_offload():
    """docs/parallelism.md's figures for training.fsdp are what the planner says."""
    text = (Path(__file__).parents[2] / "docs" / "parallelism.md").read_text()

    def planned(nodes: int, preset: str, training: dict[str, object],
                **model: object) -> tuple[float, float, float]:
        job, _ = parse(manifest(nodes=nodes, nprocPerNode=8,
                                parallelism={"pp": 1, "tp": 1, "dpShard": 8 * nodes},
                                model={"preset": preset, **model}, resources={"gpu": 8}, training=training))
        solution = check_spec(job.spec).solution
        return solution.estimate.peak_bytes / GiB, solution.time.total_s, solution.time.exposed_comm_s

    eight = {"globalBatch": 128, "activationCheckpointing": "full"}
    peak, step, exposed = planned(4, "llama3-8b", eight, seqLen=4096)
    assert (f"predicted at {step:.2f} s per step, {exposed:.2f} s of it FSDP traffic" in text
            and f"{peak:.1f} GiB per" in text)
    peak, step, _ = planned(4, "llama3-8b", {**eight, "fsdp": {"reshardAfterForward": False}}, seqLen=4096)
    assert f"`reshardAfterForward: false` at {step:.2f} s and {peak:.1f} GiB" in text
    peak, step, _ = planned(1, "llama3-70b",
                            {"globalBatch": 8, "activationCheckpointing": "full", "fsdp": {"offload": "cpu"}})
    assert f"pure FSDP fits at {peak:.1f} GiB per GPU" in text and f"at {step:.1f} s, two thirds" in text


def test_plan_judges_each_elastic_size_below_the_job():
    """At 3 of 4 pods globalBatch 8 does not divide 3 data-parallel ranks; at 2 the job runs with the same
    tp and pp, and the planner predicts it."""
    job, _ = parse(manifest(nodes=4, nprocPerNode=4, parallelism={"pp": 2, "tp": 2, "dpShard": "auto"},
                            elastic={"minNodes": 2}))
    assert job is not None
    report = plan_job(job)
    assert report["mesh"] == "pp2.dpr1.dps4.cp1.tp2"
    three, two = report["elastic"]
    assert (three["nodes"], three["mesh"]) == (3, None)
    assert "globalBatch=8 must be divisible by dpReplicate*dpShard = 3" in three["problem"]
    assert (two["nodes"], two["mesh"], two["problem"]) == (2, "pp2.dpr1.dps2.cp1.tp2", None)
    assert two["peak_bytes"] > 0
    console = Console(record=True, width=200)
    print_plan(report, console)
    text = console.export_text()
    assert "Elastic sizes below spec.nodes" in text and "pp2.dpr1.dps2.cp1.tp2" in text
    assert "cannot run: spec.training.globalBatch" in text
    assert plan_job(parse(manifest())[0])["elastic"] == []  # type: ignore[arg-type]
