"""What one rank contributes to a checkpoint, and how it gets it back.

Tensor state (model parameters, optimizer state) goes through the distributed state-dict API,
keyed by the full model's fully-qualified names (optimizer state flattened per parameter FQN), so
a checkpoint saved with one layout (pp, dp, tp, cp) loads into any other layout of the same model.
The rest of a rank's state (step, RNG, data loader position) is a small per-rank file,
`rank-0000R.pt`; after a layout change it comes from rank 0 (RNG: not restored) and the data
position is rebuilt from every old DP rank's position.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from tetrad_trainer.checkpoint.store import CheckpointError, CheckpointMismatch

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
Pair = tuple[torch.nn.Module, torch.optim.Optimizer]


class ResumableLoader(Protocol):
    """What the checkpointer needs from a data loader.

    `state_dict()` is this DP rank's position (plain ints, lists and tensors). When the DP degree
    is unchanged, each DP rank gets its own state back through `load_state_dict`. When it changed,
    a loader with `load_resharded_state(states)` receives the saved state of every old DP rank, in
    DP-rank order, and rebuilds its position from the global sample index; a loader without it
    must save the same, layout-independent state on every DP rank (e.g. the next global sample
    index), which is then loaded as is.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# -- tensors: model and optimizer ---------------------------------------------------------------

def pair_parts(model_parts: Sequence[torch.nn.Module],
               optimizers: Sequence[torch.optim.Optimizer]) -> list[Pair]:
    """(module, optimizer) pairs: one per part, or one merged view when one optimizer holds them all."""
    if len(optimizers) == len(model_parts):
        return list(zip(model_parts, optimizers, strict=True))
    if len(optimizers) == 1:  # one optimizer over several pipeline stages
        return [(merged_view(model_parts), optimizers[0])]
    raise ValueError(f"need one optimizer, or one per model part: {len(model_parts)} parts, "
                     f"{len(optimizers)} optimizers")


def tensor_state(pairs: list[Pair]) -> dict[str, Any]:
    """{"model": FQN -> tensor, "optim": flattened FQN -> state}: what DCP saves and loads in place."""
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for part, opt in pairs:
        for src, dst in ((get_model_state_dict(part), model), (optimizer_state(part, opt), optim)):
            if clash := src.keys() & dst.keys():
                raise CheckpointError(f"model parts share state keys, e.g. {sorted(clash)[0]!r}; "
                                      "each pipeline stage must keep the full model's FQNs for its own "
                                      "modules")
            dst.update(src)
    return {"model": model, "optim": optim}


def optimizer_state(part: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The flattened optimizer state, a tied parameter's under each of its names.

    torch keys the state of a parameter held under several names (tied weights) by one of them; a
    layout that holds the names apart (pipeline stages, each with its own copy) asks for the other
    too, so every name gets the same entries (the same tensors: DCP saves and loads both alike).
    """
    state = get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS)
    names: dict[int, list[str]] = {}
    for fqn, p in part.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    aliases = {}
    for tied in (n for n in names.values() if len(n) > 1):
        for key, value in state.items():
            kind, _, rest = key.partition(".")
            owner = next((n for n in tied if rest.startswith(f"{n}.")), None)
            if owner is not None:
                aliases |= {f"{kind}.{n}{rest[len(owner):]}": value for n in tied if n != owner}
    return state | aliases


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state as this rank holds them: its shards of distributed tensors."""
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(state_bytes(v) for v in obj)
    return 0


def set_tensor_state(pairs: list[Pair], state: dict[str, Any]) -> None:
    """Load a state filled in by DCP back into the modules and optimizers."""
    for part, opt in pairs:
        mkeys = get_model_state_dict(part).keys()
        set_model_state_dict(part, {k: state["model"][k] for k in mkeys})
        okeys = get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS).keys()
        set_optimizer_state_dict(part, opt, {k: state["optim"][k] for k in okeys}, options=_OPTIM_OPTIONS)


def merged_view(parts: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """One module holding several pipeline stages under the full model's names.

    Stages are copies of the full model with the blocks they do not own removed, so their
    children can be joined: ModuleDicts (e.g. `layers`, keyed by global index) are merged, any
    other child must come from one stage only. The view shares the stages' modules.
    """
    if len(parts) == 1:
        return parts[0]
    view = torch.nn.Module()
    for part in parts:
        if own := [n for n, _ in part.named_parameters(recurse=False)]:
            raise CheckpointError(f"a pipeline stage holds parameters of its own ({own[0]}); "
                                  "expected only submodules")
        for name, child in part.named_children():
            have = view._modules.get(name)
            if isinstance(child, torch.nn.ModuleDict):
                if have is None:
                    have = torch.nn.ModuleDict()
                    view.add_module(name, have)
                if not isinstance(have, torch.nn.ModuleDict) or have.keys() & child.keys():
                    raise CheckpointError(f"pipeline stages overlap in {name!r}")
                have.update(child)
            elif have is not None:
                raise CheckpointError(f"pipeline stages both hold {name!r}")
            else:
                view.add_module(name, child)
    return view


# -- the per-rank file: step, RNG, data position -------------------------------------------------

def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np.asarray(np_state[1]).astype(np.int64)), *np_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x


def rank_state_bytes(step: int, rank: int, dp_rank: int, loader: ResumableLoader | None) -> bytes:
    """This rank's own state after `step`, serialized (taken on the training thread, written later)."""
    state = {"step": step, "rank": rank, "dp_rank": dp_rank, "rng": rng_state(),
             "data": loader.state_dict() if loader is not None else None}
    return serialized(state)


def serialized(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load_data_position(loader: ResumableLoader, read: Callable[[int], dict[str, Any]], saved_dp: int, dp: int,
                       dp_rank: int, layouts: tuple[str, str]) -> None:
    """Restore the loader from the saved position of old DP rank d, `read(d)`: its own when the DP
    degree is unchanged, else rebuilt from every old DP rank's."""
    if saved_dp == dp:
        loader.load_state_dict(read(dp_rank))
        return
    states = [read(d) for d in range(saved_dp)]
    reshard = getattr(loader, "load_resharded_state", None)
    if reshard is not None:
        reshard(states)
    elif all(serialized(s) == serialized(states[0]) for s in states):
        # Every old DP rank saved the same position (e.g. the next global sample index): the
        # state does not depend on the DP degree.
        loader.load_state_dict(states[0])
    else:
        raise CheckpointMismatch(
            f"the data loader's state differs per DP rank and it cannot reshard it from dp={saved_dp} "
            f"(layout {layouts[0]}) to dp={dp} (layout {layouts[1]})")
