"""Scripts leave no process behind: `make e2e`'s script (hack/e2e.sh demo) with its collaborators replaced
by stand-ins (a kubectl whose watch runs until killed, a cluster and images that are there at once), so
what is tested is the script's own process handling; its real run against real nodes is
tests/e2e (hack/e2e.sh install and the quickstart)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.processes import processes_mentioning

REPO = Path(__file__).resolve().parents[2]

FAKE_KUBECTL = """#!/usr/bin/env bash
# kubectl --kubeconfig FILE VERB ...: a watch (-w) runs until killed, as the real one does; the rest succeed.
if [[ " $* " == *" -w "* ]]; then echo "NAME PHASE"; exec -a "$0-watch" sleep 300; fi
exit 0
"""
FAKES = {
    "hack/k8s-tools.sh": '#!/usr/bin/env bash\n[[ $1 == bindir ]] && echo "$(dirname "$0")/../bin"\n',
    "hack/cluster.sh": ('#!/usr/bin/env bash\n[[ $1 == kubeconfig ]] && echo "$(dirname "$0")/kubeconfig"\n'
                        'exit 0\n'),
    "hack/images.sh": '#!/usr/bin/env bash\necho "tetrad/$1:0 /dev/null"\n',
    "bin/kubectl": FAKE_KUBECTL,
    "bin/helm": "#!/usr/bin/env bash\nexit 0\n",
}


@pytest.mark.skipif(os.geteuid() != 0, reason="hack/e2e.sh refuses to run without root")
def test_make_e2e_leaves_no_watcher_behind(tmp_path: Path) -> None:
    (tmp_path / "hack").mkdir()
    (tmp_path / "bin").mkdir()
    shutil.copy(REPO / "hack" / "e2e.sh", tmp_path / "hack" / "e2e.sh")
    for name, text in FAKES.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "quickstart.yaml").write_text("kind: ParallelTrainingJob\n")
    # files, not pipes: a leftover process must not hold the test
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as o, err.open("w") as e:
        code = subprocess.run(["bash", str(tmp_path / "hack" / "e2e.sh"), "demo"], stdout=o, stderr=e,
                              timeout=60, cwd=tmp_path).returncode
    left = processes_mentioning(str(tmp_path))
    for line in left:
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert code == 0, err.read_text()
    assert "NAME PHASE" in out.read_text(), "the watcher ran"
    assert "quickstart Succeeded" in err.read_text(), err.read_text()
    assert not left, f"the script left a process behind: {left}"
