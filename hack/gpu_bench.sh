#!/usr/bin/env bash
# bench/gpu.py on a lent GPU machine, one call (docs/performance.md, "One GPU"): installs the wheels carried
# in .whl (pydantic for Tetrad's core; torchtitan, torchao and their needs), prints the versions, then runs
# each phase under its own time limit while the call's budget lasts, writing each phase's JSON and one log to
# $OUT (they come back even when a phase is cut).
#
#   bash hack/gpu_bench.sh BUDGET_S 'NAME|LIMIT_S|bench/gpu.py arguments' ...
#
# e.g. bash hack/gpu_bench.sh 540 'compiled|200|--configs 1b-4x2048-compile --systems tetrad,torchtitan'
# Wheels, on the machine that fetches them: see /work/.library/device/README.md (pip download --no-deps
# --python-version 3.12 ... -d .whl NAME==VERSION).
set -u
budget=$1
shift
start=$(date +%s)
out=${OUT:-/tmp/gpu-bench}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/trainer-image:$PWD/operator PYTHONUNBUFFERED=1
# torchtitan imports Hugging Face datasets for its data loaders, which the bench does not use: if the
# carried release does not import beside the machine's packages, stand in for the names it imports.
if ! python3 -c 'import datasets' 2>/dev/null; then
  echo "datasets does not import here: torchtitan gets a stand-in for its data loaders' imports"
  mkdir -p /tmp/stubs/datasets
  echo 'Dataset = load_dataset = None; __version__ = "(a stand-in)"' >/tmp/stubs/datasets/__init__.py
  echo 'split_dataset_by_node = None' >/tmp/stubs/datasets/distributed.py
  rm -rf /tmp/site/datasets
  export PYTHONPATH=/tmp/stubs:$PYTHONPATH
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, torchao, transformers; print("torch", torch.__version__, "torchao", torchao.__version__,
"transformers", transformers.__version__, "cuda", torch.version.cuda)'
  python3 -c 'import torchtitan, datasets; print("torchtitan", torchtitan.__version__, "datasets", datasets.__version__)'
  git log -1 --format='commit %h %s' 2>/dev/null || true
} 2>&1 | tee "$out/versions.txt"
for phase in "$@"; do
  IFS='|' read -r name limit args <<<"$phase"
  left=$((budget - ($(date +%s) - start)))
  if [ "$left" -lt 30 ]; then
    echo "$name: skipped, $left s of the budget left"
    continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  begun=$(date +%s)
  # shellcheck disable=SC2086  # the phase's arguments are words
  timeout "$limit" python3 bench/gpu.py --out "$out/$name.json" $args >"/tmp/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(($(date +%s) - begun)) s (limit $limit s)"
  grep -E '^\| |: (ok|failed|skipped|out of memory)' "/tmp/$name.log" | grep -v '^|---' | tail -n 8
  # one log for all phases: the machine sends back 8 files at most
  { echo "== $name: $args"; cat "/tmp/$name.log"; } >>"$out/phases.log"
done
echo "total $(($(date +%s) - start)) s"
