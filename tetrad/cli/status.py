"""`tetrad status JOB`: what a person looks at while a job runs.

`summarize` is a pure function of the job object as the apiserver returns it (defaults applied,
status written by the operator) and the current time; `format_summary` turns its result into text.
Reading the object is tetrad.cli.cluster's. The raw object is read field by field rather than parsed
into the model, so a status written by a newer operator still shows.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from tetrad.api.presets import DEFAULT_PRESET, PRESETS, model_name
from tetrad.api.problems import counted
from tetrad.api.slow_nodes import slow_nodes
from tetrad.api.spec import Metrics, Preflight, Script, Training
from tetrad.api.stragglers import is_slow

GiB = 2**30
ENDED = ("Succeeded", "Failed")


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _time(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def duration(seconds: float) -> str:
    """1d2h, 3h05m, 4m10s, 12s."""
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{s:02d}s" if minutes else f"{s}s"


def summarize(job: dict[str, Any], now: datetime) -> dict[str, Any]:
    """The figures of `tetrad status`: identity, phase, mesh, progress with ETA, throughput, restarts."""
    spec, status = _dict(job.get("spec")), _dict(job.get("status"))
    training = _dict(status.get("training"))
    model = _dict(spec.get("model"))
    given = model.get("preset")
    preset = given if isinstance(given, str) else DEFAULT_PRESET  # as expand_model
    overrides = {k: v for k, v in model.items() if k != "preset"}
    seq_len = model.get("seqLen") or _get(PRESETS.get(preset), "seqLen")
    trainer = _dict(spec.get("training"))  # absent: the trainer's defaults (the apiserver stores none)
    global_batch = trainer.get("globalBatch", Training.model_fields["global_batch"].default)
    total = trainer.get("steps", Training.model_fields["steps"].default)
    if spec.get("script"):  # a script's batch and steps are its own
        global_batch = total = seq_len = None
    step = training.get("step")
    tokens_per_second = _number(training.get("tokensPerSecond"))
    phase = status.get("phase") if isinstance(status.get("phase"), str) and status.get("phase") else "Pending"
    out: dict[str, Any] = {
        "name": _get(job, "metadata", "name"),
        "namespace": _get(job, "metadata", "namespace"),
        "phase": phase,
        "message": status.get("message"),
        "model": (_script(spec["script"]) if spec.get("script")
                  else str(model["module"]) if model.get("module")
                  else model_name(preset, overrides)),
        "nodes": spec.get("nodes"),
        "runningNodes": _dict(status.get("elastic")).get("nodes"),  # an elastic job's size now
        "resizes": _dict(status.get("elastic")).get("resizes", 0),
        "nprocPerNode": spec.get("nprocPerNode"),
        "mesh": status.get("mesh"),
        "step": step,
        "steps": total,
        "loss": _number(training.get("loss")),
        "tokensPerSecond": tokens_per_second,
        "mfu": _number(training.get("mfu")),
        "peakMemoryBytes": training.get("peakMemoryBytes"),
        "restarts": status.get("restarts", 0),
        "disruptions": status.get("disruptions", 0),
        "restartsInPlace": status.get("restartsInPlace", 0),
        "disruptionsInPlace": status.get("disruptionsInPlace", 0),
        "askedInPlace": status.get("askedInPlace", 0),
        "stepSeconds": None,
        "etaSeconds": None,
        "updatedSecondsAgo": None,
        "runningSeconds": None,
    }
    if _get(spec, "checkpoint", "enabled"):
        out["checkpoint"] = _checkpoint(_dict(status.get("checkpoint")), now)
    if (preflight := _preflight(spec, status)) is not None:
        out["preflight"] = preflight
    if (stragglers := _stragglers(spec, status)) is not None:
        out["stragglers"] = stragglers
    if (goodput := _goodput(status)) is not None:
        out["goodput"] = goodput
    tokens_per_step = (global_batch * seq_len if isinstance(global_batch, int) and isinstance(seq_len, int)
                       else None)
    if tokens_per_step and tokens_per_second:
        out["stepSeconds"] = tokens_per_step / tokens_per_second
        if isinstance(step, int) and isinstance(total, int) and phase in ("Running", "Restarting"):
            out["etaSeconds"] = max(total - step, 0) * out["stepSeconds"]
    if (updated := _time(training.get("updated"))) is not None:
        out["updatedSecondsAgo"] = max((now - updated).total_seconds(), 0.0)
    if (start := _time(status.get("startTime"))) is not None:
        end = _time(status.get("completionTime")) or now
        out["runningSeconds"] = max((end - start).total_seconds(), 0.0)
    return out


def _script(script: Any) -> str:
    try:
        return f"script {Script.model_validate(script).describe()}"
    except ValueError:
        return "script"


def _checkpoint(ckpt: dict[str, Any], now: datetime) -> dict[str, Any]:
    """status.checkpoint's figures, each None unless it has the type the operator writes."""
    def integer(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    committed = _time(ckpt.get("time"))
    return {"step": integer(ckpt.get("step")),
            "path": ckpt.get("path") if isinstance(ckpt.get("path"), str) else None,
            "secondsAgo": max((now - committed).total_seconds(), 0.0) if committed is not None else None,
            "resumedFrom": integer(ckpt.get("resumedFrom")),
            "resumedAtRestart": integer(ckpt.get("resumedAtRestart"))}


def _preflight(spec: dict[str, Any], status: dict[str, Any]) -> dict[str, Any] | None:
    """status.preflight's bandwidth (with the slow nodes, judged by the spec's fraction) and
    status.failedNodes; None when the job has neither."""
    measured = _dict(status.get("preflight"))
    nodes: dict[str, float] = {}
    for n in _list(measured.get("nodes")):
        if (isinstance(n, dict) and isinstance(n.get("node"), str)
                and (bw := _number(n.get("busBandwidthGBps"))) is not None):
            nodes[n["node"]] = min(bw, nodes.get(n["node"], bw))
    failed = [{"node": f["node"], "reason": str(f.get("reason") or ""), "restart": f.get("restart"),
               "excluded": f.get("excluded") is True}
              for f in _list(status.get("failedNodes"))
              if isinstance(f, dict) and isinstance(f.get("node"), str)]
    if not nodes and not failed:
        return None
    fraction = _number(_get(spec, "preflight", "slowNodeFraction"))
    slow = slow_nodes(nodes, Preflight().slow_node_fraction if fraction is None else fraction)
    return {"busBandwidthGBps": _number(measured.get("busBandwidthGBps")), "restart": measured.get("restart"),
            "nodes": nodes, "slowNodes": {node: nodes[node] for node in slow}, "failedNodes": failed}


def _stragglers(spec: dict[str, Any], status: dict[str, Any]) -> dict[str, Any] | None:
    """status.stragglers: the slowest ranks (those at or above spec.metrics.slowRankLag marked slow);
    None before rank 0 first gathered them."""
    measured = _dict(status.get("stragglers"))
    ranks = [{"rank": r["rank"], "node": str(r.get("node") or "?"), "lag": lag}
             for r in _list(measured.get("ranks"))
             if isinstance(r, dict) and isinstance(r.get("rank"), int)
             and (lag := _number(r.get("lag"))) is not None]
    if not ranks:
        return None
    threshold = _number(_get(spec, "metrics", "slowRankLag"))
    threshold = Metrics().slow_rank_lag if threshold is None else threshold
    return {"step": measured.get("step"), "restart": measured.get("restart"),
            "ranks": [{**r, "slow": is_slow(r["lag"], threshold)} for r in ranks]}


def _goodput(status: dict[str, Any]) -> dict[str, Any] | None:
    """status.goodput: the share of the wall time that trained and the time lost, by kind, largest
    first; None before the operator first accounted for it."""
    measured = _dict(status.get("goodput"))
    fraction, wall = _number(measured.get("fraction")), _number(measured.get("wallSeconds"))
    if fraction is None or wall is None:
        return None
    seconds = {kind: v for kind, value in _dict(measured.get("seconds")).items()
               if kind != "productive" and (v := _number(value))}
    return {"fraction": fraction, "wallSeconds": wall,
            "lostSeconds": dict(sorted(seconds.items(), key=lambda kv: -kv[1]))}


def _goodput_line(g: dict[str, Any]) -> str:
    """`78.3% of 2h03m trained; lost: restarts 12m00s, startup 8m00s`."""
    line = f"{g['fraction']:.1%} of {duration(g['wallSeconds'])} trained"
    if g["lostSeconds"]:
        line += "; lost: " + ", ".join(f"{kind} {duration(v)}" for kind, v in g["lostSeconds"].items())
    return line


def _stragglers_line(s: dict[str, Any]) -> str:
    """`rank 5 on node-b 38% of each step (slow), rank 0 on node-a 0% (step 40, restart 0)`."""
    ranks = ", ".join(f"rank {r['rank']} on {r['node']} {r['lag']:.0%}{' (slow)' if r['slow'] else ''}"
                      for r in s["ranks"])
    return f"{ranks} of each step waited for (step {s['step']}, restart {s['restart']})"


def _preflight_lines(p: dict[str, Any]) -> list[tuple[str, str]]:
    """`Preflight: 38 GB/s median bus bandwidth over 3 nodes (restart 0); slow: n2 9 GB/s` and
    `Failed nodes: n0 in restart 0 (excluded): devices: ...`."""
    rows = []
    if p["nodes"]:
        median = f"{p['busBandwidthGBps']:.3g} GB/s" if p["busBandwidthGBps"] is not None else "?"
        line = f"{median} median bus bandwidth over {len(p['nodes'])} nodes (restart {p['restart']})"
        if p["slowNodes"]:
            line += "; slow: " + ", ".join(f"{node} {bw:.3g} GB/s" for node, bw in p["slowNodes"].items())
        rows.append(("Preflight", line))
    if p["failedNodes"]:
        rows.append(("Failed nodes", "; ".join(
            f"{f['node']} in restart {f['restart']}{' (excluded)' if f['excluded'] else ''}: {f['reason']}"
            for f in p["failedNodes"])))
    return rows


def _checkpoint_line(c: dict[str, Any]) -> str:
    """`step 40 committed 5m00s ago at /ckpt/step-00000040; restart 2 resumed from step 40`."""
    line = "none committed yet" if c["step"] is None else f"step {c['step']} committed"
    if c["step"] is not None and c["secondsAgo"] is not None:
        line += f" {duration(c['secondsAgo'])} ago"
    if c["step"] is not None and c["path"]:
        line += f" at {c['path']}"
    if c["resumedFrom"] is not None:
        who = f"restart {c['resumedAtRestart']}" if c["resumedAtRestart"] else "the first run"
        line += (f"; {who} resumed from step {c['resumedFrom']}" if c["resumedFrom"]
                 else f"; {who} started fresh")
    return line


def format_summary(s: dict[str, Any]) -> str:
    """The summary as aligned `Label: value` lines; figures not known yet are left out."""
    rows: list[tuple[str, str]] = [("Job", f"{s['namespace']}/{s['name']}"), ("Phase", s["phase"])]
    if s["message"]:
        rows.append(("Message", s["message"]))
    rows.append(("Model", s["model"]))
    nodes = counted(s["nodes"], "node")
    if isinstance(s.get("runningNodes"), int) and s["runningNodes"] != s["nodes"]:
        nodes = f"{s['runningNodes']} of {nodes} (elastic: shrunk until room returns)"
    size = (f"{nodes} x {counted(s['nprocPerNode'], 'process')}"
            if isinstance(s["nodes"], int) and isinstance(s["nprocPerNode"], int) else "size unknown")
    unresolved = "never resolved" if s["phase"] in ENDED else "not resolved yet"
    rows.append(("Mesh", f"{s['mesh']} on {size}" if s["mesh"] else f"{unresolved} ({size})"))
    if isinstance(s["step"], int):
        progress = f"step {s['step']} / {s['steps']}"
        if isinstance(s["steps"], int) and s["steps"]:
            progress += f" ({s['step'] / s['steps']:.1%})"
        if s["etaSeconds"] is not None:
            progress += f", ETA {duration(s['etaSeconds'])}"
        rows.append(("Progress", progress))
    elif s["steps"] is not None:
        rows.append(("Progress",
                     f"no step reported{'' if s['phase'] in ENDED else ' yet'}, {s['steps']} to train"))
    if s["stepSeconds"] is not None:
        rows.append(("Step time", f"{s['stepSeconds']:.3g} s (global batch tokens / tokens per second)"))
    if s["tokensPerSecond"] is not None:
        rows.append(("Tokens/s", f"{s['tokensPerSecond']:,.0f}"))
    if s["mfu"] is not None:
        rows.append(("MFU", f"{s['mfu']:.1%}"))
    if s["loss"] is not None:
        rows.append(("Loss", f"{s['loss']:.4f}"))
    if isinstance(s["peakMemoryBytes"], int):
        rows.append(("Peak memory", f"{s['peakMemoryBytes'] / GiB:.2f} GiB (rank 0)"))
    if s.get("checkpoint") is not None:
        rows.append(("Checkpoint", _checkpoint_line(s["checkpoint"])))
    if s.get("preflight") is not None:
        rows += _preflight_lines(s["preflight"])
    if s.get("stragglers") is not None:
        rows.append(("Slowest ranks", _stragglers_line(s["stragglers"])))
    if s.get("goodput") is not None:
        rows.append(("Goodput", _goodput_line(s["goodput"])))
    free = [f"{s['disruptions']} of them disruptions"] if s["disruptions"] else []
    free += [f"{s['resizes']} elastic resizes"] if s.get("resizes") else []
    uncounted = f" ({', '.join(free)}, not counted against maxRestarts)" if free else ""
    rows.append(("Restarts", f"{s['restarts']}{uncounted}"))
    if s["restartsInPlace"]:
        stalls, asked = s.get("disruptionsInPlace", 0), s.get("askedInPlace", 0)
        free = ([f"{stalls} after a stall (disruptions)"] if stalls else []) + (
            [f"{asked} asked with tetrad.dev/restart-in-place"] if asked else [])
        budget = (f"{' and '.join(free)}: not counted against maxRestarts" if free
                  else "counted against maxRestarts")
        rows.append(("In place", f"{s['restartsInPlace']} (the gang restarted in its own pods; {budget})"))
    if s["runningSeconds"] is not None:
        rows.append(("Running for", duration(s["runningSeconds"])))
    if s["updatedSecondsAgo"] is not None:
        rows.append(("Figures from", f"{duration(s['updatedSecondsAgo'])} ago"))
    width = max(len(label) for label, _ in rows) + 1
    return "".join(f"{label + ':':<{width}} {value}\n" for label, value in rows)


def now() -> datetime:
    return datetime.now(UTC)
