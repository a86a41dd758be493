"""A token file that cannot hold tokens is a config error (exit 78) naming spec.data.path, on every rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
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
    cfg = job({}, nproc=1, model={"seqLen": 8, "vocab": 512},
              data={"source": "tokens", "path": str(path), "tokenDtype": dtype})
    with pytest.raises(ConfigError, match="^" + re.escape(f"spec.data.path: token file {path} {expected}")):
        build_source(cfg)


def test_missing_file_names_the_field(tmp_path: Path) -> None:
    cfg = job({}, nproc=1, data={"source": "tokens", "path": str(tmp_path / "none.bin")})
    with pytest.raises(ConfigError, match="^spec.data.path: .* is not a file"):
        build_source(cfg)


def tokens_job(path: Path, dtype: str = "uint16", vocab: int = 512):
    return job({}, nproc=1, model={"seqLen": 8, "vocab": vocab},
               data={"source": "tokens", "path": str(path), "tokenDtype": dtype})


@pytest.mark.parametrize("chunk", [100, 1 << 24])
def test_a_token_id_outside_the_vocab_is_found_at_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           chunk: int) -> None:
    """The whole file is scanned when the source is built (in chunks: the bad id sits in the third of 100),
    not when its window is read mid-run; the message names the field, the file, the token's index and the
    vocab."""
    import tetrad_trainer.data as data

    monkeypatch.setattr(data, "SCAN_TOKENS", chunk)
    tokens = np.arange(1000, dtype=np.uint16) % 500
    tokens[234], tokens[900] = 700, 800
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    with pytest.raises(ConfigError) as e:
        build_source(tokens_job(path))
    assert str(e.value) == (f"spec.data.path: token file {path} holds token id 700 at token 234 (byte offset "
                            "468), outside the model's vocab of 512 (spec.model.vocab); write the file with "
                            "the model's tokenizer, or use a model whose vocab covers it")


def test_a_uint32_file_read_as_uint16_is_named(tmp_path: Path) -> None:
    """Little-endian uint32 ids below 65,536 read as uint16 are ids and zeros, all inside the vocab: caught by
    their every second id being a high half."""
    path = tmp_path / "tokens.bin"
    (np.arange(1000, dtype=np.uint32) % 500).tofile(path)
    with pytest.raises(ConfigError, match="^" + re.escape(
            f"spec.data.tokenDtype: token file {path} looks like uint32 tokens, read as uint16: every second "
            "uint16 of its first 2000 is at most 3 (the high halves of little-endian uint32 ids); set "
            "spec.data.tokenDtype: uint32")):
        build_source(tokens_job(path))
    assert build_source(tokens_job(path, "uint32")).sample(1).tolist() == list(range(8, 17))


def test_a_uint16_file_read_as_uint32_is_named(tmp_path: Path) -> None:
    """uint16 ids read as uint32 are pairs of ids, far outside any vocab: the out-of-vocab error says so."""
    path = tmp_path / "tokens.bin"
    (np.arange(1000, dtype=np.uint16) % 400 + 100).tofile(path)
    with pytest.raises(ConfigError, match=re.escape(
            "holds token id 6619236 at token 0 (byte offset 0), outside the model's vocab of 512 "
            "(spec.model.vocab); its high 16 bits are 101: the file looks like uint16 tokens, read as "
            "uint32; set spec.data.tokenDtype: uint16")):
        build_source(tokens_job(path, "uint32"))
    assert build_source(tokens_job(path)).sample(0).tolist() == list(range(100, 109))


def test_a_real_uint16_file_whose_ids_are_small_is_not_taken_for_uint32(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    # every second id at most 3, but so is every first
    np.array([1, 2, 3, 0] * 50, dtype=np.uint16).tofile(path)
    assert build_source(tokens_job(path)).sample(0).tolist() == [1, 2, 3, 0] * 2 + [1]
    path.write_bytes(b"\x00" * 400)  # zeros: either width
    assert build_source(tokens_job(path)).sample(0).tolist() == [0] * 9


def word_level(directory: Path, vocab: dict[str, int], config: dict[str, str] | None = None) -> Path:
    """A tokenizer.json of whole words (and its tokenizer_config.json when given)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def text_job(path: Path, tokenizer: str = "byte", vocab: int = 512):
    return job({}, nproc=1, model={"seqLen": 8, "vocab": vocab},
               data={"source": "text", "path": str(path), "tokenizer": tokenizer})


def test_a_text_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    """A tokenizer reads text: a file of other bytes stops every rank with 78 naming the field and the byte,
    not a traceback (exit 1, retried). The byte tokenizer reads bytes, any of them."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"the cat sat " * 3 + b"\xe9t\xe9 " + b"the cat sat " * 30)  # Latin-1
    tok = word_level(tmp_path / "tok", {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3})
    with pytest.raises(ConfigError, match="^" + re.escape(
            f"spec.data.path: text file {path} is not UTF-8 text at byte offset 36 (invalid continuation "
            "byte); write it as UTF-8, or read its bytes with data.tokenizer: byte")):
        build_source(text_job(path, str(tok)))
    assert build_source(text_job(path)).tokens[36:39].tolist() == [0xe9, ord("t"), 0xe9]


def test_a_tokenizer_that_does_not_load_or_fails_to_tokenize_is_a_config_error(tmp_path: Path) -> None:
    """Not JSON, not a tokenizer, or a tokenizer that raises on the data (a word-level vocab without its
    unknown token): spec.data.tokenizer, one line, never the library's traceback."""
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat " * 10)
    (tmp_path / "not-json.json").write_bytes(b"\xff\xfe not JSON")
    (tmp_path / "not-a-tokenizer.json").write_text('{"vocab": [1, 2]}')
    for name, words in (("not-json.json", "is not a tokenizer.json the tokenizers library loads: stream did "
                                          "not contain valid UTF-8"),
                        ("not-a-tokenizer.json", "is not a tokenizer.json the tokenizers library loads")):
        with pytest.raises(ConfigError,
                           match="^" + re.escape(f"spec.data.tokenizer: {tmp_path / name} {words}")):
            build_source(text_job(path, str(tmp_path / name)))
    tok = word_level(tmp_path / "no-unk", {"the": 0, "cat": 1, "sat": 2})  # "on" and "mat" have no id
    with pytest.raises(ConfigError, match="^" + re.escape(
            f"spec.data.tokenizer: {tok / 'tokenizer.json'} fails to tokenize the data: WordLevel error: "
            "Missing [UNK] token from the vocabulary")):
        build_source(text_job(path, str(tok)))
    # Reading the directory already tokenizes: does the post-processor start a text with bos_token?
    tok = word_level(tmp_path / "bos", {"<s>": 0, "the": 1}, {"bos_token": "<s>"})
    with pytest.raises(ConfigError, match="^" + re.escape(f"spec.data.tokenizer: {tok / 'tokenizer.json'} "
                                                          "fails to tokenize the data: WordLevel error")):
        build_source(text_job(path, str(tok)))


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
