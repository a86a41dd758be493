"""The tests' own kubectl client (tests.cluster_fixtures.Cluster.kubectl): a call that got no answer is made
again, any other failure is the test's to see at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster_fixtures import UNANSWERED, Cluster, KubectlError


def fake_kubectl(tmp_path: Path, failures: int, stderr: str) -> Cluster:
    """A Cluster whose kubectl fails `failures` times with `stderr`, then prints "ok"."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    script = bin_dir / "kubectl"
    script.write_text(f"""#!/bin/sh
echo x >> {calls}
if [ "$(wc -l < {calls})" -le {failures} ]; then echo "{stderr}" >&2; exit 1; fi
echo ok
""")
    script.chmod(0o755)
    return Cluster(name="fake", kubeconfig=tmp_path / "kubeconfig", api_url="https://127.0.0.1:1",
                   bin_dir=bin_dir)


def calls(tmp_path: Path) -> int:
    return len((tmp_path / "calls").read_text().splitlines())


def test_a_call_that_got_no_answer_is_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.cluster_fixtures.time.sleep", lambda s: None)
    c = fake_kubectl(tmp_path, 2, f"{UNANSWERED}: net/http: TLS handshake timeout")
    assert c.kubectl("get", "pods") == "ok\n" and calls(tmp_path) == 3


def test_an_answered_failure_is_raised_at_once(tmp_path: Path) -> None:
    c = fake_kubectl(tmp_path, 1, 'Error from server (NotFound): pods "x" not found')
    with pytest.raises(KubectlError, match="NotFound"):
        c.kubectl("delete", "pod", "x")
    assert calls(tmp_path) == 1


def test_a_server_that_never_answers_fails_after_the_retries(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.cluster_fixtures.time.sleep", lambda s: None)
    c = fake_kubectl(tmp_path, 99, f"{UNANSWERED}: dial tcp: connection refused")
    with pytest.raises(KubectlError, match=UNANSWERED):
        c.kubectl("get", "pods")
    assert calls(tmp_path) == 5
