"""Running jobs without a cluster (`tetrad run`). Imports no torch."""

from tetrad.launch.local import run_local

__all__ = ["run_local"]
