#!/usr/bin/env bash
# Build llama.cpp's own speculative decoding example, llama-speculative-simple, from the
# llama.cpp source that the installed llama-cpp-python vendors, once: `spececd bench`
# then adds llama.cpp's in-process speculation (target + draft GGUF in one process) as a
# row beside SpecECD with the same GGUF pair.
#
#   bash scripts/build-llama-speculative.sh [DEST]     (default DEST: ~/.cache/spececd)
#
# Needs cmake and a C++ compiler (Debian: apt-get install cmake g++), and the `llama`
# extra (pip install 'spececd[llama]'); fetches the llama-cpp-python source from PyPI.
# Takes about ten minutes on two cores. The binary goes to DEST/llama-speculative-simple;
# the bench finds it there, or where $SPECECD_LLAMA_SPECULATIVE points.
set -euo pipefail
dest="${1:-$HOME/.cache/spececd}"
version="$(python -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m pip download --quiet --no-deps --no-binary :all: -d "$work" \
    "llama-cpp-python==$version"
tar xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF > "$work/cmake.log"
cmake --build "$work/build" --target llama-speculative-simple -j "$(nproc)" > "$work/build.log"
mkdir -p "$dest"
cp "$work/build/bin/llama-speculative-simple" "$dest/"
echo "built $dest/llama-speculative-simple (llama.cpp vendored by llama-cpp-python $version)"
