"""Validation and resolution: a parsed job to its problems, or to the trainer's ResolvedConfig.

This layer sits above the API model (tetrad.api) and the planner (tetrad.plan): `auto` degrees
are solved once, in `check_spec`, by the planner's solver, then checked by the shared rules
(tetrad.api.rules). The CRD's CEL rules reject at `kubectl apply` what CEL can express of the same
rules; these checks add the rest. Every problem names the field, the values and a fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from tetrad.api.contract import POD_VOLUMES, ROUNDS_PORT_OFFSET, SCRATCH_VOLUMES
from tetrad.api.families import FAMILIES, HFModel, config_key
from tetrad.api.manifest import parse
from tetrad.api.podschema import check_pod_fields
from tetrad.api.presets import DEFAULT_PRESET, PRESETS, model_name
from tetrad.api.problems import InvalidJob, Problem, errors
from tetrad.api.quantity import parse_quantity
from tetrad.api.resolved import Layout, ModelConfig, ResolvedConfig
from tetrad.api.rules import (
    FAMILY_PRESET_MESSAGE,
    HF_DIMS,
    PLUGIN_DIMS,
    PLUGIN_HF_MESSAGE,
    PLUGIN_PRESET_MESSAGE,
    SCRIPT_CHECKPOINT_MESSAGE,
    TRAINER_ONLY,
    TRAINER_PIPELINE,
    check_data,
    check_data_vocab,
    check_elastic,
    check_float8,
    check_layout,
    check_run_policy,
    hf_dims_message,
    microbatches,
    plugin_dims_message,
    stages_per_rank,
    trainer_only_message,
    trainer_pipeline_message,
)
from tetrad.api.spec import (
    Family,
    ModelSpec,
    ParallelTrainingJob,
    ParallelTrainingJobSpec,
    Scheduler,
)
from tetrad.plan.elastic import indivisible, resized_spec
from tetrad.plan.estimate import Estimate, GiB, MiB
from tetrad.plan.solver import Solution, solve, usable_bytes

DEFAULT_HF_SEQ_LEN = 4096  # a readable directory's job without seqLen trains at most this long

DEGREES = (("dp_replicate", "dpReplicate"), ("dp_shard", "dpShard"), ("tp", "tp"), ("cp", "cp"), ("pp", "pp"))


def expand_model(spec: ParallelTrainingJobSpec, problems: list[Problem]) -> ModelConfig | None:
    """The model's family and dims from its preset (debug when none is named) and explicit fields, or a
    plug-in's explicit dims; None (and problems) when they make no model."""
    m = spec.model
    explicit = m.model_dump(by_alias=True, exclude={"preset", "module", "hf_dir"}, exclude_none=True,
                            mode="json")
    hf_dir = hf_source(spec, problems)
    if m.module is not None:
        if m.preset is not None:
            problems.append(Problem("spec.model.preset", PLUGIN_PRESET_MESSAGE))
        problems += [Problem(f"spec.model.{f}", PLUGIN_HF_MESSAGE) for f in ("family", "hfDir")
                     if f in m.model_dump(by_alias=True, exclude_none=True)]
        if missing := [k for k in PLUGIN_DIMS if k not in explicit]:
            problems.append(Problem("spec.model", plugin_dims_message(missing)))
            return None
        dims = {"kvHeads": explicit["heads"], "ffnDim": 4 * explicit["dim"], "family": None} | explicit
        name, preset = m.module, None
    else:
        preset = m.preset or DEFAULT_PRESET
        if preset not in PRESETS:
            problems.append(Problem("spec.model.preset", (
                f"unknown preset {preset!r}; use one of {', '.join(PRESETS)} or give explicit dims")))
            return None
        if (m.hf_dir is not None and m.preset is None
                and (missing := [k for k in HF_DIMS if k not in explicit])):
            problems.append(Problem("spec.model.hfDir", hf_dims_message(missing)))
            return None
        base = dict(PRESETS[preset])
        if m.preset is not None and m.family is not None and m.family != base["family"]:
            problems.append(Problem("spec.model.family", (
                f"{FAMILY_PRESET_MESSAGE} (family={m.family.value}, preset {preset} is a {base['family']})")))
        if "headDim" not in explicit and ("dim" in explicit or "heads" in explicit):
            del base["headDim"]  # the preset's head size goes with its dim and heads
        dims = base | explicit
        name = model_name(preset, explicit)
        if m.hf_dir is not None and name == "custom":
            name = PurePosixPath(m.hf_dir).name
    dims.setdefault("ropeTheta", 500000.0)
    dims.setdefault("normEps", 1e-5)
    if "headDim" not in dims and dims["dim"] % dims["heads"]:
        problems.append(Problem("spec.model.dim", (
            f"dim={dims['dim']} is not a multiple of heads={dims['heads']}; make dim a multiple"
            " of heads or give headDim")))
        return None
    family = FAMILIES[Family(dims["family"])] if dims["family"] is not None else None
    options: dict[str, Any] = ({"qkvBias": family.qkv_bias, "qkNorm": family.qk_norm} if family is not None
                               else {})
    cfg = ModelConfig.model_validate({"name": name, "module": m.module, "hfDir": hf_dir, **dims, **options})
    before = len(problems)
    if cfg.heads % cfg.kv_heads:
        problems.append(Problem("spec.model.kvHeads", (
            f"kvHeads={cfg.kv_heads} does not divide heads={cfg.heads}; use a divisor of heads")))
    if cfg.head_dim % 2 and m.module is None:
        problems.append(Problem("spec.model.headDim" if "headDim" in explicit else "spec.model.dim",
                                f"head dim {cfg.head_dim} is odd, RoPE needs it even;"
                                " change dim or heads, or headDim"))
    if (s := cfg.rope_scaling) is not None and s.high_freq_factor <= s.low_freq_factor:
        problems.append(Problem("spec.model.ropeScaling.highFreqFactor", (
            f"highFreqFactor={s.high_freq_factor} must exceed lowFreqFactor={s.low_freq_factor} (the band"
            " between them is interpolated); Llama 3.1 uses 4 and 1")))
    return cfg if len(problems) == before else None


def hf_source(spec: ParallelTrainingJobSpec, problems: list[Problem]) -> str | None:
    """The Hugging Face directory the model starts from: model.hfDir, or training.initFrom (the same
    thing)."""
    a, b = spec.model.hf_dir, spec.training.init_from
    if a is not None and b is not None and a != b:
        problems.append(Problem("spec.training.initFrom", (
            f"initFrom={b} and model.hfDir={a} name two Hugging Face directories for one model; remove"
            " initFrom (hfDir gives the initial weights)")))
    return a or b


def model_from_hf(spec: ParallelTrainingJobSpec, hf: HFModel,
                  where: str) -> tuple[ParallelTrainingJobSpec, list[Problem]]:
    """The spec with the family and dims of a Hugging Face config.json the CLI could read (`where`): fields
    the manifest leaves out taken from it (seqLen: the checkpoint's context, at most DEFAULT_HF_SEQ_LEN),
    fields it gives, or its preset's, that contradict it refused by name. The cluster never calls this: it
    resolves the manifest as written, and the trainer checks the directory at start-up."""
    problems = [Problem("spec.model.hfDir", f"{where}: {p}") for p in hf.problems]
    if problems or spec.model.module is not None:
        return spec, problems
    m = spec.model
    given = m.model_dump(by_alias=True, exclude_none=True, mode="json")
    preset = PRESETS.get(m.preset) if m.preset is not None else None
    for f, value in hf.fields.items():
        said = f"{where} says {config_key(f)}={value!r}"
        if f in given and given[f] != value:
            problems.append(Problem(f"spec.model.{f}", (
                f"{f}={given[f]!r} but {said}; remove {f} (the directory gives it)")))
        elif f not in given and preset is not None and preset.get(f) != value:
            problems.append(Problem("spec.model.preset", (
                f"preset {m.preset} has {f}={preset.get(f)!r} but {said}; use the directory's preset or "
                "leave the preset out (the directory gives every dim)")))
    if problems:
        return spec, problems
    filled = given if preset is not None else {**hf.fields, **given}
    if "seqLen" not in filled and preset is None:
        filled["seqLen"] = min(hf.max_positions or DEFAULT_HF_SEQ_LEN, DEFAULT_HF_SEQ_LEN)
    seq_len = filled.get("seqLen", preset["seqLen"] if preset else None)
    if hf.max_positions is not None and seq_len is not None and seq_len > hf.max_positions:
        problems.append(Problem("spec.model.seqLen", (
            f"seqLen={seq_len} is beyond the checkpoint's context ({where} says max_position_embeddings="
            f"{hf.max_positions}): the model never saw such positions; use seqLen <= {hf.max_positions}"),
            "warning"))
    model = ModelSpec.model_validate(filled)
    return spec.model_copy(update={"model": model}), problems


def preset_of(hf: HFModel) -> str | None:
    """The preset whose family and dims are a config.json's (read_hf_config), if any."""
    return next((name for name, dims in PRESETS.items()
                 if all(dims.get(f) == v for f, v in hf.fields.items())), None)


def check_script(spec: ParallelTrainingJobSpec, problems: list[Problem]) -> None:
    """A script job names what runs in one way: its own entry point, none of the trainer's settings."""
    problems += [Problem(f"spec.{name}", trainer_only_message(name))
                 for name in TRAINER_ONLY if name in spec.model_fields_set]
    if spec.checkpoint.enabled:
        problems.append(Problem("spec.checkpoint.enabled", SCRIPT_CHECKPOINT_MESSAGE))
    given = spec.parallelism.model_dump(by_alias=True, exclude_none=True)
    problems += [Problem(f"spec.parallelism.{name}", trainer_pipeline_message(name))
                 for name in TRAINER_PIPELINE if name in given]


def script_layout(spec: ParallelTrainingJobSpec, problems: list[Problem]) -> Layout | None:
    """A script job's degrees: as given; without a model to plan for, `auto` is 1 except dpShard, which
    takes what the others leave."""
    world = spec.nodes * spec.nproc_per_node
    fixed = {name: 1 if getattr(spec.parallelism, name) == "auto" else getattr(spec.parallelism, name)
             for name, _ in DEGREES if name != "dp_shard"}
    rest = math.prod(fixed.values())
    shard = spec.parallelism.dp_shard
    if shard == "auto":
        if world % rest:
            problems.append(Problem("spec.parallelism", (
                f"dpShard: auto takes what the other degrees leave of nodes*nprocPerNode = {world}, but their"
                f" product {rest} does not divide it; change a degree")))
            return None
        shard = world // rest
    layout = Layout(dp_shard=shard, **fixed)
    if layout.world_size != world:
        problems.append(Problem("spec.parallelism", (
            f"the product of the degrees dpReplicate*dpShard*tp*cp*pp = {layout.dp_replicate}*"
            f"{layout.dp_shard}*{layout.tp}*{layout.cp}*{layout.pp} = {layout.world_size} must equal "
            f"nodes*nprocPerNode = {spec.nodes}*{spec.nproc_per_node} = {world}; change a degree or set "
            "dpShard: auto")))
        return None
    return layout


def check_explicit_degrees(spec: ParallelTrainingJobSpec, problems: list[Problem]) -> None:
    for name, alias in DEGREES:
        v = getattr(spec.parallelism, name)
        if v != "auto" and v < 1:
            problems.append(Problem(f"spec.parallelism.{alias}", (
                f"{alias}={v} must be >= 1; use 1 to disable this dimension or 'auto'")))


def check_other(spec: ParallelTrainingJobSpec, problems: list[Problem]) -> None:
    r = spec.resources
    for name, value in (("cpu", r.cpu), ("memory", r.memory)):
        if value is not None:
            try:
                parse_quantity(value)
            except ValueError as e:
                problems.append(Problem(f"spec.resources.{name}", str(e)))
    if r.gpu and r.gpu != spec.nproc_per_node:
        problems.append(Problem("spec.resources.gpu", (
            f"gpu={r.gpu} must equal nprocPerNode={spec.nproc_per_node} (one process"
            " per GPU), or be 0 for CPU")))
    check_data(spec.data, problems)
    check_preflight_buffer(spec, problems)
    if spec.gang.scheduler == Scheduler.KUEUE and not spec.gang.queue:
        problems.append(Problem("spec.gang.queue", (
            "gang.scheduler=kueue needs gang.queue, the Kueue LocalQueue name")))
    top = spec.metrics.port + spec.nproc_per_node - 1
    if top > 65535:
        problems.append(Problem("spec.metrics.port", (
            f"metrics.port={spec.metrics.port} + nprocPerNode={spec.nproc_per_node} runs"
            " past 65535; use a lower port")))
    rendezvous = spec.rendezvous.port
    if spec.metrics.port <= rendezvous + ROUNDS_PORT_OFFSET and rendezvous <= top:
        problems.append(Problem("spec.rendezvous.port", (
            f"rendezvous.port={rendezvous} and the next port (pod 0's restarts in place) collide with the"
            f" metrics ports {spec.metrics.port}..{top}; move one of them")))
    c = spec.checkpoint
    if c.enabled:
        mounted = c.volume is not None or any(m.get("mountPath") == c.path
                                              for m in spec.template.volume_mounts)
        if not mounted:
            problems.append(Problem("spec.checkpoint.volume", unmounted_checkpoints(c.path), "warning"))
        if c.keep_last == 1:
            problems.append(Problem("spec.checkpoint.keepLast", (
                "keepLast=1 leaves no older checkpoint to fall back to if the latest is damaged;"
                " use 2 or more"), "warning"))
    rp = spec.run_policy
    check_run_policy(rp, problems)
    check_elastic(spec, problems)
    check_float8(spec.training, spec.resources, problems)
    if rp.stall_timeout_seconds and rp.stall_timeout_seconds <= rp.collective_timeout_seconds:
        problems.append(Problem("spec.runPolicy.stallTimeoutSeconds", (
            f"stallTimeoutSeconds={rp.stall_timeout_seconds} is not above collectiveTimeoutSeconds="
            f"{rp.collective_timeout_seconds}: a hung collective is restarted as Stalled before the trainer "
            f"names the collective and the peers that did not answer; set stallTimeoutSeconds above "
            f"{rp.collective_timeout_seconds} or lower collectiveTimeoutSeconds"), "warning"))
    if spec.training.min_lr > spec.training.lr:
        problems.append(Problem("spec.training.minLr", (
            f"minLr={spec.training.min_lr} exceeds lr={spec.training.lr}; use minLr <= lr")))
    problems += check_pod_fields(spec)


def check_preflight_buffer(spec: ParallelTrainingJobSpec, problems: list[Problem]) -> None:
    """The preflight all-reduce's buffer, one per process, must fit where it lives: a GPU's memory, or on CPU
    the pod's memory limit (the gate would be OOM-killed before training, failing every restart)."""
    p, r = spec.preflight, spec.resources
    if not p.enabled:
        return
    buffer = p.all_reduce_mi_b * MiB
    if (usable := usable_bytes(spec)) is not None:
        if buffer > usable:
            problems.append(Problem("spec.preflight.allReduceMiB", (
                f"allReduceMiB={p.all_reduce_mi_b} is above the {r.gpu_memory_gib:g} GiB GPU's usable memory;"
                " use a buffer of a few hundred MiB, enough to measure bus bandwidth")))
        return
    try:
        limit = float(parse_quantity(r.memory)) if r.memory is not None else None
    except ValueError:
        return  # the bad quantity is named already
    if limit is not None and buffer * spec.nproc_per_node > limit:
        problems.append(Problem("spec.preflight.allReduceMiB", (
            f"allReduceMiB={p.all_reduce_mi_b} per process x nprocPerNode={spec.nproc_per_node} is"
            f" {buffer * spec.nproc_per_node / GiB:.1f} GiB of host memory, above memory={r.memory}; lower"
            " allReduceMiB (64 measures a CPU gang's bandwidth) or raise resources.memory")))


def unmounted_checkpoints(path: str) -> str:
    """What happens, in a cluster, to checkpoints under `path` with no volume mounted there."""
    fix = "set checkpoint.volume (e.g. a PVC) or mount one via template"
    scratch = next(((name, at) for name, at in POD_VOLUMES.items()
                    if name in SCRATCH_VOLUMES and (path == at or path.startswith(at + "/"))), None)
    if scratch is None:
        return (f"checkpoints go to {path} but no volume is mounted there; in a cluster the read-only root"
                f" filesystem fails the first save: {fix}")
    name, at = scratch
    memory = ", in memory: the checkpoints count against resources.memory" if at == "/dev/shm" else ""
    return (f"checkpoints go to {path}, in the pod's own {name} volume at {at} (an emptyDir{memory}); in a"
            " cluster saves succeed there, but every restart makes new pods, which wipes them, and the job"
            f" starts over from step 0: {fix}")


def check_host_memory(spec: ParallelTrainingJobSpec, est: Estimate, problems: list[Problem]) -> None:
    """The pod's memory limit must hold what its processes keep in host memory by the planner's estimate:
    on CPU their whole training state and activations, under CPU offload the offloaded state. The
    estimate leaves out torch's own memory (about half a GiB a process), so a job refused here cannot
    fit."""
    cpu = spec.resources.gpu == 0
    per_process = est.host_bytes + (est.peak_bytes if cpu else 0.0)
    if not per_process or spec.resources.memory is None:
        return
    try:
        limit = float(parse_quantity(spec.resources.memory))
    except ValueError:
        return  # check_other names the bad quantity
    need = per_process * spec.nproc_per_node
    if need <= limit:
        return
    held = ("keeps its parameters, gradients, AdamW state and activations in host memory (a CPU job)" if cpu
            else "offload=cpu keeps its sharded parameters, gradients and AdamW state in host memory")
    fixes = "add nodes, use a smaller model or batch" if cpu else "add nodes or set offload: none"
    problems.append(Problem("spec.resources.memory", (
        f"each process {held}: {per_process / GiB:.1f} GiB by the planner's estimate, {need / GiB:.1f} GiB"
        f" per pod ({spec.nproc_per_node} processes), above memory={spec.resources.memory}, where the"
        f" kernel's OOM killer would end them; raise resources.memory above {math.ceil(need / GiB)}Gi,"
        f" {fixes}")))


@dataclass
class Checked:
    """What validation learned on the way: the problems, the model and the solved layout."""

    problems: list[Problem]
    model: ModelConfig | None = None
    solution: Solution | None = None

    @property
    def ok(self) -> bool:
        return not errors(self.problems)

    @property
    def degrees_invalid(self) -> bool:
        """An explicit degree is out of range: the solver must not run on this layout."""
        return any(p.field.startswith("spec.parallelism.") for p in self.problems)


def check_smallest(spec: ParallelTrainingJobSpec, layout: Layout, problems: list[Problem]) -> None:
    """An elastic job must run at minNodes too (its data-parallel degrees shrunk, tetrad.plan.elastic)."""
    e = spec.elastic
    if e is None or not e.min_nodes < spec.nodes or errors(problems):
        return
    if (why := indivisible(layout, e.min_nodes * spec.nproc_per_node)) is not None:
        problems.append(Problem("spec.elastic.minNodes", f"at minNodes={e.min_nodes}, {why}; use a minNodes"
                                " they divide"))
        return
    smaller = check_spec(resized_spec(spec, layout, e.min_nodes)).problems
    problems.extend(Problem("spec.elastic.minNodes", f"at minNodes={e.min_nodes}, {p}")
                    for p in errors(smaller))


def check_spec(spec: ParallelTrainingJobSpec) -> Checked:
    """All semantic problems of a parsed spec; `auto` degrees are solved once, here."""
    checked = Checked([])
    check_other(spec, checked.problems)
    check_explicit_degrees(spec, checked.problems)
    if spec.script is not None:
        if not checked.degrees_invalid and (layout := script_layout(spec, checked.problems)) is not None:
            checked.solution = Solution(layout=layout, estimate=None, reason="")
            check_smallest(spec, layout, checked.problems)
        check_script(spec, checked.problems)
        return checked
    checked.model = expand_model(spec, checked.problems)
    if checked.model is not None:
        check_data_vocab(spec.data, checked.model.vocab, checked.problems)
    if checked.model is None or checked.degrees_invalid:
        return checked
    checked.solution = solve(spec, checked.model)
    if checked.solution.layout is None:
        checked.problems.append(Problem("spec.parallelism", checked.solution.reason))
    else:
        check_layout(spec, checked.model, checked.solution.layout, checked.problems)
        if checked.solution.estimate is not None:
            check_host_memory(spec, checked.solution.estimate, checked.problems)
        check_smallest(spec, checked.solution.layout, checked.problems)
    return checked


def validate_spec(spec: ParallelTrainingJobSpec) -> list[Problem]:
    return check_spec(spec).problems


def validate_document(document: Any) -> list[Problem]:
    job, problems = parse(document)
    return problems if job is None else validate_spec(job.spec)


def resolve(job: ParallelTrainingJob) -> ResolvedConfig:
    """Solve every `auto`, expand the preset; raise InvalidJob listing every problem."""
    spec = job.spec
    checked = check_spec(spec)
    if not checked.ok:
        raise InvalidJob(checked.problems)
    cfg, layout = checked.model, checked.solution.layout if checked.solution else None
    assert ((cfg is not None or spec.script is not None)
            and layout is not None), "check_spec admitted an unsolvable job"
    return ResolvedConfig(
        job_name=job.metadata.name,
        namespace=job.metadata.namespace,
        nodes=spec.nodes,
        nproc_per_node=spec.nproc_per_node,
        layout=layout,
        pp_schedule=spec.parallelism.pp_schedule,
        pp_microbatches=microbatches(spec, layout),
        pp_stages_per_rank=stages_per_rank(spec) if layout.pp > 1 else 1,
        model=cfg,
        script=spec.script,
        training=spec.training,
        data=spec.data,
        checkpoint=spec.checkpoint,
        metrics=spec.metrics,
        gpu_type=spec.resources.gpu_type,
        use_gpu=spec.resources.gpu > 0,
        cpus=float(parse_quantity(spec.resources.cpu)) if spec.resources.cpu else None,
        preflight=spec.preflight,
        predicted_peak_bytes=(checked.solution.estimate.peak_bytes
                              if checked.solution and checked.solution.estimate else None),
        collective_timeout_seconds=spec.run_policy.collective_timeout_seconds,
    )
