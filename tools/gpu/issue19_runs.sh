#!/bin/bash
# The GPU measurements of issues 19 and 20 on the real nvidia layout with forced routing, in parts that run
# back to back within 10-minute device calls:
#   quick     GPU tests: the runtime, forced routing through captured graphs, the measured reserve, auto's
#             trial, the emulated link's holds (eager and captured); and `plan` on this card (the measured reserve)
#   kernels   tests/engine/kernels with the Triton kernels compiled on this GPU (over 150 s here)
#   worst     the measured reserve, the worst-case routings (same, distinct, uniform) at 4/8/12gb on the
#             full-size model, and the 100-turn soak at 4gb (gpu_tests/test_gpu_reserve.py,
#             test_forced_routing.py, test_soak.py)
#   4gb|8gb|12gb  one preset: prompts 4,096 (then decode 128), 512, 16,384 and the preset's guarantee,
#             routings uniform, locality and fixed (the GPU's own step, for the combined ceiling), every
#             backend. 4gb's cache cannot hold a fixed step's 320 experts: it takes the GPU step from an
#             earlier part of the same call (12gb or 8gb), or GPU_STEP_MS from an earlier call
#   pageable  the field report's case at 4gb: records pageable, 8 CPU threads, every backend and auto
#   resume    returning to a 16K-token chat at 4gb with the real tokenizer (issue 25): the next turn's TTFT from
#             the RAM and disk state stores against a re-prefill (`engine bench-resume`)
#   fp8       the FP8 KV cache (issue 24): its tests on this GPU (the Triton decode kernel compiled, not
#             interpreted), then 4gb prefill 4,096 and 16,384 and decode 64 with --kv-cache bf16 and fp8
#   memdiff   what the 4gb model holds after its build and a 4,096-token prefill, by engine source line, on this
#             tree and on OLD_TREE (a copy of an earlier tree's engine/, default .old-tree) for comparison
#   prefill   a Gated DeltaNet layer's prefill chunk on this tree and OLD_TREE (time, peak against the plan's
#             term), its workspace test, then 4gb prefill 4,096 (first: it pays the compile), 512 and 16,384,
#             uniform routing, auto
#   redesign  issue 23's before and after in one call: OLD_TREE (default .old-tree; for issue 23 `git archive 9b2939e
#             engine`, a tree before the decode redesign: 7442f9f's plans run out of memory at 4gb and 8gb) and
#             this tree, each at PRESETS (default "4gb 8gb 12gb"; about 90 s a bench: two presets a call), prefill 4,096, decode 128 after it, uniform, every backend;
#             each tree measures the runtime reserve afresh (its kernels differ)
#   uses8gb   issue 24's plans at 8gb: --use chat against --use long-context, prefill 4,096, decode 128 after it,
#             routings locality and uniform, hybrid and auto
#   decode4gb issue 24's 4gb decode: prefill 4,096 then decode 128, routings uniform and locality, hybrid and auto
#   switch    issue 24's plan switch in place at 8gb, chat -> long context -> chat -> long context, timed, each
#             followed by a 512-token prompt and 8 decoded tokens (tools/gpu/switch_plan.py)
#   laptop    the field report's laptop emulated (issue 22): 4gb, expert copies held to 6.5 GB/s (PCIe 4.0 x4),
#             8 CPU threads, records pinned then pageable, every backend and auto, decode 64 after 4,096
# Run from the repository root on a CUDA machine, e.g. `bash tools/gpu/issue19_runs.sh 12gb 4gb`; results go
# to $OUT (default ./gpu-results).
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
MODEL=qwen3.6-35b-a3b-nvfp4
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

guarantee() {  # the preset's guaranteed prompt on this GPU (measured reserve)
    python3 -m engine plan --synthetic "$MODEL" --preset "$1" --json \
        | python3 -c 'import json, sys; print(json.load(sys.stdin)["max_prompt_tokens"])'
}

gpu_step_ms() {  # the GPU's own step: GPU_STEP_MS (ms, from an earlier call), or one an earlier part measured
    [ -n "${GPU_STEP_MS:-}" ] && echo "--gpu-step-ms $GPU_STEP_MS" && return
    for f in "$OUT"/bench_12gb.json "$OUT"/bench_8gb.json; do
        [ -s "$f" ] && python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
if "gpu_step_seconds" in r: print("--gpu-step-ms", 1e3 * r["gpu_step_seconds"])' "$f" && return
    done
}

bench() {  # name, time limit, options; from the folder BENCH_TREE (default here): `python -m` takes its engine
    local name=$1 limit=$2; shift 2
    local started=$SECONDS out
    out=$(cd "$OUT" && pwd)
    (cd "${BENCH_TREE:-.}" && timeout "$limit" python3 -m engine bench --synthetic "$MODEL" --json "$@" \
        > "$out/bench_$name.json" 2> "$out/bench_$name.err")
    echo "bench $name rc=$? in $((SECONDS - started)) s"; grep -v '^bench: ' "$OUT/bench_$name.err" | tail -3
    python3 tools/gpu/summarise.py "$OUT/bench_$name.json" "$OUT/bench_$name.err"
}

for part in "$@"; do
    case "$part" in
        quick)
            timeout "${QUICK_LIMIT:-330}" python3 -m pytest -q -p no:cacheprovider --durations=6 gpu_tests/test_gpu_runtime.py \
                gpu_tests/test_gpu_reserve.py gpu_tests/test_forced_routing.py gpu_tests/test_link_limit.py \
                -k "not worst_case" \
                > "$OUT/gpu_tests_quick.txt" 2>&1
            echo "gpu_tests quick rc=$?"; tail -12 "$OUT/gpu_tests_quick.txt"
            python3 -m engine plan --synthetic "$MODEL" --preset 4gb | tee "$OUT/plan_4gb.txt" | head -12 ;;
        kernels)
            timeout "${LIMIT:-330}" python3 -m pytest -q -p no:cacheprovider tests/engine/kernels > "$OUT/kernels_gpu.txt" 2>&1
            echo "kernel tests on the GPU rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/kernels_gpu.txt" | tail -12 ;;
        worst)
            timeout 230 python3 -m pytest -q -p no:cacheprovider --durations=6 -s gpu_tests/test_gpu_reserve.py \
                "gpu_tests/test_forced_routing.py::test_worst_case_routing_stays_within_the_preset" \
                > "$OUT/gpu_tests_worst.txt" 2>&1
            echo "gpu_tests worst rc=$?"; tail -8 "$OUT/gpu_tests_worst.txt"
            timeout 330 python3 -m pytest -q -p no:cacheprovider --durations=3 -s gpu_tests/test_soak.py \
                > "$OUT/gpu_tests_soak.txt" 2>&1
            echo "gpu_tests soak rc=$?"; tail -8 "$OUT/gpu_tests_soak.txt" ;;
        4gb|8gb|12gb)
            # shellcheck disable=SC2046  # the step's flag and value are two words
            bench "$part" "${LIMIT:-280}" --preset "$part" --prompt-tokens "4096,512,16384,$(guarantee "$part")" \
                --decode-after 4096 --decode-tokens 128 --decode-inputs random --routing uniform,locality,fixed \
                --expert-backends offload,cpu,hybrid,auto $(gpu_step_ms) ;;
        pageable)
            # shellcheck disable=SC2046
            bench pageable "${LIMIT:-200}" --preset 4gb --prompt-tokens 4096 --decode-tokens 64 --decode-inputs random \
                --routing uniform,locality --pageable --cpu-threads 8 --expert-backends auto,cpu,hybrid,offload \
                $(gpu_step_ms) ;;
        resume)
            tok=$(mktemp -d)
            cp tests/fixtures/real-tokenizers/qwen3.6/{tokenizer_config.json,generation_config.json,chat_template.jinja} "$tok"/
            gunzip -c tests/fixtures/real-tokenizers/qwen3.6/tokenizer.json.gz > "$tok/tokenizer.json"
            started=$SECONDS
            timeout "${LIMIT:-240}" python3 -m engine bench-resume --synthetic "$MODEL" --device cuda --preset 4gb \
                --tokenizer "$tok" --history-tokens 16384 --output "$OUT/resume_4gb.json" > "$OUT/resume_4gb.txt" 2>&1
            echo "bench-resume 4gb rc=$? in $((SECONDS - started)) s"; tail -12 "$OUT/resume_4gb.txt" ;;
        fp8)
            timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/kernels/test_fp8_kv_cache.py > "$OUT/fp8_tests.txt" 2>&1
            echo "fp8 tests on the GPU rc=$?"; tail -5 "$OUT/fp8_tests.txt"
            for kv in bf16 fp8; do
                bench "fp8_4gb_$kv" "${LIMIT:-150}" --preset 4gb --prompt-tokens 4096,16384 --decode-after 4096 \
                    --decode-tokens 64 --decode-inputs random --routing uniform --expert-backends auto --kv-cache "$kv"
            done ;;
        memdiff)
            for tree in "$PWD" "${OLD_TREE:-$PWD/.old-tree}"; do
                PYTHONPATH=$tree timeout 150 python3 tools/gpu/memory_diff.py --preset 4gb --prompt-tokens 4096 \
                    --output "$OUT/memdiff_$(basename "$tree").json" 2>&1 | tail -14
            done ;;
        prefill)
            for tree in "$PWD" "${OLD_TREE:-$PWD/.old-tree}"; do
                PYTHONPATH=$tree timeout 120 python3 tools/gpu/gdn_prefill.py --tokens 1000,1024,2048 \
                    --output "$OUT/gdn_$(basename "$tree").json" 2>&1 | tail -4
            done
            timeout 120 python3 -m pytest -q -p no:cacheprovider gpu_tests/test_gdn_workspace.py 2>&1 | tail -3
            bench prefill_4gb "${LIMIT:-300}" --preset 4gb --prompt-tokens 4096,512,16384 --decode-after 4096 \
                --decode-tokens 32 --decode-inputs random --routing uniform --expert-backends auto ;;
        redesign)
            for preset in ${PRESETS:-4gb 8gb 12gb}; do
                for tree in before after; do
                    root=$PWD use=()
                    # the one plan 8gb had before plans had uses is today's long context (12gb's is chat's)
                    [ "$preset" = 8gb ] && use=(--use long-context)
                    [ "$tree" = before ] && root=${OLD_TREE:-$PWD/.old-tree} use=()
                    rm -f "$HOME/.local/share/MoE Desk/runtime_reserve.json"  # each tree plans with its own reading
                    BENCH_TREE=$root bench "redesign_${preset}_$tree" "${LIMIT:-150}" --preset "$preset" \
                        --prompt-tokens 4096 --decode-after 4096 --decode-tokens 128 --decode-inputs random \
                        --routing uniform --expert-backends offload,cpu,hybrid,auto "${use[@]}"
                done
            done ;;
        uses8gb)
            for use in chat long-context; do
                bench "8gb_$use" "${LIMIT:-200}" --preset 8gb --use "$use" --prompt-tokens 4096 --decode-after 4096 \
                    --decode-tokens 128 --decode-inputs random --routing locality,uniform --expert-backends hybrid,auto
            done ;;
        decode4gb)
            bench 4gb_decode "${LIMIT:-200}" --preset 4gb --prompt-tokens 4096 --decode-tokens 128 \
                --decode-inputs random --routing uniform,locality --expert-backends hybrid,auto ;;
        switch)
            timeout "${LIMIT:-200}" python3 tools/gpu/switch_plan.py --preset 8gb --output "$OUT/switch_8gb.json" 2>&1 \
                | tail -6 ;;
        laptop)
            for records in pinned pageable; do
                # shellcheck disable=SC2046
                bench "laptop_$records" "${LIMIT:-200}" --preset 4gb --prompt-tokens 4096 --decode-tokens 64 \
                    --decode-inputs random --routing uniform,locality --link-gbps 6.5 --cpu-threads 8 \
                    --expert-backends auto,cpu,hybrid,offload $([ "$records" = pageable ] && echo --pageable) \
                    $(gpu_step_ms)
            done ;;
        *) echo "unknown part $part" ;;
    esac
done
