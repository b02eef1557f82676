#!/usr/bin/env bash
# Cross-check quantroute's GPU telemetry on a machine with an NVIDIA GPU:
# NVML vs nvidia-smi (total/used within 1 %), and a 1 GiB PyTorch allocation
# seen by NVML (within 10 %). Exit 0 ok, 1 mismatch, 2 cannot run (no GPU...).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python="python3"; fi
fi
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" "$root/scripts/gpu_check.py" "$@"
