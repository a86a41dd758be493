"""What one eager training step asks of the memory, op by op, Tetrad beside torchtitan: on the CPU.

Runs one step of each system of bench/gpu.py (the same dims, batch and settings) under a dispatch mode that
counts every aten op and the bytes of the tensors it writes (views left out), and prints the ops whose
count or bytes differ. A GPU runs memory-bound ops at about the bytes they write and read, so a difference
here is a difference in eager step time there, found without one (docs/performance.md, 2026-11-30).

    python bench/op_bytes.py [--layers 2] [--seq 2048] [--batch 1] [--vocab 16384]
                             [--systems tetrad,torchtitan]

torchtitan must be importable (pip install torchtitan; its data loaders' `datasets` may be a stand-in).
Defaults: llama3-1b's block dims, two blocks and a smaller vocabulary, so that a step fits a laptop.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402


def counted_step(system: str, layers: int, seq: int, batch: int, vocab: int) -> tuple[dict, dict]:
    """(op -> calls, op -> bytes written) of the second step of `system` (the first warms up)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from tetrad.api import parse
    from tetrad.resolve import resolve

    doc = gpu.job_document(gpu.Config("llama3-1b", seq, batch), 4, "bf16", 0, None)
    doc["spec"]["model"].update(layers=layers, vocab=vocab)
    job, problems = parse(doc)
    assert job is not None, problems
    step = {"tetrad": gpu.tetrad_step, "torchtitan": gpu.torchtitan_step}[system](
        resolve(job), torch.device("cpu"))
    step()
    calls: collections.Counter[str] = collections.Counter()
    written: collections.Counter[str] = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            returns = func._schema.returns
            if returns and returns[0].alias_info is None:  # a view writes nothing
                name = str(func.overloadpacket)
                calls[name] += 1
                written[name] += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                                     if isinstance(t, torch.Tensor))
            return out

    with Count():
        step()
    return dict(calls), dict(written)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--systems", default="tetrad,torchtitan")
    args = p.parse_args()
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"),
                        ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    systems = args.systems.split(",")
    counts = {s: counted_step(s, args.layers, args.seq, args.batch, args.vocab) for s in systems}
    for s in systems:
        calls, written = counts[s]
        print(f"{s}: {sum(calls.values())} ops, {sum(written.values()) / 1e6:,.1f} MB written")
    ops = sorted({op for calls, _ in counts.values() for op in calls})
    differ = [op for op in ops
              if len({(counts[s][0].get(op, 0), counts[s][1].get(op, 0)) for s in systems}) > 1]
    print(f"\n| op | {' | '.join(f'{s} calls | {s} MB' for s in systems)} |")
    print("|---|" + "---|---|" * len(systems))
    for op in sorted(differ, key=lambda op: -max(counts[s][1].get(op, 0) for s in systems)):
        cells = [f"{counts[s][0].get(op, 0)} | {counts[s][1].get(op, 0) / 1e6:,.1f}" for s in systems]
        print(f"| {op} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
