"""The Kubernetes schema of the pod fields a spec passes through (env, volumes, volumeMounts,
tolerations, affinity, checkpoint.volume), so that what validation admits the apiserver accepts.

podschema.json is generated from the kubernetes client's models (`python -m tetrad.api.podschema >
tetrad/api/podschema.json`; tests/api/test_hostile.py fails when it drifts), so the core validates
without depending on that client. `check` implements the subset of JSON Schema the file uses:
type, properties, required, additionalProperties, items, anyOf and $ref. On top of the types,
`check_pod_fields` adds the apiserver's rules the schema cannot say (names, uniqueness, one source
per volume, toleration operators) and Tetrad's own (reserved env names, volumes, mounts, labels).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from importlib.resources import files
from typing import TYPE_CHECKING, Any, Final

from tetrad.api import contract
from tetrad.api.problems import Problem

if TYPE_CHECKING:
    from tetrad.api.spec import ParallelTrainingJobSpec

# Spec field -> the Kubernetes model of one item.
MODELS: Final = {"env": "V1EnvVar", "volumes": "V1Volume", "volumeMounts": "V1VolumeMount",
                 "tolerations": "V1Toleration", "affinity": "V1Affinity"}
_KEEP: Final = ("type", "properties", "required", "additionalProperties", "items", "anyOf", "$ref")
_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),),
}


def generate() -> dict[str, Any]:
    """The schema of MODELS from the installed kubernetes client, reduced to the keywords `check` reads."""
    from typing import Union

    from kubernetes import client
    from pydantic import TypeAdapter

    union: Any = Union[tuple(getattr(client, m) for m in MODELS.values())]  # noqa: UP007
    full = TypeAdapter(dict[str, union]).json_schema(by_alias=True)

    def reduce(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: reduce(v) for k, v in node.items() if k in _KEEP}
            if "properties" in node:
                out["properties"] = {k: reduce(v) for k, v in node["properties"].items()}
            if "$ref" in out:
                out["$ref"] = out["$ref"].rsplit("/", 1)[-1]
            return out
        if isinstance(node, list):
            return [reduce(v) for v in node]
        return node

    return {name: reduce(d) for name, d in sorted(full["$defs"].items())}


@cache
def definitions() -> dict[str, Any]:
    return json.loads(  # type: ignore[no-any-return]
        files("tetrad.api").joinpath("podschema.json").read_text())


def check(value: Any, model: str, path: str) -> Iterator[tuple[str, str]]:
    """(field path, message) for each way `value` is not a valid `model` object."""
    yield from _check(value, {"$ref": model}, path, definitions())


def _check(value: Any, schema: dict[str, Any], path: str, defs: dict[str, Any]) -> Iterator[tuple[str, str]]:
    if "$ref" in schema:
        schema = defs[schema["$ref"]]
    if "anyOf" in schema:
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        if value is None and len(options) < len(schema["anyOf"]):
            return
        # Pick the alternative whose type fits; the client's unions are "X or null".
        for option in options:
            if _type_ok(value, option, defs):
                yield from _check(value, option, path, defs)
                return
        yield path, f"expected {' or '.join(_type_name(o, defs) for o in options)}, got {_got(value)}"
        return
    if not _type_ok(value, schema, defs):
        yield path, f"expected {_type_name(schema, defs)}, got {_got(value)}"
        return
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                yield f"{path}.{key}", "required field is missing"
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                yield from _check(item, props[key], f"{path}.{key}", defs)
            elif extra is False:
                yield f"{path}.{key}", "unknown field; check its spelling against `kubectl explain pod.spec`"
            elif isinstance(extra, dict):
                yield from _check(item, extra, f"{path}.{key}", defs)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from _check(item, schema["items"], f"{path}[{i}]", defs)


def _type_ok(value: Any, schema: dict[str, Any], defs: dict[str, Any]) -> bool:
    if "$ref" in schema:
        schema = defs[schema["$ref"]]
    kind = schema.get("type")
    if kind is None:
        return True
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, _TYPES[kind])


def _type_name(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in schema:
        return "an object"
    return {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
            "object": "an object", "array": "a list"}.get(schema.get("type", ""), "a value")


def _got(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# k8s.io/apimachinery/pkg/util/validation
_LABEL_NAME: Final = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS1123_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_ENV_NAME: Final = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_RESERVED_LABEL_PREFIX: Final = contract.GROUP + "/"
TOLERATION_OPERATORS: Final = ("Exists", "Equal")
TAINT_EFFECTS: Final = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def is_dns_label(name: str) -> bool:
    return len(name) <= 63 and bool(_DNS1123_LABEL.fullmatch(name))


def is_dns_subdomain(name: str) -> bool:
    return len(name) <= 253 and bool(_DNS1123_SUBDOMAIN.fullmatch(name))


def qualified_name_problem(key: str) -> str | None:
    """Why `key` is not a label or annotation key ([prefix/]name), or None."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and not is_dns_subdomain(prefix):
        return "the prefix before '/' must be a DNS subdomain (lowercase, e.g. example.com)"
    if len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        return ("the name must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter "
                "or digit")
    return None


def label_value_problem(value: str) -> str | None:
    if value and (len(value) > 63 or not _LABEL_NAME.fullmatch(value)):
        return ("a label value must be empty or 1-63 letters, digits, '-', '_' or '.', starting and ending "
                "with a letter or digit")
    return None


def check_pod_fields(spec: ParallelTrainingJobSpec) -> list[Problem]:
    """Problems of the pass-through pod fields, each naming its path (spec.template.env[0].name)."""
    t = spec.template
    problems = [Problem(path, msg) for field, value in (("env", t.env), ("volumes", t.volumes),
                                                         ("volumeMounts", t.volume_mounts),
                                                         ("tolerations", t.tolerations))
                for i, item in enumerate(value)
                for path, msg in check(item, MODELS[field], f"spec.template.{field}[{i}]")]
    if t.affinity is not None:
        problems += [Problem(p, m)
                     for p, m in check(t.affinity, MODELS["affinity"], "spec.template.affinity")]
    if spec.checkpoint.volume is not None:
        volume = {"name": contract.CHECKPOINT_VOLUME, **spec.checkpoint.volume}
        problems += [Problem(p, m) for p, m in check(volume, "V1Volume", "spec.checkpoint.volume")]
        problems += _volume_sources(volume, "spec.checkpoint.volume")
    if problems:  # the rules below read fields whose types the schema just refused
        return problems
    problems += _env(spec)
    problems += _volumes(spec)
    problems += _tolerations(spec)
    problems += _labels(spec)
    for field, value in (("priorityClassName", t.priority_class_name),
                         ("serviceAccountName", t.service_account_name)):
        if value is not None and not is_dns_subdomain(value):
            problems.append(Problem(f"spec.template.{field}", f"{value!r:.80} is not a DNS subdomain "
                                    "(lowercase letters, digits, '-', '.')"))
    if spec.gang.queue is not None and (why := label_value_problem(spec.gang.queue) if spec.gang.queue
                                        else "must not be empty"):
        problems.append(Problem("spec.gang.queue", f"{spec.gang.queue!r:.80}: {why}"))
    return problems


def _env(spec: ParallelTrainingJobSpec) -> Iterator[Problem]:
    for i, var in enumerate(spec.template.env):
        path, name = f"spec.template.env[{i}]", var["name"]
        if not _ENV_NAME.fullmatch(name):
            yield Problem(f"{path}.name", f"{name!r:.80} is not an environment variable name (letters, "
                          "digits, '_', '-', '.', not starting with a digit)")
        elif name in contract.RESERVED_ENV or name.startswith(contract.RESERVED_ENV_PREFIXES):
            yield Problem(f"{path}.name", f"{name} is set by Tetrad or torchrun for every node; remove it"
                          " (the job's spec fields control it)")
        if var.get("value") is not None and var.get("valueFrom") is not None:
            yield Problem(path, "set value or valueFrom, not both")


def _volume_sources(volume: dict[str, Any], path: str) -> list[Problem]:
    sources = [k for k, v in volume.items() if k != "name" and v is not None]
    if len(sources) != 1:
        return [Problem(path, "a volume needs exactly one source (e.g. persistentVolumeClaim or emptyDir), "
                        f"got {len(sources)}")]
    return []


def _volumes(spec: ParallelTrainingJobSpec) -> Iterator[Problem]:
    t = spec.template
    pod_volumes = set(contract.POD_VOLUMES) | ({contract.CHECKPOINT_VOLUME} if spec.checkpoint.volume
                                               else set())
    names: set[str] = set()
    for i, volume in enumerate(t.volumes):
        path, name = f"spec.template.volumes[{i}]", volume["name"]
        if not is_dns_label(name):
            yield Problem(f"{path}.name",
                          f"{name!r:.80} is not a DNS label (lowercase letters, digits, '-', at most 63)")
        elif name in pod_volumes:
            yield Problem(f"{path}.name", f"volume {name} is one of the pod's own "
                          f"({', '.join(sorted(pod_volumes))}); rename it")
        elif name in names:
            yield Problem(f"{path}.name", f"volume {name} is defined twice")
        names.add(name)
        yield from _volume_sources(volume, path)
    paths = {p: f"the pod's {v} volume" for v, p in contract.POD_VOLUMES.items()}
    if spec.checkpoint.volume:
        if spec.checkpoint.path in paths:
            yield Problem("spec.checkpoint.path", f"{spec.checkpoint.path} is already the mount path of"
                          f" {paths[spec.checkpoint.path]}; use e.g. /checkpoints")
        paths[spec.checkpoint.path] = "checkpoint.volume"
    for i, mount in enumerate(t.volume_mounts):
        path = f"spec.template.volumeMounts[{i}]"
        if mount["name"] not in names | pod_volumes:
            yield Problem(f"{path}.name",
                          f"no volume named {mount['name']!r:.80}; add it to spec.template.volumes")
        where = str(mount["mountPath"]).rstrip("/") or "/"
        if not where.startswith("/") or ":" in where:
            yield Problem(f"{path}.mountPath", f"{where!r:.80} must be an absolute path without ':'")
        elif where in paths:
            yield Problem(f"{path}.mountPath",
                          f"{where} is already the mount path of {paths[where]}; choose another")
        paths[where] = f"spec.template.volumeMounts[{i}]"


def _tolerations(spec: ParallelTrainingJobSpec) -> Iterator[Problem]:
    for i, tol in enumerate(spec.template.tolerations):
        path, op, effect = (f"spec.template.tolerations[{i}]", tol.get("operator") or "Equal",
                            tol.get("effect") or "")
        if op not in TOLERATION_OPERATORS:
            yield Problem(f"{path}.operator", f"{op!r:.80} is not one of {', '.join(TOLERATION_OPERATORS)}")
        if op == "Exists" and tol.get("value"):
            yield Problem(f"{path}.value", "must be empty when operator is Exists")
        if not tol.get("key") and op != "Exists":
            yield Problem(f"{path}.operator", "must be Exists when key is empty")
        if tol.get("key") and (why := qualified_name_problem(tol["key"])):
            yield Problem(f"{path}.key", why)
        if op == "Equal" and tol.get("value") and (why := label_value_problem(tol["value"])):
            yield Problem(f"{path}.value", why)
        if effect and effect not in TAINT_EFFECTS:
            yield Problem(f"{path}.effect", f"{effect!r:.80} is not one of {', '.join(TAINT_EFFECTS)}")
        if tol.get("tolerationSeconds") is not None and effect != "NoExecute":
            yield Problem(f"{path}.effect", "must be NoExecute when tolerationSeconds is set")


def _labels(spec: ParallelTrainingJobSpec) -> Iterator[Problem]:
    t = spec.template
    for field, mapping in (("labels", t.labels), ("nodeSelector", t.node_selector)):
        for key, value in mapping.items():
            path = f"spec.template.{field}[{key!r:.80}]"
            if why := qualified_name_problem(key):
                yield Problem(path, f"invalid key: {why}")
            elif field == "labels" and (key.startswith(_RESERVED_LABEL_PREFIX)
                                        or key == contract.LABEL_MANAGED_BY):
                yield Problem(path, f"label {key} is set by Tetrad; use another key")
            if why := label_value_problem(value):
                yield Problem(path, f"invalid value {value!r:.80}: {why}")
    for key in t.annotations:
        if why := qualified_name_problem(key):
            yield Problem(f"spec.template.annotations[{key!r:.80}]", f"invalid key: {why}")
    if sum(len(k) + len(v) for k, v in t.annotations.items()) > 256 * 1024:
        yield Problem("spec.template.annotations", "annotations total over 256 KiB, the apiserver's limit")


if __name__ == "__main__":
    print(json.dumps(generate(), indent=1, sort_keys=True))
