#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama-cpp-python source distribution,
# which vendors llama.cpp under vendor/llama.cpp. The result is a single static binary
# at build/llama-server (build/ is ignored by git; nothing here is committed).
#
#   benchmarks/build_llama_server.sh                 # latest llama-cpp-python sdist
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 benchmarks/build_llama_server.sh
#   JOBS=4 NICE=0 benchmarks/build_llama_server.sh   # on a machine of your own
#   NO_AMX=0 benchmarks/build_llama_server.sh        # keep AMX (default: off where the CPU has it)
#
# On this project's Xeon VMs llama.cpp's AMX repack segfaults for any batch of two or more
# tokens, so where the CPU reports AMX the build leaves it out (-mno-amx-*) and keeps
# repacking on: llama-server's fastest configuration that works there.
#
# Needs cmake, a C++17 compiler and pip (PyPI or a mirror). Takes ~10-30 min on 2 cores.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$ROOT/build"
SRC="$BUILD/llama-src"
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
PIP="${PIP:-}"
if [[ -z "$PIP" ]]; then
  if [[ -x "$ROOT/.venv/bin/pip" ]]; then PIP="$ROOT/.venv/bin/pip"; else PIP="python3 -m pip"; fi
fi
SPEC="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"

for tool in cmake g++; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found" >&2; exit 1; }
done

mkdir -p "$BUILD/sdist"
if ! ls "$BUILD"/sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  echo "== downloading $SPEC sdist"
  $PIP download --no-deps --no-binary :all: --dest "$BUILD/sdist" "$SPEC"
fi
TARBALL="$(ls -t "$BUILD"/sdist/llama_cpp_python-*.tar.gz | head -1)"

if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
  echo "== unpacking $(basename "$TARBALL")"
  rm -rf "$SRC" && mkdir -p "$SRC"
  tar -xzf "$TARBALL" -C "$SRC" --strip-components=1
fi
LLAMA="$SRC/vendor/llama.cpp"
# Record which llama.cpp we measure against (the sdist name pins the vendored commit).
basename "$TARBALL" > "$BUILD/llama-server.version"

NO_AMX="${NO_AMX:-$(grep -q amx_int8 /proc/cpuinfo && echo 1 || echo 0)}"
FLAGS=""
if [[ "$NO_AMX" == 1 ]]; then FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; echo "== building without AMX"; fi
echo "== configuring $LLAMA"
# Static libs so build/llama-server runs on its own; no curl (no model downloads);
# native CPU flags, as llama.cpp ships them to users building from source.
cmake -S "$LLAMA" -B "$LLAMA/build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS"

echo "== building llama-server with -j $JOBS (nice $NICE)"
nice -n "$NICE" cmake --build "$LLAMA/build" --config Release --target llama-server -j "$JOBS"

cp "$LLAMA/build/bin/llama-server" "$BUILD/llama-server"
echo "== built $BUILD/llama-server ($(cat "$BUILD/llama-server.version"))"
"$BUILD/llama-server" --version 2>&1 | head -3 || true
