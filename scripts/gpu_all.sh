#!/usr/bin/env bash
# Every GPU check of quantroute in ONE device call (issue #37, section 1), run by the kit's
# runner after its CUDA build of llama.cpp and llama-server:
#
#   run(command="bash .gpu/run.sh gpu bash scripts/gpu_all.sh", carry=[".gpu"], timeout_s=600)
#   bash .gpu/run.sh cpu bash scripts/gpu_all.sh        # the rehearsal on a machine without a GPU
#
# (.gpu/ is written by `bash ../shared/gpu/prepare.sh`; see /work/shared/gpu/README.md.)
# Steps, in order, each under `timeout` with its own budget, so that one slow step cannot eat
# the call; a failed step is recorded and the next one runs:
#   info      date, host, nvidia-smi, driver, CUDA (driver and nvcc), torch, llama.cpp build;
#   (synth)   in the background from the start: the bandwidth-bound synthetic model
#             (benchmarks/synthetic_model.py; TinyLlama-1.1B's shapes, random F16, 2.2 GB;
#             a ~40 MB one without a GPU);
#   gpu_check NVML against nvidia-smi, a 1 GiB torch allocation seen by NVML, each GPU's
#             memory bandwidth (scripts/gpu_check.py --json);
#   doctor    `quantroute doctor` (the build's backends, a one-token decode per precision);
#   gpu_tests the `gpu` tests (tests/gpu/): three branches on one GPU fully offloaded, NVML's
#             per-process footprint against the memory model's estimate, VRAM taken by
#             another process moving default requests to a cheaper branch within two polls;
#   synth     waits for the synthetic model;
#   bench     benchmarks/bench_serving.py on it: quantroute, llama-server (the kit's CUDA build)
#             and the worker ceiling, every layer offloaded, 1, 8 and 32 clients, short rounds
#             (as many as the time left allows, 1 to 3);
#   spec      benchmarks/bench_speculative.py on it (issue #35): its f16 alone against the f16
#             drafted by its own q4_k_m (quantized here), both wholly offloaded, one round of
#             12 greedy prompts, every output compared with plain's.
# Without a GPU the GPU-only steps (gpu_check, gpu_tests) run, find none and are recorded
# "skipped (no GPU)"; doctor and the benchmark run on the CPU.
#
# The bound: a decode step of a bandwidth-bound model reads every weight once and yields one
# token per sequence, so B concurrent sequences make at most
#     B x bandwidth / bytes read per step   tokens/s,
# bytes per step = the GGUF's weight bytes less the token-embedding table (one row of it per
# sequence is read); KV-cache reads (< 6 % here) are left out. Bandwidth = NVML's
# 2 x max memory clock x bus width / 8 (H200: expected ~4.9 TB/s), else the datasheet's
# (H200: 4.8 TB/s), or QR_HBM_GBPS when set.
#
# Time: the whole call must end within QR_CALL_LIMIT_S (600, the `run` call's timeout_s),
# counted from when the kit's run.sh (this script's parent) started, less QR_RESERVE_S (25)
# for the summary and the transfers. Output: under $QR_GPU_OUT (at most 8 files come back):
# gpu_all.log (everything printed), summary.txt, summary.json (every figure), gpu_check.json,
# bench_serving.json, bench_serving.png, speculative-DATE.json, bench_speculative.png. The summary is rewritten after every step, so a call
# cut short still brings back what it measured. Exit 0 when no step failed, else 1.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${QR_GPU_OUT:-/tmp/qr-gpu-out}"
WORK="${QR_GPU_WORK:-/tmp/qr-gpu-all}"
LIMIT="${QR_CALL_LIMIT_S:-600}"
RESERVE="${QR_RESERVE_S:-25}"
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK/logs"
exec > >(tee -a "$OUT/gpu_all.log") 2>&1

# when the call began: the kit's run.sh, our parent, started then (its setup and build count)
now() { date +%s; }
STARTED="${QR_CALL_STARTED:-}"
if [[ -z $STARTED ]]; then
  STARTED=$(now)
  if tr '\0' ' ' < "/proc/$PPID/cmdline" 2>/dev/null | grep -q 'run\.sh'; then
    # the parent's age: uptime less its start time (field 22 of /proc/PID/stat, in ticks)
    age=$(awk -v hz="$(getconf CLK_TCK)" 'NR == FNR { up = $1; next }
      { sub(/.*\) /, ""); printf "%d", up - $20 / hz }' /proc/uptime "/proc/$PPID/stat" 2>/dev/null)
    [[ $age =~ ^[0-9]+$ ]] && STARTED=$(( STARTED - age ))
  fi
fi
BEGAN=$(now)
left() { echo $(( LIMIT - RESERVE - ($(now) - STARTED) )); }

# the python the kit set up: the one its `quantroute` wrapper runs
PY="${PYTHON:-}"
if [[ -z $PY ]] && command -v quantroute >/dev/null; then
  PY="$(sed -n 's/^exec \(.*\) -m quantroute\.cli.*/\1/p' "$(command -v quantroute)")"
fi
[[ -n $PY ]] || PY="$([[ -x $ROOT/.venv/bin/python ]] && echo "$ROOT/.venv/bin/python" || echo python3)"
export PYTHON="$PY"
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  MODE=gpu
else
  MODE=cpu
fi
echo "== gpu_all.sh: $MODE mode, $(date -u +%FT%TZ), $(( BEGAN - STARTED )) s into the call" \
  "(limit $LIMIT s, $RESERVE s kept for the end), python $PY, output in $OUT"

summarize() { "$PY" scripts/gpu_check.py --summarize "$WORK" --out "$OUT" > "$WORK/summary.out" 2>&1 \
  || { echo "(summary failed:)"; tail -n 5 "$WORK/summary.out"; }; }

FAILED=0
# step NAME CAP_S MIN_S KEEP_S COMMAND...: run COMMAND for at most CAP_S, less when the time
# left less KEEP_S (for the steps after) is shorter; skipped when that is under MIN_S.
# rc 0 ok; 2 "skipped (no GPU)" where SKIP_NO_GPU=1; 124/137 timeout; else failed.
step() {
  local name=$1 cap=$2 min=$3 keep=$4; shift 4
  local avail budget t0 rc status note=""
  avail=$(( $(left) - keep ))
  budget=$(( cap < avail ? cap : avail ))
  echo
  if (( budget < min )); then
    echo "== [$(( $(now) - STARTED ))s] $name: skipped, $budget s left for it (needs $min)"
    record "$name" skipped -1 0 "$budget" "not enough time left"
    return 0
  fi
  echo "== [$(( $(now) - STARTED ))s] $name (budget $budget s): $*"
  t0=$(now)
  timeout -k 10 "$budget" "$@" 2>&1 | tee "$WORK/logs/$name.log"
  rc=${PIPESTATUS[0]}
  if (( rc == 0 )); then status=ok
  elif (( rc == 2 )) && [[ ${SKIP_NO_GPU:-0} == 1 && $MODE == cpu ]]; then status=skipped; note="no GPU: skipped"
  elif (( rc == 124 || rc == 137 )); then status=timeout; note="stopped after $budget s"; FAILED=1
  else status=failed; FAILED=1
  fi
  echo "== [$(( $(now) - STARTED ))s] $name: $status (rc $rc, $(( $(now) - t0 )) s)${note:+; $note}"
  record "$name" "$status" "$rc" "$(( $(now) - t0 ))" "$budget" "$note"
}
record() {
  "$PY" -c 'import json, sys; n, s, rc, sec, b, note = sys.argv[1:7]
print(json.dumps({"name": n, "status": s, "rc": int(rc), "seconds": int(sec), "budget_s": int(b), "note": note}))' \
    "$1" "$2" "$3" "$4" "$5" "${6:-}" >> "$WORK/steps.jsonl"
  summarize
}

# -- the steps -------------------------------------------------------------------------

info_step() {
  local f="$WORK/info.env" smi cmake_cuda
  {
    echo "mode=$MODE"
    echo "date=$(date -u +%FT%TZ)"
    echo "host=$(hostname)"
    echo "cpus=$(nproc)"
    echo "python=$("$PY" -c 'import platform; print(platform.python_version())')"
    echo "setup_and_build_s=$(( BEGAN - STARTED ))"
    [[ -n ${QR_HBM_GBPS:-} ]] && echo "hbm_gbps_override=$QR_HBM_GBPS"
  } > "$f"
  if [[ $MODE == gpu ]]; then
    smi="$(nvidia-smi)"
    echo "$smi"
    echo "smi_gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n1)" >> "$f"
    echo "smi_driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n1)" >> "$f"
    echo "smi_cuda=$(grep -o 'CUDA Version: *[0-9.]*' <<< "$smi" | grep -o '[0-9.]*$')" >> "$f"
    nvidia-smi --query-gpu=clocks.max.memory,clocks.max.sm,power.limit,compute_cap --format=csv
  fi
  if command -v nvcc >/dev/null; then
    echo "nvcc=$(nvcc --version | grep -o 'release [0-9.]*, V[0-9.]*')" >> "$f"
  fi
  cmake_cuda="$(grep -o 'Found CUDAToolkit: .*' "${W:-/tmp/qr-gpu}/cmake.log" 2>/dev/null | head -n1)"
  [[ -n $cmake_cuda ]] && echo "cmake_cuda=$cmake_cuda" >> "$f"
  echo "torch=$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())' 2>&1 | tail -n1)" >> "$f"
  echo "llama_cpp=$("$PY" -c 'import llama_cpp; print(llama_cpp.__version__, "gpu offload:", bool(llama_cpp.llama_supports_gpu_offload()))' 2>&1 | tail -n1)" >> "$f"
  if [[ -n ${QR_LLAMA_SERVER:-} ]]; then
    echo "llama_server=$("$QR_LLAMA_SERVER" --version 2>&1 | grep -E 'version|built' | tr '\n' ' ')" >> "$f"
  fi
  cat "$f"
}

gpu_tests() {
  local rc
  # the image's own plugins that these tests do not use are left out (cov, xdist, benchmark)
  "$PY" -m pytest -m gpu -s -q -rs -p no:cacheprovider -p no:cov -p no:xdist -p no:benchmark \
    -o "timeout=$1" tests/gpu > "$WORK/pytest.out" 2>&1
  rc=$?
  cat "$WORK/pytest.out"
  # without a GPU the module skips itself: "1 skipped", rc 5 (no test selected) or 0
  if (( rc == 0 || rc == 5 )) && grep -q 'no NVIDIA GPU on this machine' "$WORK/pytest.out" \
      && ! grep -qE '[0-9]+ (passed|failed)' "$WORK/pytest.out"; then
    return 2
  fi
  return $rc
}

wait_synth() {
  while [[ ! -f $WORK/synth.rc ]]; do sleep 1; done
  cat "$WORK/logs/synth_bg.log"
  return "$(cat "$WORK/synth.rc")"
}

bench() {
  local budget=$1 est rounds systems=(quantroute llama-server ceiling) rc
  local gpu_args=(--n-gpu-layers 999 --threads 4 --max-tokens 128 --min-round-s 2 --start-timeout-s 60)
  est=75  # s per round of three systems on the GPU (a guess): start, warm-up, 3 x (2 s + the tail)
  rounds=$(( (budget - 40) / est ))
  (( rounds > 3 )) && rounds=3
  if [[ $MODE == cpu ]]; then  # the rehearsal: a small model, one short round
    gpu_args=(--n-gpu-layers 0 --threads 1 --max-tokens 32 --min-round-s 1)
    rounds=$(( rounds > 1 ? 1 : rounds ))
  fi
  if (( rounds < 1 )); then rounds=1; systems=(quantroute llama-server); fi
  echo "bench: $rounds round(s) of ${systems[*]} in $budget s"
  "$PY" benchmarks/bench_serving.py --repo "$WORK/synth" --models synthetic-1b --branch f16 \
    --systems "${systems[@]}" --clients 1 8 32 --rounds "$rounds" --paired-rounds 0 \
    "${gpu_args[@]}" ${QR_LLAMA_SERVER:+--llama-server "$QR_LLAMA_SERVER"} --markdown \
    --out "$OUT/bench_serving.json" --chart "$OUT/bench_serving.png"
  rc=$?
  if (( rc != 0 )); then
    for log in benchmarks/results/logs/synthetic-1b/*.log; do
      [[ -f $log ]] && { echo "-- tail of $log"; tail -n 15 "$log"; }
    done
  fi
  return $rc
}
spec() {
  local layers=-1
  [[ $MODE == cpu ]] && layers=0
  mkdir -p "$WORK/spec" && ln -sf "$WORK/synth/synthetic-1b/f16.gguf" "$WORK/spec/f16.gguf"
  "$PY" benchmarks/bench_speculative.py --model synthetic --synthetic-dir "$WORK/spec" \
    --gpu-layers "$layers" --rounds 1 --out "$OUT" --chart "$OUT/bench_speculative.png"
}
export -f info_step gpu_tests wait_synth bench spec
export WORK MODE PY OUT BEGAN STARTED

step info 45 5 0 bash -c info_step

SYNTH_ARGS=()
[[ $MODE == cpu ]] && SYNTH_ARGS=(--layers 4 --width 256 --ffn 704 --heads 8 --kv-heads 2)
( timeout 300 "$PY" benchmarks/synthetic_model.py --out "$WORK/synth" "${SYNTH_ARGS[@]}" \
    > "$WORK/logs/synth_bg.log" 2>&1; echo $? > "$WORK/synth.rc" ) &
"$PY" -c 'import json, sys; print(json.dumps({"path": sys.argv[1], "description": sys.argv[2]}))' \
  "$WORK/synth/synthetic-1b/f16.gguf" \
  "$([[ $MODE == gpu ]] && echo "TinyLlama-1.1B shapes, random F16" || echo "4 layers, width 256, random F16 (the CPU rehearsal's)")" \
  > "$WORK/bench_model.json"

SKIP_NO_GPU=1 step gpu_check 60 10 150 "$PY" scripts/gpu_check.py --json "$OUT/gpu_check.json"
step doctor 90 10 130 "$PY" -m quantroute.cli doctor
SKIP_NO_GPU=1 step gpu_tests 150 30 100 bash -c 'gpu_tests 140'
step synth 120 5 80 bash -c wait_synth
SPEC_S=120  # the speculative step: quantize (~30 s), 5 workers, 60 generations
BUDGET=$(( $(left) - SPEC_S > 420 ? 420 : $(left) - SPEC_S ))
step bench "$BUDGET" 60 "$SPEC_S" bash -c "bench $(( BUDGET - 10 ))"
step spec "$SPEC_S" 60 0 bash -c spec

echo
echo "== [$(( $(now) - STARTED ))s] summary ($OUT/summary.txt)"
summarize
cat "$OUT/summary.txt"
echo "== gpu_all.sh done in $(( $(now) - BEGAN )) s ($(( $(now) - STARTED )) s into the call); files: $(ls "$OUT" | tr '\n' ' ')"
exit $FAILED
