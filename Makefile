# Tetrad developer entry points. `make demo` and `make test` set up everything they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: demo test test-unit e2e test-e2e lint crds cluster cluster-down cluster-status kubeconfig tools host-packages venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

demo: venv
	$(VENV)/bin/tetrad run examples/quickstart.yaml

tools:
	bash hack/k8s-tools.sh

# The Debian packages of the real-node tests (containerd, runc, CNI plugins, buildah, ...);
# they need root, as do the tests (tests/e2e), which are skipped otherwise.
host-packages:
	@if [ "$$(id -u)" = 0 ]; then bash hack/host-packages.sh; fi

# The suite in two lanes at once, each line tagged with its lane: the tests of a real cluster (marker
# `cluster`: mostly waiting on real components and pods) beside the rest (mostly CPU), so the two cores
# stay busy; the lanes share no cluster instance. Both must pass; a lane with nothing selected counts as
# passed only when the other ran tests. At the end, where a log's tail shows them: each lane's slowest
# tests, then every failed or erroring test of both lanes (one line each), then each lane's counts.
SLOWEST := sed -n '/slowest [0-9]* durations/,/short test summary info/p'
FAILURES := grep -hE '^\[[a-z]+\] (FAILED|ERROR) ' | cut -c1-240
COUNTS := grep -hE '^\[[a-z]+\] =+ .*[0-9.]+s( \([0-9:]+\))? =+$$' | tail -1
test: venv tools host-packages
	@set -o pipefail; lanes=$$(mktemp -d); \
	( OMP_NUM_THREADS=1 $(PY) -m pytest -p no:cacheprovider --durations=12 -m cluster $(PYTEST_ARGS) 2>&1 | sed -u 's/^/[cluster] /' | tee $$lanes/cluster ) & cluster=$$!; \
	( OMP_NUM_THREADS=1 $(PY) -m pytest -p no:cacheprovider --durations=12 -m 'not cluster' $(PYTEST_ARGS) 2>&1 | sed -u 's/^/[rest] /' | tee $$lanes/rest ) & rest=$$!; \
	wait $$cluster; a=$$?; wait $$rest; b=$$?; \
	echo "make test: each lane's end again"; $(SLOWEST) $$lanes/cluster; $(SLOWEST) $$lanes/rest; \
	cat $$lanes/cluster $$lanes/rest | $(FAILURES); $(COUNTS) $$lanes/cluster; $(COUNTS) $$lanes/rest; rm -rf $$lanes; \
	echo "make test: cluster lane exited $$a, rest lane exited $$b (5: nothing selected)"; \
	if [ $$a = 5 ] && [ $$b = 5 ]; then exit 5; fi; \
	[ $$a = 0 -o $$a = 5 ] && [ $$b = 0 -o $$b = 5 ]

# A real job on real nodes, as a user would watch it (root; no Docker): the control plane, two
# kubelet nodes, both images, the chart, then the quickstart streamed by `kubectl get ptj -w`
# until it succeeds. The cluster stays up; `hack/e2e.sh down` removes it. See docs/e2e.md.
e2e: venv tools host-packages
	bash hack/e2e.sh

# The real-node tests alone (tests/e2e; root).
test-e2e: venv tools host-packages
	OMP_NUM_THREADS=1 $(PY) -m pytest -m e2e $(PYTEST_ARGS)

# The fast lane: no cluster, no process groups, nothing built from Go (tests/conftest.py --fast-lane).
test-unit: venv
	$(PY) -m pytest --fast-lane $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check tetrad operator trainer-image tests bench hack
	$(VENV)/bin/mypy
	$(VENV)/bin/shellcheck --external-sources hack/*.sh hack/cluster/*.sh .ci/run

crds: venv
	$(VENV)/bin/tetrad crd > crds/tetrad.dev_paralleltrainingjobs.yaml

cluster: tools
	bash hack/cluster.sh up

cluster-down:
	bash hack/cluster.sh down

cluster-status:
	bash hack/cluster.sh status

kubeconfig:
	@bash hack/cluster.sh kubeconfig

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
