#!/usr/bin/env bash
# The serving benchmark on an NVIDIA GPU (issue 15, item 5), in one command:
#
#   scripts/gpu_serving.sh [HBM_GBPS]        e.g. 4800 for an H200, 3350 for an H100 SXM
#
# 1. builds llama-server with CUDA (scripts/llama_server_build.sh, QUANTROUTE_LLAMA_BACKEND=cuda:
#    the same llama.cpp revision and portable CPU flags, plus this GPU's compute capability);
# 2. writes a bandwidth-bound synthetic model (benchmarks/synthetic_model.py: random F16
#    weights, TinyLlama-1.1B's shapes, 2.2 GB) as a one-branch repository;
# 3. runs benchmarks/bench_serving.py on it, every layer offloaded, 1/4/16 clients, against
#    llama-server, llama-cpp-python's server and the worker ceiling, and reports decode
#    tok/s as a fraction of the bandwidth limit (clients x HBM_GBPS / model bytes per step).
#
# Needs the venv with a CUDA llama-cpp-python (`make test` builds one where there is a GPU
# and nvcc). About 5 minutes after the build (which takes ~10 on 16 cores). The output and
# benchmarks/results/serving-gpu-<date>.json go to docs/benchmarks.md ("On a GPU").
# On the lent GPU machine (no package registry there) scripts/gpu_all.sh runs this benchmark,
# with 1/8/32 clients and short rounds, after the other GPU checks, in the kit's environment.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
export PYTHONPATH="$root/src:$root/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
command -v nvidia-smi >/dev/null && nvidia-smi -L | grep -q '^GPU ' \
  || { echo "no NVIDIA GPU here" >&2; exit 2; }
hbm="${1:-}"
if [[ -z "$hbm" ]]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)" in
    *H200*) hbm=4800 ;;
    *H100*SXM* | *H100*HBM3*) hbm=3350 ;;
    *H100*) hbm=2000 ;;
    *A100*80GB*) hbm=2039 ;;
    *A100*) hbm=1555 ;;
    *) echo "unknown GPU: pass its memory bandwidth in GB/s" >&2; exit 2 ;;
  esac
fi
binary="$(QUANTROUTE_LLAMA_BACKEND=cuda bash "$root/scripts/llama_server_build.sh" "$python" | tail -n1)"
repo="${QUANTROUTE_CACHE:-$HOME/.cache/quantroute}/synthetic"
[[ -f "$repo/synthetic-1b/quantroute.yaml" ]] || "$python" "$root/benchmarks/synthetic_model.py" --out "$repo"
threads="$(( $(nproc) > 4 ? 4 : $(nproc) ))"
exec "$python" "$root/benchmarks/bench_serving.py" --repo "$repo" --models synthetic-1b \
  --branch f16 --n-gpu-layers 999 --threads "$threads" --hbm-gbps "$hbm" \
  --llama-server "$binary" --rounds 5 --min-round-s 2 --markdown \
  --out "$root/benchmarks/results/serving-gpu-$(date +%F).json" \
  --chart "$root/docs/img/bench_serving_gpu.png"
