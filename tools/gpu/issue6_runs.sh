#!/bin/bash
# Every GPU measurement docs/BENCHMARKS.md reports for the GPU runtime and the expert backends, in parts that each
# fit one 10-minute device call (the device time is scarce):
#   tests   the GPU tests and the Triton kernel tests on CUDA, then the decode profile (about 4 minutes)
#   4gb     the CPU expert kernel's scaling, then 4gb at 4,096 and 16,896 tokens with every backend, greedy
#           decoding, and at 4,096 with random decode inputs (about 8)
#   presets 8gb and 12gb at 4,096 tokens with every backend, random decode inputs (about 4)
#   hf      the transformers + accelerate row beside every backend at a 128-token prompt (builds the bf16
#           model: 70 GB of host RAM; about 3)
#   profiles where a step's GPU time goes: the cpu backend at 12gb (nearly every expert a hit: the GPU's own
#           work) and hybrid at 4gb (about 4)
# Run from the repository root on a CUDA machine, e.g. `bash tools/gpu/issue6_runs.sh tests 4gb`; results go to
# $OUT (default ./gpu-results).
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

bench() {  # preset, prompt lengths, time limit, name of the result, extra options
    timeout "$3" python3 -m engine bench --synthetic qwen3.6-35b-a3b-nvfp4 --preset "$1" --prompt-tokens "$2" \
        --decode-tokens 32 --expert-backends offload,cpu,hybrid ${5:-} --json > "$OUT/bench_$4.json" 2> "$OUT/bench_$4.err"
    echo "bench $4 rc=$?"; grep '^bench' "$OUT/bench_$4.err" | cut -c1-400
}

for part in "$@"; do
    case "$part" in
        tests)
            timeout 300 python3 -m pytest -q -p no:cacheprovider --durations=5 gpu_tests tests/test_triton_*.py \
                > "$OUT/gpu_tests.txt" 2>&1
            echo "gpu_tests rc=$?"; tail -15 "$OUT/gpu_tests.txt"
            timeout 150 python3 tools/gpu/decode_profile.py > "$OUT/decode_profile.txt" 2>&1
            echo "decode profile rc=$?"; grep -E "graph|decode step|GPU busy|  [a-z]" "$OUT/decode_profile.txt" ;;
        4gb)
            timeout 150 python3 -m engine bench --cpu-experts --threads 1,4,8,16 | tee "$OUT/cpu_experts.txt"
            bench 4gb 4096,16896 330 4gb
            bench 4gb 4096 200 4gb_random "--decode-inputs random" ;;
        presets)
            bench 8gb 4096 150 8gb "--decode-inputs random"
            bench 12gb 4096 150 12gb "--decode-inputs random" ;;
        hf)
            bench 4gb 128 280 hf "--hf-baseline" ;;
        profiles)
            for run in "cpu 12gb" "hybrid 4gb"; do
                timeout 150 python3 tools/gpu/decode_profile.py $run > "$OUT/profile_${run// /_}.txt" 2>&1
                echo "profile $run rc=$?"; grep -E "graph|decode step|GPU busy|  [a-z]" "$OUT/profile_${run// /_}.txt"
            done ;;
        *)
            echo "unknown part $part: tests, 4gb, presets, hf or profiles"; exit 2 ;;
    esac
done
