"""Deterministic, layout-independent batches.

A source maps a global sample index to seq_len+1 tokens (inputs plus the shifted labels); a source
that pads marks padding with IGNORE_INDEX: the model reads it as token PAD_INPUT, the loss skips it.
A source whose inputs are not all learned (fine-tuning data: the prompt is read, not learned) gives
the pair (inputs, labels) instead, each seq_len long, IGNORE_INDEX where nothing is learned. The
global batch of step s is samples [s*B, (s+1)*B) for every layout; data-parallel rank r of dp
takes the contiguous slice r of it. The loader's whole state is the next global sample index,
so a checkpoint taken with one dp degree resumes under another. Nothing is downloaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from tetrad.api.resolved import ResolvedConfig
from tetrad.api.rules import BYTE_TOKENIZER, BYTE_VOCAB, BYTE_VOCAB_MESSAGE
from tetrad.api.spec import DataSource
from tetrad_trainer.config import ConfigError
from tetrad_trainer.loss import IGNORE_INDEX
from tetrad_trainer.sft import jsonl_source
from tetrad_trainer.tokenizer import FIELD as TOKENIZER_FIELD
from tetrad_trainer.tokenizer import load_tokenizer

PAD_INPUT = 0  # the input token fed at a padded position (its label is IGNORE_INDEX)

# seq_len+1 tokens (IGNORE_INDEX where padded), or (inputs, labels) of seq_len each
Sample = np.ndarray | tuple[np.ndarray, np.ndarray]


class TokenSource(Protocol):
    def sample(self, index: int) -> Sample:
        """Global sample index: its seq_len+1 tokens, IGNORE_INDEX where padded; or its (inputs, labels)."""


def inputs_and_labels(sample: Sample) -> tuple[np.ndarray, np.ndarray]:
    """A sample as (inputs, labels), each seq_len long: seq_len+1 tokens are shifted, padding read as
    PAD_INPUT."""
    if isinstance(sample, tuple):
        return sample
    tokens = np.asarray(sample)
    return np.where(tokens[:-1] == IGNORE_INDEX, PAD_INPUT, tokens[:-1]), tokens[1:]


class SyntheticTokens:
    """Each sample repeats a motif of 4..32 tokens drawn from a Zipf law over the vocab.

    Both parts are learnable: the skewed unigram distribution within a few steps, copying the
    motif (induction) over hundreds, so the loss visibly falls in a demo and keeps falling.
    """

    def __init__(self, seed: int, vocab: int, seq_len: int, zipf_exponent: float = 1.0):
        self.seed, self.vocab, self.seq_len = seed, vocab, seq_len
        weights = 1.0 / np.arange(1, vocab + 1) ** zipf_exponent
        self.cdf = np.cumsum(weights / weights.sum())

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, index))
        length = int(rng.integers(4, 33))
        motif = np.minimum(np.searchsorted(self.cdf, rng.random(length)), self.vocab - 1)
        return np.resize(motif, self.seq_len + 1)


class TokenArray:
    """Consecutive windows of a token stream (in memory or memory-mapped), wrapping around; its ids are
    checked against the vocab where it is built (_token_file, the tokenizers' sizes)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, what: str):
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise ConfigError(f"{what} has {len(tokens)} tokens, fewer than seqLen+1 = {seq_len + 1}")
        self.tokens, self.seq_len, self.what = tokens, seq_len, what

    def sample(self, index: int) -> np.ndarray:
        start = (index % self.windows) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)


def _tokenize(path: Path, tokenizer: str, vocab: int) -> np.ndarray:
    if tokenizer == BYTE_TOKENIZER:
        if vocab < BYTE_VOCAB:  # validation refuses it; a config written by hand may not have been validated
            raise ConfigError(f"spec.model.vocab: {BYTE_VOCAB_MESSAGE.format(vocab)}")
        return np.frombuffer(_read(path), dtype=np.uint8)
    tok = load_tokenizer(tokenizer)
    if tok.vocab_size > vocab:
        raise ConfigError(f"{TOKENIZER_FIELD}: tokenizer {tokenizer} has {tok.vocab_size} tokens, more than"
                          f" the model's vocab of {vocab}")
    try:
        text = _read(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"spec.data.path: text file {path} is not UTF-8 text at byte offset "
                          f"{e.start} ({e.reason});"
                          " write it as UTF-8, or read its bytes with data.tokenizer: byte") from None
    return np.asarray(tok.encode([text], special=True)[0], dtype=np.int64)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"spec.data.path: cannot read text file {path}: {e.strerror or e}") from None


def build_source(cfg: ResolvedConfig, note: Callable[[str], None] = lambda _: None) -> TokenSource:
    """The job's source, its files checked (ConfigError, before any collective); `note` receives what
    rank 0 logs."""
    d, m = cfg.data, cfg.model
    assert m is not None, "a script job's config has no model to feed"
    if d.source == DataSource.SYNTHETIC:
        return SyntheticTokens(cfg.training.seed, m.vocab, m.seq_len)
    if d.source == DataSource.JSONL:
        return jsonl_source(cfg, note)
    path = Path(d.path or "")
    if not path.is_file():
        raise ConfigError(f"spec.data.path: {d.path!r} is not a file (data.source={d.source.value})")
    if d.source == DataSource.TEXT:
        return TokenArray(_tokenize(path, d.tokenizer, m.vocab), m.seq_len, f"text file {path}")
    start = time.monotonic()
    tokens = _token_file(path, d.token_dtype, m.vocab)
    note(f"token file {path}: {len(tokens):,} {d.token_dtype} tokens, every id inside the vocab of {m.vocab}"
         f" (checked in {time.monotonic() - start:.1f} s)")
    return TokenArray(tokens, m.seq_len, f"token file {path}")


# The start-up scan of a token file reads this many tokens at a time (32 or 64 MiB), vectorized.
SCAN_TOKENS = 1 << 24
# The width check reads the file's first this many uint16s.
WIDTH_SAMPLE = 1 << 20
# A token id's high 16 bits: at most 3 for vocabularies up to 2^18 (262,144), the largest in use.
HIGH_HALF_MAX = 3


def _token_file(path: Path, token_dtype: str, vocab: int) -> np.ndarray:
    """The memory-mapped tokens, every id checked against the vocab; ConfigError (exit 78) naming the
    field for a file that cannot hold them, that looks like the other width, or that holds an id outside
    the vocab."""
    dtype = np.dtype(token_dtype)
    try:
        size = path.stat().st_size
        if size == 0:
            raise ConfigError(f"spec.data.path: token file {path} is empty")
        if size % dtype.itemsize:
            raise ConfigError(f"spec.data.path: token file {path} has {size} bytes, not a whole number of"
                              f" {token_dtype} tokens ({dtype.itemsize} bytes each);"
                              " check spec.data.tokenDtype")
        tokens = np.memmap(path, dtype=dtype, mode="r")
        high = max(HIGH_HALF_MAX, (vocab - 1) >> 16)  # the largest high half of an id inside the vocab
        if (dtype.itemsize == 2 and size % 4 == 0
                and _halves_look_like_uint32(head := tokens[:WIDTH_SAMPLE], high)):
            raise ConfigError(f"spec.data.tokenDtype: token file {path} looks like uint32 tokens, read as"
                              f" uint16: every second uint16 of its first {len(head)} is at most {high}"
                              " (the high halves of little-endian uint32 ids);"
                              " set spec.data.tokenDtype: uint32")
        _scan(tokens, vocab, high, path)
        return tokens
    except OSError as e:
        raise ConfigError(f"spec.data.path: cannot read token file {path}: {e.strerror or e}") from None


def _halves_look_like_uint32(u16: np.ndarray, high: int) -> bool:
    """Little-endian uint32 ids read as uint16: every second one is a high half (0 below 65,536), while the
    others are not all that small (a file of zeros could be either)."""
    pairs = u16[:len(u16) // 2 * 2]
    return len(pairs) > 0 and int(pairs[1::2].max()) <= high < int(pairs[0::2].max())


def _scan(tokens: np.ndarray, vocab: int, high: int, path: Path) -> None:
    """Every id below the vocab, chunk by chunk; the first one outside named by its index."""
    for start in range(0, len(tokens), SCAN_TOKENS):
        chunk = tokens[start:start + SCAN_TOKENS]
        if int(chunk.max()) < vocab:
            continue
        at = start + int(np.argmax(chunk >= vocab))
        token = int(tokens[at])
        said = (f"spec.data.path: token file {path} holds token id {token} at token {at} "
                f"(byte offset {at * tokens.itemsize}),"
                f" outside the model's vocab of {vocab} (spec.model.vocab)")
        if tokens.itemsize == 4 and token >> 16 > high:  # two uint16 ids read as one
            raise ConfigError(f"{said}; its high 16 bits are {token >> 16}: the file looks like uint16"
                              " tokens, read as uint32; set spec.data.tokenDtype: uint16")
        raise ConfigError(f"{said}; write the file with the model's tokenizer, or use a model whose vocab"
                          " covers it")


class BatchLoader:
    """Yields this data-parallel rank's (inputs, labels), each (global_batch/dp, seq_len) int64."""

    def __init__(self, source: TokenSource, global_batch: int, dp_rank: int, dp_size: int):
        if global_batch % dp_size:
            raise ConfigError(f"globalBatch={global_batch} is not divisible by dp={dp_size}")
        self.source, self.global_batch = source, global_batch
        self.local_batch = global_batch // dp_size
        self.dp_rank = dp_rank
        self.sample_index = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.sample_index + self.dp_rank * self.local_batch
        rows = [inputs_and_labels(self.source.sample(i)) for i in range(first, first + self.local_batch)]
        self.sample_index += self.global_batch
        inputs = torch.from_numpy(np.stack([x for x, _ in rows]).astype(np.int64))
        labels = torch.from_numpy(np.stack([y for _, y in rows]).astype(np.int64))
        return inputs, labels

    def state_dict(self) -> dict[str, int]:
        return {"sample_index": self.sample_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sample_index = int(state["sample_index"])
