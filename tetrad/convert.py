"""Kubeflow jobs to ParallelTrainingJob script jobs: the pure core of `tetrad convert`.

`convert(document)` reads one parsed manifest, a PyTorchJob (kubeflow.org/v1, the training
operator) or a TrainJob (trainer.kubeflow.org/v1alpha1, Kubeflow Trainer v2) of a torch runtime,
and returns the equivalent ParallelTrainingJob as a plain dict, with one note for each thing that
it could not carry over, carried with another behaviour, or had to assume (docs/convert.md). The
user's own entry point becomes spec.script: Tetrad starts torchrun itself, so a torchrun or
`python -m torch.distributed.run` launcher and its options are stripped, `python FILE` becomes
script.path, `python -m MODULE` script.module and anything else (a shell, a binary) script.command.

The result always passes `tetrad.resolve.validate_document` (checked here: a job that does not is
refused with the problems, never returned) and round-trips through the model. A document that
cannot be converted raises ConvertError naming the field and the fix. Nothing here reads a
cluster: a TrainJob's runtime is named, not read, and the notes say what was assumed of it.
"""

from __future__ import annotations

import copy
import posixpath
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from tetrad.api.contract import (
    API_VERSION,
    EXIT_COLLECTIVE_TIMEOUT,
    EXIT_CONFIG_ERROR,
    EXIT_OOM,
    EXIT_PREEMPTED,
    EXIT_PREFLIGHT,
    GROUP,
    KIND,
    LABEL_MANAGED_BY,
    POD_VOLUMES,
    RESERVED_ENV,
    RESERVED_ENV_PREFIXES,
)
from tetrad.api.manifest import quoted, shorten
from tetrad.api.quantity import parse_quantity
from tetrad.api.spec import JOB_NAME_MAX, PYTHON_MODULE
from tetrad.resolve import validate_document

PYTORCHJOB: Final = ("kubeflow.org/v1", "PyTorchJob")
TRAINJOB: Final = ("trainer.kubeflow.org/v1alpha1", "TrainJob")
# The other kinds of the Kubeflow training operator and of Trainer v2, refused by name.
OTHER_KUBEFLOW_KINDS: Final = ("TFJob", "MPIJob", "XGBoostJob", "PaddleJob", "JAXJob", "MXJob",
                               "TrainingRuntime", "ClusterTrainingRuntime")

PYTORCH_CONTAINER: Final = "pytorch"  # Kubeflow's default container name in a PyTorchJob
PYTORCH_PORT: Final = "pytorchjob-port"  # the port the training operator adds to that container
TRAINJOB_CONTAINER: Final = "node"  # the trainer's container (and replicated job) of a Trainer v2 runtime
KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL: Final = "kueue.x-k8s.io/priority-class"
VOLCANO_QUEUE_ANNOTATION: Final = "scheduling.volcano.sh/queue-name"
COSCHEDULING_SCHEDULER: Final = "scheduler-plugins-scheduler"
DEFAULT_SCHEDULER: Final = "default-scheduler"
# Kubeflow's ExitCode restart policy: 1-127 fail the job, 128-255 restart the pod. Tetrad's own retryable
# codes stay retryable: a node that failed the preflight gate, a preempted worker, a collective timeout.
TETRAD_RETRYABLE: Final = (EXIT_PREFLIGHT, EXIT_PREEMPTED, EXIT_COLLECTIVE_TIMEOUT)
EXIT_CODE_PERMANENT: Final = [c for c in range(1, 128) if c not in TETRAD_RETRYABLE]

# torchrun's options (torch.distributed.run, and the older torch.distributed.launch), with and
# without a value. Kubeflow sets the rendezvous ones through PET_* variables; Tetrad sets its own.
_TORCHRUN_FLAGS: Final = frozenset({"--standalone", "--module", "-m", "--no-python", "--no_python",
                                    "--run-path", "--run_path", "--virtual-local-rank",
                                    "--virtual_local_rank", "--use-env", "--use_env"})
_TORCHRUN_VALUES: Final = frozenset({
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--node-rank", "--node_rank", "--master-addr",
    "--master_addr", "--master-port", "--master_port", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
    "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf", "--rdzv_conf", "--local-addr", "--local_addr",
    "--max-restarts", "--max_restarts", "--monitor-interval", "--monitor_interval", "--start-method",
    "--start_method", "--role", "--log-dir", "--log_dir", "-r", "--redirects", "-t", "--tee",
    "--local-ranks-filter", "--local_ranks_filter", "--logs-specs", "--logs_specs", "--event-log-handler",
    "--event_log_handler", "--numa-binding", "--numa_binding", "--signals-to-handle", "--signals_to_handle"})
# What Tetrad sets itself (the rendezvous, the node's rank and address): dropped without a note.
_TORCHRUN_SET_BY_TETRAD: Final = frozenset({
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--node-rank", "--node_rank", "--master-addr",
    "--master_addr", "--master-port", "--master_port", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
    "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf", "--rdzv_conf", "--local-addr", "--local_addr",
    "--standalone", "--module", "-m", "--no-python", "--no_python", "--run-path", "--run_path", "--use-env",
    "--use_env"})
_TORCH_LAUNCHERS: Final = ("torch.distributed.run", "torch.distributed.launch")
# Launchers that start their own worker processes: under Tetrad each worker would start them again.
_OTHER_LAUNCHERS: Final = ("accelerate", "deepspeed", "mpirun", "mpiexec", "horovodrun", "torchx")
_SHELLS: Final = frozenset({"sh", "bash", "dash", "zsh", "ash", "ksh"})
_PYTHON: Final = re.compile(r"python(\d+(\.\d+)?)?")
# A shell string made of plain words only: run without the shell, nothing changes.
_SHELL_SPECIAL: Final = re.compile(r"[$`\\*?\[\]~;&|<>(){}!#\n\r]")
_LAUNCHER_IN_SHELL: Final = re.compile(
    r"(^|[\s;&|(`'\"])(\S*/)?(torchrun|accelerate\s+launch|deepspeed|mpirun|mpiexec|horovodrun)(?=\s|$|[;&|)'\"])"
    r"|torch\.distributed\.(run|launch)\b")
_ENV_REFERENCE: Final = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# python's own options: without a value, and how some of them carry over as environment variables.
_PYTHON_FLAGS: Final = frozenset("bBdEhiIOPqsSuvVx")
_PYTHON_FLAG_ENV: Final = {"B": ("PYTHONDONTWRITEBYTECODE", "1")}
_PYTHON_X_ENV: Final = {"faulthandler": "PYTHONFAULTHANDLER", "dev": "PYTHONDEVMODE", "utf8": "PYTHONUTF8",
                        "importtime": "PYTHONPROFILEIMPORTTIME"}
_SERVER_SET_METADATA: Final = frozenset({"uid", "resourceVersion", "generation", "creationTimestamp",
                                         "managedFields", "selfLink", "deletionTimestamp",
                                         "deletionGracePeriodSeconds"})
_KUBECTL_ANNOTATION: Final = "kubectl.kubernetes.io/last-applied-configuration"
# Pod and container fields whose Kubernetes defaults say nothing (`kubectl get -o yaml` writes them).
_POD_DEFAULTS: Final = {"dnsPolicy": "ClusterFirst", "schedulerName": DEFAULT_SCHEDULER,
                        "securityContext": {}}
_CONTAINER_DEFAULTS: Final = {"terminationMessagePath": "/dev/termination-log",
                              "terminationMessagePolicy": "File", "resources": {}}
_TETRAD_PATHS: Final = {path: name for name, path in POD_VOLUMES.items()}
_GPU: Final = "nvidia.com/gpu"

Kind = Literal["changed", "assumed", "not carried over"]
KINDS: Final[tuple[Kind, ...]] = ("changed", "assumed", "not carried over")


@dataclass(frozen=True)
class Note:
    """One thing the conversion did not carry over as it was: `field` names it in the source document."""

    kind: Kind
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass
class Conversion:
    """A converted document: the ParallelTrainingJob (a plain dict, valid) and the notes."""

    source: str  # e.g. "PyTorchJob kubeflow/pytorch-simple"
    api_version: str
    job: dict[str, Any]
    notes: list[Note] = field(default_factory=list)


class ConvertError(ValueError):
    """The document cannot be converted; each line names a field and the fix."""

    def __init__(self, *lines: str):
        self.lines = list(lines)
        super().__init__("; ".join(lines))


# ---------------------------------------------------------------------------------------------------------
# Reading untrusted documents: every access checks the type, and a wrong one names the field.

def _shown(value: Any) -> str:
    return quoted(value)


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _mapping(value: Any, where: str, *, required: bool = False) -> dict[Any, Any]:
    if value is None:
        if required:
            raise ConvertError(f"{where}: required, but missing")
        return {}
    if not isinstance(value, dict):
        raise ConvertError(f"{where}: expected a mapping, got {_type_name(value)}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConvertError(f"{where}: expected a list, got {_type_name(value)}")
    return value


def _strings(value: Any, where: str) -> list[str]:
    items = _list(value, where)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ConvertError(f"{where}[{i}]: expected a string, got {_type_name(item)}")
    return items


def _string(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConvertError(f"{where}: expected a string, got {_type_name(value)}")
    return value


def _int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConvertError(f"{where}: expected an integer, got {_type_name(value)} {_shown(value)}")
    return value


def _bool(value: Any, where: str) -> bool | None:
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ConvertError(f"{where}: expected true or false, got {_type_name(value)}")
    return value


def _name(item: Any) -> str:
    """An item's name when it is a string, else "" (the item is refused later, by validation)."""
    name = item.get("name") if isinstance(item, dict) else None
    return name if isinstance(name, str) else ""


def _named(items: list[Any], where: str) -> Iterator[tuple[int, dict[Any, Any], str]]:
    """(index, item, name) of a list of mappings with a name (containers, volumes, env)."""
    for i, item in enumerate(items):
        item = _mapping(item, f"{where}[{i}]")
        name = item.get("name")
        yield i, item, name if isinstance(name, str) else ""


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == [] or value == ""


def _reserved_env(name: str) -> bool:
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES)


def _quantity(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConvertError(f"{where}: expected a quantity such as '4' or '16Gi', got {_type_name(value)}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, str) else str(value)


def _same_quantity(a: str, b: str) -> bool:
    try:
        return bool(parse_quantity(a) == parse_quantity(b))
    except ValueError:
        return a == b


def _count(value: Any, where: str) -> int:
    """A count of GPUs: an integer, or a quantity that is one."""
    text = _quantity(value, where)
    try:
        number = parse_quantity(text)
    except ValueError:
        raise ConvertError(f"{where}: {text!r} is not a number of GPUs") from None
    if number != number.to_integral_value() or number < 0:
        raise ConvertError(f"{where}: {text!r} is not a whole number of GPUs")
    return int(number)


def _default_pull_policy(image: str) -> str:
    """Kubernetes' default imagePullPolicy: Always for :latest or no tag, IfNotPresent otherwise."""
    if "@" in image:
        return "IfNotPresent"
    last = image.rsplit("/", 1)[-1]
    return "Always" if ":" not in last or last.endswith(":latest") else "IfNotPresent"


# ---------------------------------------------------------------------------------------------------------
# The entry point.

@dataclass
class EntryPoint:
    """What a container runs, as a Tetrad script, and what its launcher said."""

    script: dict[str, Any]
    launcher: str | None = None  # "torchrun", "torch.distributed.run", "torch.distributed.launch"
    nproc: str | None = None  # the launcher's --nproc-per-node, as written
    nnodes: str | None = None
    python: bool = False  # python runs the script itself, without a launcher of its own
    nested: bool = False  # a launcher inside (a shell's torchrun, accelerate): noted, it must go
    env: dict[str, str] = field(default_factory=dict)  # python options carried as environment variables

    @property
    def launched(self) -> bool:
        """Whether something in the command started the worker processes (so read nprocPerNode)."""
        return self.launcher is not None or self.nested


class _Converter:
    """One document's conversion; collects the notes."""

    def __init__(self, kind: str, api_version: str, name: str):
        self.kind, self.api_version, self.name = kind, api_version, name
        self.notes: list[Note] = []

    def note(self, kind: Kind, where: str, message: str) -> None:
        self.notes.append(Note(kind, where, message))

    # --- the entry point ---------------------------------------------------------------------------------

    def entry_point(self, command: list[str], args: list[str], where: str,
                    working_dir: str | None) -> EntryPoint:
        if not command:
            if not args:
                raise ConvertError(f"{where}.command: not set, so the pods run the image's ENTRYPOINT and"
                                   " CMD, which the converter cannot read; add the command (e.g. [python,"
                                   " /app/train.py]) and convert again")
            first = posixpath.basename(args[0])
            if not (_PYTHON.fullmatch(first) or first == "torchrun" or first in _SHELLS
                    or args[0].startswith("/")):
                raise ConvertError(f"{where}.command: not set, so the pods run the image's ENTRYPOINT with"
                                   f" args {_shown(args[:3])}, which the converter cannot read; add the"
                                   " command (e.g. [python, /app/train.py]) and convert again")
            self.note("assumed", f"{where}.command", "not set: the args were taken as the command, assuming "
                      "the image's ENTRYPOINT is empty or runs its arguments (exec \"$@\")")
        argv = [*command, *args]
        entry = self._parse(argv, where)
        self._check_references(entry.script, where)
        if working_dir is not None:
            normal = posixpath.normpath(working_dir) if working_dir.startswith("/") else None
            if normal is None or normal == "/" or normal.startswith("//"):
                self.note("not carried over", f"{where}.workingDir", f"{_shown(working_dir)}: "
                          "script.workingDir must be an absolute directory other than /; set the "
                          "image's WORKDIR or cd in a script")
            else:
                entry.script["workingDir"] = normal
        return entry

    def _parse(self, argv: list[str], where: str) -> EntryPoint:
        exe = posixpath.basename(argv[0])
        if exe in _SHELLS:
            return self._shell(argv, where)
        if exe == "torchrun":
            return self._torchrun(argv[1:], "torchrun", where)
        if _PYTHON.fullmatch(exe):
            return self._python(argv, where)
        entry = self._command(argv)
        if exe in _OTHER_LAUNCHERS:
            self._nested_launcher(f"{where}.command", exe)
            entry.nested = True
        return entry

    def _nested_launcher(self, where: str, what: str) -> None:
        self.note("not carried over", where, (
            f"{what} starts worker processes of its own, and Tetrad already runs the entry point once per "
            "process under torchrun (nprocPerNode per pod, RANK, LOCAL_RANK and WORLD_SIZE set): edit "
            "spec.script to run the training script with python instead"))

    def _shell(self, argv: list[str], where: str) -> EntryPoint:
        if len(argv) == 3 and argv[1] == "-c" and not _SHELL_SPECIAL.search(argv[2]):
            try:
                words = shlex.split(argv[2])
            except ValueError:  # an unbalanced quote: the shell's to judge
                words = []
            if words[:1] == ["exec"]:
                words = words[1:]
            first = posixpath.basename(words[0]) if words else ""
            if first and (_PYTHON.fullmatch(first) or first in ("torchrun", *_OTHER_LAUNCHERS)
                          or "/" in words[0]):
                return self._parse(words, where)  # plain words running a program: the same without the shell
        entry = self._command(argv)
        if any(_LAUNCHER_IN_SHELL.search(a) for a in argv[1:]):
            found = next(" ".join(m.group(0).strip(" \t\n\r;&|(`'\"").split())
                         for a in argv[1:] if (m := _LAUNCHER_IN_SHELL.search(a)))
            self._nested_launcher(f"{where}.command", f"the shell command runs {shorten(found, 40)}, which")
            entry.nested = True
        return entry

    def _python(self, argv: list[str], where: str) -> EntryPoint:
        """`python [options] FILE|-m MODULE ARGS`; `-c CODE` and options without an equivalent stay a
        command."""
        env: dict[str, str] = {}
        dropped: list[str] = []
        i, tokens = 1, argv
        optimize = 0
        while i < len(tokens):
            token = tokens[i]
            if token == "--" or not token.startswith("-") or token == "-":
                break
            if token.startswith("--"):
                return self._command(argv)  # --version, --help, --check-hash-based-pycs: not a script
            j = 1
            while j < len(token):
                flag = token[j]
                if flag in "mcWX":
                    value = token[j + 1:]
                    if not value:
                        if i + 1 >= len(tokens):
                            raise ConvertError(f"{where}.command: python {token} needs a value")
                        i += 1
                        value = tokens[i]
                    if flag == "c":
                        return self._command(argv)
                    if flag == "m":
                        return self._python_module(value, tokens[i + 1:], argv, env, dropped, optimize, where)
                    if flag == "W":
                        env["PYTHONWARNINGS"] = (f"{env['PYTHONWARNINGS']},{value}" if "PYTHONWARNINGS" in env
                                                 else value)
                    elif (name := _PYTHON_X_ENV.get(value.split("=")[0])) is not None:
                        env[name] = value.split("=", 1)[1] if "=" in value else "1"
                    else:
                        dropped.append(f"-X {value}")
                    break
                if flag not in _PYTHON_FLAGS:
                    return self._command(argv)
                if flag == "O":
                    optimize += 1
                elif flag in _PYTHON_FLAG_ENV:
                    env[_PYTHON_FLAG_ENV[flag][0]] = _PYTHON_FLAG_ENV[flag][1]
                elif flag != "u":
                    # unbuffered: torchrun runs its workers so, and Tetrad sets PYTHONUNBUFFERED
                    dropped.append(f"-{flag}")
                j += 1
            i += 1
        if i < len(tokens) and tokens[i] == "--":
            i += 1
        if i >= len(tokens) or tokens[i] == "-":
            return self._command(argv)  # the REPL or a script on stdin: run as it is
        self._python_options(argv[0], env, dropped, optimize, where)
        rest = tokens[i + 1:]
        return EntryPoint({"path": tokens[i], **({"args": rest} if rest else {})}, python=True, env=env)

    def _python_module(self, module: str, rest: list[str], argv: list[str], env: dict[str, str],
                       dropped: list[str], optimize: int, where: str) -> EntryPoint:
        if module in _TORCH_LAUNCHERS:
            self._python_options(argv[0], env, dropped, optimize, where)
            entry = self._torchrun(rest, module, where)
            entry.env = {**env, **entry.env}
            return entry
        if not re.fullmatch(PYTHON_MODULE, module):
            return self._command(argv)
        self._python_options(argv[0], env, dropped, optimize, where)
        return EntryPoint({"module": module, **({"args": rest} if rest else {})}, python=True, env=env)

    def _python_options(self, interpreter: str, env: dict[str, str], dropped: list[str], optimize: int,
                        where: str) -> None:
        if optimize:
            env["PYTHONOPTIMIZE"] = str(optimize)
        if dropped:
            self.note("not carried over", f"{where}.command", (
                f"python option{'s' if len(dropped) > 1 else ''} "
                f"{' '.join(shorten(d, 40) for d in dropped)}: Tetrad runs the script with the image's "
                "python3; set the equivalent environment variable in spec.template.env"))
        if env:
            self.note("changed", f"{where}.command", "python's options became environment variables: "
                      + ", ".join(f"{k}={shorten(v, 40)}" for k, v in env.items()))
        if "/" in interpreter:
            self.note("changed", f"{where}.command", (
                f"the pods ran {shorten(interpreter, 80)}; Tetrad runs the image's python3 from "
                "PATH: if that is another interpreter, use script.command: "
                f"[{shorten(interpreter, 80)}, FILE] instead"))

    @staticmethod
    def _command(argv: list[str]) -> EntryPoint:
        return EntryPoint({"command": argv[:1], **({"args": argv[1:]} if argv[1:] else {})})

    def _torchrun(self, tokens: list[str], launcher: str, where: str) -> EntryPoint:
        """torchrun's options, then its script: a file, `-m MODULE` or, with --no-python, an executable."""
        given: dict[str, str] = {}
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token == "--":
                i += 1
                break
            if not token.startswith("-"):
                break
            name, eq, value = token.partition("=")
            if name in ("-r", "-t") or (token[:2] in ("-r", "-t") and len(token) > 2 and not eq):
                name, value, eq = token[:2], token[2:], "=" if len(token) > 2 else ""
            if name in _TORCHRUN_VALUES:
                if not eq:
                    if i + 1 >= len(tokens):
                        raise ConvertError(f"{where}.command: {launcher} option"
                                           f" {shorten(name, 40)} needs a value")
                    i += 1
                    value = tokens[i]
            elif name not in _TORCHRUN_FLAGS or eq:
                raise ConvertError(
                    f"{where}.command: {launcher} option {shorten(token, 60)} is not one the converter knows;"
                    " remove it from the command (or write spec.script by hand) and convert again")
            given[name.replace("_", "-")] = value
            i += 1
        if i >= len(tokens):
            raise ConvertError(f"{where}.command: {launcher} is given no script to run")
        script, rest = tokens[i], tokens[i + 1:]
        args = {"args": rest} if rest else {}
        if "--no-python" in given:
            entry = EntryPoint({"command": [script], **args})
            if posixpath.basename(script) in _OTHER_LAUNCHERS:
                self._nested_launcher(f"{where}.command", posixpath.basename(script))
                entry.nested = True
        elif "--module" in given or "-m" in given:
            if not re.fullmatch(PYTHON_MODULE, script):
                raise ConvertError(f"{where}.command: {launcher} -m {shorten(script, 60)}"
                                   " is not a Python module name")
            entry = EntryPoint({"module": script, **args})
        else:
            entry = EntryPoint({"path": script, **args})
        entry.launcher, entry.nproc, entry.nnodes = (launcher, given.get("--nproc-per-node"),
                                                     given.get("--nnodes"))
        kept = sorted(f"{k}={shorten(v, 30)}" if v else k for k, v in given.items()
                      if k not in {o.replace("_", "-") for o in _TORCHRUN_SET_BY_TETRAD})
        self.note("changed", f"{where}.command", (
            f"the {launcher} launcher is stripped: Tetrad starts torchrun itself, with its own rendezvous,"
            " one agent per pod and nprocPerNode workers"))
        if kept:
            self.note("not carried over", f"{where}.command", (
                f"{launcher} option{'s' if len(kept) > 1 else ''} {', '.join(kept)}: Tetrad sets torchrun's "
                "options itself (restarts are whole-gang restarts, runPolicy.maxRestarts)"))
        if launcher == "torch.distributed.launch" and "--use-env" not in given:
            self.note("changed", f"{where}.command", (
                "torch.distributed.launch passed --local-rank=N to the script; torchrun passes no such "
                "argument and sets LOCAL_RANK in the environment: read it there"))
        return entry

    def _check_references(self, script: dict[str, Any], where: str) -> None:
        words = [script.get("path") or script.get("module") or "", *script.get("command", []),
                 *script.get("args", [])]
        names = sorted({m.group(1) for w in words for m in _ENV_REFERENCE.finditer(w)
                        if _reserved_env(m.group(1))})
        if names:
            self.note("changed", f"{where}.command", (
                f"{', '.join('$(' + n + ')' for n in names[:8])}: Kubernetes expanded these from "
                "the variables Kubeflow set in the pod; Tetrad's pods do not set them (torchrun "
                "sets each worker's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT): read them from "
                "the environment in the script"))

    # --- processes per pod ---------------------------------------------------------------------------------

    def nproc(self, value: Any, where: str, gpus: int, entry: EntryPoint, *, given: bool) -> int:
        """Processes per pod from a torchrun-style value (an integer, auto, gpu or cpu)."""
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConvertError(f"{where}: expected an integer or auto, gpu or cpu, got {_type_name(value)}")
        text = str(value).strip()
        if text.isdigit() and int(text) >= 1:
            n = int(text)
        elif text in ("auto", "gpu", "cpu"):
            n = gpus or 1
            if not entry.launched:
                # it only told torchrun how many processes to start, and none starts: once per pod, as here
                pass
            elif gpus and text != "cpu":
                if given:
                    self.note("assumed", where,
                              f"{text}: one process per GPU, {gpus} (the container's {_GPU} limit)")
            else:
                what = ("torchrun would have failed without a GPU" if text == "gpu" else
                        "torchrun would start one process per CPU of the node"
                        f" (os.cpu_count()){' on GPU pods' if gpus else ''}")
                self.note("assumed", where, f"{text}: {what}; converted to nprocPerNode: {n}, set it to the"
                          " number of processes each pod should run")
        else:
            raise ConvertError(f"{where}: {_shown(value)} is not a number of processes; use an"
                               " integer or auto, gpu or cpu")
        return n

    # --- pod template pieces -----------------------------------------------------------------------------

    def env(self, items: list[Any], where: str) -> list[dict[str, Any]]:
        kept, dropped = [], []
        for _, item, name in _named(items, where):
            if name and _reserved_env(name):
                dropped.append(name)
            else:
                kept.append(copy.deepcopy(item))
        if dropped:
            self.note("not carried over", where, (
                f"{', '.join(shorten(n, 40) for n in dict.fromkeys(dropped))}: Tetrad or torchrun sets "
                f"{'these' if len(set(dropped)) > 1 else 'it'} in every pod and worker"))
        return kept

    def resources(self, value: Any, where: str) -> tuple[dict[str, Any], int]:
        """spec.resources (cpu, memory as Tetrad sets them: request = limit) and the GPU count."""
        r = _mapping(value, where)
        limits, requests = (_mapping(r.get("limits"), f"{where}.limits"),
                            _mapping(r.get("requests"), f"{where}.requests"))
        out: dict[str, Any] = {}
        for key in ("cpu", "memory"):
            limit, request = limits.get(key), requests.get(key)
            if limit is not None:
                out[key] = _quantity(limit, f"{where}.limits.{key}")
                if request is not None and not _same_quantity(_quantity(request, f"{where}.requests.{key}"),
                                                              out[key]):
                    self.note("changed", f"{where}.requests.{key}", (
                        f"{_shown(request)} below the limit {_shown(out[key])}: Tetrad requests "
                        "the limit (request = limit)"))
            elif request is not None:
                out[key] = _quantity(request, f"{where}.requests.{key}")
                self.note("changed", f"{where}.requests.{key}", (
                    f"{_shown(out[key])}: Tetrad makes the request the limit as well (request = limit)"))
        gpus = 0
        if (gpu := limits.get(_GPU, requests.get(_GPU))) is not None:
            gpus = _count(gpu, f"{where}.limits.{_GPU}")
        others = sorted({str(k) for k in [*limits, *requests] if k not in ("cpu", "memory", _GPU)})
        if others:
            self.note("not carried over", where, (
                f"{', '.join(shorten(k, 40) for k in others)}: Tetrad requests cpu, memory and {_GPU} only"))
        if not _empty(r.get("claims")):
            self.note("not carried over", f"{where}.claims", "Tetrad's pods claim no dynamic resources")
        return out, gpus

    def volumes(self, volumes: list[Any], mounts: list[Any], where_v: str,
                where_m: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The pod's volumes and the container's mounts, less what Tetrad mounts itself, renamed off its
        names."""
        kept_mounts, dropped_from = [], {}
        for i, mount, name in _named(mounts, where_m):
            path = mount.get("mountPath")
            normal = ((posixpath.normpath(path) if path.startswith("/") else path) if isinstance(path, str)
                      else path)
            if isinstance(normal, str) and normal in _TETRAD_PATHS:
                self.note("not carried over", f"{where_m}[{i}]", (
                    f"{shorten(name, 40)} at {normal}: Tetrad mounts its own"
                    f" {_TETRAD_PATHS[normal]} volume there"
                    + (" (memory-backed)" if normal == "/dev/shm" else "")))
                dropped_from[name] = normal
            else:
                kept_mounts.append(copy.deepcopy(mount))
        used = {_name(m) for m in kept_mounts}
        kept_volumes: list[dict[str, Any]] = []
        taken = {_name(v) for v in volumes} | set(POD_VOLUMES)
        for i, volume, name in _named(volumes, where_v):
            if name in dropped_from and name not in used:
                continue  # said with its mount
            volume = copy.deepcopy(volume)
            if name in POD_VOLUMES:
                new = next(n for k in range(1, 1000)
                           if (n := f"user-{name}" + (f"-{k}" if k > 1 else "")) not in taken)
                taken.add(new)
                volume["name"] = new
                for mount in kept_mounts:
                    if _name(mount) == name:
                        mount["name"] = new
                self.note("changed", f"{where_v}[{i}].name",
                          f"{name} is a volume of Tetrad's own pods: renamed {new}")
            kept_volumes.append(volume)
        return kept_volumes, kept_mounts

    def labels(self, labels: dict[Any, Any], where: str) -> dict[Any, Any]:
        """Pod labels less Tetrad's own."""
        out = {}
        for key, value in labels.items():
            if isinstance(key, str) and (key.startswith(GROUP + "/") or key == LABEL_MANAGED_BY):
                self.note("not carried over", f"{where}[{shorten(key, 60)}]",
                          "Tetrad sets this label on its pods")
            else:
                out[key] = value
        return out

    def unknown(self, mapping: dict[Any, Any], known: set[str], where: str, why: str,
                defaults: dict[str, Any] | None = None) -> None:
        """A note for each field of `mapping` the conversion does not read (empty values and defaults are
        silent)."""
        skipped = [str(k) for k, v in mapping.items()
                   if k not in known and not _empty(v) and (defaults or {}).get(str(k), object()) != v]
        if skipped:
            shown = ", ".join(shorten(k, 40) for k in skipped[:12]) + (f" (and {len(skipped) - 12} more)"
                                                                        if len(skipped) > 12 else "")
            self.note("not carried over", where, f"{shown}: {why}")


# ---------------------------------------------------------------------------------------------------------
# The documents.

_POD_SPEC_READ: Final = {"containers", "initContainers", "volumes", "nodeSelector", "tolerations", "affinity",
                         "priorityClassName", "serviceAccountName", "serviceAccount", "schedulerName",
                         "restartPolicy", "terminationGracePeriodSeconds", "imagePullSecrets"}
_CONTAINER_READ: Final = {"name", "image", "imagePullPolicy", "command", "args", "env", "resources",
                          "volumeMounts", "workingDir", "ports", "envFrom"}


def _metadata(c: _Converter, doc: dict[Any, Any]) -> tuple[dict[str, Any], dict[Any, Any], dict[Any, Any]]:
    """The job's metadata (name, namespace) and its labels and annotations, still to be sorted."""
    meta = _mapping(doc.get("metadata"), "metadata", required=True)
    name = _string(meta.get("name"), "metadata.name")
    if not name:
        hint = (" (metadata.generateName is not enough: a ParallelTrainingJob needs its name)"
                if meta.get("generateName") else "")
        raise ConvertError(f"metadata.name: required, but missing{hint}; set metadata.name and convert again")
    if len(name) > JOB_NAME_MAX:
        raise ConvertError(
            f"metadata.name: {shorten(name, 80)} is {len(name)} characters; a ParallelTrainingJob's name is "
            f"at most {JOB_NAME_MAX}, to leave room for its pods' -<rank> suffix in a 63-character DNS "
            f"label: rename the {c.kind} (e.g. to {name[:JOB_NAME_MAX].rstrip('-')}) and convert again")
    out: dict[str, Any] = {"name": name}
    if (namespace := _string(meta.get("namespace"), "metadata.namespace")) is not None:
        out["namespace"] = namespace
    labels = dict(_mapping(meta.get("labels"), "metadata.labels"))
    annotations = {k: v for k, v in _mapping(meta.get("annotations"), "metadata.annotations").items()
                   if k != _KUBECTL_ANNOTATION}
    c.unknown(meta, {"name", "namespace", "labels", "annotations", "generateName", *_SERVER_SET_METADATA},
              "metadata", "Tetrad does not carry these to the ParallelTrainingJob")
    return out, labels, annotations


@dataclass(frozen=True)
class _Paths:
    """Where a pod's parts are in the source document, for the notes."""

    pod: str  # the pod spec, e.g. spec.pytorchReplicaSpecs.Master.template.spec
    container: str  # the training container, e.g. ...containers[0], or spec.trainer
    env: str
    resources: str
    metadata: str  # the pod template's metadata


@dataclass
class _Pod:
    """What the converted pods take from a Kubeflow pod: the container, the pod fields, the gang hints."""

    paths: _Paths
    image: str
    pull_policy: str
    entry: EntryPoint
    resources: dict[str, Any]
    gpus: int
    template: dict[str, Any]
    scheduler_name: str | None = None
    grace: int | None = None


def _template_fields(c: _Converter, pod_spec: dict[Any, Any], paths: _Paths, env: list[dict[str, Any]],
                     mounts: list[Any], pod_labels: dict[Any, Any],
                     pod_annotations: dict[Any, Any]) -> dict[str, Any]:
    """spec.template from the pod spec's pass-through fields, the container's env and mounts, the pod
    metadata."""
    where = paths.pod
    volumes, volume_mounts = c.volumes(_list(pod_spec.get("volumes"), f"{where}.volumes"), mounts,
                                       f"{where}.volumes", f"{paths.container}.volumeMounts")
    template: dict[str, Any] = {}
    for key, value in (("env", env), ("volumes", volumes), ("volumeMounts", volume_mounts)):
        if value:
            template[key] = value
    if node_selector := _mapping(pod_spec.get("nodeSelector"), f"{where}.nodeSelector"):
        template["nodeSelector"] = dict(node_selector)
    if tolerations := _list(pod_spec.get("tolerations"), f"{where}.tolerations"):
        template["tolerations"] = copy.deepcopy(tolerations)
    if affinity := _mapping(pod_spec.get("affinity"), f"{where}.affinity"):
        template["affinity"] = copy.deepcopy(affinity)
    if priority := _string(pod_spec.get("priorityClassName"), f"{where}.priorityClassName"):
        template["priorityClassName"] = priority
    account = _string(pod_spec.get("serviceAccountName"), f"{where}.serviceAccountName") or _string(
        pod_spec.get("serviceAccount"), f"{where}.serviceAccount")
    if account:
        template["serviceAccountName"] = account
    if labels := c.labels(pod_labels, f"{paths.metadata}.labels"):
        template["labels"] = labels
    if pod_annotations:
        template["annotations"] = dict(pod_annotations)
    if not _empty(pod_spec.get("imagePullSecrets")):
        c.note("not carried over", f"{where}.imagePullSecrets", (
            "Tetrad's pod template has no imagePullSecrets: add them to the ServiceAccount the pods run as "
            "(spec.template.serviceAccountName), whose imagePullSecrets every pod gets"))
    if not _empty(pod_spec.get("initContainers")):
        items = _list(pod_spec.get("initContainers"), f"{where}.initContainers")
        names = [n or f"[{i}]" for i, _, n in _named(items, f"{where}.initContainers")]
        c.note("not carried over", f"{where}.initContainers", (
            f"{', '.join(shorten(n, 40) for n in names)}: Tetrad's pods run no init containers; do their "
            "work in the script, or in a Job before this one"))
    c.unknown(pod_spec, _POD_SPEC_READ, where, "Tetrad's pods have no such field", _POD_DEFAULTS)
    return template


def _container(c: _Converter, pod_spec: dict[Any, Any], name: str, where: str) -> tuple[int, dict[Any, Any]]:
    containers = _list(pod_spec.get("containers"), f"{where}.containers")
    found = [(i, item) for i, item, n in _named(containers, f"{where}.containers") if n == name]
    if not found:
        raise ConvertError(f"{where}.containers: no container named {name}, the one a {c.kind} trains in;"
                           f" name the training container {name}")
    others = [n or f"[{i}]" for i, _, n in _named(containers, f"{where}.containers") if n != name]
    if others:
        c.note("not carried over", f"{where}.containers", (
            f"{', '.join(shorten(n, 40) for n in others)}: Tetrad's pods run one container, the training "
            "one; run sidecars some other way (a DaemonSet, or the script)"))
    return found[0]


def _pod(c: _Converter, pod_spec: dict[Any, Any], pod_meta: dict[Any, Any], paths: _Paths,
         container: dict[Any, Any], *, command: list[str], args: list[str], env: list[Any], resources: Any,
         image: str | None, mounts: list[Any]) -> _Pod:
    """A Kubeflow pod as Tetrad pod fields: the container's settings are given (a PyTorchJob's container, a
    TrainJob's trainer), the pod's fields come from `pod_spec` and `pod_meta`."""
    cw = paths.container
    if not image:
        raise ConvertError(f"{cw}.image: required, but missing")
    pull = _string(container.get("imagePullPolicy"), f"{cw}.imagePullPolicy") or _default_pull_policy(image)
    entry = c.entry_point(command, args, cw, _string(container.get("workingDir"), f"{cw}.workingDir"))
    res, gpus = c.resources(resources, paths.resources)
    env_items = c.env(env, paths.env)
    names = {_name(e) for e in env_items}
    env_items += [{"name": k, "value": v} for k, v in entry.env.items() if k not in names]
    if not _empty(container.get("envFrom")):
        c.note("not carried over", f"{cw}.envFrom", (
            "Tetrad's pod template takes env entries only: list each variable in spec.template.env with "
            "valueFrom.configMapKeyRef or secretKeyRef"))
    ports = [p for p in _list(container.get("ports"), f"{cw}.ports")
             if not (isinstance(p, dict) and p.get("name") == PYTORCH_PORT)]
    if ports:
        c.note("not carried over", f"{cw}.ports",
               "Tetrad's pods declare their own ports (rendezvous, metrics)")
    c.unknown(container, _CONTAINER_READ, cw,
              "Tetrad's trainer container has no such field", _CONTAINER_DEFAULTS)
    template = _template_fields(c, pod_spec, paths, env_items, mounts,
                                dict(_mapping(pod_meta.get("labels"), f"{paths.metadata}.labels")),
                                dict(_mapping(pod_meta.get("annotations"), f"{paths.metadata}.annotations")))
    grace = _int(pod_spec.get("terminationGracePeriodSeconds"), f"{paths.pod}.terminationGracePeriodSeconds")
    scheduler = _string(pod_spec.get("schedulerName"), f"{paths.pod}.schedulerName")
    return _Pod(paths, image, pull, entry, res, gpus, template, scheduler, grace)


def _world(c: _Converter, pod: _Pod, nodes: int, nproc_value: Any, nproc_where: str, *,
           given: bool) -> tuple[int, int]:
    """(nprocPerNode, gpu): the launcher's --nproc-per-node wins over the job's setting, as torchrun reads
    them."""
    entry, command = pod.entry, f"{pod.paths.container}.command"
    if entry.nproc is not None:
        n = c.nproc(entry.nproc, f"{command} --nproc-per-node", pod.gpus, entry, given=True)
        if given and str(nproc_value) != entry.nproc:
            c.note("changed", nproc_where, (
                f"{_shown(nproc_value)} conflicts with the command's "
                f"--nproc-per-node={shorten(entry.nproc, 20)}, which torchrun obeyed: nprocPerNode: {n}"))
    else:
        n = c.nproc(nproc_value, nproc_where, pod.gpus, entry, given=given)
    if entry.nnodes is not None and entry.nnodes != str(nodes):
        elastic = ":" in entry.nnodes
        c.note("changed", f"{command} --nnodes", (
            f"{shorten(entry.nnodes, 20)} {'is an elastic range' if elastic else 'disagrees with the job'}:"
            f" Tetrad runs a fixed gang of nodes: {nodes}, the job's pods"))
    gpu = pod.gpus
    if gpu and gpu != n:
        c.note("changed", f"{pod.paths.resources}.limits[{_GPU}]", (
            f"{gpu} GPUs for {n} process{'es' if n > 1 else ''} per pod: Tetrad gives each process one GPU,"
            f" gpu: {n} (a process that drives several GPUs cannot be carried over)"))
        gpu = n
    if not entry.launched and n > 1:
        c.note("changed", command, (
            f"{'python' if entry.python else 'the command'} ran once per pod; Tetrad runs it under torchrun "
            f"{n} times per pod (one per {'GPU' if gpu else 'process'}) with RANK, LOCAL_RANK and WORLD_SIZE "
            "set for each: a script that spawned its own processes must use these instead"))
    return n, gpu


def _spec(nodes: int, nproc: int, gpu: int, pod: _Pod) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodes": nodes, "nprocPerNode": nproc, "script": pod.entry.script,
                            "image": pod.image, "imagePullPolicy": pod.pull_policy}
    resources = dict(pod.resources)
    if gpu:
        resources["gpu"] = gpu
    if resources:
        spec["resources"] = resources
    if pod.template:
        spec["template"] = pod.template
    return spec


def _gang(c: _Converter, spec: dict[str, Any], pod: _Pod, job_labels: dict[Any, Any],
          scheduling: dict[Any, Any] | None = None, volcano_queue: str | None = None) -> None:
    """spec.gang from the queue label (Kueue), the scheduler name (Volcano, scheduler-plugins) and Kubeflow's
    schedulingPolicy; moves the queue and priority labels where Tetrad reads them."""
    template = spec.setdefault("template", {})
    pod_labels = template.get("labels", {})
    queue = job_labels.pop(KUEUE_QUEUE_LABEL, None)
    pod_queue = pod_labels.pop(KUEUE_QUEUE_LABEL, None)
    if queue is not None and pod_queue is not None and pod_queue != queue:
        c.note("changed", f"{pod.paths.metadata}.labels[{KUEUE_QUEUE_LABEL}]", (
            f"{_shown(pod_queue)} differs from the job's {_shown(queue)}: the job's queue is used"))
    queue = queue if queue is not None else pod_queue
    if ((priority := job_labels.pop(KUEUE_PRIORITY_LABEL, None)) is not None
            and KUEUE_PRIORITY_LABEL not in pod_labels):
        pod_labels[KUEUE_PRIORITY_LABEL] = priority
        template["labels"] = pod_labels
        c.note("changed", f"metadata.labels[{KUEUE_PRIORITY_LABEL}]", "moved to the pods' labels, where "
               "Kueue's pod integration reads the WorkloadPriorityClass")
    policy = scheduling or {}
    sw = "spec.runPolicy.schedulingPolicy"
    gang: dict[str, Any] = {}
    name = pod.scheduler_name if pod.scheduler_name != DEFAULT_SCHEDULER else None
    policy_queue = _string(policy.get("queue"), f"{sw}.queue") or volcano_queue
    if queue is not None:
        gang = {"scheduler": "kueue", "queue": queue}
        if name:
            c.note("not carried over", f"{pod.paths.pod}.schedulerName", f"{_shown(name)}: Kueue admits the "
                   f"job (its {KUEUE_QUEUE_LABEL} label) and the pods use the default scheduler")
    elif name == "volcano" or volcano_queue:
        gang = {"scheduler": "volcano", **({"queue": policy_queue} if policy_queue else {})}
    elif name == COSCHEDULING_SCHEDULER:
        gang = {"scheduler": "coscheduling"}
    elif name:
        gang = {"schedulerName": name}
    if policy_queue and gang.get("scheduler") != "volcano":
        c.note("not carried over", f"{sw}.queue", f"{_shown(policy_queue)}: a queue is carried for Volcano"
               " (schedulerName: volcano) or Kueue (the queue-name label) only")
    if ((minimum := _int(policy.get("minAvailable"), f"{sw}.minAvailable")) is not None
            and minimum != spec["nodes"]):
        c.note("changed", f"{sw}.minAvailable", f"{minimum}: Tetrad's gang is every pod, {spec['nodes']}")
    if not _empty(policy.get("minResources")):
        c.note("not carried over", f"{sw}.minResources", "Tetrad sums the gang's requests itself")
    if ((timeout := _int(policy.get("scheduleTimeoutSeconds"), f"{sw}.scheduleTimeoutSeconds")) is not None
            and timeout >= 1):
        gang["timeoutSeconds"] = timeout
    if (priority_class := _string(policy.get("priorityClass"), f"{sw}.priorityClass")) is not None:
        if template.get("priorityClassName") in (None, priority_class):
            template["priorityClassName"] = priority_class
        else:
            c.note("not carried over", f"{sw}.priorityClass", (
                f"{_shown(priority_class)}: the pods' priorityClassName "
                f"{_shown(template['priorityClassName'])} is used (Tetrad's Volcano PodGroup takes it too)"))
    c.unknown(policy, {"minAvailable", "queue", "minResources", "priorityClass", "scheduleTimeoutSeconds"},
              sw, "unknown to the converter")
    if not pod_labels:
        template.pop("labels", None)
    if not template:
        spec.pop("template")
    if gang:
        spec["gang"] = gang


def _kueue_suspend(c: _Converter, spec: dict[str, Any], run_policy: dict[str, Any], where: str) -> None:
    """Kueue admits a PyTorchJob or TrainJob by unsuspending it; Tetrad's pods wait in Kueue's queue
    themselves."""
    if spec.get("gang", {}).get("scheduler") == "kueue" and run_policy.pop("suspend", False):
        c.note("changed", where, (
            "true: Kueue holds a Kubeflow job suspended until it admits it; Tetrad's pods wait "
            "behind Kueue's scheduling gate instead, so the job is not suspended (set "
            "runPolicy.suspend: true to hold it yourself)"))


def _job(c: _Converter, meta: dict[str, Any], labels: dict[Any, Any], annotations: dict[Any, Any],
         spec: dict[str, Any]) -> dict[str, Any]:
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec}


# --- PyTorchJob --------------------------------------------------------------------------------------------

_REPLICA_TYPES: Final = ("Master", "Worker")


def _dict(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}


def _differences(master: dict[Any, Any], worker: dict[Any, Any]) -> list[str]:
    """What differs between the Master's and the Worker's templates, by the fields that matter."""
    def container(template: dict[Any, Any]) -> dict[Any, Any]:
        items = _dict(template.get("spec")).get("containers")
        found = [x for x in items if isinstance(x, dict) and x.get("name") == PYTORCH_CONTAINER] \
            if isinstance(items, list) else []
        return found[0] if found else {}

    mc, wc = container(master), container(worker)
    out = [k for k in ("image", "imagePullPolicy", "command", "args", "env", "envFrom", "resources",
                       "volumeMounts", "workingDir") if mc.get(k) != wc.get(k)]
    ms, ws = _dict(master.get("spec")), _dict(worker.get("spec"))
    out += [k for k in sorted({*ms, *ws} - {"containers"}, key=str) if ms.get(k) != ws.get(k)]
    out += [f"metadata.{k}" for k in ("labels", "annotations")
            if _dict(master.get("metadata")).get(k) != _dict(worker.get("metadata")).get(k)]
    return [str(k) for k in out]


def _restart_policy(c: _Converter, policies: dict[str, str], backoff: int | None,
                    run_policy: dict[str, Any]) -> None:
    where = "spec.pytorchReplicaSpecs"
    if len(set(policies.values())) > 1:
        c.note("changed", where, "the restart policies differ ("
               + ", ".join(f"{k}: {v}" for k, v in policies.items())
               + f"): Tetrad has one for the whole gang, the {next(iter(policies))}'s")
    kind, policy = next(iter(policies.items()))
    pw = f"{where}.{kind}.restartPolicy"
    if policy not in ("OnFailure", "Always", "Never", "ExitCode"):
        raise ConvertError(f"{pw}: {_shown(policy)} is not Always, OnFailure, Never or ExitCode")
    if policy == "Never":
        run_policy["maxRestarts"] = 0
        c.note("changed", pw, "Never: a failure fails the job (maxRestarts: 0); Tetrad still "
               "restarts the gang after a disruption (a preemption, an eviction, a lost node), up "
               "to runPolicy.maxDisruptions")
        return
    if backoff is not None:
        run_policy["maxRestarts"] = backoff
    limit = (f"at most runPolicy.maxRestarts: {backoff} times (backoffLimit)" if backoff is not None else
             "at most runPolicy.maxRestarts times, 3 by default (Kubeflow had no backoffLimit: no limit)")
    if policy == "ExitCode":
        run_policy["permanentExitCodes"] = EXIT_CODE_PERMANENT
        c.note("changed", pw, (
            "ExitCode: exit codes 1-127 fail the job at once (runPolicy.permanentExitCodes) and "
            f"128-255 restart the whole gang, {limit}; {', '.join(map(str, TETRAD_RETRYABLE))} "
            "stay retryable, Tetrad's own codes for a node that failed the preflight gate, a "
            "preemption and a collective timeout"))
        return
    extra = "; Always restarted a container that exited 0 too, Tetrad's job succeeds when every pod exits 0" \
        if policy == "Always" else ""
    c.note("changed", pw, (
        f"{policy}: Kubeflow restarted the failed container in its pod; Tetrad restarts the whole gang, "
        f"every pod, {limit}; exit codes {EXIT_OOM} and {EXIT_CONFIG_ERROR} fail the job at once "
        f"(runPolicy.permanentExitCodes){extra}"))


def _run_policy(c: _Converter, value: Any, run_policy: dict[str, Any]) -> dict[Any, Any]:
    """spec.runPolicy less the restart settings (read with the restart policy); returns schedulingPolicy."""
    w = "spec.runPolicy"
    rp = _mapping(value, w)
    if (deadline := _int(rp.get("activeDeadlineSeconds"), f"{w}.activeDeadlineSeconds")) is not None:
        if deadline >= 1:
            run_policy["activeDeadlineSeconds"] = deadline
        else:
            c.note("not carried over", f"{w}.activeDeadlineSeconds",
                   f"{deadline}: a deadline must be at least 1 s")
    if (ttl := _int(rp.get("ttlSecondsAfterFinished"), f"{w}.ttlSecondsAfterFinished")) is not None:
        if ttl >= 0:
            run_policy["ttlSecondsAfterFinished"] = ttl
        else:
            c.note("not carried over", f"{w}.ttlSecondsAfterFinished", f"{ttl}: must be 0 or more")
    clean = _string(rp.get("cleanPodPolicy"), f"{w}.cleanPodPolicy")
    if clean is not None and clean not in ("All", "Running", "None"):
        raise ConvertError(f"{w}.cleanPodPolicy: {_shown(clean)} is not All, Running or None")
    run_policy["cleanPodPolicy"] = clean or "None"  # a PyTorchJob's default: keep the pods
    if clean is None:
        c.note("assumed", f"{w}.cleanPodPolicy", "not set: Kubeflow's default for a PyTorchJob, None"
               " (finished pods are kept), written out; Tetrad's own default is Running")
    if _bool(rp.get("suspend"), f"{w}.suspend"):
        run_policy["suspend"] = True
    if not _empty(rp.get("managedBy")):
        c.note("not carried over", f"{w}.managedBy",
               f"{_shown(rp.get('managedBy'))}: Tetrad's operator manages the job")
    c.unknown(rp, {"activeDeadlineSeconds", "ttlSecondsAfterFinished", "cleanPodPolicy", "suspend",
                   "managedBy", "backoffLimit", "schedulingPolicy"}, w, "unknown to the converter")
    return _mapping(rp.get("schedulingPolicy"), f"{w}.schedulingPolicy")


def _pytorchjob(c: _Converter, doc: dict[Any, Any]) -> dict[str, Any]:
    meta, labels, annotations = _metadata(c, doc)
    spec_in = _mapping(doc.get("spec"), "spec", required=True)
    specs = _mapping(spec_in.get("pytorchReplicaSpecs"), "spec.pytorchReplicaSpecs", required=True)
    replicas: dict[str, tuple[str, dict[Any, Any]]] = {}
    for key, value in specs.items():
        kind = next((t for t in _REPLICA_TYPES if str(key).lower() == t.lower()), None)
        where = f"spec.pytorchReplicaSpecs.{shorten(str(key), 40)}"
        if kind is None:
            raise ConvertError(f"{where}: a PyTorchJob has Master and Worker replicas,"
                               f" not {shorten(str(key), 40)}")
        if kind in replicas:
            raise ConvertError(f"{where}: {kind} is given twice")
        replicas[kind] = (where, _mapping(value, where, required=True))
    if not replicas:
        raise ConvertError("spec.pytorchReplicaSpecs: no Master or Worker; give at least one")
    counts = {}
    for kind, (where, rs) in replicas.items():
        n = _int(rs.get("replicas"), f"{where}.replicas")
        counts[kind] = 1 if n is None else n
        if counts[kind] < 0:
            raise ConvertError(f"{where}.replicas: {n} is negative")
        c.unknown(rs, {"replicas", "template", "restartPolicy"}, where, "unknown to the converter")
    if counts.get("Master", 1) != 1:
        raise ConvertError(f"{replicas['Master'][0]}.replicas: a PyTorchJob's Master has 1"
                           f" replica, not {counts['Master']}")
    nodes = sum(counts.values())
    if nodes < 1:
        raise ConvertError("spec.pytorchReplicaSpecs: no replicas at all; give the"
                           " Master or at least one Worker")
    primary = "Master" if "Master" in replicas else "Worker"
    where, rs = replicas[primary]
    template = _mapping(rs.get("template"), f"{where}.template", required=True)
    if primary == "Master" and "Worker" in replicas and counts["Worker"]:
        worker = _mapping(replicas["Worker"][1].get("template"), f"{replicas['Worker'][0]}.template")
        if differ := _differences(template, worker):
            c.note("changed", replicas["Worker"][0], (
                "its template differs from the Master's in "
                f"{', '.join(shorten(d, 30) for d in differ[:10])}: Tetrad runs one template for every pod, "
                "converted from the Master's"))
    pod_meta = _mapping(template.get("metadata"), f"{where}.template.metadata")
    c.unknown(pod_meta, {"labels", "annotations"}, f"{where}.template.metadata",
              "Tetrad does not carry these to its pods")
    pod_where = f"{where}.template.spec"
    pod_spec = _mapping(template.get("spec"), pod_where, required=True)
    index, ctr = _container(c, pod_spec, PYTORCH_CONTAINER, pod_where)
    cw = f"{pod_where}.containers[{index}]"
    paths = _Paths(pod_where, cw, f"{cw}.env", f"{cw}.resources", f"{where}.template.metadata")
    pod = _pod(c, pod_spec, pod_meta, paths, ctr, command=_strings(ctr.get("command"), f"{cw}.command"),
               args=_strings(ctr.get("args"), f"{cw}.args"), env=_list(ctr.get("env"), f"{cw}.env"),
               resources=ctr.get("resources"), image=_string(ctr.get("image"), f"{cw}.image"),
               mounts=_list(ctr.get("volumeMounts"), f"{cw}.volumeMounts"))
    elastic = _mapping(spec_in.get("elasticPolicy"), "spec.elasticPolicy")
    nproc_value, nproc_where, given = spec_in.get("nprocPerNode"), "spec.nprocPerNode", True
    if nproc_value is None and elastic.get("nProcPerNode") is not None:
        nproc_value, nproc_where = elastic["nProcPerNode"], "spec.elasticPolicy.nProcPerNode"
    if nproc_value is None:
        nproc_value, given = "auto", False  # Kubeflow's default
    nproc, gpu = _world(c, pod, nodes, nproc_value, nproc_where, given=given)
    spec = _spec(nodes, nproc, gpu, pod)
    if elastic:
        shown = ", ".join(f"{k}: {shorten(str(v), 20)}" for k, v in elastic.items()
                          if k not in ("metrics", "nProcPerNode") and not _empty(v))
        c.note("not carried over", "spec.elasticPolicy", (
            f"{shown or 'elastic training'}"
            f"{', metrics (an autoscaler)' if not _empty(elastic.get('metrics')) else ''}: "
            f"Tetrad runs a fixed gang of nodes: {nodes} pods and restarts it whole after a failure"))
    run_policy: dict[str, Any] = {}
    rp = _mapping(spec_in.get("runPolicy"), "spec.runPolicy")
    backoff = _int(rp.get("backoffLimit"), "spec.runPolicy.backoffLimit")
    if backoff is not None and backoff < 0:
        raise ConvertError(f"spec.runPolicy.backoffLimit: {backoff} is negative")
    policies = {k: (_string(replicas[k][1].get("restartPolicy"), f"{replicas[k][0]}.restartPolicy")
                    or "OnFailure")
                for k in sorted(replicas, key=lambda k: k != primary)}
    _restart_policy(c, policies, backoff, run_policy)
    scheduling = _run_policy(c, rp, run_policy)
    if pod.grace is not None:
        run_policy["terminationGracePeriodSeconds"] = pod.grace
    c.unknown(spec_in, {"pytorchReplicaSpecs", "runPolicy", "elasticPolicy", "nprocPerNode"}, "spec",
              "unknown to the converter")
    _gang(c, spec, pod, labels, scheduling)
    _kueue_suspend(c, spec, run_policy, "spec.runPolicy.suspend")
    if run_policy:
        spec["runPolicy"] = run_policy
    return _job(c, meta, labels, annotations, spec)


# --- TrainJob ----------------------------------------------------------------------------------------------

_NOT_TORCH: Final = {"deepspeed": "DeepSpeed (launched by mpirun)", "mpi": "MPI", "mlx": "MLX", "jax": "JAX",
                     "xgboost": "XGBoost", "tensorflow": "TensorFlow", "flux": "Flux",
                     "paddle": "PaddlePaddle"}


def _runtime(c: _Converter, spec: dict[Any, Any]) -> str:
    ref = _mapping(spec.get("runtimeRef"), "spec.runtimeRef", required=True)
    name = _string(ref.get("name"), "spec.runtimeRef.name")
    if not name:
        raise ConvertError("spec.runtimeRef.name: required, but missing")
    kind = _string(ref.get("kind"), "spec.runtimeRef.kind") or "ClusterTrainingRuntime"
    group = _string(ref.get("apiGroup"), "spec.runtimeRef.apiGroup") or "trainer.kubeflow.org"
    if group != "trainer.kubeflow.org" or kind not in ("ClusterTrainingRuntime", "TrainingRuntime"):
        raise ConvertError(f"spec.runtimeRef: {shorten(group, 60)}/{shorten(kind, 60)}"
                           " is not a Trainer runtime")
    lowered = name.lower()
    for word, framework in _NOT_TORCH.items():
        if word in lowered and "torch" not in lowered.replace("deepspeed", ""):
            raise ConvertError(
                f"spec.runtimeRef.name: {shorten(name, 80)} is a {framework} runtime; Tetrad runs "
                "PyTorch jobs under torchrun, so only a TrainJob of a torch runtime (e.g. "
                "torch-distributed) converts")
    known = "torch" in lowered
    c.note("assumed", "spec.runtimeRef", (
        f"the {kind} {shorten(name, 80)} was not read{'' if known else ', and taken for a torch runtime'}: "
        "assumed its torch policy (numProcPerNode auto, numNodes 1), a trainer container "
        f"{TRAINJOB_CONTAINER} with no volumes, no sidecars, no gang policy and no failure policy (a failed "
        "node failed the TrainJob; Tetrad restarts the whole gang, at most runPolicy.maxRestarts times, 3 by "
        "default); carry what it adds by hand"))
    return name


def _overrides(c: _Converter, spec: dict[Any, Any], pod_spec: dict[str, Any], pod_meta: dict[str, Any],
               container: dict[str, Any]) -> str:
    """podSpecOverrides (Trainer v2.0), podTemplateOverrides (v2.1) and runtimePatches, applied in order to
    the trainer's pod (the replicated job `node`); what they aim at elsewhere is noted. Returns where the
    pod's fields came from, for the notes."""
    items: list[tuple[str, dict[Any, Any] | None, dict[Any, Any]]] = []  # (where, metadata, pod spec)
    for i, o in enumerate(_list(spec.get("podSpecOverrides"), "spec.podSpecOverrides")):
        w = f"spec.podSpecOverrides[{i}]"
        o = _mapping(o, w)
        if _targets(c, o, w):
            items.append((w, None, {k: v for k, v in o.items() if k != "targetJobs"}))
    for i, o in enumerate(_list(spec.get("podTemplateOverrides"), "spec.podTemplateOverrides")):
        w = f"spec.podTemplateOverrides[{i}]"
        o = _mapping(o, w)
        c.unknown(o, {"targetJobs", "metadata", "spec"}, w, "unknown to the converter")
        if _targets(c, o, w):
            items.append((w, _mapping(o.get("metadata"), f"{w}.metadata"),
                          _mapping(o.get("spec"), f"{w}.spec")))
    for i, patch in enumerate(_list(spec.get("runtimePatches"), "spec.runtimePatches")):
        w = f"spec.runtimePatches[{i}]"
        patch = _mapping(patch, w)
        runtime = _mapping(patch.get("trainingRuntimeSpec"), f"{w}.trainingRuntimeSpec")
        template = _mapping(runtime.get("template"), f"{w}.trainingRuntimeSpec.template")
        if not _empty(template.get("metadata")):
            c.note("not carried over", f"{w}.trainingRuntimeSpec.template.metadata",
                   "Tetrad creates no JobSet")
        jobs = _list(_mapping(template.get("spec"),
                              f"{w}.trainingRuntimeSpec.template.spec").get("replicatedJobs"),
                     f"{w}.trainingRuntimeSpec.template.spec.replicatedJobs")
        for j, job, name in _named(jobs, f"{w}.trainingRuntimeSpec.template.spec.replicatedJobs"):
            jw = f"{w}.trainingRuntimeSpec.template.spec.replicatedJobs[{j}]"
            if name != TRAINJOB_CONTAINER:
                c.note("not carried over", jw, f"{shorten(name, 40)}: Tetrad runs the trainer's pods only")
                continue
            job_template = _mapping(job.get("template"), f"{jw}.template")
            pod_template = _mapping(_mapping(job_template.get("spec"), f"{jw}.template.spec").get("template"),
                                    f"{jw}.template.spec.template")
            if not _empty(job_template.get("metadata")):
                c.note("not carried over", f"{jw}.template.metadata", "Tetrad creates no Jobs")
            items.append((f"{jw}.template.spec.template", _mapping(pod_template.get("metadata"), "metadata"),
                          _mapping(pod_template.get("spec"), "spec")))
        c.unknown(patch, {"manager", "time", "trainingRuntimeSpec"}, w, "unknown to the converter")
    for w, meta, override in items:
        if meta:
            for key in ("labels", "annotations"):
                pod_meta.setdefault(key, {}).update(_mapping(meta.get(key), f"{w}.metadata.{key}"))
        for key, value in override.items():
            if key == "containers":
                for i, ctr, name in _named(_list(value, f"{w}.spec.containers"), f"{w}.spec.containers"):
                    cw = f"{w}.spec.containers[{i}]"
                    if name != TRAINJOB_CONTAINER:
                        c.note("not carried over", cw, f"{shorten(name, 40)}: a container of the runtime's; "
                               "Tetrad's pods run the trainer's container only")
                        continue
                    for field_name in ("env", "volumeMounts"):
                        merged = {_name(m): m for m in container.get(field_name, [])}
                        merged.update({n: m for _, m, n in _named(
                            _list(ctr.get(field_name), f"{cw}.{field_name}"), f"{cw}.{field_name}")})
                        if merged:
                            container[field_name] = list(merged.values())
                    c.unknown(ctr, {"name", "env", "volumeMounts"}, cw, "not read by the converter")
            elif key == "volumes":
                merged = {_name(v): v for v in pod_spec.get("volumes", [])}
                merged.update({n: v for _, v, n in _named(_list(value, f"{w}.spec.volumes"),
                                                          f"{w}.spec.volumes")})
                pod_spec["volumes"] = list(merged.values())
            elif key == "nodeSelector":
                pod_spec["nodeSelector"] = {**pod_spec.get("nodeSelector", {}),
                                            **_mapping(value, f"{w}.spec.nodeSelector")}
            elif key == "schedulingGates" and not _empty(value):
                c.note("not carried over", f"{w}.spec.schedulingGates",
                       "Tetrad gates its pods itself (the gang)")
            else:
                # serviceAccountName, affinity, tolerations; the rest is noted with the pod
                pod_spec[key] = value
    return ("spec.podTemplateOverrides[*]" if len({w.split("[")[0] for w, _, _ in items}) != 1
            else f"{items[0][0].split('[')[0]}[*]")


def _targets(c: _Converter, override: dict[Any, Any], where: str) -> bool:
    """Whether an override aims at the trainer's pods; a note for what it aims at besides."""
    names = [n for _, _, n in _named(_list(override.get("targetJobs"), f"{where}.targetJobs"),
                                     f"{where}.targetJobs")]
    others = [n for n in names if n != TRAINJOB_CONTAINER]
    if others:
        c.note("not carried over", f"{where}.targetJobs", (
            f"{', '.join(shorten(n or '?', 40) for n in others)}: Tetrad runs the trainer's"
            " pods only (no initializer)"))
    return TRAINJOB_CONTAINER in names


def _trainjob(c: _Converter, doc: dict[Any, Any]) -> dict[str, Any]:
    meta, labels, annotations = _metadata(c, doc)
    spec_in = _mapping(doc.get("spec"), "spec", required=True)
    runtime = _runtime(c, spec_in)
    w = "spec.trainer"
    trainer = _mapping(spec_in.get("trainer"), w)
    image = _string(trainer.get("image"), f"{w}.image")
    if not image:
        raise ConvertError(f"{w}.image: not set, so the pods run the image of the runtime "
                           f"{shorten(runtime, 80)}, which the converter cannot read; set "
                           "spec.trainer.image (the runtime's is in `kubectl get clustertrainingruntime "
                           "NAME -o yaml`) and convert again")
    command = _strings(trainer.get("command"), f"{w}.command")
    if not command:
        raise ConvertError(f"{w}.command: not set, so the pods run the command of the runtime "
                           f"{shorten(runtime, 80)}, which the converter cannot read; set "
                           "spec.trainer.command and convert again")
    pod_spec: dict[str, Any] = {}
    pod_meta: dict[str, Any] = {}
    container: dict[str, Any] = {}
    overrides = _overrides(c, spec_in, pod_spec, pod_meta, container)
    env = [*_list(trainer.get("env"), f"{w}.env")]
    names = {_name(e) for e in env}
    env += [e for e in container.get("env", []) if _name(e) not in names]
    paths = _Paths(f"{overrides}.spec", w, f"{w}.env", f"{w}.resourcesPerNode", f"{overrides}.metadata")
    pod = _pod(c, pod_spec, pod_meta, paths, {}, image=image, command=command,
               args=_strings(trainer.get("args"), f"{w}.args"), env=env,
               resources=trainer.get("resourcesPerNode"), mounts=container.get("volumeMounts", []))
    nodes = _int(trainer.get("numNodes"), f"{w}.numNodes")
    if nodes is None:
        nodes = 1
        c.note("assumed", f"{w}.numNodes", "not set: the runtime's numNodes, assumed 1")
    if nodes < 1:
        raise ConvertError(f"{w}.numNodes: {nodes} must be at least 1")
    nproc_value, given = trainer.get("numProcPerNode"), True
    if nproc_value is None:
        nproc_value, given = "auto", False
    nproc, gpu = _world(c, pod, nodes, nproc_value, f"{w}.numProcPerNode", given=given)
    spec = _spec(nodes, nproc, gpu, pod)
    c.unknown(trainer, {"image", "command", "args", "env", "numNodes", "numProcPerNode", "resourcesPerNode"},
              w, "unknown to the converter")
    initializer = _mapping(spec_in.get("initializer"), "spec.initializer")
    for part in ("dataset", "model"):
        if not _empty(initializer.get(part)):
            uri = _mapping(initializer[part], f"spec.initializer.{part}").get("storageUri")
            c.note("not carried over", f"spec.initializer.{part}", (
                f"{shorten(str(uri), 80) + ': ' if uri else ''}Tetrad runs no initializer: download the "
                f"{part} in the script, or mount a volume that holds it (spec.template.volumes)"))
    # spec.labels and spec.annotations (Trainer v2.0, v2.1) went on the JobSet and its Jobs: the job object
    # here.
    for key, target in (("labels", labels), ("annotations", annotations)):
        if extra := _mapping(spec_in.get(key), f"spec.{key}"):
            target.update(extra)
            c.note("changed", f"spec.{key}",
                   "put on the ParallelTrainingJob (Tetrad creates no JobSet or Jobs)")
    volcano_queue = annotations.pop(VOLCANO_QUEUE_ANNOTATION, None)
    if volcano_queue is not None:
        c.note("assumed", f"metadata.annotations[{VOLCANO_QUEUE_ANNOTATION}]", (
            "the runtime gang-schedules with Volcano (podGroupPolicy.volcano): gang.scheduler volcano"))
    _gang(c, spec, pod, labels, None, volcano_queue if isinstance(volcano_queue, str) else None)
    run_policy: dict[str, Any] = {}
    if ((deadline := _int(spec_in.get("activeDeadlineSeconds"), "spec.activeDeadlineSeconds")) is not None
            and deadline >= 1):
        run_policy["activeDeadlineSeconds"] = deadline
    if _bool(spec_in.get("suspend"), "spec.suspend"):
        run_policy["suspend"] = True
    if pod.grace is not None:
        run_policy["terminationGracePeriodSeconds"] = pod.grace
    _kueue_suspend(c, spec, run_policy, "spec.suspend")
    if (not _empty(spec_in.get("managedBy"))
            and spec_in.get("managedBy") != "trainer.kubeflow.org/trainjob-controller"):
        c.note("not carried over", "spec.managedBy",
               f"{_shown(spec_in.get('managedBy'))}: Tetrad's operator manages the job")
    c.unknown(spec_in, {"runtimeRef", "trainer", "initializer", "labels", "annotations", "podSpecOverrides",
                        "podTemplateOverrides", "runtimePatches", "suspend", "activeDeadlineSeconds",
                        "managedBy"},
              "spec", "unknown to the converter")
    if run_policy:
        spec["runPolicy"] = run_policy
    return _job(c, meta, labels, annotations, spec)


# ---------------------------------------------------------------------------------------------------------

def describe(document: Any) -> str:
    """How a document is named in messages: its kind and namespace/name, as far as it has them."""
    if not isinstance(document, dict):
        return f"a {_type_name(document).removeprefix('a ').removeprefix('an ')}"
    kind = document.get("kind")
    meta = _dict(document.get("metadata"))
    name, namespace = meta.get("name"), meta.get("namespace")
    shown_kind = shorten(kind, 40) if isinstance(kind, str) and kind else "a document without a kind"
    if isinstance(name, str) and name:
        return (f"{shown_kind} "
                f"{shorten(namespace, 63) + '/' if isinstance(namespace, str) and namespace else ''}"
                f"{shorten(name, 80)}")
    return shown_kind


def convert(document: Any) -> Conversion:
    """The ParallelTrainingJob equivalent to a PyTorchJob or a torch TrainJob; ConvertError when there is
    none."""
    if not isinstance(document, dict):
        raise ConvertError(f"expected a YAML mapping (a PyTorchJob or TrainJob), got {_type_name(document)}")
    api_version, kind = document.get("apiVersion"), document.get("kind")
    if (api_version, kind) not in (PYTORCHJOB, TRAINJOB):
        expected = ("tetrad convert reads a PyTorchJob (kubeflow.org/v1) or a TrainJob"
                    " (trainer.kubeflow.org/v1alpha1)")
        if kind == KIND:
            raise ConvertError(f"kind: already a {KIND}; nothing to convert")
        if kind in (PYTORCHJOB[1], TRAINJOB[1]):
            raise ConvertError(f"apiVersion: {_shown(api_version)} is not the supported version; {expected}")
        if kind in OTHER_KUBEFLOW_KINDS:
            raise ConvertError(f"kind: {kind} is not a PyTorch job; {expected}")
        raise ConvertError(f"kind: {_shown(kind)} is not a job to convert; {expected};"
                           " apply other objects as they are")
    c = _Converter(str(kind), str(api_version), describe(document))
    job = _pytorchjob(c, document) if kind == PYTORCHJOB[1] else _trainjob(c, document)
    problems = validate_document(job)
    if errors := [p for p in problems if p.severity == "error"]:
        raise ConvertError(*(f"the converted job is not valid: {p}" for p in errors))
    c.notes += [Note("changed", p.field, f"Tetrad warns: {p.message}") for p in problems]
    return Conversion(c.name, c.api_version, job, c.notes)


__all__ = ["Conversion", "ConvertError", "EXIT_CODE_PERMANENT", "KINDS", "Note", "convert", "describe"]
