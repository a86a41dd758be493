"""`tetrad operator`: registered with the core CLI through the `tetrad.commands` entry point
(pyproject.toml), so the core never imports the operator. kopf loads only when the command runs."""

from __future__ import annotations

import typer


def operator(
    namespace: list[str] = typer.Option([], "--namespace", "-n", help="Watch these namespaces (repeatable)."),
    all_namespaces: bool = typer.Option(False, "--all-namespaces", "-A", help="Watch every namespace."),
    metrics_port: int = typer.Option(8080, help="Port of the operator's Prometheus metrics."),
    peering: str | None = typer.Option(None, help="kopf peering name for leader election between replicas."),
    standalone: bool = typer.Option(False, help="Run without peering (a single replica)."),
) -> None:
    """Run the Tetrad operator (wraps `kopf run`)."""
    if not namespace and not all_namespaces:
        typer.echo("error: give --namespace NAME (repeatable) or --all-namespaces", err=True)
        raise typer.Exit(1)
    from tetrad_operator.main import run_operator  # kopf and kubernetes: only when the operator runs

    raise typer.Exit(run_operator(namespaces=namespace, all_namespaces=all_namespaces,
                                  metrics_port=metrics_port, peering=peering, standalone=standalone))
