"""From YAML text to the model: bounded, strict parsing, and pydantic errors as field-named problems.

`load_manifests` reads what a user hands the CLI and refuses, before anything is expanded or
built, what could exhaust the process: text over MAX_MANIFEST_BYTES (the apiserver's 3 MiB request
cap), nesting deeper than MAX_DEPTH, aliases that expand to more than MAX_ALIAS_EXPANSION nodes
beyond the text's own (a "billion laughs" bomb) or refer to themselves. Duplicate keys are errors
naming both lines. Plain scalars and mapping keys are read as kubectl reads them (tetrad.api.scalars:
`lr: 3e-4` is a number, `y` a boolean, a key `1` the text "1"); timestamps stay strings, as they do
in the JSON kubectl sends.
"""

from __future__ import annotations

import re
from typing import Any, Final

import yaml
from pydantic import ValidationError

from tetrad.api.contract import API_VERSION, KIND
from tetrad.api.problems import Problem
from tetrad.api.scalars import NUMBER_START, go_scalar, mapping_key, plain_scalar
from tetrad.api.spec import ParallelTrainingJob

MAX_MANIFEST_BYTES: Final = 3 * 1024 * 1024
MAX_DEPTH: Final = 64
MAX_ALIAS_EXPANSION: Final = 10_000
# Longest value or field name quoted in a problem.
MAX_SHOWN: Final = 80


class ManifestError(Exception):
    """Text that cannot be read as manifests; the message is user-facing and names the line."""


def shorten(text: str, limit: int = MAX_SHOWN) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def quoted(value: Any, limit: int = MAX_SHOWN) -> str:
    """A value as Python writes it, cut at `limit` characters; a cut string counts its own characters, not
    its quotes."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return shorten(repr(value), limit)


_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# The tags of the plain scalars PyYAML resolves by YAML 1.1's rules, which kubectl reads otherwise.
_YAML11_TAGS: Final = frozenset(f"tag:yaml.org,2002:{t}"
                                for t in ("bool", "int", "float", "null", "timestamp"))
# Every other plain scalar that may be one of them: read by tetrad.api.scalars.plain_scalar instead.
_KUBECTL_PLAIN: Final = "tag:tetrad.dev,2025:kubectl-plain"
_KUBECTL_FIRST: Final = ["", *"~yYnNtTfFoO", *NUMBER_START]


def _resolvers() -> dict[Any, list[tuple[str, Any]]]:
    table: dict[Any, list[tuple[str, Any]]] = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML11_TAGS]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for first in _KUBECTL_FIRST:
        table.setdefault(first, []).insert(0, (_KUBECTL_PLAIN, re.compile(r".*", re.DOTALL)))
    return table


class _Resolver(yaml.resolver.Resolver):
    """Which plain scalars `plain_scalar` reads (for writers that must know what kubectl reads back)."""

    yaml_implicit_resolvers = _resolvers()


_RESOLVER: Final = _Resolver()


def reads_as_string(text: str) -> bool:
    """Whether kubectl reads `text`, written plain (unquoted), as that same string."""
    tag = _RESOLVER.resolve(yaml.ScalarNode, text, (True, False))  # type: ignore[no-untyped-call]
    return tag == "tag:yaml.org,2002:str" or (tag == _KUBECTL_PLAIN and plain_scalar(text) == text)


class _Loader(_Base):  # type: ignore[misc]
    """SafeLoader (libyaml's parser when available) that rejects duplicate keys and reads plain scalars
    and keys as kubectl does (timestamps stay text)."""

    yaml_implicit_resolvers = _Resolver.yaml_implicit_resolvers

    def construct_kubectl_plain(self, node: yaml.ScalarNode) -> Any:
        return plain_scalar(node.value)

    def _key(self, node: yaml.Node, deep: bool = True) -> Any:
        """A key as JSON has it: from go-yaml's value (a float key keeps its float spelling,
        1e6 -> "1e+06")."""
        if node.tag == _KUBECTL_PLAIN:
            return mapping_key(go_scalar(node.value))
        return mapping_key(self.construct_object(node, deep=deep))

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self._key(key_node)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get((type(key), key))
            except TypeError:
                raise ManifestError(f"line {line}: a mapping key must be a scalar") from None
            if first is not None:
                raise ManifestError(f"line {line}: duplicate key {quoted(key)} (first at line {first});"
                                    " remove one of them")
            seen[(type(key), key)] = line
        self.flatten_mapping(node)  # merge keys (<<) first, the keys written here over them
        mapping: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = self._key(key_node, deep)
            try:
                mapping[key] = self.construct_object(value_node, deep=deep)
            except TypeError:
                raise ManifestError(
                    f"line {key_node.start_mark.line + 1}: a mapping key must be a scalar") from None
        return mapping


_Loader.add_constructor(_KUBECTL_PLAIN, _Loader.construct_kubectl_plain)


def _check_graph(root: yaml.Node) -> None:
    """Depth, alias expansion and alias cycles of a composed document, without expanding it."""
    expanded: dict[int, int] = {}  # id(node) -> nodes it stands for when expanded
    on_path: set[int] = set()
    distinct = 0
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else (
            node.value if isinstance(node, yaml.SequenceNode) else [])
        if done:
            on_path.discard(key)
            expanded[key] = 1 + sum(expanded[id(c)] for c in children)
            continue
        if key in on_path:
            raise ManifestError(
                f"line {node.start_mark.line + 1}: an alias refers to a node that contains it")
        if key in expanded:
            continue
        if depth > MAX_DEPTH:
            raise ManifestError(f"line {node.start_mark.line + 1}: nested deeper than {MAX_DEPTH} levels")
        distinct += 1
        on_path.add(key)
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in expanded)
    extra = expanded[id(root)] - distinct
    if extra > MAX_ALIAS_EXPANSION:
        raise ManifestError(f"aliases expand to {extra} more nodes than the text holds (limit "
                            f"{MAX_ALIAS_EXPANSION}); write the repeated parts out or drop the anchors")


def load_manifests(text: str | bytes) -> list[Any]:
    """The non-empty YAML documents of `text`; ManifestError (naming the line) for anything refused."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{len(text)} bytes is over the {MAX_MANIFEST_BYTES}-byte limit of a manifest")
    loader = _Loader(text)
    docs: list[Any] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            _check_graph(node)
            docs.append(loader.construct_document(node))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ManifestError(
            f"invalid YAML{where}: {shorten(getattr(e, 'problem', None) or str(e), 200)}") from None
    except RecursionError:
        raise ManifestError(f"nested deeper than {MAX_DEPTH} levels") from None
    finally:
        loader.dispose()
    return [d for d in docs if d is not None]


def parse(document: Any) -> tuple[ParallelTrainingJob | None, list[Problem]]:
    """The job, or None and the problems that keep the document from being one."""
    if not isinstance(document, dict):
        return None, [Problem("<document>", f"expected a YAML mapping, got {type(document).__name__}")]
    if document.get("kind") != KIND:
        return None, [Problem("kind", f"kind={quoted(document.get('kind'))} is not {KIND}; set kind: {KIND}")]
    if document.get("apiVersion") != API_VERSION:
        return None, [Problem("apiVersion", f"apiVersion={quoted(document.get('apiVersion'))} is not "
                                            f"supported; set apiVersion: {API_VERSION}")]
    try:
        return ParallelTrainingJob.model_validate(document), []
    except ValidationError as e:
        return None, _from_pydantic(e.errors())


# Union members pydantic names in an error's location (int | 'auto' degrees): not fields.
_UNION_TAGS: Final = ("int", "literal['auto']", "str", "none")


def _from_pydantic(errs: list[Any]) -> list[Problem]:
    """One problem per field; the alternatives of a union (an int or 'auto') merge into one."""
    by_field: dict[str, list[str]] = {}
    for err in errs:
        loc = [shorten(str(x), 40) for x in err["loc"] if not (isinstance(x, str) and x in _UNION_TAGS)]
        field = ".".join(loc) or "<document>"
        by_field.setdefault(field, []).append(_message(err))
    return [Problem(field, " or ".join(dict.fromkeys(msgs))) for field, msgs in by_field.items()]


def _message(err: Any) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field; remove it or check its spelling against `kubectl explain ptj.spec`"
    if err["type"] == "missing":
        return "required field is missing"
    msg = str(err["msg"]).removeprefix("Value error, ")
    value = err.get("input")
    shown = "" if isinstance(value, dict | list) else f" (got {quoted(value)})"
    return f"{msg}{shown}"
