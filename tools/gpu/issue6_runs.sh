#!/bin/bash
# Every GPU measurement docs/BENCHMARKS.md reports for the GPU runtime, in one batch (the device time is
# scarce): the GPU tests, then the full-size benchmark at each preset under its cap. Run from the
# repository root on a CUDA machine; results go to $OUT (default ./gpu-results).
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider --durations=8 gpu_tests > "$OUT/gpu_tests.txt" 2>&1
echo "gpu_tests rc=$?"; tail -15 "$OUT/gpu_tests.txt"
bench() {  # preset, prompt lengths, time limit
    timeout "$3" python3 -m engine bench --synthetic qwen3.6-35b-a3b-nvfp4 --preset "$1" --prompt-tokens "$2" \
        --decode-tokens 64 --json > "$OUT/bench_$1.json" 2> "$OUT/bench_$1.err"
    echo "bench $1 rc=$?"; grep '^bench' "$OUT/bench_$1.err" | cut -c1-400
}
bench 4gb 512,4096,16384,18944 240
bench 8gb 512,4096 120
bench 12gb 512,4096 120
