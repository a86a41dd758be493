"""Supervised fine-tuning data (`spec.data.source: jsonl`): prompt/completion pairs and chat
conversations from a JSONL file, tokenized once at start-up, only the answers learned.

Each line is one JSON object (other keys are ignored):

    {"prompt": "What is 2+2?", "completion": "4"}
    {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}

(a chat line may add "tools", passed to the chat template). A sample is the line's tokens and, for
each token, whether the loss learns it:

- prompt/completion: bos (when the tokenizer starts texts with it) + prompt + completion + eos; the
  completion and the eos train.
- messages: the conversation as the tokenizer's chat template renders it; the assistant turns train
  (as TRL's assistant-only loss). An assistant turn is the text the template adds between the
  conversation rendered up to it with the generation prompt and rendered through it: its content
  and its end-of-turn marker, which teaches the model to stop (when the turn holds the tokenizer's
  eos_token, what follows the last one is not learned: ChatML's newline after <|im_end|>, as
  transformers' {% generation %} masks leave it out). This needs a template that renders
  a conversation turn by turn (each rendering the start of the next); no {% generation %} markers
  are needed. Nothing is appended: the template ends the turns.

Each span (prompt, completion, the text between assistant turns, an assistant turn) is tokenized on
its own, without the post-processor's special tokens, so no token straddles a learned and an
unlearned span; for templates whose turns are delimited by special tokens this is the tokenization
of the whole rendered text. A sample's first token never trains (nothing of its sample precedes it).

Rows of seqLen+1 tokens (the inputs and the last label): packing false puts one sample in a row,
packing true fills rows with whole samples, next-fit in an order drawn from the seed (no sample is
split over rows). The rest of a row is padding: input the pad token, label IGNORE_INDEX; a learned
token's label is the token, every other label IGNORE_INDEX. Global sample index i is row
perm_e[i mod R] of epoch e = i div R, perm_e a permutation of the R rows drawn from (seed, e): the
same for every layout, and a function of i alone, so the loader's state (the next global index)
resumes exactly.

Every line is checked at start-up, on every rank, before any collective (one streamed pass,
tokenized in chunks of CHUNK_LINES lines). A line that is not a JSON object of one of the two forms,
text no tokenizer takes (not UTF-8, an unpaired surrogate escape), a missing or mistyped field, an
empty completion, a chat without an assistant turn, a template that
fails on it, a token id at or above the model's vocab, and a sample longer than seqLen+1 tokens
(unless spec.data.truncate) are errors naming spec.data.path, the file, the line and the field:
exit 78 (the first SHOWN, and how many more). Empty lines are skipped and counted; with
truncate: true a longer sample keeps its first seqLen+1 tokens and one left with nothing to learn is
left out, both counted; rank 0 logs the counts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tetrad.api.resolved import ResolvedConfig
from tetrad.api.rules import BYTE_TOKENIZER, JSONL_TOKENIZER_MESSAGE
from tetrad_trainer.config import ConfigError
from tetrad_trainer.loss import IGNORE_INDEX
from tetrad_trainer.tokenizer import FIELD as TOKENIZER_FIELD
from tetrad_trainer.tokenizer import HFTokenizer, load_tokenizer

FIELD = "spec.data.path"
CHUNK_LINES = 1024  # lines tokenized together (bounds the memory of the tokenizer's output)
SHOWN = 5  # problems spelled out in the error; the rest are counted
SHOWN_LINES = 10  # line numbers listed in a logged count
PACK_STREAM, EPOCH_STREAM = 1, 2  # the random streams drawn from (seed, stream[, epoch])
FORMS = ('a line is {"prompt": "...", "completion": "..."} or {"messages": [{"role": "user", '
         '"content": "..."}, {"role": "assistant", "content": "..."}]}')


class LineProblem(Exception):
    """What is wrong with one line (its number is added by the reader)."""


@dataclass(frozen=True)
class Span:
    """Text of a sample, or fixed token ids (bos, eos), and whether the loss learns it."""

    field: str  # where it comes from, for the messages: prompt, completion, messages[3], ...
    trains: bool
    text: str = ""
    ids: tuple[int, ...] | None = None
    turn: bool = False  # an assistant turn: what follows its last eos is not learned


@dataclass
class Tokenized:
    """The file's samples, concatenated."""

    tokens: np.ndarray  # int32
    trains: np.ndarray  # bool: the loss learns this token (as the label of the position before it)
    starts: np.ndarray  # int64, count + 1 offsets into tokens
    lines: np.ndarray  # int64, each sample's line number

    @property
    def count(self) -> int:
        return len(self.lines)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)


@dataclass
class Counts:
    """What the reader decided on the way, for rank 0's log."""

    pairs: int = 0
    chats: int = 0
    empty: list[int] = field(default_factory=list)  # line numbers
    truncated: list[int] = field(default_factory=list)
    dropped_tokens: int = 0
    dropped_trained: int = 0
    left_out: list[int] = field(default_factory=list)
    seconds: float = 0.0


def _n(count: int, what: str) -> str:
    return f"{count} {what}" if count == 1 else f"{count} {what}s"


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:SHOWN_LINES]))
    return f"{shown}, ..." if len(numbers) > SHOWN_LINES else shown


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def spans_of(obj: Any, tok: HFTokenizer) -> tuple[list[Span], bool]:
    """A parsed line's spans, and whether it is a chat; LineProblem when it is neither form."""
    if not isinstance(obj, dict):
        raise LineProblem(f"is a JSON {_json_type(obj)}, not an object; {FORMS}")
    chat, pair = "messages" in obj, "prompt" in obj or "completion" in obj
    if chat and pair:
        raise LineProblem('has both "messages" and "prompt"/"completion"; give one form per line')
    if not chat and not pair:
        raise LineProblem(f"has neither \"prompt\"/\"completion\" nor \"messages\" "
                          f"(its keys: {', '.join(sorted(obj)) or 'none'}); {FORMS}")
    return (_chat_spans(obj, tok), True) if chat else (_pair_spans(obj, tok), False)


def _pair_spans(obj: dict[str, Any], tok: HFTokenizer) -> list[Span]:
    for key in ("prompt", "completion"):
        if key not in obj:
            raise LineProblem(f'"{key}" is missing: a prompt/completion line needs both')
        if not isinstance(obj[key], str):
            hint = ' (a conversation goes in "messages")' if isinstance(obj[key], list) else ""
            raise LineProblem(f'"{key}" is a JSON {_json_type(obj[key])}, not a string{hint}')
    if not obj["completion"]:
        raise LineProblem('"completion" is empty: there is nothing to learn but the end of text; '
                          'give the answer or remove the line')
    eos = tok.eos
    if eos is None:
        raise ConfigError(f"{TOKENIZER_FIELD}: {tok.directory} names no eos_token in tokenizer_config.json: "
                          "it ends every completion (the model learns to stop); use the model's tokenizer "
                          "directory, which names it")
    bos = [Span("bos_token", False, ids=(tok.bos.id,))] if tok.add_bos and tok.bos is not None else []
    return [*bos, Span("prompt", False, obj["prompt"]), Span("completion", True, obj["completion"]),
            Span("eos_token", True, ids=(eos.id,))]


def _chat_spans(obj: dict[str, Any], tok: HFTokenizer) -> list[Span]:
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise LineProblem('"messages" must be a non-empty array of {"role": ..., "content": ...} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise LineProblem(f"messages[{i}] is a JSON {_json_type(m)}, not an object")
        for key in ("role", "content"):
            if key not in m:
                raise LineProblem(f"messages[{i}].{key} is missing")
            if not isinstance(m[key], str):
                raise LineProblem(f"messages[{i}].{key} is a JSON {_json_type(m[key])}, not a string")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise LineProblem("messages has no assistant message: nothing would be learned "
                          "(the assistant turns are)")
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise LineProblem(f'"tools" is a JSON {_json_type(tools)}, not an array')
    try:
        whole = tok.render_chat(messages, add_generation_prompt=False, tools=tools)
        spans, cursor, after = [], 0, 0  # after: the first message not yet in a span
        for i in turns:
            before = tok.render_chat(messages[:i], add_generation_prompt=True, tools=tools)
            through = tok.render_chat(messages[:i + 1], add_generation_prompt=False, tools=tools)
            if not (whole.startswith(before) and whole.startswith(through)
                    and cursor <= len(before) <= len(through)):
                raise LineProblem(
                    f"the chat template does not render this conversation turn by turn"
                    f" (rendered up to messages[{i}], the assistant's, it is not the start of the whole),"
                    " so the assistant's tokens cannot be told apart; write the line as prompt/completion,"
                    " or use a template that only appends turns")
            spans += [Span(_messages(after, i), False, whole[cursor:len(before)]),
                      Span(f"messages[{i}]", True, whole[len(before):len(through)], turn=True)]
            cursor, after = len(through), i + 1
        return [*spans, Span(_messages(after, len(messages)), False, whole[cursor:])]
    except (ConfigError, LineProblem):
        raise
    except Exception as e:  # noqa: BLE001 - raise_exception, an undefined call or a type error in the template
        raise LineProblem(f"the chat template fails on it: {type(e).__name__}: {e}") from None


def _messages(first: int, end: int) -> str:
    """The field name of the unlearned text before messages[end]: the messages since `first` and the
    template's text."""
    if end == first:
        return (f"the chat template's text before messages[{end}]" if end
                else "the chat template's opening text")
    return f"messages[{first}]" if end == first + 1 else f"messages[{first}..{end - 1}]"


class _Reader:
    """One pass over the file: parse, tokenize in chunks, check, collect."""

    def __init__(self, path: Path, tok: HFTokenizer, row: int, vocab: int, truncate: bool):
        self.path, self.tok, self.row, self.vocab, self.truncate = path, tok, row, vocab, truncate
        self.counts = Counts()
        self.problems: list[str] = []
        self.problem_count = 0
        self.fixes: dict[str, None] = {}  # said once, after the problems
        self.pending: list[tuple[int, list[Span], bool]] = []  # (line, spans, a chat)
        self.tokens: list[np.ndarray] = []
        self.trains: list[np.ndarray] = []
        self.lines: list[int] = []

    def problem(self, line: int, message: str, fix: str | None = None) -> None:
        self.problem_count += 1
        if len(self.problems) < SHOWN:
            self.problems.append(f"line {line}: {message}")
        if fix is not None:
            self.fixes[fix] = None

    def read(self) -> Tokenized:
        start = time.monotonic()
        try:
            with self.path.open("rb") as f:
                for number, raw in enumerate(f, 1):
                    self.line(number, raw)
        except OSError as e:
            raise ConfigError(f"{FIELD}: cannot read {self.path}: {e.strerror or e}") from None
        self.flush()
        if self.problems:
            more = self.problem_count - len(self.problems)
            raise ConfigError(f"{FIELD}: {self.path} " + "; ".join(self.problems)
                              + (f"; and {more} more line{'s' if more > 1 else ''} with problems"
                                 if more else "")
                              + "".join(f"; {fix}" for fix in self.fixes))
        if not self.lines:
            raise ConfigError(
                f"{FIELD}: {self.path} holds no sample ({len(self.counts.empty)} empty lines"
                f"{', and every other was left out by truncation' if self.counts.left_out else ''}"
                f"); {FORMS}")
        self.counts.seconds = time.monotonic() - start
        lengths = np.array([len(t) for t in self.tokens], dtype=np.int64)
        return Tokenized(np.concatenate(self.tokens), np.concatenate(self.trains),
                         np.concatenate([[0], np.cumsum(lengths)]), np.array(self.lines, dtype=np.int64))

    def line(self, number: int, raw: bytes) -> None:
        if not raw.strip():
            self.counts.empty.append(number)
            return
        try:
            obj = json.loads(raw.rstrip(b"\r\n").decode("utf-8"))
            spans, chat = spans_of(obj, self.tok)
        except UnicodeDecodeError as e:
            self.problem(number, f"is not UTF-8 text (byte {e.start + 1}); write the file as UTF-8")
            return
        except json.JSONDecodeError as e:
            self.problem(number, f"is not valid JSON ({e.msg} at column {e.colno}); "
                                 "each line must be one JSON object")
            return
        except LineProblem as e:
            self.problem(number, str(e))
            return
        for span in spans:  # JSON may escape half a surrogate pair, which no tokenizer takes
            try:
                span.text.encode("utf-8")
            except UnicodeEncodeError as e:
                self.problem(number, f"{span.field} holds an unpaired surrogate "
                                     f"(\\u{ord(span.text[e.start]):04x}); escape"
                                     " characters outside the BMP as a pair, or write them as UTF-8")
                return
        self.pending.append((number, spans, chat))
        if len(self.pending) >= CHUNK_LINES:
            self.flush()

    def flush(self) -> None:
        texts = [s.text for _, spans, _ in self.pending for s in spans if s.ids is None]
        encoded = iter(self.tok.encode(texts))
        for number, spans, chat in self.pending:
            self.sample(number, spans,
                        [list(s.ids) if s.ids is not None else next(encoded) for s in spans], chat)
        self.pending = []

    def learned(self, span: Span, ids: list[int]) -> np.ndarray:
        """Which of a span's tokens the loss learns: all or none; an assistant turn up to its last eos
        (ChatML's newline after <|im_end|> is the template's, not the model's: generation stops at eos)."""
        trains = np.full(len(ids), span.trains)
        eos = self.tok.eos
        if span.turn and eos is not None and eos.id in ids:
            trains[len(ids) - ids[::-1].index(eos.id):] = False
        return trains

    def sample(self, number: int, spans: list[Span], ids: list[list[int]], chat: bool) -> None:
        for span, span_ids in zip(spans, ids, strict=True):
            if span_ids and (top := max(span_ids)) >= self.vocab:
                self.problem(number, f"{span.field} holds token id {top} ({self.tok.piece(top)!r}),"
                                     f" outside the model's vocab of {self.vocab}",
                                     f"use a model whose vocab covers the tokenizer's"
                                     f" {self.tok.vocab_size} tokens (spec.model.vocab)")
                return
        tokens = np.array([t for span_ids in ids for t in span_ids], dtype=np.int32)
        trains = np.concatenate([self.learned(s, i) for s, i in zip(spans, ids, strict=True)])
        trains[:1] = False
        if len(tokens) > self.row:
            if not self.truncate:
                sizes = ", ".join(f"{s.field} {len(i)}" for s, i in zip(spans, ids, strict=True)
                                  if s.ids is None and i)
                self.problem(number, f"has {len(tokens)} tokens ({sizes}), more than a row holds"
                                     f" (seqLen+1 = {self.row})",
                             "raise spec.model.seqLen, shorten or remove the lines longer than a row, or set"
                             f" spec.data.truncate: true to keep their first {self.row} tokens")
                return
            self.counts.truncated.append(number)
            self.counts.dropped_tokens += len(tokens) - self.row
            self.counts.dropped_trained += int(trains[self.row:].sum())
            tokens, trains = tokens[:self.row], trains[:self.row]
        if not trains.any():
            if self.counts.truncated[-1:] == [number]:
                self.counts.left_out.append(number)
            else:
                self.problem(number, "has no token to learn "
                                     "(the chat template renders its assistant turns empty)")
            return
        self.tokens.append(tokens)
        self.trains.append(trains)
        self.lines.append(number)
        if chat:
            self.counts.chats += 1
        else:
            self.counts.pairs += 1


def read_jsonl(path: Path, tok: HFTokenizer, row: int, vocab: int,
               truncate: bool) -> tuple[Tokenized, Counts]:
    """Every line of path checked and tokenized: samples of at most `row` tokens, ids below vocab."""
    if not path.is_file():
        raise ConfigError(f"{FIELD}: {str(path)!r} is not a file (data.source=jsonl)")
    reader = _Reader(path, tok, row, vocab, truncate)
    return reader.read(), reader.counts


def next_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Row bounds over samples of these lengths, in order: a row takes samples while they fit."""
    bounds, used = [0], 0
    for k, length in enumerate(lengths.tolist()):
        if used + length > capacity:
            bounds.append(k)
            used = 0
        used += length
    bounds.append(len(lengths))
    return np.array(bounds, dtype=np.int64)


class JsonlSource:
    """Rows of whole samples (one each, or packed), visited in a permutation per epoch drawn from the seed."""

    def __init__(self, data: Tokenized, seq_len: int, seed: int, packing: bool, pad_id: int):
        self.data, self.seq_len, self.seed, self.pad_id = data, seq_len, seed, pad_id
        if packing:
            self.members = np.random.default_rng((seed, PACK_STREAM)).permutation(data.count)
            self.bounds = next_fit(data.lengths[self.members], seq_len + 1)
        else:
            self.members = np.arange(data.count)
            self.bounds = np.arange(data.count + 1)
        self.rows = len(self.bounds) - 1
        self._epoch, self._order = -1, self.members

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng(
                (self.seed, EPOCH_STREAM, epoch)).permutation(self.rows)
        return self._order

    def row(self, index: int) -> np.ndarray:
        """The samples of global sample index's row, in row order."""
        epoch, r = divmod(index, self.rows)
        row = int(self.order(epoch)[r])
        return self.members[self.bounds[row]:self.bounds[row + 1]]

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels) of global sample index, each seq_len long."""
        d = self.data
        parts = [slice(d.starts[s], d.starts[s + 1]) for s in self.row(index)]
        tokens = np.concatenate([d.tokens[p] for p in parts]).astype(np.int64)
        trains = np.concatenate([d.trains[p] for p in parts])
        inputs = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        inputs[:min(len(tokens), self.seq_len)] = tokens[:self.seq_len]
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        labels[:len(tokens) - 1] = np.where(trains[1:], tokens[1:], IGNORE_INDEX)
        return inputs, labels

    def fill(self) -> float:
        """The share of the rows' seq_len+1 tokens that are samples, not padding."""
        return float(self.data.lengths.sum()) / (self.rows * (self.seq_len + 1))


def notes(path: Path, data: Tokenized, counts: Counts, source: JsonlSource, packing: bool) -> list[str]:
    """What rank 0 logs: the data, and every decision the reader counted."""
    trained, row = int(data.trains.sum()), source.seq_len + 1
    said = [f"jsonl data {path}: {_n(data.count, 'sample')} ({counts.pairs} prompt/completion,"
            f" {counts.chats} chat) read and tokenized in {counts.seconds:.1f} s,"
            f" {_n(len(data.tokens), 'token')}, {trained} of them learned"
            f" ({100 * trained / len(data.tokens):.0f}%), the longest sample {int(data.lengths.max())};"
            f" {_n(source.rows, 'row')} of seqLen+1 = {row} tokens"
            f" ({'packed' if packing else 'one sample each'}, {100 * source.fill():.0f}% tokens,"
            " the rest padding), in a new order every epoch"]
    if counts.empty:
        said.append(f"skipped {_n(len(counts.empty), 'empty line')}: {_lines(counts.empty)}")
    if counts.truncated:
        said.append(f"spec.data.truncate: cut {_n(len(counts.truncated), 'sample')} longer than {row} tokens"
                    f" to their first {row} (lines {_lines(counts.truncated)}),"
                    f" dropping {_n(counts.dropped_tokens, 'token')},"
                    f" {counts.dropped_trained} of them learned")
    if counts.left_out:
        said.append(f"spec.data.truncate: left out {_n(len(counts.left_out), 'sample')} with nothing left"
                    f" to learn once cut (lines {_lines(counts.left_out)})")
    return said


def jsonl_source(cfg: ResolvedConfig, note: Callable[[str], None]) -> JsonlSource:
    """The job's JSONL source, every line checked; `note` receives what rank 0 logs."""
    d, m = cfg.data, cfg.model
    assert m is not None
    if d.tokenizer == BYTE_TOKENIZER:
        # validation refuses it; a config written by hand may not have been validated
        raise ConfigError(f"{TOKENIZER_FIELD}: {JSONL_TOKENIZER_MESSAGE}")
    tok = load_tokenizer(d.tokenizer)
    for name, token in tok.special.items():
        if name != "unk_token" and token.id >= m.vocab:
            raise ConfigError(f"{TOKENIZER_FIELD}: {name} {token.text!r} is token id {token.id},"
                              f" outside the model's vocab of {m.vocab}; use a model whose vocab covers"
                              f" the tokenizer's {tok.vocab_size} tokens")
    path = Path(d.path or "")
    data, counts = read_jsonl(path, tok, m.seq_len + 1, m.vocab, d.truncate)
    source = JsonlSource(data, m.seq_len, cfg.training.seed, d.packing, tok.pad_id)
    for line in notes(path, data, counts, source, d.packing):
        note(line)
    return source
