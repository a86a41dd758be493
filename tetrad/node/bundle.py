"""The launcher as one file: a zip of tetrad.node and the tetrad.api modules it imports, which
`python3 tetrad-node.pyz` runs (zipapp) with nothing else installed.

The renderer puts it in every job's config ConfigMap (contract.LAUNCHER_FILE, mounted at CONFIG_DIR),
so the launcher a pod runs is always the one its operator rendered, whatever the image holds;
`tetrad run` writes it into its work directory. The zip is the same bytes for the same sources.
"""

from __future__ import annotations

import ast
import functools
import io
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the tetrad package
# The zip's tetrad.api is a plain namespace: the real package's __init__ imports the pydantic models.
API_INIT = '"""The standard-library modules of tetrad.api the launcher needs (tetrad.node.bundle)."""\n'
MAIN = "import sys\n\nfrom tetrad.node.__main__ import main\n\nsys.exit(main())\n"
ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def _imported_api_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        if isinstance(node, ast.ImportFrom) and node.module == "tetrad.api":  # from tetrad.api import module
            names = [f"tetrad.api.{a.name}" for a in node.names]
        found.update(n for n in names if n.startswith("tetrad.api."))
    return found


def sources() -> dict[str, str]:
    """The zip's files (archive name -> text): tetrad.node's modules and, transitively, the tetrad.api
    modules they import."""
    files = {"__main__.py": MAIN, "tetrad/__init__.py": (ROOT / "__init__.py").read_text(),
             "tetrad/api/__init__.py": API_INIT}
    todo = []
    for path in sorted((ROOT / "node").glob("*.py")):
        if path.name != "bundle.py":
            files[f"tetrad/node/{path.name}"] = path.read_text()
            todo.append(path)
    while todo:
        for module in _imported_api_modules(todo.pop()):
            name = module.replace(".", "/") + ".py"
            if name not in files:
                files[name] = (ROOT.parent / name).read_text()
                todo.append(ROOT.parent / name)
    return files


@functools.cache
def launcher() -> bytes:
    """The launcher zip's bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in sorted(sources().items()):
            info = zipfile.ZipInfo(name, ZIP_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, text)
    return out.getvalue()
