"""`tetrad plan`: the solved layout and its predicted costs, as a dict and as a table (part of the CLI
layer)."""

from __future__ import annotations

from typing import Any

from tetrad.api import Layout, ParallelTrainingJob
from tetrad.plan.elastic import indivisible, resized_spec
from tetrad.plan.estimate import GiB, count_text
from tetrad.plan.placement import placement
from tetrad.plan.solver import no_fit_advice, solve, usable_bytes
from tetrad.resolve import Checked, check_spec

# What the planner says of what it cannot know.
SCRIPT_NOTE = ("spec.script runs your own code: Tetrad cannot predict its memory or step time. The layout and"
               " placement are what its pods get (TETRAD_MESH); the runtime library reports the real"
               " figures.")
PLUGIN_NOTE = ("spec.model.module is a model of your own: its memory, FLOPs and time are estimated as for a"
               " Llama decoder of the same dims (dim, layers, heads, kvHeads, ffnDim, vocab, seqLen); the"
               " trainer measures and reports the real figures.")


ELASTIC_SIZES_SHOWN = 16  # the largest sizes below spec.nodes that `tetrad plan` judges


def elastic_sizes(job: ParallelTrainingJob, layout: Layout) -> list[dict[str, Any]]:
    """An elastic job below spec.nodes, largest first: the layout, the peak memory and the speed the
    planner predicts at each size, or why the job cannot run there (tetrad.plan.elastic)."""
    spec, e = job.spec, job.spec.elastic
    if e is None:
        return []
    sizes = []
    for n in range(spec.nodes - 1, e.min_nodes - 1, -1)[:ELASTIC_SIZES_SHOWN]:
        row: dict[str, Any] = {"nodes": n, "mesh": None, "peak_bytes": None, "tokens_per_second": None,
                               "problem": None}
        if (why := indivisible(layout, n * spec.nproc_per_node)) is not None:
            row["problem"] = why
        else:
            checked = check_spec(resized_spec(spec, layout, n))
            errors = [p for p in checked.problems if p.severity == "error"]
            solution = checked.solution
            if errors or solution is None or solution.layout is None:
                row["problem"] = str(errors[0]) if errors else (solution.reason if solution else "")
            else:
                row["mesh"] = solution.layout.label()
                if solution.estimate is not None:
                    row["peak_bytes"] = solution.estimate.peak_bytes
                if solution.time is not None:
                    row["tokens_per_second"] = solution.time.tokens_per_second * n * spec.nproc_per_node
        sizes.append(row)
    return sizes


def plan_script(job: ParallelTrainingJob, checked: Checked) -> dict[str, Any]:
    """A script job: its layout and where each dim lies; no prediction."""
    spec = job.spec
    errors = [str(p) for p in checked.problems if p.severity == "error"]
    layout = checked.solution.layout if checked.solution else None
    assert spec.script is not None
    return {"job": job.metadata.name, "script": spec.script.describe(),
            "fits": layout is not None and not errors,
            "world_size": spec.nodes * spec.nproc_per_node, "nproc_per_node": spec.nproc_per_node,
            "layout": layout.model_dump(by_alias=True) if layout else None,
            "mesh": layout.label() if layout else None,
            "placement": placement(layout, spec.nproc_per_node) if layout else None,
            "note": SCRIPT_NOTE, "problems": errors,
            "elastic": elastic_sizes(job, layout) if layout and not errors else []}


def plan_job(job: ParallelTrainingJob) -> dict[str, Any]:
    spec = job.spec
    checked = check_spec(spec)
    if spec.script is not None:
        return plan_script(job, checked)
    cfg = checked.model
    report: dict[str, Any] = {"job": job.metadata.name, "fits": False}
    if cfg is None or checked.degrees_invalid:
        report["problems"] = [str(p) for p in checked.problems if p.severity == "error"]
        return report
    solution = checked.solution or solve(spec, cfg)  # solved here when another field is wrong
    budget = usable_bytes(spec)
    report.update({
        "model": cfg.model_dump(by_alias=True) | {"params": cfg.num_params()},
        "world_size": spec.nodes * spec.nproc_per_node,
        "nproc_per_node": spec.nproc_per_node,
        "gpu_memory_gib": spec.resources.gpu_memory_gib if spec.resources.gpu else None,
        "usable_bytes": budget,
        "layout": solution.layout.model_dump(by_alias=True) if solution.layout else None,
        "mesh": solution.layout.label() if solution.layout else None,
        "estimate": solution.estimate.to_dict() if solution.estimate else None,
        "time": solution.time.to_dict() if solution.time else None,
        "reason": solution.reason,
        "candidates": solution.candidates,
        "placement": placement(solution.layout, spec.nproc_per_node) if solution.layout else None,
    })
    if cfg.module is not None:
        report["note"] = PLUGIN_NOTE
    errors = [p for p in checked.problems if p.severity == "error"]
    report["problems"] = [str(p) for p in errors]
    report["elastic"] = elastic_sizes(job, solution.layout) if solution.layout is not None else []
    if solution.layout is not None:
        est = solution.estimate
        fits = budget is None or (est is not None and est.peak_bytes <= budget)
        report["fits"] = fits and not errors
        if not fits and est is not None and budget is not None:
            report["reason"] = (f"{solution.layout.label()} needs {est.peak_bytes / GiB:.1f} GiB per GPU but"
                                f" {budget / GiB:.1f} GiB are usable; {no_fit_advice(spec, est, budget)}")
    return report


def _gib(x: float) -> str:
    return f"{x / GiB:.2f}"


def print_plan(report: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if "script" in report:
        print_script_plan(console, report)
        return
    if "model" not in report:
        for p in report.get("problems", []):
            console.print(f"[red]error[/]: {p}")
        return
    m = report["model"]
    console.print(f"[bold]{report['job']}[/]: {m['name']}, {count_text(m['params'])} params,"
                  f" seqLen {m['seqLen']}, on {report['world_size']} processes")
    est = report["estimate"]
    if est is None:
        console.print(f"[red]{report['reason']}[/]")
        return
    layout = report["mesh"] or est["layout"]
    title = (f"chosen layout {layout}" if report["fits"]
             else f"[red]does not fit[/] - closest layout {Layout.model_validate(est['layout']).label()}")
    mem = Table(title=f"Peak memory per device (GiB): {title}")
    for col in ("params", "grads", "optimizer", "activations", "buffers", "total", "usable"):
        mem.add_column(col, justify="right")
    usable = report["usable_bytes"]
    mem.add_row(*(_gib(est[k]) for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                         "activations_bytes", "buffers_bytes", "peak_bytes")),
                _gib(usable) if usable else "n/a (CPU)")
    console.print(mem)
    if est["host_bytes"]:
        console.print(f"Host memory (CPU offload): {_gib(est['host_bytes'])} GiB per process,"
                      f" {_gib(est['host_bytes'] * report['nproc_per_node'])} GiB per pod")
    work = Table(title="Per device, per step")
    work.add_column("quantity")
    work.add_column("value", justify="right")
    work.add_row("model FLOPs (6N + 12LHQT)", f"{est['model_flops']:.3e}")
    work.add_row("hardware FLOPs (with recompute)", f"{est['hardware_flops']:.3e}")
    for dim, b in est["comm_bytes"].items():
        work.add_row(f"communication {dim}", f"{b / GiB:.3f} GiB")
    if est["host_copy_bytes"]:
        work.add_row("host <-> device copies (CPU offload)", f"{est['host_copy_bytes'] / GiB:.3f} GiB")
    console.print(work)
    if (t := report["time"]) is not None:
        timing = Table(title=f"Predicted step on {t['accelerator']} (docs/planner.md)")
        for col in ("compute", "pipeline bubble", "exposed comm", "step", "tokens/s/device", "MFU"):
            timing.add_column(col, justify="right")
        timing.add_row(*(f"{t[k]:.2f} s" for k in ("compute_s", "bubble_s", "exposed_comm_s", "total_s")),
                       f"{t['tokens_per_second_per_device']:,.0f}", f"{t['mfu']:.1%}")
        console.print(timing)
        if t["host_optimizer_s"]:
            console.print(f"The step includes {t['host_optimizer_s']:.2f} s of AdamW on the CPU"
                          " (offload; an assumed rate, docs/planner.md)")
    if report["placement"]:
        console.print(f"Placement: {_placement(report['placement'])}")
    print_elastic_sizes(console, report)
    if report.get("note"):
        console.print(report["note"])
    if report["reason"]:
        console.print(f"[red]{report['reason']}[/]")
    for p in report.get("problems", []):
        if not (report["reason"] and p.endswith(report["reason"])):  # said just above
            console.print(f"[red]error[/]: {p}")


def _placement(dims: dict[str, str]) -> str:
    return ", ".join(f"{dim} {where}" for dim, where in dims.items()) or "one process"


def print_elastic_sizes(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    if not report.get("elastic"):
        return
    table = Table(title="Elastic sizes below spec.nodes (spec.elastic): the same global batch")
    for col in ("nodes", "layout", "peak GiB/device", "tokens/s"):
        table.add_column(col, justify="right")
    for row in report["elastic"]:
        if row["problem"]:
            table.add_row(str(row["nodes"]), f"[red]cannot run[/]: {row['problem']}", "", "")
            continue
        table.add_row(str(row["nodes"]), row["mesh"],
                      _gib(row["peak_bytes"]) if row["peak_bytes"] is not None else "",
                      f"{row['tokens_per_second']:,.0f}" if row["tokens_per_second"] is not None else "")
    console.print(table)


def print_script_plan(console: Any, report: dict[str, Any]) -> None:
    console.print(f"[bold]{report['job']}[/]: script {report['script']}, on {report['world_size']} processes")
    if report["mesh"]:
        console.print(f"Layout: {report['mesh']} (TETRAD_MESH); placement: {_placement(report['placement'])}")
    print_elastic_sizes(console, report)
    console.print(report["note"])
    for p in report["problems"]:
        console.print(f"[red]error[/]: {p}")

