#!/usr/bin/env bash
# Build llama.cpp's own llama-server, for the serving benchmark's peer, from the llama.cpp
# revision that the project's llama-cpp-python vendors, with the same portable flags.
#
#   scripts/llama_server_build.sh [PYTHON]   build it once (or keep it); print the binary's path last
#   scripts/llama_server_build.sh --flags    print the backend and CMake flags it would use
#   scripts/llama_server_build.sh --key      print the cache key of those flags
#
# The sources are llama-cpp-python's sdist (the version pinned in scripts/llama_build.sh),
# which carries llama.cpp as a submodule; the sdist comes from $QUANTROUTE_LLAMA_SDIST, else
# the cache, else `PYTHON -m pip download --no-binary :all:`. The ggml flags are exactly
# scripts/llama_build.sh's (a fixed x86-64 baseline, AVX-512 and AMX off, never the build
# machine's own CPU flags; CUDA where that script would use it), so the peer and quantroute
# run the same kernels. Only the server target is built (static, no web UI, no HTTPS).
#
# Cached under $QUANTROUTE_CACHE (default ~/.cache/quantroute)/llama-server/<key>/, with
# build.json naming the revision and the flags. A GPU session builds the CUDA one with
# QUANTROUTE_LLAMA_BACKEND=cuda, under another key.
set -euo pipefail

# ninja's "[12/206] Building ..." lines as one line per 5 %, and the errors. In bash, line by
# line: llama_build.sh's awk filter is mawk here, which reads a pipe in 4 KiB blocks.
progress() {
  local shown=0 line pct
  while IFS= read -r line; do
    if [[ "$line" =~ \[\ *([0-9]+)/([0-9]+)\] ]]; then
      pct=$((100 * BASH_REMATCH[1] / BASH_REMATCH[2]))
      if ((pct >= shown + 5 || BASH_REMATCH[1] == BASH_REMATCH[2])); then
        shown=$pct
        printf '    llama-server build %3d%%  (%s/%s)\n' "$pct" "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"
      fi
    elif [[ "$line" =~ ^\[\ *([0-9]+)%\] ]]; then   # make, where there is no ninja
      pct=${BASH_REMATCH[1]}
      if ((pct >= shown + 5 || pct == 100)); then
        shown=$pct
        printf '    llama-server build %3d%%\n' "$pct"
      fi
    elif [[ "$line" =~ ERROR|[Ee]rror:|CMake\ Error ]]; then
      printf '%s\n' "$line"
    fi
  done
}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mode="${1:-}" python="python3"
case "$mode" in
  --flags | --key) ;;
  -*) echo "usage: $0 [PYTHON] | --flags | --key" >&2; exit 2 ;;
  "") ;;
  *) python="$1" ;;
esac

version="$(sed -n 's/^version="\([0-9.]*\)".*/\1/p' "$here/llama_build.sh")"
base="$(bash "$here/llama_build.sh" --flags)"   # backend=... then one flag a line
backend="${base%%$'\n'*}" && backend="${backend#backend=}"
mapfile -t flags < <(printf '%s\n' "$base" | tail -n +2)
flags+=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TOOLS=ON
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_OPENSSL=OFF)
describe="llama-server from llama-cpp-python=$version backend=$backend machine=$(uname -m) flags=${flags[*]}"
key="$(printf '%s' "$describe" | sha256sum | cut -c1-16)"

case "$mode" in
  --flags) echo "backend=$backend"; printf '%s\n' "${flags[@]}"; exit 0 ;;
  --key) echo "$key"; exit 0 ;;
esac

cache="${QUANTROUTE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/quantroute}"
dir="$cache/llama-server/$key"
if [[ -x "$dir/llama-server" && -f "$dir/build.json" ]]; then
  echo "$dir/llama-server"
  exit 0
fi

sdist="${QUANTROUTE_LLAMA_SDIST:-$cache/llama-sdist/llama_cpp_python-$version.tar.gz}"
if [[ ! -f "$sdist" ]]; then
  echo "==> downloading llama-cpp-python $version's sources" >&2
  mkdir -p "$(dirname "$sdist")"
  "$python" -m pip download -q --no-binary :all: --no-deps -d "$(dirname "$sdist")" \
    "llama-cpp-python==$version" >&2
fi
[[ -f "$sdist" ]] || { echo "no sdist at $sdist" >&2; exit 1; }

work="$dir.partial"
rm -rf "$work" && mkdir -p "$work"
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
revision="$(cat "$work/llama_cpp_python-$version/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null || echo unknown)"
echo "==> building llama-server (llama.cpp $revision, $backend, no -march=native) — about 10 minutes on 2 cores, the first time only" >&2
echo "    flags: ${flags[*]}" >&2
log="$work/build.log"
jobs="$(nproc 2>/dev/null || echo 2)"
generator=(-G Ninja) && command -v ninja >/dev/null || generator=()
if ! { cmake -S "$src" -B "$work/build" "${generator[@]}" "${flags[@]}" \
  -DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT="${revision:0:9}" >"$log" 2>&1 &&
  cmake --build "$work/build" --target llama-server -j "$jobs" 2>&1 | tee -a "$log" |
  progress >&2; } ||
  [[ ! -x "$work/build/bin/llama-server" ]]; then
  echo "llama-server build failed; the full log: $log" >&2
  exit 1
fi
mkdir -p "$dir.new"
cp "$work/build/bin/llama-server" "$dir.new/llama-server"
printf '{"key": "%s", "revision": "%s", "backend": "%s", "llama_cpp_python": "%s", "describe": "%s"}\n' \
  "$key" "$revision" "$backend" "$version" "$describe" >"$dir.new/build.json"
rm -rf "$dir" && mv "$dir.new" "$dir" && rm -rf "$work"
echo "==> llama-server built: $dir/llama-server" >&2
echo "$dir/llama-server"
