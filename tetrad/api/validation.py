"""Semantic validation of a ParallelTrainingJob.

The CRD's CEL rules (tetrad.api.crd) reject what CEL can express at `kubectl apply`; these
checks repeat them and add the rest. Every problem names the field, the values and a fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError

from tetrad.api.presets import PRESETS
from tetrad.api.resolved import Layout, ModelConfig
from tetrad.api.spec import (
    DataSource,
    ParallelTrainingJob,
    ParallelTrainingJobSpec,
    PPSchedule,
    Scheduler,
)

if TYPE_CHECKING:
    from tetrad.api.solver import Solution


@dataclass(frozen=True)
class Problem:
    field: str
    message: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class InvalidJob(ValueError):
    def __init__(self, problems: list[Problem]):
        self.problems = [p for p in problems if p.severity == "error"]
        super().__init__("; ".join(str(p) for p in self.problems))


def parse(document: Any) -> tuple[ParallelTrainingJob | None, list[Problem]]:
    """Parse a manifest dict into the model; pydantic errors become field-named problems."""
    if not isinstance(document, dict):
        return None, [Problem("<document>", f"expected a YAML mapping, got {type(document).__name__}")]
    if document.get("kind") != "ParallelTrainingJob":
        return None, [Problem("kind", f"kind={document.get('kind')!r} is not ParallelTrainingJob; set kind: ParallelTrainingJob")]
    if document.get("apiVersion") != "tetrad.dev/v1alpha1":
        return None, [Problem("apiVersion", f"apiVersion={document.get('apiVersion')!r} is not supported; set apiVersion: tetrad.dev/v1alpha1")]
    try:
        return ParallelTrainingJob.model_validate(document), []
    except ValidationError as e:
        return None, [_from_pydantic(err) for err in e.errors()]


def _from_pydantic(err: Any) -> Problem:
    loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and x in ("int", "literal['auto']"))]
    field = ".".join(loc) or "<document>"
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    if err["type"] == "extra_forbidden":
        return Problem(field, "unknown field; remove it or check its spelling against `kubectl explain ptj.spec`")
    return Problem(field, f"{err['msg']}{shown}")


def model_config(spec: ParallelTrainingJobSpec, problems: list[Problem]) -> ModelConfig | None:
    """Expand the preset and explicit dims; append problems when they cannot make a model."""
    m = spec.model
    base: dict[str, Any] = {}
    if m.preset is not None:
        if m.preset not in PRESETS:
            problems.append(Problem("spec.model.preset", f"unknown preset {m.preset!r}; use one of {', '.join(PRESETS)} or give explicit dims"))
            return None
        base = dict(PRESETS[m.preset])
    explicit = m.model_dump(by_alias=True, exclude={"preset"}, exclude_none=True)
    dims = base | explicit
    dims.setdefault("ropeTheta", 500000.0)
    dims.setdefault("normEps", 1e-5)
    missing = [k for k in ("dim", "layers", "heads", "kvHeads", "vocab", "ffnDim", "seqLen") if k not in dims]
    if missing:
        problems.append(Problem("spec.model", f"no preset and missing dims {', '.join(missing)}; set model.preset or give every dim"))
        return None
    name = m.preset if m.preset and not explicit else "custom"
    cfg = ModelConfig(name=name, **dims)
    before = len(problems)
    if cfg.heads % cfg.kv_heads:
        problems.append(Problem("spec.model.kvHeads", f"kvHeads={cfg.kv_heads} does not divide heads={cfg.heads}; use a divisor of heads"))
    if cfg.dim % cfg.heads:
        problems.append(Problem("spec.model.dim", f"dim={cfg.dim} is not a multiple of heads={cfg.heads}; make dim a multiple of heads"))
    elif cfg.head_dim % 2:
        problems.append(Problem("spec.model.dim", f"head dim {cfg.dim}/{cfg.heads}={cfg.head_dim} is odd, RoPE needs it even; change dim or heads"))
    return cfg if len(problems) == before else None


def stages_per_rank(spec: ParallelTrainingJobSpec) -> int:
    p = spec.parallelism
    if p.pp_stages_per_rank is not None:
        return p.pp_stages_per_rank
    return 2 if p.pp_schedule in (PPSchedule.INTERLEAVED_1F1B, PPSchedule.ZERO_BUBBLE) else 1


def microbatches(spec: ParallelTrainingJobSpec, layout: Layout) -> int:
    p = spec.parallelism
    return p.pp_microbatches if p.pp_microbatches is not None else layout.pp * stages_per_rank(spec)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_explicit_degrees(spec: ParallelTrainingJobSpec, problems: list[Problem]) -> None:
    for name, alias in (("dp_replicate", "dpReplicate"), ("dp_shard", "dpShard"), ("tp", "tp"), ("cp", "cp"), ("pp", "pp")):
        v = getattr(spec.parallelism, name)
        if v != "auto" and v < 1:
            problems.append(Problem(f"spec.parallelism.{alias}", f"{alias}={v} must be >= 1; use 1 to disable this dimension or 'auto'"))


def check_layout(spec: ParallelTrainingJobSpec, cfg: ModelConfig, layout: Layout, problems: list[Problem]) -> None:
    """Checks that need concrete degrees (explicit, or solved from 'auto')."""
    world = spec.nodes * spec.nproc_per_node
    par = "spec.parallelism"
    if layout.world_size != world:
        problems.append(Problem(par, (
            f"the product of the degrees dpReplicate*dpShard*tp*cp*pp = {layout.dp_replicate}*{layout.dp_shard}*{layout.tp}*{layout.cp}*{layout.pp}"
            f" = {layout.world_size} must equal nodes*nprocPerNode = {spec.nodes}*{spec.nproc_per_node} = {world};"
            " change a degree or set dpShard: auto")))
    if cfg.heads % layout.tp or cfg.kv_heads % layout.tp:
        ok = [d for d in _divisors(cfg.kv_heads) if cfg.heads % d == 0]
        problems.append(Problem(f"{par}.tp", f"tp={layout.tp} must divide heads={cfg.heads} and kvHeads={cfg.kv_heads}; use one of {ok}"))
    chunk = 2 * layout.tp * layout.cp
    if cfg.seq_len % chunk:
        problems.append(Problem("spec.model.seqLen", (
            f"seqLen={cfg.seq_len} must be divisible by tp*2*cp = {layout.tp}*2*{layout.cp} = {chunk};"
            f" use seqLen {cfg.seq_len - cfg.seq_len % chunk or chunk} or {cfg.seq_len + chunk - cfg.seq_len % chunk}")))
    spr = stages_per_rank(spec)
    stages = layout.pp * spr
    if layout.pp > cfg.layers:
        problems.append(Problem(f"{par}.pp", f"pp={layout.pp} exceeds layers={cfg.layers}; use pp <= {cfg.layers}"))
    elif stages > cfg.layers:
        problems.append(Problem(f"{par}.ppStagesPerRank", f"pp*ppStagesPerRank = {layout.pp}*{spr} = {stages} stages exceed layers={cfg.layers}; lower pp or ppStagesPerRank"))
    if layout.pp > 1:
        sched = spec.parallelism.pp_schedule
        multi = sched in (PPSchedule.INTERLEAVED_1F1B, PPSchedule.ZERO_BUBBLE)
        if multi and spr < 2:
            problems.append(Problem(f"{par}.ppStagesPerRank", f"ppSchedule={sched.value} needs ppStagesPerRank >= 2 (got {spr}); set it to 2 or use 1F1B"))
        if not multi and spr != 1:
            problems.append(Problem(f"{par}.ppStagesPerRank", f"ppSchedule={sched.value} runs one stage per rank (got {spr}); set ppStagesPerRank: 1 or use Interleaved1F1B"))
        if sched == PPSchedule.ZERO_BUBBLE and spr != 2:
            problems.append(Problem(f"{par}.ppStagesPerRank", f"ppSchedule=ZeroBubble uses the V-shaped schedule with 2 stages per rank (got {spr}); set ppStagesPerRank: 2"))
        n_mb = microbatches(spec, layout)
        if n_mb < stages:
            problems.append(Problem(f"{par}.ppMicrobatches", f"ppMicrobatches={n_mb} is below the {stages} pipeline stages (pp={layout.pp} x {spr} per rank); use ppMicrobatches >= {stages}"))
        if multi and n_mb % layout.pp:
            problems.append(Problem(f"{par}.ppMicrobatches", f"ppMicrobatches={n_mb} must be a multiple of pp={layout.pp} for {sched.value}; use {n_mb + layout.pp - n_mb % layout.pp}"))
    t = spec.training
    if t.global_batch % layout.dp:
        problems.append(Problem("spec.training.globalBatch", f"globalBatch={t.global_batch} must be divisible by dpReplicate*dpShard = {layout.dp}; use {t.global_batch + layout.dp - t.global_batch % layout.dp}"))
    else:
        local = t.global_batch // layout.dp
        if layout.pp > 1:
            n_mb = microbatches(spec, layout)
            if local % n_mb:
                problems.append(Problem("spec.training.globalBatch", f"the per-rank batch globalBatch/dp = {t.global_batch}/{layout.dp} = {local} must split into ppMicrobatches={n_mb}; make globalBatch a multiple of {layout.dp * n_mb}"))
        elif local % t.micro_batch:
            problems.append(Problem("spec.training.microBatch", f"microBatch={t.micro_batch} must divide the per-rank batch globalBatch/dp = {t.global_batch}/{layout.dp} = {local}; use a divisor of {local}"))
    if layout.tp > spec.nproc_per_node:
        problems.append(Problem(f"{par}.tp", f"tp={layout.tp} spans nodes (nprocPerNode={spec.nproc_per_node}); TP is fastest within a node", "warning"))


def check_other(spec: ParallelTrainingJobSpec, problems: list[Problem]) -> None:
    r = spec.resources
    if r.gpu and r.gpu != spec.nproc_per_node:
        problems.append(Problem("spec.resources.gpu", f"gpu={r.gpu} must equal nprocPerNode={spec.nproc_per_node} (one process per GPU), or be 0 for CPU"))
    d = spec.data
    if d.source in (DataSource.TEXT, DataSource.TOKENS) and not d.path:
        problems.append(Problem("spec.data.path", f"data.source={d.source.value} needs data.path; set the file's path inside the pod"))
    if spec.gang.scheduler == Scheduler.KUEUE and not spec.gang.queue:
        problems.append(Problem("spec.gang.queue", "gang.scheduler=kueue needs gang.queue, the Kueue LocalQueue name"))
    top = spec.metrics.port + spec.nproc_per_node - 1
    if top > 65535:
        problems.append(Problem("spec.metrics.port", f"metrics.port={spec.metrics.port} + nprocPerNode={spec.nproc_per_node} runs past 65535; use a lower port"))
    if spec.metrics.port <= spec.rendezvous.port <= top:
        problems.append(Problem("spec.rendezvous.port", f"rendezvous.port={spec.rendezvous.port} collides with the metrics ports {spec.metrics.port}..{top}; move one of them"))
    c = spec.checkpoint
    if c.enabled:
        mounted = c.volume is not None or any(m.get("mountPath") == c.path for m in spec.template.volume_mounts)
        if not mounted:
            problems.append(Problem("spec.checkpoint.volume", (
                f"checkpoints go to {c.path} but no volume is mounted there; in a cluster the read-only root"
                " filesystem fails the first save: set checkpoint.volume (e.g. a PVC) or mount one via template"), "warning"))
        if c.keep_last == 1:
            problems.append(Problem("spec.checkpoint.keepLast", "keepLast=1 leaves no older checkpoint to fall back to if the latest is damaged; use 2 or more", "warning"))
    if spec.training.min_lr > spec.training.lr:
        problems.append(Problem("spec.training.minLr", f"minLr={spec.training.min_lr} exceeds lr={spec.training.lr}; use minLr <= lr"))


@dataclass
class Checked:
    """What validation learned on the way: the problems, the model and the solved layout."""

    problems: list[Problem]
    model: ModelConfig | None = None
    solution: Solution | None = None

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)


def check_spec(spec: ParallelTrainingJobSpec) -> Checked:
    """All semantic problems of a parsed spec; `auto` degrees are solved once, here."""
    from tetrad.api.solver import solve  # the solver uses the planner, which uses this module

    checked = Checked([])
    check_other(spec, checked.problems)
    check_explicit_degrees(spec, checked.problems)
    checked.model = model_config(spec, checked.problems)
    if checked.model is None or any(p.field.startswith("spec.parallelism.") for p in checked.problems):
        return checked
    checked.solution = solve(spec, checked.model)
    if checked.solution.layout is None:
        checked.problems.append(Problem("spec.parallelism", checked.solution.reason))
    else:
        check_layout(spec, checked.model, checked.solution.layout, checked.problems)
    return checked


def validate_spec(spec: ParallelTrainingJobSpec) -> list[Problem]:
    return check_spec(spec).problems


def validate_document(document: Any) -> list[Problem]:
    job, problems = parse(document)
    return problems if job is None else validate_spec(job.spec)
