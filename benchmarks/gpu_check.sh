#!/usr/bin/env bash
# The GPU check: run on a lent NVIDIA GPU (the `device` tool) in under 8 minutes.
#   1. kernel tests compiled for the GPU (no interpret mode there) against the jnp reference,
#      and the engine on --attention-backend pallas against the bundled model's references;
#   2. the paged-attention microbenchmark (pallas vs xla, Llama-3-8B attention shapes);
#   3. W1-style offline throughput of a Llama-3-8B-shaped model (configs/models/llama3-8b-shape,
#      dummy bfloat16 weights) on --attention-backend pallas, then xla (compilation excluded).
# The timeouts add up to under 8 minutes.
# Uses the machine's own python3 (it has jax with CUDA, flax, transformers, safetensors);
# nothing is installed. Results go to $OUT (or /tmp/gpu_check): record them in docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
    2>&1 | tee "$OUT/versions.txt"

timeout 120 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_paged_attention.py tests/kernels/test_kv_write.py \
    "tests/test_attention_backends.py::test_engine_on_pallas_reproduces_reference_greedy_outputs" \
    2>&1 | tee "$OUT/tests.log"

timeout 120 python3 benchmarks/kernels/paged_attention.py --mode decode \
    --batch 1 64 256 --context 512 4096 --output-json "$OUT/decode.json" \
    2>&1 | tee "$OUT/bench_decode.log"
timeout 50 python3 benchmarks/kernels/paged_attention.py --mode mixed \
    --batch 8 64 --context 2048 4096 --output-json "$OUT/mixed.json" \
    2>&1 | tee "$OUT/bench_mixed.log"

for backend in pallas xla; do
    timeout 90 python3 -m jaxpaged.benchmarks.throughput --model configs/models/llama3-8b-shape \
        --tokenizer configs/tokenizers/llama2 --load-format dummy --dtype bfloat16 \
        --attention-backend "$backend" --max-model-len 1024 --max-num-seqs 64 \
        --max-num-batched-tokens 2048 --dataset-name random --num-prompts 64 \
        --random-input-len 144 --random-range-ratio 0.75 --random-output-len 64 \
        --output-json "$OUT/throughput_$backend.json" 2>&1 | tee "$OUT/throughput_$backend.log"
done
