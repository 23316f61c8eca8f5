#!/bin/bash
# Build llama.cpp (as vendored by llama-cpp-python 0.3.36, llama.cpp commit 0c1e57098) from the trimmed source
# tools/llama_source.py extracts, for the side-by-side runs of issue 22: CPU + CUDA backends, CUDA for the
# H200 only (sm_90), native CPU code, Release, all cores, and only the targets the runs need (llama-bench,
# llama-server, llama-cli). No network is needed: the web UI and OpenSSL are off.
#
# What the vendored llama.cpp has (checked in its source):
#   - the qwen35moe architecture (Qwen3.5/3.6 MoE: LLM_ARCH_QWEN35MOE, "qwen35moe" in src/llama-arch.cpp)
#   - --n-cpu-moe N / -ncmoe N (llama-bench and common/arg.cpp: the first N layers' experts on the CPU)
#   - -ot / --override-tensor PATTERN=BUFFER (llama-bench and common/arg.cpp, e.g. -ot exps=CPU)
#   - -fa / --flash-attn on|off|auto (llama-bench and common/arg.cpp)
#
# How to run, from the repository root. Here (once, CPU machine):
#     python tools/llama_source.py /tmp/llsdist/llama_cpp_python-0.3.36.tar.gz      # writes .llama-src/
# On the CUDA machine (carry .llama-src; the build goes to .llama-build/, kept between calls of a warm machine):
#     bash tools/gpu/build_llama_cpp.sh
# A first device call that builds and, meanwhile on one core, writes the full-size GGUF (.whl holds gguf 0.19.0,
# `pip download --no-deps -d .whl gguf==0.19.0` here; both ignored folders carried: carry [".llama-src", ".whl"]):
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl && mkdir -p .llama-build && \
#     { PYTHONPATH=/tmp/site:$PWD python3 -m tools.gguf_random --like-nvidia .llama-build/q36.gguf \
#         > $OUT/gguf.txt 2>&1 & } && \
#     bash tools/gpu/build_llama_cpp.sh; wait; cat $OUT/gguf.txt
# then, e.g., experts of the first N layers on the CPU, flash attention on, 16 threads:
#     .llama-build/bin/llama-bench -m .llama-build/q36.gguf -ngl 99 --n-cpu-moe 30 -fa on -t 16 -p 512 -n 128 -o json
# Checked on a 2-core CPU machine with --cpu-only: configure 1 s, llama-bench alone 293 s at -j2, then
# llama-server and llama-cli 344 s more; that llama-bench ran the tiny and the full-size GGUF of
# tools/gguf_random.py ("qwen35moe 35B.A3B Q4_K", 34.66 B parameters). The CUDA build was not run there.
# The carried source is 23.6 MiB; with the tracked tree (about 30 MiB) a call carries about 54 of its 64 MiB.
# Options: --cpu-only (no CUDA; how it was checked on a CPU machine), --targets "llama-bench ..." (default
# llama-bench llama-server llama-cli). SRC and BUILD override the folders.
set -eu
SRC=${SRC:-.llama-src}
BUILD=${BUILD:-.llama-build}
TARGETS="llama-bench llama-server llama-cli"
CUDA=ON
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-only) CUDA=OFF ;;
        --targets) TARGETS=$2; shift ;;
        *) echo "build_llama_cpp: unknown option $1 (use --cpu-only, --targets \"...\")"; exit 2 ;;
    esac
    shift
done
if [ ! -f "$SRC/CMakeLists.txt" ] || [ ! -f "$SRC/VENDORED_COMMIT" ]; then
    echo "build_llama_cpp: no trimmed llama.cpp source in $SRC; run tools/llama_source.py SDIST first and carry it."
    exit 1
fi
COMMIT=$(head -1 "$SRC/VENDORED_COMMIT")
echo "llama.cpp commit $COMMIT ($(sed -n 2p "$SRC/VENDORED_COMMIT")), CUDA=$CUDA, targets: $TARGETS"
cmake --version | head -1
CUDA_OPTIONS=()
if [ "$CUDA" = ON ]; then
    command -v nvcc > /dev/null || export PATH=/usr/local/cuda/bin:$PATH
    nvcc --version | tail -2
    CUDA_OPTIONS=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
fi
started=$SECONDS
# The build number is unknown without git; 0 keeps the UI's asset lookup (off anyway) from guessing one.
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "${CUDA_OPTIONS[@]}" \
    -DLLAMA_BUILD_COMMIT="$COMMIT" -DLLAMA_BUILD_NUMBER=0 \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_RPC=OFF \
    > "$BUILD.configure.log" 2>&1 \
    || { tail -30 "$BUILD.configure.log"; echo "build_llama_cpp: cmake configure failed (log $BUILD.configure.log)"
         exit 1; }
echo "configured in $((SECONDS - started)) s"
# shellcheck disable=SC2086  # TARGETS is a list of names
cmake --build "$BUILD" --config Release -j "$(nproc)" --target $TARGETS > "$BUILD.build.log" 2>&1 \
    || { grep -m5 -B2 -A8 "error" "$BUILD.build.log"; echo "build_llama_cpp: build failed (log $BUILD.build.log)"
         exit 1; }
for target in $TARGETS; do
    [ -x "$BUILD/bin/$target" ] || { echo "build_llama_cpp: $BUILD/bin/$target was not built (log $BUILD.build.log)"
                                     exit 1; }
done
echo "built in $((SECONDS - started)) s: $TARGETS in $BUILD/bin"
"$BUILD/bin/llama-bench" --help 2>&1 | grep -m1 -i "n-cpu-moe" || echo "build_llama_cpp: llama-bench lacks --n-cpu-moe"
