"""The worker's environment is read in one place (tetrad.node.environment): what the renderer writes and
torchrun adds parses into one typed `WorkerEnv`, and no other module of the node or the trainer reads
os.environ for it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.api.helpers import manifest, rendered_env
from tests.api.test_render import job_of
from tetrad.node.environment import WorkerEnv
from tetrad.render import render

REPO = Path(__file__).resolve().parents[2]

# Modules that may touch os.environ, and why.
ENVIRONMENT_READERS = {
    "tetrad/node/environment.py": "the one reader",
    "tetrad/node/collective.py": "sets torch's own flight-recorder variables before the process group exists",
    "tetrad/node/exits.py": "the exit files also serve processes outside torchrun (no RANK: the pid)",
    "tetrad/node/supervisor.py": "passes its whole environment on to torchrun",
    "tetrad/node/worker.py": "names PATH in the error for a missing command",
    "tetrad/node/__main__.py": "a worker started with the spare's socket relays itself, without it",
    "tetrad/node/spare.py": "a spare's child takes its relay's whole environment, as exec would",
}


def test_what_the_pod_is_given_and_torchrun_adds_reads_into_one_typed_object() -> None:
    rendered = rendered_env(render(job_of(manifest()), restart=3), 1)
    env = {k: v for k, v in rendered.items() if isinstance(v, str)}  # not the downward API's fieldRefs
    env |= {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
            "TETRAD_TEST_FAULT": "hang-rank:1:step:3"}
    w = WorkerEnv.read(env)
    assert (w.rank, w.local_rank, w.world_size, w.local_world_size) == (5, 1, 8, 4)
    assert w.restart == 3 and w.node.node_rank == 1 and w.node.checkpoint_dir == "/checkpoints"
    assert w.config == Path("/etc/tetrad/config.json") and w.metrics_port == 9400
    assert w.checkpoint_request_file == Path("/etc/tetrad-pod/checkpoint-now")
    assert w.shutdown_timeout_s == 110.0  # the grace period less 10 s, as rendered
    assert w.test_fault == "hang-rank:1:step:3" and not w.test_faults_allowed  # a stray fault never acts
    assert w.jsonl is None and w.test_oom_at_step is None


def test_outside_torchrun_and_a_pod_every_field_has_its_default() -> None:
    w = WorkerEnv.read({})
    assert (w.rank, w.local_rank, w.world_size, w.local_world_size, w.restart) == (0, 0, 1, 1, 0)
    assert w.config is None and w.metrics_port is None and w.shutdown_timeout_s is None
    assert WorkerEnv.read({"PET_SHUTDOWN_TIMEOUT": "soon", "RANK": "x"}).shutdown_timeout_s is None


def _reads_environ(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in {"environ", "getenv"} and \
                isinstance(node.value, ast.Name) and node.value.id == "os":
            return True
    return False


def test_no_other_node_or_trainer_module_reads_the_environment() -> None:
    modules = [*REPO.glob("tetrad/node/**/*.py"), *REPO.glob("trainer-image/tetrad_trainer/**/*.py")]
    readers = {str(p.relative_to(REPO)) for p in modules if _reads_environ(ast.parse(p.read_text()))}
    assert len(modules) > 40
    assert readers <= set(ENVIRONMENT_READERS), (
        "read the environment through tetrad.node.environment (WorkerEnv, NodeEnv): "
        f"{sorted(readers - set(ENVIRONMENT_READERS))}")
    assert "tetrad/node/environment.py" in readers
