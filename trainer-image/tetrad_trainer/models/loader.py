"""Which model a job trains: `spec.model.module` None is the built-in decoder (its definition for the
model's options, `llama.definition_for`), otherwise the import path "pkg.mod:name" of a
`ModelDefinition` (tetrad.api.spec.PLUGIN_PATH).

`checked_definition` runs on every rank before any collective: a path that does not import, an
object that is no definition, or a model that lacks what its definition names is a ConfigError
(exit 78) naming spec.model.module and the cause.
"""

from __future__ import annotations

import functools
import importlib

from torch import nn

from tetrad.api.resolved import ModelConfig, ResolvedConfig
from tetrad_trainer.config import ConfigError
from tetrad_trainer.models import llama
from tetrad_trainer.models.interface import ModelDefinition

BUILT_IN = "tetrad_trainer.models.llama:definition"


@functools.cache
def load_definition(module: str | None) -> ModelDefinition:
    """The definition at the import path module ("pkg.mod:name"); None: the built-in Llama."""
    path = module or BUILT_IN
    where = f"spec.model.module={path}"
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(f"{where}: not an import path MODULE:NAME, e.g. mypkg.models:gpt2")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - whatever the import raised is the cause to report
        raise ConfigError(f"{where}: cannot import {mod_name}: {type(e).__name__}: {e}") from e
    if not hasattr(mod, attr):
        raise ConfigError(f"{where}: module {mod_name} has no attribute {attr!r}")
    obj = getattr(mod, attr)
    if not isinstance(obj, ModelDefinition):
        raise ConfigError(f"{where}: {mod_name}.{attr} is a {type(obj).__name__}, not a "
                          "tetrad_trainer.models.ModelDefinition")
    return obj


def definition_of(cfg: ModelConfig) -> ModelDefinition:
    """The definition the model cfg is built with: its module's, or the built-in decoder's for its options."""
    return load_definition(cfg.module) if cfg.module is not None else llama.definition_for(cfg)


def checked_definition(cfg: ResolvedConfig) -> ModelDefinition:
    """The job's definition, its model built on the meta device and checked against what the
    definition names and what the layout needs."""
    if cfg.model is None:
        raise ConfigError("the config has no model (a spec.script job): "
                          "Tetrad's trainer has nothing to train")
    definition = definition_of(cfg.model)
    if problems := definition_problems(definition, cfg):
        raise ConfigError(f"spec.model.module={cfg.model.module or BUILT_IN}: {'; '.join(problems)}")
    return definition


def definition_problems(definition: ModelDefinition, cfg: ResolvedConfig) -> list[str]:
    """What keeps the trainer from training this definition's model in cfg's layout."""
    assert cfg.model is not None
    problems = layout_problems(definition, cfg)
    try:
        model = definition.meta_model(cfg.model)
    except Exception as e:  # noqa: BLE001 - the user's build failed: report why
        return [*problems, f"build({cfg.model.name}) failed: {type(e).__name__}: {e}"]
    return problems + model_problems(definition, model, cfg.model.layers)


def layout_problems(definition: ModelDefinition, cfg: ResolvedConfig) -> list[str]:
    problems = []
    if cfg.layout.tp > 1 and definition.tensor_parallel is None:
        problems.append(f"spec.parallelism.tp={cfg.layout.tp} needs a tensor-parallel plan"
                        " (ModelDefinition.tensor_parallel) and the definition has none; use tp: 1")
    if cfg.layout.cp > 1 and definition.attention is None:
        problems.append(f"spec.parallelism.cp={cfg.layout.cp} needs the blocks' attention core"
                        " (ModelDefinition.attention) and the definition names none; use cp: 1")
    return problems


def model_problems(definition: ModelDefinition, model: nn.Module, layers: int) -> list[str]:
    """Whether the built model has every part the definition names (and the trainer's protocol)."""
    problems = [f"the model has no {m!r} (the Decoder protocol)"
                for m in ("cfg", "project_output", "set_positions") if not hasattr(model, m)]
    blocks = getattr(model, definition.blocks, None)
    if not isinstance(blocks, nn.ModuleDict) or list(blocks) != [str(i) for i in range(layers)]:
        problems.append(f"ModelDefinition.blocks={definition.blocks!r}: the model needs a ModuleDict "
                        f"of that name keyed '0'..'{layers - 1}'")
        return problems
    stages = (*definition.first_stage, *definition.last_stage)
    problems += [f"the model has no top-level module {name!r} (ModelDefinition.first_stage / last_stage)"
                 for name in stages if not isinstance(getattr(model, name, None), nn.Module)]
    if definition.output not in definition.last_stage:
        problems.append(f"ModelDefinition.output={definition.output!r} is not among last_stage "
                        f"{definition.last_stage}")
    owned = {definition.blocks, *stages}
    if stray := sorted({n.split(".")[0] for n, _ in model.named_parameters()} - owned):
        problems.append(f"parameters of {stray} belong to no pipeline stage: name their modules in "
                        "first_stage or last_stage")
    block = blocks["0"]
    if definition.attention is not None and not _has_module(block, definition.attention):
        problems.append(f"ModelDefinition.attention={definition.attention!r} is not a module of a block")
    if (plan := definition.tensor_parallel) is not None:
        problems += [f"tensor_parallel.top names {p!r}, not a module of the model" for p in plan.top
                     if not _has_module(model, p)]
        problems += [f"tensor_parallel.block names {p!r}, not a module of a block" for p in plan.block
                     if not _has_module(block, p)]
    return problems + tied_problems(definition, model)


def tied_problems(definition: ModelDefinition, model: nn.Module) -> list[str]:
    problems = []
    stages = (*definition.first_stage, *definition.last_stage)
    params = dict(model.named_parameters(remove_duplicate=False))
    for a, b in definition.tied:
        if a not in params or b not in params:
            problems.append(f"tied ({a!r}, {b!r}): the model has no parameter "
                            f"{a if a not in params else b!r}")
        elif params[a] is not params[b]:
            problems.append(f"tied ({a!r}, {b!r}) are two tensors: build must tie them "
                            "(e.g. output.weight = embedding.weight)")
        elif {a.split(".")[0], b.split(".")[0]} - set(stages):
            problems.append(f"tied ({a!r}, {b!r}): only parameters of first_stage and last_stage modules "
                            "can be tied")
        elif a.split(".")[0] in definition.last_stage and b.split(".")[0] in definition.first_stage:
            problems.append(f"tied ({a!r}, {b!r}): name the first stage's end first, ({b!r}, {a!r})")
    return problems


def _has_module(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
    except AttributeError:
        return False
    return True
