"""The checkpoint directory without process groups: durable writes, manifests, damage detection,
`latest`, retention, and a single-process save → damage → fall back → resume cycle."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
from tetrad_trainer import checkpoint
from tetrad_trainer.checkpoint import state as ck_state
from tetrad_trainer.checkpoint import store as ck
from torch import nn
from torch.distributed.checkpoint import filesystem as dcp_files

from tests.checkpoint import toy
from tetrad.api.contract import EXIT_CONFIG_ERROR, EXIT_OOM, EXIT_PREEMPTED
from tetrad.node.exits import node_exit_code


def make_step(root: Path, step: int, files: dict[str, bytes] | None = None) -> Path:
    """A committed-looking step directory with a valid manifest."""
    d = root / ck.step_dir_name(step)
    d.mkdir(parents=True)
    digests = {}
    for name, data in (files or {"__0_0.distcp": b"x" * 100, ".metadata": b"meta"}).items():
        (d / name).write_bytes(data)
        size, crc = ck.file_digest(d / name)
        digests[name] = {"size": size, "crc32": crc}
    (d / ck.MANIFEST).write_bytes(ck.seal_manifest({"format": ck.FORMAT, "step": step, "files": digests}))
    return d


def test_write_durably_replaces_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "latest"
    ck.write_durably(target, b"step-00000001\n")
    ck.write_durably(target, b"step-00000002\n")
    assert target.read_bytes() == b"step-00000002\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_file_digest_matches_zlib_over_chunks(tmp_path):
    import zlib

    data = os.urandom(3 * ck._CHUNK + 17)  # several chunks and a tail
    (tmp_path / "f").write_bytes(data)
    assert ck.file_digest(tmp_path / "f") == (len(data), f"{zlib.crc32(data):08x}")


def test_manifest_round_trip_and_self_check(tmp_path):
    d = make_step(tmp_path, 7)
    assert ck.read_manifest(d)["step"] == 7
    text = (d / ck.MANIFEST).read_text().replace('"step": 7', '"step": 8')
    (d / ck.MANIFEST).write_text(text)
    with pytest.raises(ck.CheckpointError, match="manifest checksum mismatch"):
        ck.read_manifest(d)
    (d / ck.MANIFEST).write_text(text[: len(text) // 2])
    with pytest.raises(ck.CheckpointError, match="unreadable"):
        ck.read_manifest(d)
    (d / ck.MANIFEST).unlink()
    with pytest.raises(ck.CheckpointError, match="never committed"):
        ck.read_manifest(d)


def test_verify_files_names_each_kind_of_damage(tmp_path):
    d = make_step(tmp_path, 1, {"a": b"a" * 10, "b": b"b" * 10, "c": b"c" * 10, "d": b"d" * 10})
    files = ck.read_manifest(d)["files"]
    assert ck.verify_files(d, files) == []
    (d / "a").unlink()
    (d / "b").write_bytes(b"b" * 5)
    (d / "c").write_bytes(b"c" * 9 + b"X")
    problems = ck.verify_files(d, files)
    assert problems[0] == "a: missing"
    assert problems[1].startswith("b: 5 bytes, the manifest says 10 (truncated")
    assert problems[2].startswith("c: CRC32") and problems[2].endswith("(corrupted)")
    assert len(problems) == 3


def test_candidates_follow_latest_then_older(tmp_path):
    store = ck.CheckpointDir(tmp_path)
    assert store.candidates() == []
    for s in (2, 4, 6, 8):
        make_step(tmp_path, s)
    store.publish(6)  # step 8 was renamed but never published: not committed
    assert [c.step for c in store.candidates()] == [6, 4, 2]
    (tmp_path / ck.LATEST).unlink()
    cands = store.candidates()
    assert [c.step for c in cands] == [8, 6, 4, 2]
    assert "missing" in cands[0].note
    (tmp_path / ck.LATEST).write_text("garbage")
    assert "not a step directory name" in store.candidates()[0].note


def test_latest_naming_a_directory_without_manifest_is_still_a_candidate(tmp_path):
    make_step(tmp_path, 2)
    (tmp_path / ck.step_dir_name(4)).mkdir()
    ck.CheckpointDir(tmp_path).publish(4)
    assert [c.step for c in ck.CheckpointDir(tmp_path).candidates()] == [4, 2]


def test_prune_keeps_the_newest_committed_and_drops_unpublished(tmp_path):
    store = ck.CheckpointDir(tmp_path)
    for s in (1, 2, 3, 4, 5):
        make_step(tmp_path, s)
    assert store.prune(2) == []  # nothing is committed before `latest` exists
    store.publish(4)
    assert store.prune(2) == [1, 2, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000004"]


def test_clean_garbage_removes_temporaries_only(tmp_path):
    make_step(tmp_path, 1)
    (tmp_path / ".tmp-step-00000002").mkdir()
    (tmp_path / ".tmp-step-00000002" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / ".trash-step-00000000.1.2").mkdir()
    (tmp_path / ".tmp-latest.123").write_text("x")
    ck.CheckpointDir(tmp_path).clean_garbage()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]


@pytest.mark.parametrize(("torchrun", "workers", "nproc", "want"), [
    (0, [], 4, 0),
    (1, [EXIT_PREEMPTED] * 4, 4, EXIT_PREEMPTED),
    (1, [EXIT_PREEMPTED] * 3, 4, 1),  # one worker never got to save
    (1, [EXIT_PREEMPTED, EXIT_CONFIG_ERROR], 2, EXIT_CONFIG_ERROR),
    (1, [EXIT_OOM, EXIT_PREEMPTED], 2, EXIT_OOM),  # out of memory on one rank: permanent, not 1
    (1, [EXIT_OOM, EXIT_CONFIG_ERROR], 2, EXIT_CONFIG_ERROR),
    (1, [], 4, 1),
    (-9, [], 4, 137),
])
def test_node_exit_code(torchrun, workers, nproc, want):
    assert node_exit_code(torchrun, workers, nproc) == want


def test_merged_view_joins_pipeline_stages_under_full_names():
    cfg = toy.config({}, "/unused")
    full = toy.ToyLM(cfg)
    first = toy.ToyLM(cfg, keep={0, 1}, last=False)
    last = toy.ToyLM(cfg, keep={2}, first=False)
    view = checkpoint.merged_view([first, last])
    assert sorted(n for n, _ in view.named_parameters()) == sorted(n for n, _ in full.named_parameters())
    assert view.layers["2"] is last.layers["2"]
    with pytest.raises(ck.CheckpointError, match="overlap in 'layers'"):
        checkpoint.merged_view([first, toy.ToyLM(cfg, keep={1}, first=False)])


# -- one process, no process group --------------------------------------------------------------

def tiny(path: Path, **ckpt) -> tuple[checkpoint.Checkpointer, nn.Module, torch.optim.Optimizer]:
    cfg = toy.config({}, path, **ckpt)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return (checkpoint.Checkpointer(cfg, model_parts=[model], optimizers=[opt], logger=lambda m: None),
            model, opt)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        model(torch.full((3, 4), float(i))).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_single_process_damage_falls_back_to_previous(tmp_path, monkeypatch):
    monkeypatch.setenv("TETRAD_RESTART", "3")
    saver, model, opt = tiny(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        train_steps(model, opt, 1)
        saver.save(step)
        if step == 2:
            at_two = {k: v.clone() for k, v in model.state_dict().items()}
    assert (tmp_path / ck.LATEST).read_text() == "step-00000003\n"
    data = tmp_path / "step-00000003" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))

    lines: list[str] = []
    loader, fresh, _ = tiny(tmp_path)
    loader._say = lines.append
    resumed = loader.resume()
    assert resumed is not None and resumed.step == 2 and resumed.restart == 3
    assert any("refusing" in ln and "__0_0.distcp: CRC32" in ln and "(corrupted)" in ln for ln in lines)
    assert any("falling back to the previous good checkpoint" in ln for ln in lines)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_two[k]), k


def test_single_process_all_damaged_is_refused(tmp_path):
    saver, model, opt = tiny(tmp_path, keep_last=1)
    train_steps(model, opt, 1)
    saver.save(1)
    with open(tmp_path / "step-00000001" / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    loader, _, _ = tiny(tmp_path)
    with pytest.raises(ck.NoGoodCheckpoint, match=r"truncated or overwritten.*checkpoint.resume: false"):
        loader.resume()


def test_single_process_model_change_names_both_layouts(tmp_path):
    saver, model, opt = tiny(tmp_path)
    train_steps(model, opt, 1)
    saver.save(1)
    manifest = json.loads((tmp_path / "step-00000001" / ck.MANIFEST).read_text())
    assert (manifest["layout_label"] == "pp1.dpr1.dps1.cp1.tp1"
            and manifest["config"]["checkpoint"]["path"] == str(tmp_path))
    other = toy.config({}, tmp_path, dims={**toy.DIMS, "dim": 48})
    opt2 = torch.optim.AdamW(model.parameters())
    loader = checkpoint.Checkpointer(other, model_parts=[model], optimizers=[opt2], logger=lambda m: None)
    with pytest.raises(ck.CheckpointMismatch, match=r"layout pp1\.dpr1\.dps1\.cp1\.tp1.*dim 32 -> 48"):
        loader.resume()


_write_item = dcp_files._write_item


def _written_to_a_full_disk(transforms, stream, data, *rest):
    """DCP's _write_item on a full disk: the small byte items fit in the stream's buffer, the first tensor's
    writes fail with ENOSPC (/dev/full), and torch.save raises its serializer's RuntimeError ("enforce fail at
    inline_container.cc"), the OSError only its context, as it does for a tensor larger than the default
    buffer (the small buffer makes the toy's small tensors do the same)."""
    if isinstance(data, io.BytesIO):
        return _write_item(transforms, stream, data, *rest)
    full = open("/dev/full", "wb", buffering=64)  # noqa: SIM115 (closed below, its flush failing too)
    try:
        torch.save(data, full)
    finally:
        with contextlib.suppress(OSError):
            full.close()


def test_a_full_disk_is_said_with_the_bytes_needed_and_the_checkpoint_kept(tmp_path, monkeypatch):
    saver, model, opt = tiny(tmp_path)
    train_steps(model, opt, 1)
    need = (ck_state.state_bytes(ck_state.tensor_state(saver.pairs))
            + len(ck_state.rank_state_bytes(1, 0, 0, None)))
    with monkeypatch.context() as m:
        m.setattr(dcp_files, "_write_item", _written_to_a_full_disk)
        with pytest.raises(ck.CheckpointError) as first:
            saver.save(1)
    msg = str(first.value)
    assert msg.startswith(f"saving step 1 to {tmp_path}/.tmp-step-00000001 failed: the disk holding "
                          f"{tmp_path} is full (this checkpoint needs about {need:,} bytes): rank 0: "
                          "OSError: [Errno 28] No space left on device"), msg
    assert "enforce fail" not in msg and "RuntimeError" not in msg, msg  # not torch's serializer's words
    assert msg.endswith(f"nothing was committed, and no checkpoint was committed in {tmp_path} before it; "
                        "free space on the checkpoint volume or lower checkpoint.keepLast"), msg
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the partial step is gone

    saver.save(2)
    with monkeypatch.context() as m:
        m.setattr(dcp_files, "_write_item", _written_to_a_full_disk)
        with pytest.raises(ck.CheckpointError, match=rf"nothing was committed: `latest` still names step 2 "
                                                     rf"\({tmp_path}/step-00000002\); free space"):
            saver.save(3)


def test_commit_refuses_shards_rank_0_cannot_see(tmp_path):
    # What rank 0 finds when the checkpoint path is a per-node volume instead of a shared one.
    saver, _, _ = tiny(tmp_path)
    tmp = tmp_path / ".tmp-step-00000001"
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"mine")
    reports = [{"rank": 0, "dp_rank": 0, "files": {"__0_0.distcp": {"size": 4, "crc32": "0"}}},
               {"rank": 1, "dp_rank": 1, "files": {"__1_0.distcp": {"size": 4, "crc32": "0"}}}]
    with pytest.raises(ck.CheckpointError,
                       match=r"rank 1 wrote __1_0\.distcp .* rank 0 sees no such file.*shared"):
        saver.dir.commit(1, tmp, reports, {}, keep_last=3)
    assert not (tmp_path / ck.LATEST).exists() and not (tmp_path / "step-00000001").exists()


def test_a_checkpoint_path_that_is_a_file_is_called_a_file(tmp_path):
    (tmp_path / "ckpt").write_text("x")
    assert ck.writable_problem(tmp_path / "ckpt") == (
        f"spec.checkpoint.path: {tmp_path}/ckpt is a file, not a directory; move that file away or set "
        "checkpoint.path to a directory")
    assert ck.writable_problem(tmp_path / "ckpt" / "sub") == (
        f"spec.checkpoint.path: {tmp_path}/ckpt/sub cannot be a directory: {tmp_path}/ckpt is a file; "
        "move that file away or set checkpoint.path to a directory")
    assert ck.writable_problem(tmp_path / "new" / "dir") is None and (tmp_path / "new" / "dir").is_dir()
    assert [p.name for p in (tmp_path / "new" / "dir").iterdir()] == []  # the probe is gone


def test_another_jobs_checkpoints_are_resumed_only_when_allowed_and_never_deleted(tmp_path):
    saver, model, opt = tiny(tmp_path)  # the job "toy"
    for step in (1, 2):
        train_steps(model, opt, 1)
        saver.save(step)
    assert ck.job_of(ck.read_manifest(tmp_path / "step-00000002")) == "toy"

    renamed = toy.config({}, tmp_path, name="renamed", keep_last=1)
    loader = checkpoint.Checkpointer(renamed, model_parts=[model], optimizers=[opt], logger=lambda m: None)
    with pytest.raises(ck.ForeignCheckpoint) as refused:
        loader.resume()
    assert isinstance(refused.value, ck.CheckpointMismatch)  # the trainer's exit 78
    assert str(refused.value) == (
        f"spec.checkpoint.path: {tmp_path} holds checkpoint step 2 of the job 'toy', not of this job "
        "'renamed'; give this job its own checkpoint.path, or set checkpoint.allowForeign: true to resume "
        "it (e.g. after renaming the job)")

    allowed = toy.config({}, tmp_path, name="renamed", keep_last=1, allow_foreign=True)
    lines: list[str] = []
    adopter = checkpoint.Checkpointer(allowed, model_parts=[model], optimizers=[opt], logger=lines.append)
    resumed = adopter.resume()
    assert resumed is not None and resumed.step == 2
    assert any("resuming step 2 of the job 'toy' (checkpoint.allowForeign)" in ln for ln in lines), lines
    for step in (3, 4):
        train_steps(model, opt, 1)
        adopter.save(step)
    # keepLast=1 removed the renamed job's step 3, not the toy job's steps 1 and 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001", "step-00000002",
                                                          "step-00000004"]
    assert ck.job_of(ck.read_manifest(tmp_path / "step-00000004")) == "renamed"

    (tmp_path / "latest").write_text("step-00000001\n")  # the toy job's step 1 is `latest` again
    with pytest.raises(ck.CheckpointError, match=r"step-00000002 is a checkpoint of the job 'toy', which the "
                                                 r"job 'renamed' does not replace"):
        adopter.save(2)
    assert (tmp_path / "step-00000002").is_dir()
