#!/bin/bash
# Issue 22's side by side on one machine: llama.cpp (built by tools/gpu/build_llama_cpp.sh, on the GGUF of
# tools/gguf_random.py --like-nvidia) against MoE Desk's bench, preset by preset, in parts that each fit one
# 10-minute device call:
#   llama4gb|llama8gb|llama12gb   llama.cpp at that VRAM budget. It cannot be capped, so it is measured: a probe
#             with every layer's experts on the CPU (--n-cpu-moe 40, the 16,384-token prompt, memory.used sampled
#             by nvidia-smi every 100 ms) gives what does not depend on N; tools/gpu/llama_vram.py picks the
#             fewest CPU layers that fit (a GPU layer adds its 432 MiB of Q4_K experts); the measured runs check
#             it and, if their peak is over the budget, are run once more with the N that peak implies (where
#             even N = 40 is over at -ub $UB, the probe is run again at -ub 512, and that batch is used). Then
#             prefill of 512, 4,096 and 16,384 tokens (depth 0) and decode of 128 tokens after a 4,096-token
#             prompt (-d 4096), flash attention on, -ub/-b $UB, all layers on the GPU but the N layers' experts,
#             16 threads.
#             FITS="4gb:40:1024 8gb:33:2048" skips a preset's probe with an earlier call's N and batch.
#   llamalaptop   the laptop row's llama.cpp: the 4gb fit (llama_4gb_fit.json of this call, or N=... UB=...),
#             8 threads, prefill of 4,096 and decode of 128 after 4,096. Its link is not held: the throttle of
#             MoE Desk's bench (--link-gbps) lives in MoE Desk's copy path, and llama.cpp issues its own copies.
#   llamaub   the prefill batch llama.cpp runs best at: -ub/-b 512, 1024, 2048, 4096 on the 4,096-token prompt,
#             every expert on the CPU, with the peak of each (to choose UB for the preset parts)
#   ours4gb|ours8gb|ours12gb   MoE Desk's bench at the preset: prompts 4,096 (first: it pays the compile), 512
#             and 16,384, decode 128 after 4,096, uniform routing, every backend and auto, 16 threads
#             HF=1 adds the transformers + accelerate row (--hf-baseline; carry HF_WHEELS, default .whl/hf, the cp312
#             wheels of transformers 5.24.0, accelerate 1.15.0 and the dependencies the machine lacks or has in
#             another version; the H200 image needs transformers, safetensors and regex)
#   hf4gb     the transformers + accelerate row alone, at 4gb (HF_WHEELS as for HF=1), beside a short MoE Desk run
#   ourslaptop   tools/gpu/issue19_runs.sh laptop: 4gb, 6.5 GB/s link, 8 threads, records pinned then pageable
# Results go to $OUT (default ./gpu-results): llama_<part>_{probe,prefill,decode}.json (llama-bench's JSON),
# .err (its stderr), .vram (peak bytes above the idle GPU), llama_<preset|laptop>_fit.json (the N, the budget);
# bench_<preset>.json as issue19_runs.sh writes them. `python3 tools/gpu/side_by_side.py $OUT` prints the table.
# Run from the repository root, e.g. `bash tools/gpu/issue22_runs.sh llama4gb`. TTFT is llama-bench's time for a
# prompt-only test (avg_ns: the whole prompt through the model to the first token's logits), ours the bench's.
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LLAMA_BENCH=${LLAMA_BENCH:-.llama-build/bin/llama-bench}
GGUF=${GGUF:-.llama-build/q36.gguf}
UB=${UB:-2048}      # llama.cpp's prefill batch (-ub and -b); llamaub measures the choice
REPS=${REPS:-1}     # llama-bench repetitions, after its own untimed warm-up run of each test
PROBE_N=40          # every layer's experts on the CPU
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt"

have_llama() {  # true if llama-bench and the GGUF are here; else says what builds them
    [ -x "$LLAMA_BENCH" ] && [ -s "$GGUF" ] && return
    echo "issue22_runs: need $LLAMA_BENCH and $GGUF (tools/gpu/build_llama_cpp.sh, tools/gguf_random.py)"; return 1
}

idle_mib() {  # the GPU's memory.used now (MiB), with nothing of ours on it
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 | head -1
}

measured() {  # name, time limit, llama-bench options: runs it while sampling memory.used; its peak to .vram
    local name=$1 limit=$2 idle sampler rc started=$SECONDS
    shift 2
    idle=$(idle_mib)
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 100 > "$OUT/llama_$name.samples" &
    sampler=$!
    timeout "$limit" "$LLAMA_BENCH" -m "$GGUF" -ngl 99 -fa on -o json "$@" \
        > "$OUT/llama_$name.json" 2> "$OUT/llama_$name.err"
    rc=$?
    sleep 0.3; kill "$sampler"; wait "$sampler" 2> /dev/null
    python3 tools/gpu/llama_vram.py peak "$OUT/llama_$name.samples" "$idle" > "$OUT/llama_$name.vram"
    echo "llama-bench $name rc=$rc in $((SECONDS - started)) s, peak" \
        "$(awk '{printf "%.2f GiB", $1 / 2^30}' "$OUT/llama_$name.vram")" "(above the idle GPU): $*"
    grep -iE "error|failed" "$OUT/llama_$name.err" | head -3
    return $rc
}

over() {  # name, budget GiB: true if that run's measured peak is over the budget (false if unmeasured)
    awk -v budget="$2" 'NR == 1 { over = $1 > budget * 2^30 } END { exit !over }' "$OUT/llama_$1.vram"
}

HF_SITE=/tmp/hf-site
HF_WHEELS=${HF_WHEELS:-.whl/hf}
hf_site() {  # transformers and accelerate for --hf-baseline: each wheel of $HF_WHEELS whose version this machine
    local wheel dist version  # lacks goes into $HF_SITE, which PYTHONPATH puts before the installed packages
    mkdir -p "$HF_SITE"
    for wheel in "$HF_WHEELS"/*.whl; do
        dist=$(basename "$wheel" | cut -d- -f1) version=$(basename "$wheel" | cut -d- -f2)
        python3 -c 'import importlib.metadata as m, sys; sys.exit(m.version(sys.argv[1]) != sys.argv[2])' \
            "$dist" "$version" 2> /dev/null \
            || python3 -m pip install -q --no-index --no-deps --target "$HF_SITE" "$wheel"
    done
    PYTHONPATH=$PWD:$HF_SITE python3 -c 'import transformers, accelerate; print("transformers", transformers.__version__,
"accelerate", accelerate.__version__)' \
        || { echo "hf_site: transformers or accelerate will not import; carry .whl/hf (pip download, see docs)"; return 1; }
}

known_fit() {  # preset: "N UB" from FITS (e.g. FITS="4gb:40:1024 12gb:24:2048"), or nothing
    local fit
    for fit in ${FITS:-}; do
        [ "${fit%%:*}" = "$1" ] && echo "${fit#*:}" | tr : ' ' && return
    done
}

llama_preset() {  # preset, budget GiB, thread counts (comma-separated)
    local preset=$1 gib=$2 threads=$3 ub=$UB n fewer attempt known
    known=$(known_fit "$preset")
    if [ -n "$known" ]; then  # an earlier call's fit: the measured runs below still check it against the budget
        n=${known% *} ub=${known#* }
        echo "$preset: --n-cpu-moe $n -ub $ub from FITS (no probe)"
    else
        measured "${preset}_probe" "${PROBE_LIMIT:-120}" -ncmoe "$PROBE_N" -t 16 -ub "$ub" -b "$ub" -p 16384 -n 0 \
            -r 1 --no-warmup -v
        if [ "$ub" -gt 512 ] && over "${preset}_probe" "$gib"; then  # a smaller batch's compute buffer may fit
            ub=512
            echo "$preset: over the budget with every expert on the CPU at -ub $UB; probing -ub $ub"
            measured "${preset}_probe" "${PROBE_LIMIT:-120}" -ncmoe "$PROBE_N" -t 16 -ub "$ub" -b "$ub" -p 16384 \
                -n 0 -r 1 --no-warmup -v
        fi
        n=$(python3 tools/gpu/llama_vram.py choose "$gib" "$(cat "$OUT/llama_${preset}_probe.vram")" "$PROBE_N")
        echo "$preset: --n-cpu-moe $n; the probe's GPU buffers (MiB):" \
            "$(python3 tools/gpu/llama_vram.py buffers "$OUT/llama_${preset}_probe.err")"
    fi
    for attempt in 1 2; do
        measured "${preset}_prefill" "${LIMIT:-200}" -ncmoe "$n" -t "$threads" -ub "$ub" -b "$ub" \
            -p 512,4096,16384 -n 0 -r "$REPS"
        if [ "$attempt" = 2 ] || ! over "${preset}_prefill" "$gib"; then
            break
        fi
        fewer=$(python3 tools/gpu/llama_vram.py choose "$gib" "$(cat "$OUT/llama_${preset}_prefill.vram")" "$n")
        if [ "$fewer" = "$n" ]; then
            echo "$preset: over the budget with every expert on the CPU already: llama.cpp cannot fit it"; break
        fi
        n=$fewer
        echo "$preset: over the budget; again with --n-cpu-moe $n"
    done
    measured "${preset}_decode" "${LIMIT:-120}" -ncmoe "$n" -t "$threads" -ub "$ub" -b "$ub" -p 0 -n 128 -d 4096 \
        -r "$REPS"
    printf '{"preset": "%s", "budget_bytes": %d, "n_cpu_moe": %d, "ubatch": %d, "probe_n_cpu_moe": %d, %s}\n' \
        "$preset" "$((gib * 2**30))" "$n" "$ub" "$PROBE_N" "\"attempts\": $attempt" > "$OUT/llama_${preset}_fit.json"
}

for part in "$@"; do
    case "$part" in
        llama*) have_llama || continue ;;&
        llama4gb) llama_preset 4gb 4 16 ;;
        llama8gb) llama_preset 8gb 8 16 ;;
        llama12gb) llama_preset 12gb 12 16 ;;
        llamalaptop)  # the 4gb fit: this call's llama_4gb_fit.json, or N (and UB) from an earlier call's
            fit=$(python3 -c 'import json, sys; f = json.load(open(sys.argv[1])); print(f["n_cpu_moe"], f["ubatch"])' \
                "$OUT/llama_4gb_fit.json" 2> /dev/null)
            n=${N:-${fit% *}} ub=${fit#* }
            [ -n "${N:-}" ] && ub=$UB
            if [ -z "$n" ]; then
                echo "llamalaptop: run llama4gb first in this call, or give N=<its --n-cpu-moe> (and UB)"; continue
            fi
            measured laptop_prefill "${LIMIT:-200}" -ncmoe "$n" -t 8 -ub "$ub" -b "$ub" -p 4096 -n 0 -r "$REPS"
            measured laptop_decode "${LIMIT:-150}" -ncmoe "$n" -t 8 -ub "$ub" -b "$ub" -p 0 -n 128 -d 4096 -r "$REPS"
            printf '{"preset": "4gb", "budget_bytes": %d, "n_cpu_moe": %d, "ubatch": %d}\n' "$((4 * 2**30))" "$n" \
                "$ub" > "$OUT/llama_laptop_fit.json" ;;
        llamaub)
            for ub in 512 1024 2048 4096; do
                measured "ub$ub" "${LIMIT:-120}" -ncmoe "$PROBE_N" -t 16 -ub "$ub" -b "$ub" -p 4096 -n 0 -r 1
            done ;;
        ours4gb|ours8gb|ours12gb)  # the table's prompts and decode, uniform routing, every backend and auto
            started=$SECONDS preset=${part#ours} baseline=()
            [ -n "${HF:-}" ] && hf_site && baseline=(--hf-baseline)
            PYTHONPATH=$PWD:$HF_SITE timeout "${LIMIT:-240}" python3 -m engine bench --synthetic qwen3.6-35b-a3b-nvfp4 \
                --json --preset "$preset" --prompt-tokens 4096,512,16384 --decode-after 4096 --decode-tokens 128 \
                --decode-inputs random --routing uniform --expert-backends offload,cpu,hybrid,auto "${baseline[@]}" \
                > "$OUT/bench_$preset.json" 2> "$OUT/bench_$preset.err"
            echo "bench $preset rc=$? in $((SECONDS - started)) s"
            python3 tools/gpu/summarise.py "$OUT/bench_$preset.json" "$OUT/bench_$preset.err" ;;
        hf4gb)
            started=$SECONDS
            hf_site && PYTHONPATH=$PWD:$HF_SITE timeout "${LIMIT:-400}" python3 -m engine bench --synthetic \
                qwen3.6-35b-a3b-nvfp4 --json --preset 4gb --prompt-tokens 128 --decode-tokens 8 --decode-inputs random \
                --routing uniform --expert-backends auto --hf-baseline > "$OUT/bench_hf_4gb.json" 2> "$OUT/bench_hf_4gb.err"
            echo "bench hf 4gb rc=$? in $((SECONDS - started)) s"
            python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("baseline"))' "$OUT/bench_hf_4gb.json" ;;
        ourslaptop) bash tools/gpu/issue19_runs.sh laptop ;;
        *) echo "unknown part $part (llama4gb llama8gb llama12gb llamalaptop llamaub ours4gb ours8gb ours12gb" \
                "hf4gb ourslaptop)" ;;
    esac
done
