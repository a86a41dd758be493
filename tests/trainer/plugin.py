"""The bring-your-own example model (examples/bring-your-own/model/gpt2_model.py) in the trainer tests."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bring-your-own" / "model"
# spec.model of a job training it, at the debug size of the Llama tests
GPT2 = {"module": "gpt2_model:definition", "dim": 64, "layers": 4, "heads": 4, "vocab": 256, "seqLen": 64}


def env() -> dict[str, str]:
    """The ranks' environment: the example's directory on PYTHONPATH, as a job's image would have it."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(EXAMPLE), os.environ.get("PYTHONPATH", "")) if p)}


@contextlib.contextmanager
def importable() -> Iterator[None]:
    """gpt2_model importable in this process too (the tests' own checks load its definition)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield
    finally:
        sys.path.remove(str(EXAMPLE))
