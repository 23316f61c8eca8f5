#!/bin/bash
# The GPU measurements of issue 19 on the real nvidia layout with forced routing, in parts that each fit one
# 10-minute device call:
#   tests    GPU tests: forced routing through captured graphs, the measured reserve, auto's trial (pageable
#            too), the worst-case routings at 4/8/12gb on the full-size model (about 8 minutes)
#   4gb|8gb|12gb  one preset: prompts 512, 4,096, 16,384 and the preset's guarantee, decode 128, routings
#            uniform, locality and fixed (the GPU's own step, for the combined ceiling), every backend
#   pageable the field report's case at 4gb: records pageable, 8 CPU threads, every backend and auto
# Run from the repository root on a CUDA machine, e.g. `bash tools/gpu/issue19_runs.sh tests`; results go to $OUT
# (default ./gpu-results).
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

guarantee() {  # the preset's guaranteed prompt on this GPU (measured reserve)
    python3 -m engine plan --synthetic qwen3.6-35b-a3b-nvfp4 --preset "$1" --json \
        | python3 -c 'import json, sys; print(json.load(sys.stdin)["max_prompt_tokens"])'
}

bench() {  # name, time limit, options
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m engine bench --synthetic qwen3.6-35b-a3b-nvfp4 --json "$@" \
        > "$OUT/bench_$name.json" 2> "$OUT/bench_$name.err"
    echo "bench $name rc=$?"; grep '^bench' "$OUT/bench_$name.err" | cut -c1-300
}

for part in "$@"; do
    case "$part" in
        tests)
            timeout 560 python3 -m pytest -q -p no:cacheprovider --durations=8 gpu_tests > "$OUT/gpu_tests.txt" 2>&1
            echo "gpu_tests rc=$?"; tail -20 "$OUT/gpu_tests.txt" ;;
        4gb|8gb|12gb)
            bench "$part" 560 --preset "$part" --prompt-tokens "512,4096,16384,$(guarantee "$part")" \
                --decode-tokens 128 --decode-inputs random --routing uniform,locality,fixed \
                --expert-backends offload,cpu,hybrid,auto ;;
        pageable)
            bench pageable 560 --preset 4gb --prompt-tokens 4096 --decode-tokens 64 --decode-inputs random \
                --routing uniform,locality --pageable --cpu-threads 8 --expert-backends auto,cpu,hybrid,offload ;;
        *) echo "unknown part $part" ;;
    esac
done
