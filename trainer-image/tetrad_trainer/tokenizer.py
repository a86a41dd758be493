"""A Hugging Face tokenizer as the data tokenizer (`spec.data.tokenizer`).

The tokenizer is a directory as `save_pretrained` writes it, or its tokenizer.json:

- tokenizer.json: the fast tokenizer (HF `tokenizers`), the only file read for source `text`;
- tokenizer_config.json beside it: `bos_token`, `eos_token`, `pad_token` (a string, or an object
  with its `content`), `add_bos_token`, and `chat_template` (a string, or a list of named
  templates whose `default` is taken);
- chat_template.jinja beside it (transformers 4.43 and later save the template there): wins over
  tokenizer_config.json's.

The chat template is rendered with Jinja2 as transformers renders it: a sandbox, trim_blocks and
lstrip_blocks, the loop controls, `raise_exception`, a `tojson` that keeps non-ASCII text, and the
special tokens as `bos_token`, `eos_token`, ... The `{% generation %}` marker renders its body (the
trained spans are found by rendering turn by turn: tetrad_trainer.sft). `strftime_now` is left
undefined on purpose: a date would make the tokens depend on the day, so ranks rendering on either
side of midnight, or a run resumed a day later, would see other data (templates that test for it,
as Llama 3.1's, fall back to their fixed date).

Every problem is a ConfigError naming spec.data.tokenizer (exit 78, on every rank before any
collective).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2 import nodes
from jinja2.parser import Parser
from tokenizers import Encoding, Tokenizer

from tetrad_trainer.config import ConfigError

FIELD = "spec.data.tokenizer"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclass(frozen=True)
class SpecialToken:
    text: str
    id: int


@dataclass
class HFTokenizer:
    """tokenizer.json and what tokenizer_config.json says about it."""

    tokenizer: Tokenizer
    file: Path  # tokenizer.json
    special: dict[str, SpecialToken]  # by its tokenizer_config.json key: bos_token, eos_token, ...
    add_bos: bool  # a prompt starts with bos_token
    chat_template: str | None
    template_source: str  # where the template came from, for messages
    _compiled: jinja2.Template | None = field(default=None, repr=False)

    @property
    def directory(self) -> Path:
        return self.file.parent

    @property
    def bos(self) -> SpecialToken | None:
        return self.special.get("bos_token")

    @property
    def eos(self) -> SpecialToken | None:
        return self.special.get("eos_token")

    @property
    def pad_id(self) -> int:
        """The input fed at a padded position: pad_token, else eos_token (as Hugging Face trainers do),
        else 0."""
        token = self.special.get("pad_token") or self.eos
        return token.id if token is not None else 0

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, texts: list[str], *, special: bool = False) -> list[list[int]]:
        """Each text's ids, with the special tokens the post-processor adds only when `special`."""
        return [e.ids for e in _encoded(self.tokenizer, self.file, texts, special)]

    def piece(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id) or "?"

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                    tools: list[Any] | None = None) -> str:
        """The chat template applied to messages, as transformers' apply_chat_template(tokenize=False).
        Raises jinja2.TemplateError when the template does (raise_exception, an undefined call)."""
        if self._compiled is None:
            if self.chat_template is None:
                raise ConfigError(f"{FIELD}: {self.directory} has no chat template (neither {TEMPLATE_FILE} "
                                  f"nor chat_template in {CONFIG_FILE}), which chat lines (messages) need; "
                                  "use a tokenizer saved with its template or write the lines as "
                                  "prompt/completion")
            try:
                self._compiled = _environment().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ConfigError(f"{FIELD}: the chat template in {self.template_source} does not parse:"
                                  f" {e.message} (template line {e.lineno})") from None
        specials = {name: token.text for name, token in self.special.items()}
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, documents=None, **specials)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, transformers' marker of the assistant's tokens: its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


def load_tokenizer(spec: str) -> HFTokenizer:
    """The tokenizer of spec.data.tokenizer: a directory, or its tokenizer.json (its directory read
    beside it)."""
    path = Path(spec)
    if path.is_dir():
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"{FIELD}: the directory {path} has no tokenizer.json; save the tokenizer "
                              "there with transformers' save_pretrained (a fast tokenizer) or name the "
                              "tokenizer.json itself")
    elif path.is_file():
        file = path
    else:
        raise ConfigError(f"{FIELD}: {spec!r} is neither 'byte', a tokenizer.json nor a Hugging Face "
                          "tokenizer directory inside the pod; mount it (template.volumes) and give its path")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - the Rust library raises plain Exceptions
        raise ConfigError(f"{FIELD}: {file} is not a tokenizer.json"
                          f" the tokenizers library loads: {e}") from None
    config = _config(file.parent / CONFIG_FILE)
    special = {name: token for name in SPECIAL if (token := _special(tok, config, name, file)) is not None}
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        # not said: what the post-processor does, as transformers' tokenizer(text)
        add_bos = _post_processor_adds(tok, file, special.get("bos_token"))
    elif add_bos and "bos_token" not in special:
        raise ConfigError(f"{FIELD}: {file.parent / CONFIG_FILE} sets add_bos_token but names no bos_token; "
                          "name it or set add_bos_token: false")
    template, source = _chat_template(file.parent, config)
    return HFTokenizer(tok, file, special, add_bos, template, source)


def _config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{FIELD}: cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{FIELD}: {path} holds a JSON {type(config).__name__}, not an object")
    return config


def _special(tok: Tokenizer, config: dict[str, Any], name: str, file: Path) -> SpecialToken | None:
    value = config.get(name)
    if isinstance(value, dict):  # an AddedToken written out: {"content": ..., "special": true, ...}
        value = value.get("content")
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{FIELD}: {file.parent / CONFIG_FILE}'s {name} is a {type(value).__name__}, not a "
                          "token (a string or an object with its content)")
    token_id = tok.token_to_id(value)
    if token_id is None:
        raise ConfigError(f"{FIELD}: {file.parent / CONFIG_FILE} names {name} {value!r}, "
                          f"which {file} does not hold")
    return SpecialToken(value, token_id)


def _encoded(tok: Tokenizer, file: Path, texts: list[str], special: bool) -> list[Encoding]:
    try:
        return tok.encode_batch(texts, add_special_tokens=special)
    except Exception as e:  # noqa: BLE001 - the Rust library raises plain Exceptions (a word-level vocab without unk)
        raise ConfigError(f"{FIELD}: {file} fails to tokenize the data: {e}") from None


def _post_processor_adds(tok: Tokenizer, file: Path, bos: SpecialToken | None) -> bool:
    """Whether tokenizer.json's post-processor starts a text with bos (Llama 3's TemplateProcessing does)."""
    if bos is None:
        return False
    with_specials, plain = (_encoded(tok, file, ["a"], special)[0].ids for special in (True, False))
    return with_specials[:1] == [bos.id] and plain[:1] != [bos.id]


def _chat_template(directory: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    file = directory / TEMPLATE_FILE
    if file.is_file():
        try:
            return file.read_text(encoding="utf-8"), str(file)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{FIELD}: cannot read {file}: {e}") from None
    where = f"{directory / CONFIG_FILE}'s chat_template"
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ConfigError(f"{FIELD}: {where} lists templates {sorted(map(str, named))} "
                              "but none named 'default'")
        template, where = named["default"], f"{where} 'default'"
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{FIELD}: {where} is a {type(template).__name__}, not a Jinja template")
    return template, where
