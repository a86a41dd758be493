"""Batches are the same for every layout, and the loader's state is layout-independent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tetrad_trainer.config import ConfigError
from tetrad_trainer.cp import shard_sequence
from tetrad_trainer.data import BatchLoader, SyntheticTokens, build_source

from tests.trainer.harness import job


def global_batches(source, global_batch: int, dp: int, steps: int, cp: int = 1) -> list[torch.Tensor]:
    """What every (dp, cp) rank sees per step, put back together."""
    loaders = [BatchLoader(source, global_batch, dp_rank=r, dp_size=dp) for r in range(dp)]
    out = []
    for _ in range(steps):
        per_rank = [loader.next_batch() for loader in loaders]
        inputs = torch.cat([x for x, _ in per_rank])
        labels = torch.cat([y for _, y in per_rank])
        if cp > 1:  # each cp rank's load-balanced shard, reassembled chunk by chunk
            shards = [shard_sequence(inputs, 1, cp, r) for r in range(cp)]
            chunks: list[torch.Tensor | None] = [None] * (2 * cp)
            for r, shard in enumerate(shards):
                first, second = shard.chunk(2, dim=1)
                chunks[r], chunks[2 * cp - 1 - r] = first, second
            assert torch.equal(torch.cat(chunks, dim=1), inputs)
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
        out.append(inputs)
    return out


@pytest.mark.parametrize("dp, cp", [(2, 1), (4, 1), (8, 1), (2, 2), (1, 4)])
def test_global_batch_is_identical_for_every_layout(dp: int, cp: int) -> None:
    source = SyntheticTokens(seed=5, vocab=1000, seq_len=64)
    single = global_batches(source, 8, 1, steps=3)
    assert all(torch.equal(a, b)
               for a, b in zip(single, global_batches(source, 8, dp, steps=3, cp=cp), strict=True))
    assert not torch.equal(single[0], single[1])


def test_synthetic_data_depends_on_seed_and_is_learnable() -> None:
    a, b = SyntheticTokens(1, 500, 64), SyntheticTokens(2, 500, 64)
    assert np.array_equal(a.sample(3), SyntheticTokens(1, 500, 64).sample(3))
    assert not np.array_equal(a.sample(3), b.sample(3))
    s = a.sample(0)
    assert len(s) == 65 and s.max() < 500
    period = next(p for p in range(1, 33) if np.array_equal(s[p:], s[:-p]))  # a repeated motif
    assert 4 <= period <= 32
    counts = np.bincount(np.concatenate([a.sample(i)[:4] for i in range(2000)]), minlength=500)
    assert counts[0] > 10 * counts[100] > 0  # Zipf: frequent small ids, rare large ones


def test_state_is_the_global_sample_index_and_resumes_under_another_dp() -> None:
    source = SyntheticTokens(0, 100, 16)
    before = [BatchLoader(source, 8, dp_rank=r, dp_size=2) for r in range(2)]
    for loader in before:
        loader.next_batch()
        loader.next_batch()
    states = [loader.state_dict() for loader in before]
    assert states[0] == states[1] == {"sample_index": 16}
    after = [BatchLoader(source, 8, dp_rank=r, dp_size=4) for r in range(4)]
    for loader in after:
        loader.load_state_dict(states[0])
    resumed = torch.cat([loader.next_batch()[0] for loader in after])
    fresh = BatchLoader(source, 8, dp_rank=0, dp_size=1)
    fresh.next_batch()
    fresh.next_batch()
    assert torch.equal(resumed, fresh.next_batch()[0])


def test_token_file_is_memory_mapped_windows_that_wrap(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint32) % 300
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    cfg = job({}, nproc=1, model={"seqLen": 64, "vocab": 512},
              data={"source": "tokens", "path": str(path), "tokenDtype": "uint32"})
    notes: list[str] = []
    source = build_source(cfg, notes.append)
    assert notes[0].startswith(f"token file {path}: 1,000 uint32 tokens, every id inside the vocab of 512 "
                               "(checked in ")
    assert isinstance(source.tokens, np.memmap)
    assert np.array_equal(source.sample(2), tokens[128:193])
    windows = (1000 - 1) // 64
    assert np.array_equal(source.sample(windows), source.sample(0))


def test_text_with_the_byte_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text("hello tetrad " * 40)
    cfg = job({}, nproc=1, model={"seqLen": 32}, data={"source": "text", "path": str(path)})
    assert bytes(build_source(cfg).sample(0).astype(np.uint8)) == b"hello tetrad " * 2 + b"hello t"


def test_text_with_a_local_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("the cat sat " * 30)
    cfg = job({}, nproc=1, model={"seqLen": 8}, data={"source": "text", "path": str(tmp_path / "corpus.txt"),
                                                      "tokenizer": str(tmp_path / "tokenizer.json")})
    assert build_source(cfg).sample(0).tolist() == [1, 2, 3, 1, 2, 3, 1, 2, 3]


def test_missing_files_are_config_errors(tmp_path: Path) -> None:
    cfg = job({}, nproc=1, data={"source": "tokens", "path": str(tmp_path / "nope.bin")})
    with pytest.raises(ConfigError, match="is not a file"):
        build_source(cfg)
    (tmp_path / "short.txt").write_text("tiny")
    cfg = job({}, nproc=1, data={"source": "text", "path": str(tmp_path / "short.txt")})
    with pytest.raises(ConfigError, match="fewer than seqLen"):
        build_source(cfg)
