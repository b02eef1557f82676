#!/usr/bin/env bash
# Every GPU check of quantroute, in a few minutes, on a machine with an NVIDIA GPU:
# 1. telemetry: NVML vs nvidia-smi (total/used within 1 %), and a 1 GiB PyTorch
#    allocation seen by NVML (within 10 %) — scripts/gpu_check.py;
# 2. serving: the `gpu` tests (tests/gpu/): three branches of the demo model on
#    one GPU, NVML's measured footprint vs the estimate, and VRAM pressure from
#    torch moving default requests to a cheaper branch within two poll intervals;
#    plus `quantroute doctor` (build backends, a decode of every precision).
# Needs the venv (`make test` builds llama.cpp with CUDA where there is a GPU and nvcc). On the
# lent GPU machine, which reaches no package registry, run scripts/gpu_all.sh through the kit
# instead (these checks, the serving benchmark, in one call; docs/telemetry.md).
# Exit 0 ok, 1 a mismatch or failure, 2 cannot run (no GPU...). Record the output in
# docs/telemetry.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python="python3"; fi
fi
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
status=0
"$python" "$root/scripts/gpu_check.py" "$@" || status=$?
[[ $status -eq 2 ]] && exit 2
echo "== quantroute doctor"
"$python" -m quantroute.cli doctor || status=1
echo "== gpu tests"
(cd "$root" && "$python" -m pytest -m gpu -s -q -p no:cacheprovider tests/gpu) || status=1
exit $status
