"""Tetrad beside torchtitan, a Hugging Face transformers loop and a hand-written loop, on one GPU, in one run.

For each configuration, each system trains the same dims on the same synthetic batches in a fresh process
(clean memory statistics; an out-of-memory error ends only its own row):

    tetrad      Trainer.run_step of tetrad_trainer, one process (all degrees 1)
    torchtitan  torchtitan's own Trainer (the PyPI release): its Llama 3 model given Tetrad's dims, its
                parallelize (per-block compile with the loss, AC: full or every other block), fused AdamW,
                clipping, loss and train_step; float8 through its converter on the same recipe, the output
                layer left out as in Tetrad
    hf          transformers LlamaForCausalLM of the same dims (untied embeddings), fp32 weights,
                bf16 autocast, SDPA attention, fused AdamW, gradient clipping; torch.compile(model)
                when the configuration compiles; gradient checkpointing (HF has only full) with AC
    hand        the hand-written loop of bench/trainer.py: tetrad_trainer.model.Transformer, autocast,
                fused AdamW, plain cross-entropy; torch.compile(model) when the configuration compiles

It prints one table: median tokens/s after the warm-up, MFU (6N + attention FLOPs over the
datasheet bf16 peak, float8 rows too), peak memory allocated, the mean loss of the last 10 steps, the
planner's predicted tokens/s and peak (tetrad plan for the same job on one GPU of --gpu-type), and each
system's throughput over the torchtitan and hf rows of the same configuration. transformers and torchtitan
are optional: without one its rows say so and its ratios are left out. hf and hand have no float8 path.

    python bench/gpu.py [--configs all] [--systems tetrad,torchtitan] [--steps 30] [--warmup 10]
                        [--system-steps tetrad=300] [--gpu-type auto] [--out results.json]
    python bench/gpu.py --smoke       # CPU, debug preset, eager, a few steps: checks the script end to end
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GiB = 1024**3
SYSTEMS = ("tetrad", "torchtitan", "hf", "hand")
BASELINES = ("torchtitan", "hf")  # the ratio columns
LOSS_WINDOW = 10  # the loss column: the mean of the last this many steps


@dataclass(frozen=True)
class Config:
    model: str
    seq_len: int
    batch: int  # globalBatch = microBatch: one process, no gradient accumulation
    ac: str = "none"
    compile: bool = False
    loss_chunks: int = 1
    float8: str = "none"  # training.float8.recipe


CONFIGS = {
    "1b-4x2048-compile": Config("llama3-1b", 2048, 4, compile=True),
    "1b-4x2048-eager": Config("llama3-1b", 2048, 4),
    "1b-4x2048-float8-tensorwise-compile": Config("llama3-1b", 2048, 4, compile=True, float8="tensorwise"),
    "1b-4x2048-float8-rowwise-compile": Config("llama3-1b", 2048, 4, compile=True, float8="rowwise"),
    "1b-1x8192-compile": Config("llama3-1b", 8192, 1, compile=True),
    "1b-1x32768-fullAC-compile": Config("llama3-1b", 32768, 1, ac="full", compile=True),
    "1b-8x2048-selectiveAC-compile": Config("llama3-1b", 2048, 8, ac="selective", compile=True),
    "1b-16x2048-fullAC-eager": Config("llama3-1b", 2048, 16, ac="full"),
    "1b-16x2048-fullAC-lossChunks8-eager": Config("llama3-1b", 2048, 16, ac="full", loss_chunks=8),
}
SMOKE = {"debug-2x64-eager": Config("debug", 64, 2)}


def job_document(cfg: Config, steps: int, precision: str, gpu: int, gpu_type: str | None) -> dict[str, Any]:
    return {"apiVersion": "tetrad.dev/v1alpha1", "kind": "ParallelTrainingJob",
            "metadata": {"name": "bench-gpu"},
            "spec": {"nodes": 1, "nprocPerNode": 1, "parallelism": {"dpShard": 1},
                     "model": {"preset": cfg.model, "seqLen": cfg.seq_len},
                     "resources": {"gpu": gpu, **({"gpuType": gpu_type} if gpu and gpu_type else {})},
                     "training": {"steps": steps, "globalBatch": cfg.batch, "microBatch": cfg.batch,
                                  "precision": precision, "activationCheckpointing": cfg.ac,
                                  "compile": cfg.compile, "lossChunks": cfg.loss_chunks, "warmupSteps": 2,
                                  "float8": {"recipe": cfg.float8}}}}


def planned(cfg: Config, steps: int, precision: str, gpu_type: str | None) -> dict[str, float | None]:
    """The planner's predicted tokens/s and peak bytes for the job on one GPU (None without a GPU type)."""
    if gpu_type is None:
        return {"tokens_per_second": None, "peak_bytes": None}
    from tetrad.api import parse
    from tetrad.plan.estimate import estimate
    from tetrad.plan.solver import predict_time, workload
    from tetrad.resolve import resolve

    job, problems = parse(job_document(cfg, steps, precision, 1, gpu_type))
    assert job is not None, problems
    resolved = resolve(job)
    est = estimate(resolved.model, resolved.layout, workload(job.spec, resolved.layout))
    time = predict_time(job.spec, resolved.model, est)
    return {"tokens_per_second": time.tokens_per_second if time else None, "peak_bytes": est.peak_bytes}


# --- run in a fresh process per (configuration, system) -------------------------------------------

def profile_table(step: Any, steps: int = 3) -> str:
    """torch.profiler over `steps` more steps: the kernels by their own device time, largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    return f"{steps} steps\n" + events.table(sort_by=key, row_limit=45, max_name_column_width=90)


def worker(system: str, config_path: str, result: str, warmup: int, profile_to: str | None = None) -> None:
    import time

    import torch
    from tetrad_trainer.metrics import peak_memory_bytes

    from tetrad.api import ResolvedConfig

    cfg = ResolvedConfig.load(config_path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out: dict[str, Any] = {"status": "ok"}
    try:
        step = {"tetrad": tetrad_step, "torchtitan": torchtitan_step, "hf": hf_step,
                "hand": hand_step}[system](cfg, device)
        times, losses = [], []
        for _ in range(cfg.training.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            losses.append(step())
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[warmup:])
        out["tokens_per_second"] = cfg.training.global_batch * cfg.model.seq_len / seconds
        out["peak_bytes"] = peak_memory_bytes(device)[0]
        out["final_loss"] = statistics.fmean(float(x) for x in losses[-LOSS_WINDOW:])
        if profile_to and device.type == "cuda":
            try:
                Path(profile_to).write_text(profile_table(step))
            except Exception as e:  # noqa: BLE001 - a profiler failure must not lose the row's figures
                Path(profile_to).write_text(f"profile failed: {type(e).__name__}: {e}")
    except ModuleNotFoundError as e:
        out["status"] = f"skipped: {e.name} is not installed (pip install {e.name})"
    except torch.OutOfMemoryError:
        out["status"] = "out of memory"
    except Exception as e:  # noqa: BLE001 - Tetrad's own OOM and anything else end this row only
        name = type(e).__name__
        out["status"] = "out of memory" if name == "DeviceOutOfMemory" else f"failed: {name}: {str(e)[:200]}"
    Path(result).write_text(json.dumps(out))


def tetrad_step(cfg: Any, device: Any):
    import contextlib
    import io

    from tetrad_trainer.mesh import init_distributed
    from tetrad_trainer.train import Trainer

    trainer = Trainer(cfg, init_distributed(), jsonl=None)
    train_step, last = trainer.train_step, {}

    def keeping_the_loss():  # run_step logs only every logInterval; the bench wants every step's loss
        last["step"] = train_step()
        return last["step"]
    trainer.train_step = keeping_the_loss  # type: ignore[method-assign]

    def step() -> Any:
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.run_step()
        return last["step"][0]
    return step


def torchtitan_settings(cfg: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """torchtitan's model args and JobConfig sections for a Tetrad config: the same dims, batch,
    optimizer, clipping, AC, compile and float8 recipe. torchtitan sizes the FFN as multiple_of *
    ceil(8 dim / 3 / multiple_of); multiple_of = ffn_dim gives Tetrad's width whenever 8 dim / 3 <=
    ffn_dim."""
    m, t = cfg.model, cfg.training
    if int(8 * m.dim / 3) > m.ffn_dim:
        raise ValueError(f"torchtitan cannot size an FFN of {m.ffn_dim} for dim {m.dim}")
    model_args = {"dim": m.dim, "n_layers": m.layers, "n_heads": m.heads, "n_kv_heads": m.kv_heads,
                  "vocab_size": m.vocab, "multiple_of": m.ffn_dim, "ffn_dim_multiplier": None,
                  "norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "max_seq_len": m.seq_len}
    recipe = t.float8.recipe.value
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": "tetrad_llama3", "flavor": "tetrad",
                  "converters": ["quantize.linear.float8"] if recipe != "none" else []},
        "training": {"local_batch_size": t.micro_batch, "global_batch_size": t.global_batch,
                     "seq_len": m.seq_len, "steps": t.steps, "max_norm": t.grad_clip,
                     "mixed_precision_param": "bfloat16" if t.precision.value == "bf16" else "float32"},
        "optimizer": {"name": "AdamW", "lr": t.lr, "weight_decay": t.weight_decay, "implementation": "fused"},
        "lr_scheduler": {"warmup_steps": t.warmup_steps},
        "parallelism": {"data_parallel_shard_degree": 1},
        # Tetrad's selective AC is every other block: torchtitan's selective_ac_option "2"
        "activation_checkpoint": {"mode": t.activation_checkpointing.value, "selective_ac_option": "2"},
        "compile": {"enable": t.compile, "components": ["model", "loss"]},
        "metrics": {"log_freq": 1_000_000},
        "checkpoint": {"enable": False},
    }
    if recipe != "none":
        sections["float8"] = {"recipe_name": recipe, "filter_fqns": [] if t.float8.output else ["output"]}
    return model_args, sections


class _CpuAsAccelerator:
    """What torchtitan asks of torch.cuda, answered for the CPU (--smoke): no memory figures."""

    def __getattr__(self, name: str) -> Any:
        import collections
        import types

        answers = {"get_device_name": "cpu", "current_device": 0, "device_count": 1,
                   "get_device_properties": types.SimpleNamespace(total_memory=1),
                   "memory_stats": collections.defaultdict(int)}
        return lambda *args, **kwargs: answers.get(name)


def torchtitan_step(cfg: Any, device: Any):
    import dataclasses
    import tempfile

    import torch
    from torchtitan.config import JobConfig
    from torchtitan.models.llama3 import TransformerModelArgs, get_train_spec
    from torchtitan.protocols.train_spec import register_train_spec
    from torchtitan.train import Trainer

    if device.type == "cpu":  # the smoke run: torchtitan assumes an accelerator, named in each module
        for module in [m for name, m in sys.modules.items() if name.startswith("torchtitan")]:
            for name, value in (("device_type", "cpu"), ("device_module", _CpuAsAccelerator())):
                if hasattr(module, name):
                    setattr(module, name, value)

    model_args, sections = torchtitan_settings(cfg)
    register_train_spec("tetrad_llama3", dataclasses.replace(
        get_train_spec(), model_args={"tetrad": TransformerModelArgs(**model_args)},
        build_dataloader_fn=None, build_tokenizer_fn=None, build_validator_fn=None))
    job = JobConfig()
    job.job.dump_folder = tempfile.mkdtemp(prefix="bench-torchtitan-")
    for name, values in sections.items():
        section = job.quantize.linear.float8 if name == "float8" else getattr(job, name)
        for key, value in values.items():
            setattr(section, key, value)
    trainer = Trainer(job)
    batch = _batches(cfg, torch.device("cpu"))  # torchtitan moves each microbatch to the device itself
    losses: list[Any] = []

    def batches():
        while True:
            x, y = batch()
            yield {"input": x}, y

    data = trainer.batch_generator(batches())  # as Trainer.train feeds it: counted and timed
    forward_backward = trainer.forward_backward_step

    def keeping_the_loss(**kwargs):
        losses.append(forward_backward(**kwargs).detach())
        return losses[-1]
    trainer.forward_backward_step = keeping_the_loss  # type: ignore[method-assign]

    def step() -> Any:
        trainer.step += 1
        trainer.gc_handler.run(trainer.step)
        trainer.train_step(data)
        return sum(losses[-trainer.gradient_accumulation_steps:])
    return step


def _batches(cfg: Any, device: Any):
    from tetrad_trainer.data import BatchLoader, build_source

    loader = BatchLoader(build_source(cfg), cfg.training.global_batch, dp_rank=0, dp_size=1)
    return lambda: tuple(t.to(device) for t in loader.next_batch())


def _plain_loop(cfg: Any, device: Any, model: Any, logits_of):
    """One optimizer step: forward under bf16 autocast, fp32 cross-entropy, clipping, fused AdamW."""
    import torch
    import torch.nn.functional as F

    bf16 = cfg.training.precision.value == "bf16"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.training.weight_decay, fused=True)
    if cfg.training.compile:
        model = torch.compile(model)
    batch = _batches(cfg, device)

    def step() -> float:
        x, y = batch()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = logits_of(model, x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def hand_step(cfg: Any, device: Any):
    import torch
    from tetrad_trainer.model import Transformer, init_weights
    from tetrad_trainer.parallelize import apply_ac

    from tetrad.api.spec import ActivationCheckpointing

    with torch.device("meta"):
        model = Transformer(cfg.model)
    if cfg.training.activation_checkpointing != ActivationCheckpointing.NONE:
        apply_ac(model, cfg.training.activation_checkpointing)
    init_weights(model, device, cfg.training.seed)
    return _plain_loop(cfg, device, model, lambda m, x: m(x))


def hf_step(cfg: Any, device: Any):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tetrad.api.spec import ActivationCheckpointing

    m = cfg.model
    hf_config = LlamaConfig(vocab_size=m.vocab, hidden_size=m.dim, intermediate_size=m.ffn_dim,
                            num_hidden_layers=m.layers, num_attention_heads=m.heads,
                            num_key_value_heads=m.kv_heads, max_position_embeddings=m.seq_len,
                            rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
                            tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(cfg.training.seed)
    model = LlamaForCausalLM(hf_config).to(device)
    if cfg.training.activation_checkpointing != ActivationCheckpointing.NONE:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return _plain_loop(cfg, device, model, lambda mod, x: mod(input_ids=x).logits)


def measure(name: str, cfg: Config, system: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import importlib.util

    from tetrad.api import parse
    from tetrad.resolve import resolve

    package = {"hf": "transformers", "torchtitan": "torchtitan"}.get(system)
    if package and importlib.util.find_spec(package) is None:
        return {"status": f"skipped: {package} is not installed (pip install {package})"}
    if cfg.float8 != "none" and system in ("hf", "hand"):
        return {"status": "skipped: no float8 path"}
    if cfg.loss_chunks > 1 and system == "torchtitan":
        return {"status": "skipped: no chunked loss"}
    steps = args.system_steps.get(system, args.steps)
    # float8 asks for a GPU (tetrad.api.validation); the rest may run on the CPU (--smoke)
    job, problems = parse(job_document(cfg, steps + args.warmup, args.precision,
                                       int(cfg.float8 != "none"), None))
    assert job is not None, problems
    path, result = work / f"{name}-{system}.json", work / f"{name}-{system}-result.json"
    path.write_text(resolve(job).to_json())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", __file__,
           "--worker", system, "--config", str(path), "--result", str(result), "--warmup", str(args.warmup)]
    if args.profile:
        cmd += ["--profile-to", str(args.profile / f"profile-{name}-{system}.txt")]
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "TETRAD_METRICS_PORT": str(args.metrics_port)})
    if not result.exists():
        errors = [line for line in done.stderr.splitlines() if "Error" in line]
        return {"status": f"failed: exit {done.returncode}: "
                          f"{errors[-1].strip() if errors else 'no error line'}"}
    return json.loads(result.read_text())


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| configuration | system | tokens/s | MFU | peak GiB | loss | planner tokens/s "
             "| planner peak GiB | vs torchtitan | vs hf |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r["status"] == "ok"
        pred_tps, pred_peak = r["planned"]["tokens_per_second"], r["planned"]["peak_bytes"]
        lines.append(" | ".join([
            f"| {r['config']}", r["system"],
            f"{r['tokens_per_second']:,.0f}" if ok else r["status"],
            f"{r['mfu']:.1%}" if ok else "",
            f"{r['peak_bytes'] / GiB:.1f}" if ok else "",
            f"{r['final_loss']:.4f}" if ok else "",
            f"{pred_tps:,.0f}" if pred_tps else "-",
            f"{pred_peak / GiB:.1f}" if pred_peak else "-",
            *(f"{r['vs_' + b]:.3f}" if r.get("vs_" + b) else "-" for b in BASELINES),
        ]) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="all", help=f"comma-separated names of {', '.join(CONFIGS)}, or all")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--steps", type=int, default=30, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--system-steps", default="", type=lambda text: {
        name: int(n) for name, n in (part.split("=") for part in text.split(",") if part)},
        help="timed steps for some systems instead of --steps, e.g. tetrad=300 (the loss column over a "
             "longer run)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                   help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--gpu-type", default="auto",
                   help="the accelerator the planner predicts for: auto (this GPU, else H100), a name, "
                        "or none")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the script: debug preset, eager, 3 steps")
    p.add_argument("--metrics-port", type=int, default=19600)
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON, after each row")
    p.add_argument("--profile", type=Path, default=None,
                   help="directory for a torch.profiler table of 3 more steps of each row (CUDA only)")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--profile-to", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.config, args.result, args.warmup, args.profile_to)
        return
    import torch
    from tetrad_trainer.metrics import peak_tflops

    from tetrad.api.accelerators import find_accelerator
    from tetrad.api.presets import PRESETS
    from tetrad.api.resolved import ModelConfig

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        configs, args.steps, args.warmup, args.gpu_type = SMOKE, 2, 1, "none"
    else:
        configs = CONFIGS if args.configs == "all" else {n: CONFIGS[n] for n in args.configs.split(",")}
    args.precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    gpu_type = None if args.gpu_type == "none" else args.gpu_type
    if gpu_type == "auto":
        found = find_accelerator(torch.cuda.get_device_name()) if device.type == "cuda" else None
        gpu_type = found[0] if found else "H100"
    mfu_peak = peak_tflops(device, None, None)
    peak, source = mfu_peak.tflops, mfu_peak.source
    rows = []
    with tempfile.TemporaryDirectory(prefix="tetrad-bench-gpu-") as tmp:
        for name, cfg in configs.items():
            plan = planned(cfg, args.steps + args.warmup, args.precision, gpu_type)
            flops = ModelConfig(name=cfg.model, **PRESETS[cfg.model]).model_copy(
                update={"seq_len": cfg.seq_len}).flops_per_token()
            for system in args.systems.split(","):
                r = {"config": name, "system": system, **asdict(cfg), "planned": plan,
                     **measure(name, cfg, system, args, Path(tmp))}
                if r["status"] == "ok":
                    r["mfu"] = r["tokens_per_second"] * flops / (peak * 1e12)
                rows.append(r)
                if args.out:  # after each row: a run stopped halfway keeps what it measured
                    args.out.write_text(json.dumps(rows, indent=2) + "\n")
                print(f"{name} {system}: {r['status']} {r.get('tokens_per_second', 0):,.0f} tokens/s",
                      file=sys.stderr, flush=True)
    for r in rows:
        for baseline in BASELINES:
            b = next((b for b in rows if b["config"] == r["config"] and b["system"] == baseline
                      and b["status"] == "ok"), None)
            if b and r["status"] == "ok":
                r["vs_" + baseline] = r["tokens_per_second"] / b["tokens_per_second"]
    print(f"\n{device.type} {torch.cuda.get_device_name() if device.type == 'cuda' else ''},"
          f" torch {torch.__version__},"
          f" {args.precision}, {args.steps} timed steps after {args.warmup} warm-up, medians; MFU against"
          f" {peak:.3g} TFLOPS ({source})\n")
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
