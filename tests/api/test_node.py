"""The node launcher ships to pods that may have no Tetrad: tetrad.node and the tetrad.api modules it
takes import the standard library only (torch inside the functions that need it), parse as Python 3.9,
and the zip runs with an interpreter that sees no site-packages at all."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from io import BytesIO
from pathlib import Path

import pytest

from tests.api.test_layers import imports
from tetrad.node.bundle import launcher, sources

STDLIB = sys.stdlib_module_names
OLDEST_PYTHON = (3, 9)  # torch 2.5's oldest; the launcher runs with the image's python3, not Tetrad's


def test_the_zip_holds_the_launcher_and_what_it_imports() -> None:
    names = set(sources())
    assert {"__main__.py", "tetrad/node/supervisor.py", "tetrad/node/worker.py", "tetrad/api/contract.py",
            "tetrad/api/termination.py"} <= names
    assert "tetrad/api/spec.py" not in names and "tetrad/node/bundle.py" not in names
    assert launcher() == launcher() and zipfile.ZipFile(BytesIO(launcher())).namelist() == sorted(names)


@pytest.mark.parametrize("name", sorted(n for n in sources() if n.startswith("tetrad/")))
def test_a_shipped_module_imports_the_standard_library_and_torch_only_where_it_is_used(
        name: str, tmp_path: Path) -> None:
    path = tmp_path / "module.py"
    path.write_text(sources()[name])  # as shipped: the zip's tetrad.api is a stub without the pydantic models
    package = name.removesuffix(".py").replace("/", ".").removesuffix(".__init__").rpartition(".")[0]
    shipped = {n.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for n in sources()}
    for imported, in_function in imports(path, package):
        top = imported.partition(".")[0]
        if imported.startswith("tetrad"):
            assert imported in shipped, f"{name} imports {imported}, which the launcher zip does not hold"
        elif top == "torch":
            assert in_function, f"{name} imports torch at module level: the supervisor runs without it"
        else:
            assert top in STDLIB or top == "__future__", (
                f"{name} imports {imported}: the launcher has only the standard library")


@pytest.mark.parametrize("name", sorted(sources()))
def test_a_shipped_module_parses_as_the_oldest_python_a_pod_may_have(name: str) -> None:
    ast.parse(sources()[name], filename=name, feature_version=OLDEST_PYTHON)
    assert "strict=" not in sources()[name], f"{name}: zip(strict=...) is Python 3.10"


def test_the_zip_runs_without_site_packages(tmp_path: Path) -> None:
    pyz = tmp_path / "tetrad-node.pyz"
    pyz.write_bytes(launcher())
    marker = tmp_path / "ran"
    r = subprocess.run([sys.executable, "-I", "-S", str(pyz), "supervise", "--", sys.executable, "-c",
                        f"open({str(marker)!r}, 'w').write('yes')"], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert marker.read_text() == "yes"
    usage = subprocess.run([sys.executable, "-I", "-S", str(pyz)], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage: tetrad-node.pyz" in usage.stderr


def test_a_worker_leaves_the_interpreter_to_the_images_own_tetrad_through_a_symlinked_zip(
        tmp_path: Path) -> None:
    """In a pod the zip is a ConfigMap key: /etc/tetrad/tetrad-node.pyz links into the volume's ..data
    directory. The worker must still drop its own `tetrad` (a stub without the pydantic models) before the
    entry point imports the image's."""
    data = tmp_path / "..2026_11_27_data"
    data.mkdir()
    (data / "tetrad-node.pyz").write_bytes(launcher())
    (tmp_path / "tetrad-node.pyz").symlink_to(Path(data.name) / "tetrad-node.pyz")
    entry = tmp_path / "entry.py"
    entry.write_text("import tetrad.api.resolved, tetrad.node.worker\nprint(tetrad.api.resolved.__file__)\n")
    r = subprocess.run([sys.executable, str(tmp_path / "tetrad-node.pyz"), "worker", "--path", str(entry)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert ".pyz" not in r.stdout and r.stdout.strip().endswith("tetrad/api/resolved.py"), r.stdout
