"""A node's command, the same in a pod and under `tetrad run`: the launcher's supervisor around
torchrun, which starts every worker through the launcher around the entry point.

    python3 /etc/tetrad/tetrad-node.pyz supervise -- python3 -m torch.distributed.run \\
        /etc/tetrad/tetrad-node.pyz worker --trainer -- --config /etc/tetrad/config.json

A script job's workers run `worker --path FILE`, `--module MODULE` or `--command -- EXE ...` with the
script's arguments instead (spec.script). torchrun is run as a module, so an image needs only python3
with torch on PATH.
"""

from __future__ import annotations

from collections.abc import Sequence

from tetrad.api.resolved import ResolvedConfig


def worker_args(cfg: ResolvedConfig, config_path: str) -> list[str]:
    """The launcher's worker arguments for the job's entry point, and the entry point's own after --."""
    script = cfg.script
    if script is None:
        return ["--trainer", "--", "--config", config_path]
    workdir = ["--workdir", script.working_dir] if script.working_dir else []
    if script.path is not None:
        return ["--path", script.path, *workdir, "--", *script.args]
    if script.module is not None:
        return ["--module", script.module, *workdir, "--", *script.args]
    assert script.command is not None
    return ["--command", *workdir, "--", *script.command, *script.args]


# The launcher as the pods run it (the zip in the job's ConfigMap), and as an image with Tetrad installed
# can run it without one (the trainer image's CMD).
INSTALLED_LAUNCHER = ("-m", "tetrad.node")


def node_command(cfg: ResolvedConfig, *, python: str, launcher: Sequence[str], config_path: str) -> list[str]:
    """`launcher`: the zip's path, or INSTALLED_LAUNCHER."""
    return [python, *launcher, "supervise", "--", python, "-m", "torch.distributed.run",
            *launcher, "worker", *worker_args(cfg, config_path)]
