"""The job's status, read and written through its model.

`ParallelTrainingJobStatus` (tetrad.api.spec) generates the CRD's status schema. The operator reads
the stored status into it (`read`), builds the next one as the model, and writes the difference as
one JSON merge patch keyed by the model's aliases (`patch`): a field the model lacks cannot be
written, where the API server would have dropped a misspelled key without a word.

Two writers share the status. A pass of the job's loop owns every field but SCRAPER_OWNED and
writes them whole; the scraper owns the SCRAPER_OWNED objects and merges into them field by field,
as does a pass that learned one of their fields (`changes`), so that neither undoes the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Final, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from tetrad.api.spec import ParallelTrainingJobStatus

# fields of ParallelTrainingJobStatus
SCRAPER_OWNED: Final = ("training", "checkpoint", "preflight", "stragglers", "trainer_time")
_SCRAPER_KEYS: Final = frozenset(ParallelTrainingJobStatus.model_fields[f].alias or f for f in SCRAPER_OWNED)
_KEYS: Final = frozenset(f.alias or name for name, f in ParallelTrainingJobStatus.model_fields.items())


M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class StatusField:
    """A field of the status model, where it is stored and what it holds."""

    path: str  # field names from the status down, e.g. training.tokens_per_second
    key: str  # its camelCase alias in its object, e.g. tokensPerSecond
    kind: type  # int, float, str or a status object

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]


@cache
def field(path: str) -> StatusField:
    """The field of ParallelTrainingJobStatus at `path`; KeyError when the model has no such field."""
    model: type[BaseModel] = ParallelTrainingJobStatus
    *objects, name = path.split(".")
    for parent in objects:
        model = field_kind(model, parent)
    return StatusField(path, model.model_fields[name].alias or name, field_kind(model, name))


def field_kind(model: type[BaseModel], name: str) -> Any:
    """The type of a model's field, None aside (`X | None` is X)."""
    annotation = model.model_fields[name].annotation
    return next((a for a in get_args(annotation) if a is not type(None)), annotation)


def read(stored: Mapping[str, Any] | None, *, scraped: bool = True) -> ParallelTrainingJobStatus:
    """The stored status as the model (without the SCRAPER_OWNED objects unless `scraped`). A field
    it cannot read (one a newer operator writes, or a value edited by hand) is left out, and the rest
    still counts."""
    data = {k: v for k, v in (stored or {}).items() if scraped or k not in _SCRAPER_KEYS}
    while True:
        try:
            return ParallelTrainingJobStatus.model_validate(data)
        except ValidationError as e:
            named = {error["loc"][0] for error in e.errors() if error["loc"]}
            if not (unreadable := [k for k in data if k in named]):
                raise
            for key in unreadable:
                del data[key]


def wire(model: BaseModel) -> dict[str, Any]:
    """The status, or one of its objects, as stored: the fields set (read, or assigned since),
    camelCase, none of them null."""
    return model.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude_none=True)


def whole(model: BaseModel) -> dict[str, Any]:
    """A status object as a merge patch that replaces the stored one: every field, null where unset."""
    return {(f.alias or name): None for name, f in type(model).model_fields.items()} | wire(model)


def merged(model: M, fields: Mapping[str, Any]) -> M:
    """A status object with `fields` (camelCase, as a scrape reads them; None removes one) merged in."""
    return type(model).model_validate({**wire(model), **fields})


def changes(before: BaseModel | None, after: BaseModel) -> dict[str, Any]:
    """What a merge patch of one status object must say to turn `before` into `after`: the fields
    that differ, and None for each field `after` no longer has."""
    old, new = wire(before) if before is not None else {}, wire(after)
    return {k: new.get(k) for k in [*new, *(k for k in old if k not in new)] if old.get(k) != new.get(k)}


def patch(stored: Mapping[str, Any], new: ParallelTrainingJobStatus,
          learned: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any] | None:
    """The merge patch of status that writes a pass's outcome over the `stored` status, or None when
    it would change nothing. `new` is written whole but for SCRAPER_OWNED (a field of the model it
    lacks is removed; one the model does not know is left alone); `learned` is merged into the
    SCRAPER_OWNED objects (None removes a field), leaving out what they hold already."""
    written = {k: v for k, v in wire(new).items() if k not in _SCRAPER_KEYS}
    current = {k: v for k, v in stored.items() if k in _KEYS and k not in _SCRAPER_KEYS}
    merging = {key: changed for key, fields in (learned or {}).items()
               if (changed := {k: v for k, v in fields.items() if (stored.get(key) or {}).get(k) != v})}
    assert merging.keys() <= _SCRAPER_KEYS, merging.keys()
    if written == current and not merging:
        return None
    return _over(current, written) | merging


def _over(stored: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch that turns `stored` into `new` (objects in it too): a key `new` lacks is null."""
    return {k: _over(stored[k], v) if isinstance(v, Mapping) and isinstance(stored.get(k), Mapping) else v
            for k, v in new.items()} | {k: None for k in stored if k not in new}
