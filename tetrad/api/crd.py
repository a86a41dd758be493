"""Generate the ParallelTrainingJob CRD from the pydantic model.

The OpenAPI schema is the model's JSON schema made structural (refs inlined, int-or-string
degrees, defaults on every object so CEL sees concrete values). The CEL rules repeat the
rules of tetrad.api.rules that CEL can express, built from the same constants; the presets table
is compiled into them. tests/api/test_crd.py checks on generated specs that CEL and Python agree.
"""

from __future__ import annotations

import copy
from typing import Any

from tetrad.api.contract import EXIT_ALWAYS_RETRIED, GROUP, KIND, PLURAL, SHORT_NAME, VERSION
from tetrad.api.presets import DEFAULT_PRESET, PRESETS
from tetrad.api.rules import (
    ALWAYS_RETRIED_MESSAGE,
    BACKOFF_MESSAGE,
    BOTH_LISTS_MESSAGE,
    BYTE_TOKENIZER,
    BYTE_VOCAB,
    BYTE_VOCAB_MESSAGE,
    DATA_PATH_MESSAGE,
    DEFAULT_MULTI_STAGES_PER_RANK,
    ELASTIC_MIN_MESSAGE,
    ELASTIC_SCHEDULER_MESSAGE,
    FAMILY_PRESET_MESSAGE,
    FILE_SOURCES,
    FLOAT8_FIELD,
    FLOAT8_NEEDS,
    HF_DIMS,
    JSONL_TOKENIZER_MESSAGE,
    MULTI_STAGE,
    NON_BLOCK_STAGE_UNITS,
    PERMANENT_DEFAULT,
    PLUGIN_DIMS,
    PLUGIN_HF_MESSAGE,
    PLUGIN_PRESET_MESSAGE,
    SCRIPT_CHECKPOINT_MESSAGE,
    TRAINER_ONLY,
    TRAINER_PIPELINE,
    hf_dims_message,
    plugin_dims_message,
    trainer_only_message,
    trainer_pipeline_message,
)
from tetrad.api.spec import (
    CHECKPOINT_PATH_RULE,
    DNS1035_LABEL,
    JOB_NAME_MAX,
    DataSource,
    Float8Recipe,
    Offload,
    ParallelTrainingJobSpec,
    ParallelTrainingJobStatus,
    Precision,
    Scheduler,
)

DEGREES = ("dpReplicate", "dpShard", "tp", "cp", "pp")
IMMUTABLE = ("nodes", "nprocPerNode", "parallelism", "model", "script")
IMMUTABLE_PRESENCE = ("model", "script")  # the optional ones
# The one anyOf a structural schema allows: beside x-kubernetes-int-or-string, without `type`.
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]


def _structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Turn one pydantic JSON-schema node into a structural OpenAPI v3 node."""
    s = copy.deepcopy(schema)
    if "$ref" in s:
        target = defs[s.pop("$ref").split("/")[-1]]
        s = {**copy.deepcopy(target), **s}
    if "allOf" in s and len(s["allOf"]) == 1:
        s = {**_structural(s.pop("allOf")[0], defs), **s}
    if s.get("x-kubernetes-int-or-string"):
        s.pop("type", None)
        s["anyOf"] = copy.deepcopy(INT_OR_STRING)
    elif "anyOf" in s:
        options = [o for o in s.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot make a structural schema of anyOf {options}")
        s = {**_structural(options[0], defs), **s}
    s.pop("title", None)
    if s.get("default", 0) is None:
        del s["default"]
    if isinstance(s.get("additionalProperties"), bool):  # structural schemas prune instead
        del s["additionalProperties"]
    # not converted yet (Optional fields recurse)
    if "exclusiveMinimum" in s and not isinstance(s["exclusiveMinimum"], bool):
        s["minimum"], s["exclusiveMinimum"] = s["exclusiveMinimum"], True
    if "const" in s:
        s["enum"] = [s.pop("const")]
    if s.get("type") == "object" and "properties" in s:
        s["properties"] = {k: _structural(v, defs) for k, v in s["properties"].items()}
        s.pop("required", None) if not s.get("required") else None
    elif s.get("type") == "object" and isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = _structural(s["additionalProperties"], defs)
    elif s.get("type") == "object" and not s.get("properties"):
        s["x-kubernetes-preserve-unknown-fields"] = True
    if s.get("type") == "array" and "items" in s:
        s["items"] = (_structural(s["items"], defs) if "type" in s["items"] or "$ref" in s["items"]
                      else s["items"])
        s["items"].setdefault("type", "object")
    return s


# The spec's sections whose presence says something: what runs (script, or Tetrad's trainer with its model,
# training and data). The apiserver leaves them out when the manifest does, so CEL and Python can tell.
PRESENCE_SIGNIFICANT = ("script", "model", "training", "data")


def _with_object_defaults(s: dict[str, Any], keep_absent: tuple[str, ...] = ()) -> None:
    """Default every nested object to {} so the apiserver fills the defaults beneath it, except the
    top-level sections in keep_absent (their own fields are still defaulted once they are given) and
    objects with required fields (an optional ropeScaling: {} would be invalid)."""
    for name, prop in s.get("properties", {}).items():
        if prop.get("type") == "object" and "properties" in prop:
            if name not in keep_absent and not prop.get("required"):
                prop.setdefault("default", {})
            _with_object_defaults(prop)


def schema_of(model: type[Any], keep_absent: tuple[str, ...] = ()) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    s = _structural(raw, defs)
    _with_object_defaults(s, keep_absent)
    return s


# CEL helpers over the (defaulted) spec object `self`.
BUILTIN = "!has(self.script)"  # the job runs Tetrad's trainer: the model-dependent rules apply
_PRESET_FAMILIES = "{" + ", ".join(f"'{name}': '{dims['family']}'" for name, dims in PRESETS.items()) + "}"
_PRESET = f"(has(self.model) && has(self.model.preset) ? self.model.preset : '{DEFAULT_PRESET}')"


def _model_dim(dim: str) -> str:
    """A model dim as resolve.expand_model takes it: explicit, else a plug-in's default (kvHeads: heads),
    else the preset's (debug without one)."""
    table = ", ".join(f"'{name}': {dims[dim]}"  # type: ignore[literal-required]
                      for name, dims in PRESETS.items())
    fallback = f"{{{table}}}[{_PRESET}]"
    if dim == "kvHeads":
        fallback = f"(has(self.model) && has(self.model.module) ? {_model_dim('heads')} : {fallback})"
    return f"(has(self.model) && has(self.model.{dim}) ? self.model.{dim} : {fallback})"


def _is_int(*degrees: str) -> str:
    return " && ".join(f"type(self.parallelism.{d}) == int" for d in degrees)


def _degree(d: str) -> str:
    """The CEL path of a parallelism degree."""
    return f"self.parallelism.{d}"


def _fmt(text: str, *args: str) -> str:
    """A CEL messageExpression 'text'.format([args]) (%d per int argument).

    The API server's cost estimator rejects string concatenation with string(int) (it assumes
    unbounded strings), while format() of a list of ints passes.
    """
    return f"'{text}'.format([{', '.join(args)}])"


def _stages_per_rank() -> str:
    """rules.stages_per_rank: ppStagesPerRank, else 2 for the multi-stage schedules, else 1."""
    multi = ", ".join(f"'{s.value}'" for s in MULTI_STAGE)
    return ("(has(self.parallelism.ppStagesPerRank) ? self.parallelism.ppStagesPerRank : "
            f"(self.parallelism.ppSchedule in [{multi}] ? {DEFAULT_MULTI_STAGES_PER_RANK} : 1))")


def spec_rules() -> list[dict[str, str]]:
    heads, kv, layers, seq = (_model_dim(d) for d in ("heads", "kvHeads", "layers", "seqLen"))
    product = "*".join(_degree(d) for d in DEGREES)
    per_rank = _stages_per_rank()
    max_stages = f"{layers} + {NON_BLOCK_STAGE_UNITS}"  # rules.max_pipeline_stages
    return [
        {
            "rule": f"!({_is_int(*DEGREES)}) || {product} == self.nodes * self.nprocPerNode",
            "messageExpression": _fmt(
                "spec.parallelism: the product of the degrees dpReplicate*dpShard*tp*cp*pp = %d*%d*%d*%d*%d "
                "= %d must equal nodes*nprocPerNode = %d*%d = %d; change a degree or set dpShard: auto",
                *(_degree(d) for d in DEGREES), product, "self.nodes", "self.nprocPerNode",
                "self.nodes * self.nprocPerNode"),
            "reason": "FieldValueInvalid",
            "fieldPath": ".parallelism",
        },
        {
            "rule": (f"!{BUILTIN} || !({_is_int('tp')})"
                     f" || ({heads} % {_degree('tp')} == 0 && {kv} % {_degree('tp')} == 0)"),
            "messageExpression": _fmt(
                "spec.parallelism.tp: tp=%d must divide heads=%d and kvHeads=%d; use a common divisor"
                " of both",
                _degree("tp"), heads, kv),
            "reason": "FieldValueInvalid",
            "fieldPath": ".parallelism.tp",
        },
        {
            "rule": (f"!{BUILTIN} || !({_is_int('tp', 'cp')})"
                     f" || {seq} % ({_degree('tp')} * 2 * {_degree('cp')}) == 0"),
            "messageExpression": _fmt(
                "spec.model.seqLen: seqLen=%d must be divisible by tp*2*cp = %d; change seqLen, tp or cp",
                seq, f"{_degree('tp')} * 2 * {_degree('cp')}"),
            "reason": "FieldValueInvalid",
            "fieldPath": ".model",
        },
        {
            "rule": (f"!{BUILTIN} || !({_is_int('pp')}) || {_degree('pp')} == 1"
                     f" || {_degree('pp')} * {per_rank} <= {max_stages}"),
            "messageExpression": _fmt(
                "spec.parallelism: pp*ppStagesPerRank = %d*%d = %d stages exceed layers=%d + "
                f"{NON_BLOCK_STAGE_UNITS} (the embedding and the output take a stage each); use at most "
                "%d stages",
                _degree("pp"), per_rank, f"{_degree('pp')} * {per_rank}", layers, max_stages),
            "reason": "FieldValueInvalid",
            "fieldPath": ".parallelism.pp",
        },
        {
            "rule": (f"!{BUILTIN} || !({_is_int('pp')}) || {_degree('pp')} == 1"
                     " || !has(self.parallelism.ppMicrobatches)"
                     f" || self.parallelism.ppMicrobatches >= {_degree('pp')} * {per_rank}"),
            "messageExpression": _fmt(
                "spec.parallelism.ppMicrobatches: ppMicrobatches=%d is below the %d pipeline stages"
                " (pp=%d x %d per rank); use ppMicrobatches >= %d",
                "self.parallelism.ppMicrobatches", f"{_degree('pp')} * {per_rank}", _degree("pp"), per_rank,
                f"{_degree('pp')} * {per_rank}"),
            "reason": "FieldValueInvalid",
            "fieldPath": ".parallelism.ppMicrobatches",
        },
        {
            "rule": "self.resources.gpu == 0 || self.resources.gpu == self.nprocPerNode",
            "messageExpression": _fmt(
                "spec.resources.gpu: gpu=%d must equal nprocPerNode=%d (one process per GPU), or be 0"
                " for CPU",
                "self.resources.gpu", "self.nprocPerNode"),
            "reason": "FieldValueInvalid",
            "fieldPath": ".resources.gpu",
        },
        {
            "rule": (f"!{BUILTIN} || !has(self.training) || !({_is_int('dpShard', 'cp')})"
                     f" || self.training.fsdp.offload != '{Offload.CPU.value}'"
                     f" || {_degree('dpShard')} * {_degree('cp')} > 1"),
            "messageExpression": _fmt(
                "spec.training.fsdp.offload: offload=cpu needs FSDP, but dpShard*cp = %d*%d = 1 shards "
                "nothing; set dpShard >= 2 or offload: none", _degree("dpShard"), _degree("cp")),
            "reason": "FieldValueInvalid",
            "fieldPath": ".training.fsdp.offload",
        },
        *float8_rules(),
        *script_rules(),
        *data_rules(),
        *run_policy_rules(),
        *elastic_rules(),
        {
            "rule": "self.gang.scheduler != 'kueue' || has(self.gang.queue)",
            "message": "spec.gang.queue: gang.scheduler=kueue needs gang.queue, the Kueue LocalQueue name",
            "reason": "FieldValueRequired",
            "fieldPath": ".gang.queue",
        },
    ]


def script_rules() -> list[dict[str, str]]:
    """A script job (spec.script) names what runs in one way: none of the trainer's sections or settings
    (tetrad.resolve.check_script says the same)."""
    rules = [{"rule": f"{BUILTIN} || !has(self.{name})",
              "message": f"spec.{name}: {trainer_only_message(name)}",
              "reason": "FieldValueForbidden", "fieldPath": f".{name}"} for name in TRAINER_ONLY]
    rules.append({"rule": f"{BUILTIN} || !self.checkpoint.enabled",
                  "message": f"spec.checkpoint.enabled: {SCRIPT_CHECKPOINT_MESSAGE}",
                  "reason": "FieldValueForbidden", "fieldPath": ".checkpoint.enabled"})
    rules += [{"rule": f"{BUILTIN} || !has(self.parallelism.{name})",
               "message": f"spec.parallelism.{name}: {trainer_pipeline_message(name)}",
               "reason": "FieldValueForbidden", "fieldPath": f".parallelism.{name}"}
              for name in TRAINER_PIPELINE]
    return rules


def data_rules() -> list[dict[str, str]]:
    """A file source needs its path, jsonl a Hugging Face tokenizer, the byte tokenizer a vocab of 256
    (tetrad.api.rules.check_data and check_data_vocab say the same)."""
    sources = ", ".join(f"'{s.value}'" for s in FILE_SOURCES)
    # Only an explicit vocab can be too small for the byte tokenizer: every preset's holds its 256 ids.
    assert all(dims["vocab"] >= BYTE_VOCAB for dims in PRESETS.values())
    return [
        {"rule": f"!has(self.data) || !(self.data.source in [{sources}]) || has(self.data.path)",
         "messageExpression": _fmt("spec.data.path: " + DATA_PATH_MESSAGE.replace("{}", "%s"),
                                   "self.data.source"),
         "reason": "FieldValueRequired", "fieldPath": ".data.path"},
        {"rule": (f"!has(self.data) || self.data.source != '{DataSource.JSONL.value}'"
                  f" || self.data.tokenizer != '{BYTE_TOKENIZER}'"),
         "message": f"spec.data.tokenizer: {JSONL_TOKENIZER_MESSAGE}",
         "reason": "FieldValueInvalid", "fieldPath": ".data.tokenizer"},
        {"rule": (f"!{BUILTIN} || !has(self.data) || self.data.source != '{DataSource.TEXT.value}'"
                  f" || self.data.tokenizer != '{BYTE_TOKENIZER}' || !has(self.model)"
                  f" || !has(self.model.vocab) || self.model.vocab >= {BYTE_VOCAB}"),
         "messageExpression": _fmt("spec.model.vocab: " + BYTE_VOCAB_MESSAGE.replace("{}", "%d"),
                                   "self.model.vocab"),
         "reason": "FieldValueInvalid", "fieldPath": ".model.vocab"},
    ]


def float8_rules() -> list[dict[str, str]]:
    """What float8 needs (rules.check_float8, check_float8_layout)."""
    off = f"!has(self.training) || self.training.float8.recipe == '{Float8Recipe.NONE.value}'"
    needs = {"compile": "self.training.compile",
             "precision": f"self.training.precision == '{Precision.BF16.value}'",
             "gpu": "self.resources.gpu > 0",
             # the layout's check (rules.check_float8_layout) is the trainer's: a script job has none
             "tp": f"!{BUILTIN} || !({_is_int('tp')}) || {_degree('tp')} == 1"}
    return [{"rule": f"{off} || {rule}", "message": f"{FLOAT8_FIELD}: {FLOAT8_NEEDS[what]}",
             "reason": "FieldValueInvalid", "fieldPath": ".training.float8.recipe"}
            for what, rule in needs.items()]


def elastic_rules() -> list[dict[str, str]]:
    """spec.elastic's minNodes and gang (rules.check_elastic)."""
    return [
        {"rule": "!has(self.elastic) || self.elastic.minNodes <= self.nodes",
         "messageExpression": _fmt("spec.elastic.minNodes: " + ELASTIC_MIN_MESSAGE.replace("{}", "%d"),
                                   "self.elastic.minNodes", "self.nodes"),
         "reason": "FieldValueInvalid", "fieldPath": ".elastic.minNodes"},
        {"rule": f"!has(self.elastic) || self.gang.scheduler == '{Scheduler.BUILTIN.value}'",
         "message": f"spec.elastic: {ELASTIC_SCHEDULER_MESSAGE}",
         "reason": "FieldValueInvalid", "fieldPath": ".elastic"},
    ]


def run_policy_rules() -> list[dict[str, str]]:
    """The exit-code lists and the backoff agree with each other and the operator (rules.check_run_policy)."""
    rp = "self.runPolicy"
    permanent = f"(has({rp}.permanentExitCodes) ? {rp}.permanentExitCodes : {PERMANENT_DEFAULT})"
    return [
        {"rule": (f"!has({rp}.permanentExitCodes)"
                  f" || !{rp}.permanentExitCodes.exists(c, c in {list(EXIT_ALWAYS_RETRIED)})"),
         "message": f"spec.runPolicy.permanentExitCodes: {ALWAYS_RETRIED_MESSAGE}",
         "reason": "FieldValueInvalid", "fieldPath": ".runPolicy.permanentExitCodes"},
        {"rule": f"!has({rp}.retryableExitCodes) || !{permanent}.exists(c, c in {rp}.retryableExitCodes)",
         "message": f"spec.runPolicy.retryableExitCodes: {BOTH_LISTS_MESSAGE}",
         "reason": "FieldValueInvalid", "fieldPath": ".runPolicy.retryableExitCodes"},
        {"rule": f"{rp}.backoffMaxSeconds >= {rp}.backoffSeconds",
         "messageExpression": _fmt("spec.runPolicy.backoffMaxSeconds: " + BACKOFF_MESSAGE.replace("{}", "%d"),
                                   f"{rp}.backoffMaxSeconds", f"{rp}.backoffSeconds"),
         "reason": "FieldValueInvalid", "fieldPath": ".runPolicy.backoffMaxSeconds"},
    ]


SCRIPT_RULE = {
    "rule": "(has(self.path) ? 1 : 0) + (has(self.module) ? 1 : 0) + (has(self.command) ? 1 : 0) == 1",
    "message": "spec.script: give exactly one entry point of path, module or command",
}
PLUGIN_RULES = [
    {"rule": "!has(self.module) || !has(self.preset)",
     "message": f"spec.model.preset: {PLUGIN_PRESET_MESSAGE}"},
    {"rule": f"!has(self.module) || ({' && '.join(f'has(self.{d})' for d in PLUGIN_DIMS)})",
     "message": f"spec.model: {plugin_dims_message(PLUGIN_DIMS)}"},
    {"rule": "!has(self.module) || (!has(self.family) && !has(self.hfDir))",
     "message": f"spec.model: {PLUGIN_HF_MESSAGE}"},
]
# The families' rules on spec.model (resolve.expand_model says the same).
FAMILY_RULES = [
    {"rule": (f"!has(self.hfDir) || has(self.module) || has(self.preset)"
              f" || ({' && '.join(f'has(self.{d})' for d in HF_DIMS)})"),
     "message": f"spec.model.hfDir: {hf_dims_message(HF_DIMS)}"},
    {"rule": (f"!has(self.family) || !has(self.preset) || !(self.preset in {_PRESET_FAMILIES})"
              f" || {_PRESET_FAMILIES}[self.preset] == self.family"),
     "message": f"spec.model.family: {FAMILY_PRESET_MESSAGE}"},
]


def degree_rule(name: str) -> dict[str, str]:
    return {
        "rule": "type(self) == string ? self == 'auto' : self >= 1",
        "message": (f"spec.parallelism.{name} must be an integer >= 1, unquoted ({name}: 2, not {name}: "
                    "\"2\"), or 'auto'; use 1 to disable this dimension"),
    }


def immutable_rule(name: str) -> dict[str, str]:
    return {"rule": "self == oldSelf",
            "message": f"spec.{name} is immutable; delete and recreate the job to change it"}


def presence_immutable_rule(name: str) -> dict[str, str]:
    """An optional immutable section may not appear or go either (self == oldSelf sees only both present)."""
    return {"rule": f"has(self.{name}) == has(oldSelf.{name})",
            "message": f"spec.{name} is immutable; delete and recreate the job to change it",
            "fieldPath": f".{name}"}


def spec_schema() -> dict[str, Any]:
    s = schema_of(ParallelTrainingJobSpec, keep_absent=PRESENCE_SIGNIFICANT)
    props = s["properties"]
    for d in DEGREES:
        props["parallelism"]["properties"][d]["x-kubernetes-validations"] = [degree_rule(d)]
    props["model"]["properties"]["preset"]["enum"] = list(PRESETS)
    props["model"]["x-kubernetes-validations"] = [*PLUGIN_RULES, *FAMILY_RULES]
    props["script"]["x-kubernetes-validations"] = [SCRIPT_RULE]
    for name in IMMUTABLE:
        props[name]["x-kubernetes-validations"] = [*props[name].get("x-kubernetes-validations", []),
                                                   immutable_rule(name)]
    s["x-kubernetes-validations"] = [*spec_rules(),
                                     *[presence_immutable_rule(name) for name in IMMUTABLE_PRESENCE]]
    props["checkpoint"]["properties"]["path"]["x-kubernetes-validations"] = [CHECKPOINT_PATH_RULE]
    s["description"] = "The desired training job: its size, 4D layout, model, training, data and policies."
    return s


def _without_object_defaults(s: dict[str, Any]) -> None:
    """The status is written whole by the operator: no object of it is defaulted (an empty object
    would also miss the fields it requires)."""
    for prop in s.get("properties", {}).values():
        prop.pop("default", None)
        _without_object_defaults(prop)


def status_schema() -> dict[str, Any]:
    s = schema_of(ParallelTrainingJobStatus)
    _without_object_defaults(s)
    s["description"] = "The observed state, written by the Tetrad operator."
    return s


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Job phase"},
    {"name": "Nodes", "type": "integer", "jsonPath": ".spec.nodes", "description": "Pods in the gang"},
    {"name": "Running-Nodes", "type": "integer", "jsonPath": ".status.elastic.nodes", "priority": 1,
     "description": "An elastic job's pods now (spec.elastic)"},
    {"name": "Mesh", "type": "string", "jsonPath": ".status.mesh", "description": "Resolved 4D layout"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts",
     "description": "Whole-gang restarts"},
    {"name": "Tokens/s", "type": "integer", "jsonPath": ".status.training.tokensPerSecond",
     "description": "Global throughput (whole tokens)"},
    {"name": "Last-Ckpt", "type": "integer", "jsonPath": ".status.checkpoint.step",
     "description": "Step of the last committed checkpoint"},
    # `kubectl get ptj -o wide` adds the progress `tetrad status` shows (priority 1).
    {"name": "Step", "type": "integer", "jsonPath": ".status.training.step", "priority": 1,
     "description": "Last step reported by rank 0"},
    {"name": "Steps", "type": "integer", "jsonPath": ".spec.training.steps", "priority": 1,
     "description": "Steps to train for"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.training.loss", "priority": 1,
     "description": "Last training loss"},
    {"name": "MFU", "type": "number", "jsonPath": ".status.training.mfu", "priority": 1,
     "description": "Model FLOPs utilization, 0..1"},
    {"name": "Goodput", "type": "number", "jsonPath": ".status.goodput.fraction", "priority": 1,
     "description": "Share of the wall time spent on steps that counted, 0..1"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": KIND.lower(),
                      "shortNames": [SHORT_NAME], "categories": ["tetrad", "all"]},
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": ("A 4D-parallel PyTorch training job: gang-scheduled pods running "
                                    "torchrun."),
                    "properties": {
                        "apiVersion": {"type": "string",
                                       "description": "APIVersion of this object: tetrad.dev/v1alpha1."},
                        "kind": {"type": "string",
                                 "description": "Kind of this object: ParallelTrainingJob."},
                        "metadata": {"type": "object", "properties": {"name": {
                            "type": "string", "maxLength": JOB_NAME_MAX,
                            "pattern": f"^{DNS1035_LABEL.pattern}$"}}},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                    "required": ["spec"],
                }},
            }],
        },
    }


def crd_yaml() -> str:
    import yaml

    header = "# Generated by `tetrad crd` from tetrad/api/spec.py; do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)
