#!/bin/bash
# Every GPU measurement docs/BENCHMARKS.md reports for the GPU runtime and the expert backends, in one batch (the
# device time is scarce): the GPU tests, the decode profile, the CPU expert kernel's scaling, then the full-size
# benchmark at each preset under its cap with every expert backend, and the transformers + accelerate row last.
# Run from the repository root on a CUDA machine; results go to $OUT (default ./gpu-results).
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider --durations=5 gpu_tests tests/test_triton_*.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu_tests rc=$?"; tail -15 "$OUT/gpu_tests.txt"
timeout 150 python3 tools/gpu/decode_profile.py > "$OUT/decode_profile.txt" 2>&1
echo "decode profile rc=$?"; grep -E "graph|decode step|GPU busy" "$OUT/decode_profile.txt"
timeout 150 python3 -m engine bench --cpu-experts --threads 1,4,8,16 | tee "$OUT/cpu_experts.txt"
bench() {  # preset, prompt lengths, time limit, extra options
    timeout "$3" python3 -m engine bench --synthetic qwen3.6-35b-a3b-nvfp4 --preset "$1" --prompt-tokens "$2" \
        --decode-tokens 32 --expert-backends offload,cpu,hybrid ${4:-} --json > "$OUT/bench_$1.json" 2> "$OUT/bench_$1.err"
    echo "bench $1 rc=$?"; grep '^bench' "$OUT/bench_$1.err" | cut -c1-400
}
bench 4gb 4096,16896 200
bench 8gb 4096 100
bench 12gb 4096,32768 150
bench 4gb 128 300 --hf-baseline  # the baseline builds the bf16 model (70 GB of host RAM) after ours
