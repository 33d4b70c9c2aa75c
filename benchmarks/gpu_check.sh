#!/usr/bin/env bash
# The GPU check, sized for a 15-minute GPU slot that includes the machine's start: at most
# 6 minutes in all and at most 8 files in $OUT. Run on a lent NVIDIA GPU (the `device` tool):
#   OUT=$OUT bash benchmarks/gpu_check.sh
# --dry-run runs every step on the CPU (JAX_PLATFORMS=cpu) in a form that takes seconds: the
# A/B's cases shrunk (--smoke), the tests collected, not run, and the throughput rows on the
# bundled model; it proves each step's imports and arguments where the GPU image's Python
# would run them (tests/test_benchmarks.py runs it with the packages that image lacks hidden).
# Steps, each time-boxed (the T_* seconds below, plus KILL_AFTER if a step ignores its TERM;
# tests/test_benchmarks.py checks that boxes, kill delays and 3 s of bookkeeping a step sum to
# <= 360 s) and each leaving its result in $OUT before the next one starts:
#   probe     jax / flax versions, the devices, the Pallas kernel variants this checkout has;
#   ab        kernel A/B, old (v1) vs new (v2) and the xla backend (and v2's decode kernel
#             alone, row v2-kernel, beside v2's whole forward), most telling first: bf16
#             decode batch 64 at context 4096, prefill 1x4096, fp8 decode 64x4096, batch 1 at
#             8192 (bf16, fp8), mixed, then batch 33, while the step's budget lasts
#             (benchmarks/kernels/paged_attention.py -> ab.json, rewritten after every case);
#   tests     a kernel-test subset compiled for the GPU against the jnp references, stopped
#             by SIGINT at its box so that pytest still writes its report (-> kernel_tests.xml);
#   tp_pallas, tp_xla   offline throughput of the Llama-3-8B-shaped model with 8 of its 32
#             layers, so that its compilation fits the box on an empty compile cache
#             (configs/models/llama3-8b-shape-8l, dummy bf16 weights) on --attention-backend
#             pallas, then xla: 32 prompts of 64 tokens, 64 output tokens, buckets kept to one
#             prefill and one decode shape, a persistent compilation cache
#             (-> throughput_{pallas,xla}.json).
# Files in $OUT: summary.txt (rewritten after every step), logs.tar.gz (every step's log,
# re-packed after every step), ab.json, kernel_tests.xml, throughput_pallas.json,
# throughput_xla.json.
# Uses the machine's own python3 (jax 0.11.2 with CUDA, flax, transformers, safetensors,
# pytest); nothing is installed. Record what it prints in docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    export JAX_PLATFORMS=cpu
fi
OUT="${OUT:-/tmp/gpu_check}"
LOGS="$(mktemp -d /tmp/gpu_check_logs.XXXXXX)"
DRY_CACHE="$(mktemp -d /tmp/gpu_check_cache.XXXXXX)"     # the dry run's compile cache
trap 'rm -rf "$LOGS" "$DRY_CACHE"' EXIT
mkdir -p "$OUT"
# (a PYTHONPATH already set stays after the checkout: wheels carried to the GPU image)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error

T_PROBE=15
T_AB=120
T_TESTS=60
T_TP_PALLAS=70
T_TP_XLA=70
KILL_AFTER=2    # seconds from a step's TERM to its KILL

# run_step NAME SECONDS COMMAND...: run COMMAND under `timeout SECONDS` (its signal $SIGNAL,
# TERM unless set), its output to $LOGS/NAME.log (and the terminal), then record rc and
# seconds, re-pack the logs into $OUT and rewrite $OUT/summary.txt, so a later step cut off or
# a lost machine keeps this one's result.
run_step() {
    local name="$1" seconds="$2" start=$SECONDS rc
    shift 2
    echo "=== $name (time box ${seconds}s)"
    timeout -s "${SIGNAL:-TERM}" -k "$KILL_AFTER" "$seconds" "$@" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    echo "$name rc=$rc seconds=$((SECONDS - start)) box=$seconds" >> "$LOGS/steps.txt"
    tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
    python3 -m jaxpaged.benchmarks.gpu_check_summary "$OUT" "$LOGS" > "$OUT/summary.txt" 2>&1
}

run_step probe "$T_PROBE" python3 -c "
import jax, flax
from jaxpaged.benchmarks.kernels.paged_attention import available_kernels
print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())
print('kernels', ' '.join(available_kernels()))"
KERNELS="$(sed -n 's/^kernels //p' "$LOGS/probe.log")"

SMOKE=()
[ "$DRY_RUN" = 1 ] && SMOKE=(--smoke)
run_step ab "$T_AB" python3 benchmarks/kernels/paged_attention.py --kernel ${KERNELS:-v1 v2} \
    --cases decode:64x4096 prefill:1x4096 decode:64x4096:fp8 decode:1x8192 decode:1x8192:fp8 \
    mixed:64x4096 decode:33x4096 decode:33x4096:fp8 "${SMOKE[@]}" \
    --row-time-limit 2 --trials 5 --time-budget $((T_AB - 25)) --output-json "$OUT/ab.json"

# 50 tests: GQA 1-8 and head_dim 8/64/128 over random ragged batches (bf16), decode-only,
# split-K (v1 and v2), the fp8 pool through the kernel and through forward (both backends),
# the KV write
SUBSET="(ragged_batch_matches_reference and bfloat16) or decode_only_batch or split_k_matches"
SUBSET+=" or (fp8_pool_matches_reference and pallas-auto-splits and bfloat16)"
SUBSET+=" or backend_forward_on_fp8_pool or rows_land_in_their_slots"
COLLECT=()
[ "$DRY_RUN" = 1 ] && COLLECT=(--collect-only)
SIGNAL=INT run_step tests "$T_TESTS" python3 -m pytest -q -p no:cacheprovider -rf -k "$SUBSET" \
    tests/kernels/test_paged_attention.py tests/kernels/test_paged_attention_v2.py \
    tests/kernels/test_kv_write.py "${COLLECT[@]}" --junitxml "$OUT/kernel_tests.xml"

THROUGHPUT=(python3 -m jaxpaged.benchmarks.throughput --model configs/models/llama3-8b-shape-8l
    --tokenizer configs/tokenizers/llama2 --load-format dummy --dtype bfloat16
    --max-model-len 128 --max-num-seqs 32 --max-num-batched-tokens 2048
    --num-gpu-blocks-override 1024 --compilation-cache-dir /tmp/jaxpaged_compilation_cache
    --dataset-name random --num-prompts 32 --random-input-len 64 --random-range-ratio 0
    --random-output-len 64)
if [ "$DRY_RUN" = 1 ]; then     # the bundled model, a few tokens, the same flags otherwise
    THROUGHPUT=(python3 -m jaxpaged.benchmarks.throughput --tokenizer configs/tokenizers/llama2
        --load-format dummy --max-model-len 128 --max-num-seqs 4 --max-num-batched-tokens 64
        --num-gpu-blocks-override 64 --compilation-cache-dir "$DRY_CACHE"
        --dataset-name random --num-prompts 2 --random-input-len 8 --random-range-ratio 0
        --random-output-len 4)
fi
run_step tp_pallas "$T_TP_PALLAS" "${THROUGHPUT[@]}" --attention-backend pallas \
    --output-json "$OUT/throughput_pallas.json"
run_step tp_xla "$T_TP_XLA" "${THROUGHPUT[@]}" --attention-backend xla \
    --output-json "$OUT/throughput_xla.json"

cat "$OUT/summary.txt"
