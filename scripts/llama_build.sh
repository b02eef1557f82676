#!/usr/bin/env bash
# Install llama-cpp-python into a virtual environment, built for machines other than this one.
#
#   scripts/llama_build.sh VENV            install (or keep) the right build in VENV
#   scripts/llama_build.sh --flags         print the backend and CMake flags it would use
#   scripts/llama_build.sh --key [VENV]    print the cache key of those flags (for VENV's python)
#   scripts/llama_build.sh --progress-filter   turn a build log on stdin into progress lines
#
# Never -march=native: ggml's native build compiles every instruction set the build
# machine has (AMX on Intel Xeons, where ggml's AMX path dies with SIGILL; AVX-512
# elsewhere), and the wheel then crashes on the next machine of the "same" kind.
# The CPU build is a fixed x86-64 baseline (llama.cpp's "haswell" level: SSE4.2,
# AVX, AVX2, BMI2, FMA, F16C) with AVX-512 and AMX off. With an NVIDIA GPU *and* a
# CUDA toolkit it adds -DGGML_CUDA=on for that GPU's compute capability.
#
# Wheels are cached under $QUANTROUTE_CACHE (default ~/.cache/quantroute), in a
# folder named by the sha256 of the version, backend and flags. pip's own wheel
# cache is keyed by the sdist alone, so it is never used for this build: a wheel
# made with other flags can't come back unnoticed. The venv records what it got
# in VENV/llama-build.json, which `quantroute doctor` reads.
#
# Overrides: QUANTROUTE_LLAMA_BACKEND=auto|cpu|cuda, QUANTROUTE_CUDA_ARCH=90 (say).
set -euo pipefail

# ninja prints "[12/212] Building ...": show one line per 5 %, and the errors.
progress_filter() {
  awk '
    match($0, /\[ *[0-9]+\/[0-9]+\]/) {
      split(substr($0, RSTART + 1, RLENGTH - 2), p, "/"); pct = int(100 * p[1] / p[2])
      if (pct >= shown + 5 || p[1] == p[2]) { shown = pct; printf "    llama.cpp build %3d%%  (%s/%s)\n", pct, p[1], p[2]; fflush() }
      next
    }
    /ERROR|[Ee]rror:|CMake Error/ { print; fflush() }
  '
}

mode="${1:-}" venv=""
case "$mode" in
  --progress-filter) progress_filter; exit 0 ;;
  --flags) ;;
  --key) venv="${2:-}" ;;
  "" | -*) echo "usage: $0 VENV | --flags | --key [VENV] | --progress-filter" >&2; exit 2 ;;
  *) venv="$1" ;;
esac

version="0.3.36"   # keep equal to pyproject.toml's pin (tests/build checks it)
backend="${QUANTROUTE_LLAMA_BACKEND:-auto}"
cache="${QUANTROUTE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/quantroute}"

nvcc_path() {
  command -v nvcc 2>/dev/null && return 0
  [[ -x /usr/local/cuda/bin/nvcc ]] && echo /usr/local/cuda/bin/nvcc && return 0
  return 1
}

gpu_present() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }

if [[ "$backend" == auto ]]; then
  if gpu_present && nvcc_path >/dev/null; then backend=cuda; else backend=cpu; fi
fi

flags=(-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF)
case "$(uname -m)" in
  x86_64 | amd64)
    flags+=(-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON
      -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
      -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
  *) ;;  # aarch64 and others: ggml's non-native defaults are its portable baseline
esac
if [[ "$backend" == cuda ]]; then
  nvcc_path >/dev/null || { echo "backend cuda: no nvcc on PATH or in /usr/local/cuda/bin" >&2; exit 1; }
  # No GPU to ask (a build box): "native", not an errexit on nvidia-smi's status.
  arch="${QUANTROUTE_CUDA_ARCH:-$({ nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null || true; } \
    | head -n1 | tr -d ' .')}"
  flags+=(-DGGML_CUDA=on "-DCMAKE_CUDA_ARCHITECTURES=${arch:-native}"
    "-DCMAKE_CUDA_COMPILER=$(nvcc_path)")
fi

python="${venv:+$venv/bin/python}"   # the key names the venv's python, not the one on PATH
describe="llama-cpp-python=$version backend=$backend python=$("${python:-python3}" -c 'import sys; print(sys.implementation.cache_tag)') machine=$(uname -m) flags=${flags[*]}"
key="$(printf '%s' "$describe" | sha256sum | cut -c1-16)"

case "$mode" in
  --flags) echo "backend=$backend"; printf '%s\n' "${flags[@]}"; exit 0 ;;
  --key) echo "$key"; exit 0 ;;
esac

record="$venv/llama-build.json"
if [[ -f "$record" ]] && grep -q "\"key\": \"$key\"" "$record" \
  && "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  exit 0   # this venv already has this build
fi

dir="$cache/llama-wheels/$key"
wheel="$(ls "$dir"/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "$wheel" ]]; then
  echo "==> building llama.cpp ($backend, no -march=native) — about 8 minutes on 2 cores, the first time only"
  echo "    flags: ${flags[*]}"
  rm -rf "$dir.partial" && mkdir -p "$dir.partial"
  log="$dir.partial/build.log"
  # A failed pip must reach the message below (pipefail + errexit would end the script
  # silently here); the wheel's presence is the verdict, the full log stays for reading.
  CMAKE_ARGS="${flags[*]}" FORCE_CMAKE=1 "$venv/bin/pip" wheel -v --no-deps --no-cache-dir \
    --no-binary llama-cpp-python -w "$dir.partial" "llama-cpp-python==$version" 2>&1 \
    | tee "$log" | progress_filter || true
  wheel="$(ls "$dir.partial"/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n1 || true)"
  [[ -n "$wheel" ]] || { echo "llama-cpp-python build failed; the full log: $log (rerun with: CMAKE_ARGS='${flags[*]}' pip wheel -v llama-cpp-python==$version)" >&2; exit 1; }
  rm -rf "$dir" && mv "$dir.partial" "$dir"
  wheel="$dir/$(basename "$wheel")"
  printf '{"key": "%s", "describe": "%s"}\n' "$key" "$describe" >"$dir/build.json"
fi

"$venv/bin/pip" install -q --force-reinstall --no-deps "$wheel"
"$venv/bin/pip" install -q "$wheel"   # its dependencies
"$venv/bin/python" -c "import llama_cpp" || { echo "llama_cpp does not import from $wheel" >&2; exit 1; }
python3 - "$record" "$key" "$backend" "$version" "$wheel" "${flags[@]}" <<'PY'
import json, sys
path, key, backend, version, wheel, *flags = sys.argv[1:]
with open(path, "w") as f:
    json.dump({"key": key, "backend": backend, "version": version, "wheel": wheel, "cmake_flags": flags}, f, indent=1)
    f.write("\n")
PY
echo "==> llama-cpp-python $version ($backend) installed from $(dirname "$wheel")"
