"""Save, kill, resume on real gloo process groups with the toy job (FSDP2, TP, AdamW, LambdaLR).

Run A trains 10 steps straight. Run B saves at step 5, is SIGKILLed right after the commit, and a
fresh gang resumes it to step 10: with the same layout its losses at steps 6-10 and its final
parameters equal A's bit for bit; with another layout they agree within the reduction-order noise.
"""

from __future__ import annotations

import pytest

from tests.checkpoint import gang, toy
from tests.checkpoint.conftest import LAYOUTS, assert_same_run, manifest_of, run_toy, world_of

pytestmark = pytest.mark.distributed


def killed_after_commit(layout: str, path, step: int = 5, **spec) -> None:
    """Train with checkpoints every `step` steps; rank 0 SIGKILLs itself right after publishing `step`."""
    lay = LAYOUTS[layout]
    g = gang.Gang(toy.train, world_of(lay), {"layout": lay, "path": str(path), "interval": step,
                                             "die": {"rank": 0, "phase": "published", "step": step}, **spec})
    try:
        codes = g.wait()
    finally:
        g.close()
    assert codes[0] == -9, f"rank 0 should have been killed, exit codes {codes}"
    assert (path / "latest").read_text() == f"step-{step:08d}\n"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layout", ["dps2", "tp2xdps2"])
def test_exact_resume(tmp_path, straight, layout, async_save):
    a = straight(layout)
    killed_after_commit(layout, tmp_path, **{"async": async_save})
    b = run_toy(layout, tmp_path, steps=10, interval=5, **{"async": async_save})
    assert b[0]["resumed"]["step"] == 5
    assert sorted(b[0]["losses"]) == [6, 7, 8, 9, 10]
    assert_same_run(b[0], a[0], range(6, 11))
    # Every rank read exactly the samples it read in the straight run, from sample 40 on.
    for rank, (ra, rb) in enumerate(zip(a, b, strict=True)):
        assert rb["consumed"] == [i for i in ra["consumed"] if i >= 40], f"rank {rank}"
    # The LR schedule continued rather than restarting.
    assert b[0]["lr"] == a[0]["lr"]
    m = manifest_of(tmp_path / "step-00000010")
    assert m["layout_label"] == toy.config(LAYOUTS[layout], tmp_path).layout.label()
    assert len(m["ranks"]) == world_of(LAYOUTS[layout])


@pytest.mark.parametrize(("before", "after", "loader"), [
    ("dps4", "tp2xdps2", "toy"),  # a loader with per-DP-rank state: load_resharded_state
    ("tp2xdps2", "dps1", "toy"),
    ("dps2", "dps4", "trainer"),  # the trainer's loader: the same global sample index on every rank
])
def test_reshard(tmp_path, straight, before, after, loader):
    a = straight(before)
    killed_after_commit(before, tmp_path, loader=loader)
    b = run_toy(after, tmp_path, steps=10, interval=5, loader=loader)
    r = b[0]["resumed"]
    assert r["step"] == 5 and r["saved_layout"] != toy.config(LAYOUTS[after], tmp_path).layout.label()
    assert any("layout changed" in line for line in b[0]["log"])
    assert_same_run(b[0], a[0], range(6, 11), tol=1e-5)
    # No sample skipped or repeated across the DP change: steps 6-10 read samples 40..79 once.
    consumed = sorted(i for rank in b if rank["tp_rank"] == 0 for i in rank["consumed"])
    assert consumed == list(range(40, 80))


def test_model_change_is_refused_naming_both_layouts(tmp_path):
    killed_after_commit("dps2", tmp_path)
    with pytest.raises(gang.GangError) as err:
        run_toy("tp2xdps2", tmp_path, dims={**toy.DIMS, "ffnDim": 128})
    msg = str(err.value)
    assert "CheckpointMismatch" in msg and "ffn_dim 64 -> 128" in msg
    assert "layout pp1.dpr1.dps2.cp1.tp1" in msg and "layout pp1.dpr1.dps2.cp1.tp2" in msg


def test_damaged_latest_falls_back_to_previous(tmp_path, straight):
    a = straight("dps2")
    run_toy("dps2", tmp_path, steps=10, interval=5)
    victim = tmp_path / "step-00000010" / "__1_0.distcp"
    raw = bytearray(victim.read_bytes())
    raw[100] ^= 0x01  # one flipped bit
    victim.write_bytes(bytes(raw))
    b = run_toy("dps2", tmp_path, steps=10, interval=5)
    r = b[0]["resumed"]
    assert r["step"] == 5
    assert (len(r["refused"]) == 1 and "step-00000010" in r["refused"][0]
            and "__1_0.distcp: CRC32" in r["refused"][0])
    assert any("falling back to the previous good checkpoint" in line for line in b[0]["log"])
    assert_same_run(b[0], a[0], range(6, 11))


def test_retention_deletes_only_after_a_newer_commit(tmp_path):
    run_toy("dps2", tmp_path, steps=4, interval=1, keep_last=2, **{"async": True})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000004"]
    # Killed while writing step 6: steps 4 and 5 must both survive (nothing deleted for step 6).
    lay = LAYOUTS["dps2"]
    g = gang.Gang(toy.train, 2, {"layout": lay, "path": str(tmp_path), "steps": 8, "interval": 1,
                                 "keep_last": 2, "die": {"rank": 1, "phase": "dcp-written", "step": 6}})
    try:
        g.wait()
    finally:
        g.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".tmp-step-00000006", "latest", "step-00000004", "step-00000005"]
    assert (tmp_path / "latest").read_text() == "step-00000005\n"
    b = run_toy("dps2", tmp_path, steps=8, interval=1, keep_last=2)
    assert b[0]["resumed"]["step"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000007", "step-00000008"]
