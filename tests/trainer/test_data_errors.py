"""A token file that cannot hold tokens is a config error (exit 78) naming spec.data.path, on every rank."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tetrad_trainer.config import ConfigError
from tetrad_trainer.data import build_source

from tests.trainer.harness import job


@pytest.mark.parametrize(("content", "dtype", "expected"), [
    (b"", "uint16", "is empty"),
    (b"\x01\x00\x02", "uint16", "has 3 bytes, not a whole number of uint16 tokens"),
    (b"\x01\x00\x02\x00\x03\x00", "uint32", "has 6 bytes, not a whole number of uint32 tokens"),
])
def test_bad_token_files(tmp_path: Path, content: bytes, dtype: str, expected: str) -> None:
    path = tmp_path / "tokens.bin"
    path.write_bytes(content)
    cfg = job({}, nproc=1, model={"seqLen": 8, "vocab": 512}, data={"source": "tokens", "path": str(path), "tokenDtype": dtype})
    with pytest.raises(ConfigError, match="^" + re.escape(f"spec.data.path: token file {path} {expected}")):
        build_source(cfg)


def test_missing_file_names_the_field(tmp_path: Path) -> None:
    cfg = job({}, nproc=1, data={"source": "tokens", "path": str(tmp_path / "none.bin")})
    with pytest.raises(ConfigError, match="^spec.data.path: .* is not a file"):
        build_source(cfg)


def test_a_byte_tokenizer_with_a_vocab_below_256_is_refused_by_name(tmp_path: Path) -> None:
    """Validation refuses it (tests/api/test_validation.py); a config written by hand stops at load_config's
    check, and the source says the same."""
    from tetrad_trainer.config import check_runnable

    path = tmp_path / "corpus.txt"
    path.write_text("hello tetrad " * 40)
    cfg = job({}, nproc=1, model={"seqLen": 8, "vocab": 256}, data={"source": "text", "path": str(path)})
    cfg.model = cfg.model.model_copy(update={"vocab": 200})
    said = "^spec.model.vocab: vocab=200 is below the 256 ids of the byte tokenizer"
    with pytest.raises(ConfigError, match=said):
        check_runnable(cfg)
    with pytest.raises(ConfigError, match=said):
        build_source(cfg)
