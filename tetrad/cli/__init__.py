"""`tetrad validate | render | plan | crd | run | status | convert`, and the commands other packages register.

The CLI is the top layer. Heavy imports stay inside commands. Every subcommand reads its files
through `load_documents`; the ones that act on one job (render, plan, run) take it through
`load_document`, which rejects a file of several documents instead of picking one.

Other packages add subcommands through the entry-point group COMMANDS_GROUP (the operator's
`tetrad operator`, see pyproject.toml), so the core imports none of them.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from tetrad.api import ParallelTrainingJob, Problem, parse
from tetrad.api.manifest import MAX_MANIFEST_BYTES, ManifestError, load_manifests, shorten
from tetrad.cli.examples import add_examples
from tetrad.resolve import validate_spec

if TYPE_CHECKING:
    from collections.abc import Callable

    from tetrad.cli.ask import Answer

COMMANDS_GROUP = "tetrad.commands"

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Tetrad: 4D-parallel PyTorch training on Kubernetes.")


STDIN = Path("-")


def read_text(path: Path) -> bytes:
    """The bytes of `path` (`-` is stdin, as for kubectl), at most one byte past the manifest limit."""
    try:
        if path == STDIN:
            return sys.stdin.buffer.read(MAX_MANIFEST_BYTES + 1)
        with path.open("rb") as f:
            return f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise ManifestError("no such file") from None
    except OSError as e:  # a directory, a path through a file, a symlink loop, a name too long, no permission
        raise ManifestError(f"cannot read: {e.strerror or e}") from None


def load_documents(path: Path) -> list[Any]:
    try:
        docs = load_manifests(read_text(path))
    except ManifestError as e:
        raise ManifestError(f"{_shown(path)}: {e}") from None
    if not docs:
        raise ManifestError(f"{_shown(path)}: empty file, expected a ParallelTrainingJob manifest")
    return docs


def _shown(path: Path) -> str:
    return "<stdin>" if path == STDIN else shorten(str(path), 200)


def load_document(path: Path) -> Any:
    """The one document of `path`, or exit 1 saying why (unreadable, not YAML, empty, several documents)."""
    try:
        docs = load_documents(path)
    except ManifestError as e:
        _fail([str(e)])
    if len(docs) != 1:
        _fail([f"{_shown(path)}: expected one ParallelTrainingJob, found {len(docs)} documents; split the"
               " file or use `tetrad validate`"])
    return docs[0]


def load_job(path: Path) -> ParallelTrainingJob:
    """The single valid job in `path` (its model filled from a Hugging Face directory on this machine), or
    exit 1 with one line per problem."""
    job, problems = parse(load_document(path))
    if job is not None:
        job, problems = checked_job(job)
    errors = [p for p in problems if p.severity == "error"]
    if errors or job is None:
        _fail([f"{_shown(path)}: {p}" for p in errors])
    return job


def checked_job(job: ParallelTrainingJob) -> tuple[ParallelTrainingJob, list[Problem]]:
    """The job's model taken from spec.model.hfDir where it is readable here (tetrad.cli.hfdir), and its
    problems."""
    from tetrad.cli.hfdir import with_local_hf_dir

    job, problems = with_local_hf_dir(job)
    if any(p.severity == "error" for p in problems):
        return job, problems
    return job, problems + validate_spec(job.spec)


def _fail(lines: list[str]) -> NoReturn:
    for line in lines:
        typer.echo(f"error: {line}", err=True)
    raise typer.Exit(1)


@app.command()
def validate(files: list[Path] = typer.Argument(..., help="Manifests to check.")) -> None:
    """Exit 0 when every file holds valid ParallelTrainingJobs; else print one line per problem."""
    failed = False
    for path in files:
        try:
            docs = load_documents(path)
        except ManifestError as e:
            typer.echo(f"error: {e}", err=True)
            failed = True
            continue
        for i, doc in enumerate(docs):
            where = _shown(path) if len(docs) == 1 else f"{_shown(path)}[{i}]"
            job, problems = parse(doc)
            if job is not None:
                job, problems = checked_job(job)
            for p in problems:
                typer.echo(f"{p.severity}: {where}: {p}", err=True)
            if any(p.severity == "error" for p in problems):
                failed = True
            else:
                typer.echo(f"ok: {where}: {job.metadata.name if job else '?'}")
    raise typer.Exit(1 if failed else 0)


@app.command()
def render(
    file: Path,
    restart: int = typer.Option(0, min=0, help="Render the gang of this restart (0, 1, ...)."),
) -> None:
    """Print the Kubernetes objects the operator creates for FILE."""
    from tetrad.cli.yamlout import dump_all
    from tetrad.render import render as render_job

    typer.echo(dump_all(render_job(load_job(file), restart=restart).objects()), nl=False)


@app.command()
def plan(
    file: Path,
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Solve `auto` degrees and predict memory, FLOPs and communication per device."""
    from tetrad.cli.hfdir import with_local_hf_dir
    from tetrad.cli.report import plan_job, print_plan

    job, problems = parse(load_document(file))
    if job is not None:
        job, problems = with_local_hf_dir(job)
    if job is None or any(p.severity == "error" for p in problems):
        _fail([f"{_shown(file)}: {p}" for p in problems if p.severity == "error"])
    report = plan_job(job)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_plan(report)
    raise typer.Exit(0 if report["fits"] else 1)


@app.command()
def model(
    hf_dir: Path = typer.Argument(..., help="A Hugging Face model directory (its config.json)."),
) -> None:
    """Print the spec.model of a manifest for a Hugging Face directory: its preset, or its family and every dim.

    A cluster cannot read the directory in the pods' volume: its manifest names a preset or the dims, and every
    rank checks them against config.json at start-up. Exit 1 naming each config.json key Tetrad does not implement.
    """  # noqa: E501
    from tetrad.cli.hfdir import HFDirError, describe

    try:
        hf, text = describe(hf_dir)
    except HFDirError as e:
        _fail([str(e)])
    if hf.problems:
        _fail([f"{shorten(str(hf_dir / 'config.json'), 200)}: {p}" for p in hf.problems])
    typer.echo(text, nl=False)


@app.command()
def crd() -> None:
    """Print the ParallelTrainingJob CustomResourceDefinition."""
    from tetrad.api.crd import crd_yaml

    typer.echo(crd_yaml(), nl=False)


@app.command()
def run(
    file: Path,
    steps: int | None = typer.Option(None, min=1,
                                     help="Train up to this step instead of spec.training.steps."),
    jsonl: Path | None = typer.Option(None, help="Also append rank 0's JSON lines to this file (a new "
                                      "file, a JSON-lines file, or a stream such as /dev/stdout; never "
                                      "the manifest)."),
    workdir: Path | None = typer.Option(None, help="Work directory for the resolved config, logs and "
                                        "metrics: a new or empty directory, or one an earlier tetrad run "
                                        "made (default: a new temporary one). Locked while the run lasts."),
) -> None:
    """Run the job locally, without a cluster: the same environment a pod gets.

    Exit codes: 0 trained (or nothing left to train: the checkpoint is at the last step); 1 refused before anything started (an invalid or suspended job, missing GPUs, a --workdir or --jsonl it must not write, a work directory or checkpoint path another run holds); 2 a bad command line; 69, 75, 77, 78, 79 or a script's own code: a node exited with it (docs/trainer.md); 124 runPolicy.activeDeadlineSeconds passed and every node was stopped; 128+N stopped by signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP or the death of its parent).
    """  # noqa: E501
    from tetrad.launch.local import run_local

    job = load_job(file)
    raise typer.Exit(run_local(job, steps=steps, jsonl=jsonl, workdir=workdir,
                               manifest=None if file == STDIN else file))


_NAMESPACE = typer.Option(None, "--namespace", "-n", help="The job's namespace; defaults to the kubeconfig "
                          "context's.")
_WAIT = typer.Option(120.0, min=0, help="Seconds to wait for the operator's answer (0: ask and return).")
_REQUEST_TIMEOUT = typer.Option(30.0, min=0.1, help="Seconds to wait for each of the API server's answers.")


@app.command()
def status(
    job: str = typer.Argument(..., help="The job's name (metadata.name)."),
    namespace: str | None = _NAMESPACE,
    output: str = typer.Option("text", "--output", "-o", help="text, or json for scripts."),
    request_timeout: float = _REQUEST_TIMEOUT,
) -> None:
    """Show a running job: phase, mesh, step/total with ETA, tokens/s, MFU, loss, restarts (needs the kubernetes client)."""  # noqa: E501
    from tetrad.cli.cluster import ClusterError, jobs
    from tetrad.cli.status import format_summary, now, summarize

    if output not in ("text", "json"):
        _fail([f"--output {shorten(output, 40)!r}: use text or json"])
    try:
        summary = summarize(jobs("status", namespace, request_timeout).get(job), now())
    except ClusterError as e:
        _fail([str(e)])
    typer.echo(json.dumps(summary, indent=2) if output == "json" else format_summary(summary),
               nl=output == "json")


def _ask(command: str, job: str, namespace: str | None, wait: float, request_timeout: float,
         annotation: str, answer: Callable[[dict[str, Any], str], Answer | None], waiting: str) -> NoReturn:
    from tetrad.cli.ask import ask
    from tetrad.cli.cluster import ClusterError, jobs

    try:
        asked = ask(jobs(command, namespace, request_timeout), job, annotation, answer, wait)
    except ClusterError as e:
        _fail([str(e)])
    if asked.token:
        typer.echo(f"asked: {annotation}={asked.token}")
    if asked.answer is None:
        typer.echo(f"{'no answer within ' + format(wait, 'g') + ' s: ' if wait else ''}{waiting};"
                   f" `tetrad status {job}` shows it")
        raise typer.Exit(3 if wait else 0)
    typer.echo(asked.answer.text, err=not asked.answer.done)
    raise typer.Exit(0 if asked.answer.done else 1)


@app.command()
def checkpoint(job: str = typer.Argument(..., help="The job's name (metadata.name)."),
               namespace: str | None = _NAMESPACE, wait: float = _WAIT,
               request_timeout: float = _REQUEST_TIMEOUT) -> None:
    """Save a checkpoint of a running job now, without stopping it (the tetrad.dev/checkpoint-now annotation).

    Exit codes: 0 saved (or asked, with --wait 0); 1 ignored (checkpointing is off, the job ended) or the cluster cannot be asked; 3 no answer within --wait (the ask stands: rank 0 saves once it runs).
    """  # noqa: E501
    from tetrad.api.contract import ANNOTATION_CHECKPOINT_NOW
    from tetrad.cli.ask import checkpoint_answer

    _ask("checkpoint", job, namespace, wait, request_timeout, ANNOTATION_CHECKPOINT_NOW, checkpoint_answer,
         "rank 0 saves at its next step once it runs")


@app.command()
def restart(job: str = typer.Argument(..., help="The job's name (metadata.name)."),
            namespace: str | None = _NAMESPACE, wait: float = _WAIT,
            request_timeout: float = _REQUEST_TIMEOUT) -> None:
    """Restart a running job's gang in its own pods, every worker saving a checkpoint first (the tetrad.dev/restart-in-place annotation).

    The round spends no maxRestarts and resumes from the step saved: to pick up a new script or data in a mounted volume, or to shake off a process in a bad state. Exit codes: 0 accepted (or asked, with --wait 0); 1 refused or ignored (docs/operator.md) or the cluster cannot be asked; 3 no answer within --wait (the ask stands: the operator asks once pod 0 runs).
    """  # noqa: E501
    from tetrad.api.contract import ANNOTATION_RESTART_IN_PLACE
    from tetrad.cli.ask import restart_answer

    _ask("restart", job, namespace, wait, request_timeout, ANNOTATION_RESTART_IN_PLACE, restart_answer,
         "the operator asks pod 0's coordinator once the gang runs")


@app.command()
def convert(
    file: Path = typer.Argument(..., help="A manifest of Kubeflow PyTorchJobs (kubeflow.org/v1) "
                                "and TrainJobs (trainer.kubeflow.org/v1alpha1) of a torch "
                                "runtime; - reads stdin."),
    output: Path | None = typer.Option(None, "--output", "-o",
                                       help="Write the jobs to this new file instead of stdout."),
    force: bool = typer.Option(False, "--force",
                               help="Let --output replace an existing file (never FILE itself)."),
) -> None:
    """Convert Kubeflow PyTorchJobs and TrainJobs into ParallelTrainingJobs that run the same script.

    Prints the jobs as YAML, each headed by comments naming its source and its notes; on stderr one line for each thing not carried over, changed or assumed. Exit 1, writing nothing, when a document cannot be converted (docs/convert.md).
    """  # noqa: E501
    from tetrad.cli.convert import note_line, one_line, render, write_new
    from tetrad.convert import ConvertError, describe
    from tetrad.convert import convert as convert_document

    try:
        docs = load_manifests(read_text(file))
    except ManifestError as e:
        _fail([f"{_shown(file)}: {e}"])
    if not docs:
        _fail([f"{_shown(file)}: empty file, expected a PyTorchJob or TrainJob manifest"])
    conversions, errors = [], []
    for i, doc in enumerate(docs):
        where = _shown(file) if len(docs) == 1 else f"{_shown(file)}[{i}]"
        try:
            conversions.append(convert_document(doc))
        except ConvertError as e:
            errors += [one_line(f"{where}: {describe(doc)}: {line}") for line in e.lines]
    if errors:
        _fail(errors)
    for conversion in conversions:
        for note in conversion.notes:
            typer.echo(note_line(conversion, note), err=True)
    text = render(conversions)
    if output is None:
        typer.echo(text, nl=False)
        return
    shown = shorten(str(output), 200)
    if file != STDIN and _same_file(file, output):
        _fail([f"--output {shown}: is the input file; write the jobs to a new file"])
    try:
        write_new(output, text, force=force)
    except FileExistsError:
        _fail([f"--output {shown}: already exists; choose a new file, or add --force to replace it"])
    except OSError as e:
        _fail([f"--output {shown}: cannot write the file: {e.strerror or e}"])
    typer.echo(f"wrote {shown}: {len(conversions)} ParallelTrainingJob{'s' if len(conversions) > 1 else ''}",
               err=True)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:  # one of them does not exist (or cannot be looked at): not the same file
        return False


def register_commands(target: typer.Typer) -> None:
    """Add the subcommands installed packages declare in COMMANDS_GROUP (name = module:function)."""
    for entry in entry_points(group=COMMANDS_GROUP):
        target.command(name=entry.name)(entry.load())


register_commands(app)
add_examples(app)


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        sys.exit(1)


__all__ = ["app", "load_job", "main", "Problem"]


if __name__ == "__main__":
    main()
