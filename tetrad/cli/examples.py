"""Example invocations shown under `tetrad --help` (and `tetrad` alone) and each subcommand's `--help`.

Every command, the ones other packages register included, has an entry; tests/api/test_cli.py
runs `--help` for each and checks that the files named here exist in examples/.
"""

from __future__ import annotations

import typer

EXAMPLES: dict[str, list[str]] = {
    "validate": ["tetrad validate examples/fsdp.yaml", "tetrad validate examples/*.yaml"],
    "render": ["tetrad render examples/quickstart.yaml | kubectl apply --dry-run=server -f -"],
    "plan": ["tetrad plan examples/llama3-8b-2x8.yaml", "tetrad plan --json examples/llama3-70b-8x8.yaml"],
    "crd": ["tetrad crd | kubectl apply --server-side -f -"],
    "model": ["tetrad model ./Qwen3-1.7B", "tetrad model /mnt/models/Llama-3.2-1B"],
    "run": ["tetrad run examples/cpu-4d.yaml --steps 5 --jsonl metrics.jsonl"],
    "status": ["tetrad status llama3-8b -n team-a", "tetrad status llama3-8b -o json"],
    "checkpoint": ["tetrad checkpoint llama3-8b -n team-a", "tetrad checkpoint llama3-8b --wait 0"],
    "restart": ["tetrad restart llama3-8b -n team-a"],
    "convert": ["tetrad convert pytorchjob.yaml -o job.yaml",
                "kubectl get pytorchjob mnist -o yaml | tetrad convert - | kubectl apply -f -"],
    "operator": ["tetrad operator --all-namespaces --standalone",
                 "tetrad operator -n team-a -n team-b --peering tetrad"],
}
FIRST_STEPS = ["tetrad validate examples/quickstart.yaml", "tetrad plan examples/quickstart.yaml",
               "kubectl apply -f examples/quickstart.yaml", "tetrad status quickstart"]


def _epilog(lines: list[str]) -> str:
    return "Examples:\n" + "\n".join(f"  $ {line}" for line in lines)


def add_examples(app: typer.Typer) -> None:
    """Give the app and every registered command without an epilog its examples."""
    app.info.epilog = _epilog(FIRST_STEPS)
    for command in app.registered_commands:
        name = command.name or (command.callback.__name__ if command.callback else None)
        if name in EXAMPLES and not command.epilog:
            command.epilog = _epilog(EXAMPLES[name])
