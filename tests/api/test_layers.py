"""The layers of the core point one way; checked over the import statements of every module (ast).

    cli (tetrad.cli: commands, the plan report)         top
    launch (tetrad.launch: `tetrad run`)
    render (tetrad.render: pure renderer)
    convert (tetrad.convert: Kubeflow jobs to script jobs, checked by resolve)
    resolve (tetrad.resolve: validation and resolution)
    plan (tetrad.plan: estimates, step time, the solver)
    node (tetrad.node: the launcher in every pod)
    api (tetrad.api: model, contract, rules, quantity)   bottom

A module may import its own layer and the layers below it, never above. The core never imports
the operator or the trainer; the trainer imports only tetrad.api and tetrad.node of the core
(tests/api/test_node.py checks what tetrad.node itself may import).

The operator has layers of its own (OPERATOR_LAYERS): the Kubernetes protocol and the status model
at the bottom, the pure decisions (lifecycle) below everything that talks to the API server, the
controller above them, kopf's handlers on top. It holds no code for tests; the tests' in-memory
Kubernetes knows the operator only by its protocol.

Each gang scheduler is a plug-in, one module of tetrad.render.gangs that only the package's
registry imports: the renderer and the operator reach it through the registry.

Deferred imports: an import inside a function is allowed for third-party modules (heavy ones such
as rich, yaml or kopf load only when used) and for a CLI subcommand's module; a deferred import of
another layer of the core anywhere else is a cycle dodged, and fails here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
LAYERS = [("tetrad.api",), ("tetrad.node",), ("tetrad.plan",), ("tetrad.resolve",), ("tetrad.convert",),
          ("tetrad.render",), ("tetrad.launch",), ("tetrad.cli",)]
OUTSIDE_THE_CORE = ("tetrad_operator", "tetrad_trainer")
OPERATOR = ROOT / "operator"
OPERATOR_LAYERS = [  # bottom first
    # the protocol, resource vectors, the operator's metrics, the job's status
    ("kubeapi", "resources", "operator_metrics", "status"),
    ("observed",),  # views of pods and nodes
    ("packing", "scrape"),  # the built-in gang's fit; rank 0's figures
    ("lifecycle",),  # the pure decisions: no API calls
    ("settings",),
    ("kube", "informer"),  # the REST client; watched kinds in memory
    ("admission",),
    ("controller",),
    ("handlers", "main"),  # kopf
    ("command", "__main__"),
]


def layer(module: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, package: str, names: bool = False) -> Iterator[tuple[str, bool]]:
    """(imported module, inside a function) for every import statement of the file; with `names`,
    module.name for each name a `from module import` takes (a submodule, or one of its attributes)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    deferred: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            deferred.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in deferred
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                assert node.module is not None
                module = node.module
            for name in [f"{module}.{a.name}" for a in node.names] if names else [module]:
                yield name, id(node) in deferred


def core_modules() -> list[tuple[str, Path]]:
    return sorted((module_name(p, ROOT), p) for p in (ROOT / "tetrad").rglob("*.py"))


def test_every_core_module_has_a_layer():
    assert [m for m, _ in core_modules() if m != "tetrad" and layer(m) is None] == []


@pytest.mark.parametrize("module, path", core_modules(), ids=[m for m, _ in core_modules()])
def test_core_imports_point_down(module: str, path: Path) -> None:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    own = layer(module)
    for imported, in_function in imports(path, package):
        assert not imported.startswith(OUTSIDE_THE_CORE), (
            f"{module} imports {imported}: the core never imports the operator or the trainer")
        target = layer(imported)
        if target is None:
            continue  # the standard library or a third-party package
        assert own is not None and target <= own, (
            f"{module} (layer {LAYERS[own or 0]}) imports {imported} from a layer above")
        if in_function:
            subcommand = own == len(LAYERS) - 1  # the CLI loads a command's modules when the command runs
            assert subcommand, (
                f"{module} defers the import of {imported}: a dodged cycle; import it at the top")


def test_api_and_plan_import_nothing_above_them():
    """The two bottom layers, spelt out (the parametrized test above covers them too)."""
    for module, path in core_modules():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for imported, _ in imports(path, package):
            if module.startswith("tetrad.api"):
                assert not imported.startswith(("tetrad.node", "tetrad.plan", "tetrad.resolve",
                                                "tetrad.render", "tetrad.launch",
                                                "tetrad.cli")), (module, imported)
            if module.startswith("tetrad.plan"):
                assert not imported.startswith(
                    ("tetrad.resolve", "tetrad.render", "tetrad.launch", "tetrad.cli")), (module, imported)


def operator_modules() -> list[tuple[str, Path]]:
    return sorted((module_name(p, OPERATOR), p) for p in (OPERATOR / "tetrad_operator").rglob("*.py"))


def operator_layer(module: str) -> int | None:
    part = module.removeprefix("tetrad_operator.").split(".")[0]
    return next((i for i, names in enumerate(OPERATOR_LAYERS) if part in names), None)


def test_every_operator_module_has_a_layer():
    assert [m for m, _ in operator_modules() if m != "tetrad_operator" and operator_layer(m) is None] == []


@pytest.mark.parametrize("module, path", operator_modules(), ids=[m for m, _ in operator_modules()])
def test_operator_imports_point_down(module: str, path: Path) -> None:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    own = operator_layer(module)
    for imported, _ in imports(path, package, names=True):
        assert imported != "tests" and not imported.startswith("tests."), (
            f"{module} imports {imported}: test code")
        if imported == "tetrad_operator" or not imported.startswith("tetrad_operator."):
            continue
        target = operator_layer(imported)
        assert own is None or (target is not None and target <= own), \
            f"{module} (layer {OPERATOR_LAYERS[own][0]}) imports {imported} from a layer above"


GANGS = "tetrad.render.gangs"
GANGS_SHARED = ("backend", "topology")  # the protocol, and the stage topology every backend shares


def gang_backends() -> list[str]:
    return [m for m, _ in core_modules()
            if m.startswith(GANGS + ".") and m.rpartition(".")[2] not in GANGS_SHARED]


def test_each_gang_backend_is_one_module_that_only_the_registry_imports():
    """A gang scheduler is a plug-in: one module of tetrad.render.gangs, registered in its __init__.
    No backend imports another, and the renderer and the operator reach a backend only through the
    registry, so no code outside its module names a scheduler's objects."""
    backends = gang_backends()
    assert {"tetrad.render.gangs.builtin", "tetrad.render.gangs.kueue"} <= set(backends), "the walk is broken"
    registry = ROOT / "tetrad" / "render" / "gangs" / "__init__.py"
    assert {m for m, _ in imports(registry, GANGS, names=True)} >= set(backends), (
        "a backend the registry does not know")
    everything = [*core_modules(), *operator_modules()]
    for module, path in everything:
        if module == GANGS:
            continue
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for imported, _ in imports(path, package, names=True):
            reached = [b for b in backends if imported == b or imported.startswith(b + ".")]
            assert not [b for b in reached if b != module], (
                f"{module} imports {imported}: a gang backend is the registry's")


def test_the_in_memory_kubernetes_knows_the_operator_by_its_protocol_alone():
    memory = ROOT / "tests" / "operator" / "memory_kube.py"
    used = {m.split(".")[1] for m, _ in imports(memory, "tests.operator", names=True)
            if m.startswith("tetrad_operator")}
    assert used == {"kubeapi"}, used


def test_trainer_imports_only_the_api_and_the_node_launcher_of_the_core():
    trainer = ROOT / "trainer-image"
    found = []
    for path in sorted((trainer / "tetrad_trainer").rglob("*.py")):
        module = module_name(path, trainer)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for imported, _ in imports(path, package):
            if (imported.startswith(("tetrad.", "kopf", "kubernetes", "tetrad_operator"))
                    or imported == "tetrad"):
                found.append(imported)
                assert (imported.startswith(("tetrad.api.", "tetrad.node."))
                        or imported in ("tetrad.api", "tetrad.node")), \
                    f"{module} imports {imported}: the trainer uses only tetrad.api and tetrad.node"
    assert found, "no import of tetrad.api found: the walk is broken"
