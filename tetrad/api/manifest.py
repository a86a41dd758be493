"""From a manifest (a parsed YAML mapping) to the model: pydantic errors become field-named problems."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tetrad.api.contract import API_VERSION, KIND
from tetrad.api.problems import Problem
from tetrad.api.spec import ParallelTrainingJob


def parse(document: Any) -> tuple[ParallelTrainingJob | None, list[Problem]]:
    """The job, or None and the problems that keep the document from being one."""
    if not isinstance(document, dict):
        return None, [Problem("<document>", f"expected a YAML mapping, got {type(document).__name__}")]
    if document.get("kind") != KIND:
        return None, [Problem("kind", f"kind={document.get('kind')!r} is not {KIND}; set kind: {KIND}")]
    if document.get("apiVersion") != API_VERSION:
        return None, [Problem("apiVersion", f"apiVersion={document.get('apiVersion')!r} is not supported; set apiVersion: {API_VERSION}")]
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
