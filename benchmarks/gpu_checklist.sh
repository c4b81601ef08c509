#!/bin/bash
# The GPU measurements (training step, tests, attention, MoE layer, decoding) in one call of about
# 9 minutes. Each step has its own time limit; the steps' logs and result files are packed into
# OUT/results.tgz as each one ends, so a step that runs out of time loses only itself.
#
#   bash benchmarks/gpu_checklist.sh OUT_DIR [SUFFIX]     # SUFFIX names the files: h100, h200
#
# Run from the repository root on the GPU machine, with jax[cuda] and mllm's dependencies on the
# path (on the lent image: carry ml-collections, grain, array-record, portpicker and tensorboardX as
# wheels, not flax: the image's flax 0.12.10 matches its jax 0.11.2, and 0.12.8 does not import).
# Results of 2026-11-26 and what ran out of time: benchmarks/results/gpu-h200.md.
# Items, the training step first (it printed nothing on 2026-11-26 after a cut-off pytest step):
# (3) the 125M model's training step, tokens/s and MFU; (1) the attention kernels' tests with the
# real Triton / Mosaic GPU kernels and cuDNN; (2) the attention table (bf16, 16k tokens a batch,
# H 16, D 128, causal and not); (4) MoE dispatch: capacity vs dropless vs dense; (5) decoding
# the 125M model at batch 1 and 32.
set -u
OUT=${1:?usage: gpu_checklist.sh OUT_DIR [SUFFIX]}
SUFFIX=${2:-gpu}
RES=${RES:-/tmp/gpu_checklist}
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

stamp() { echo "=== $* ($(date -u +%H:%M:%S) UTC)"; }
pack() { tar czf "$OUT/results.tgz" -C "$RES" .; }
step() {  # step NAME LIMIT_S COMMAND...: run it under a limit, log it, keep the tail, pack
  local name=$1 limit=$2
  shift 2
  stamp "$name: start, limit ${limit}s: $*"
  timeout -k 5 "$limit" "$@" > "$RES/$name.log" 2>&1
  stamp "$name: rc=$? (124 = out of time)"
  tail -n 30 "$RES/$name.log"
  pack
}

{
  stamp environment
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__,
              "optax", optax.__version__, jax.devices())'
  # (3) first, on an idle GPU.
  step train_step 100 python3 -m benchmarks.train_step --models=125m --only=jax --batch_size=64 \
    --traceback_every_s=40 \
    --out="$RES/train_step-$SUFFIX.md"
  # (1) float32 references at full precision, so that a failure is the kernel's, not TF32's. The
  # interpreted TPU kernels (splash, pallas_tpu) say nothing about a GPU and take minutes.
  JAX_DEFAULT_MATMUL_PRECISION=highest step tests 150 python3 -m pytest -q -n 8 \
    -p no:cacheprovider --timeout=100 --tb=line -rfE -W ignore::DeprecationWarning \
    -k 'not splash and not pallas_tpu' tests/test_pallas_attention.py tests/test_attention_impls.py
  step attention 160 python3 -m benchmarks.attention --dtype=bfloat16 --tokens_per_batch=16384 \
    --heads=16 --head_dim=128 --causal=both --impls=xla,blockwise,pallas,pallas_mgpu,cudnn \
    --repeats=5 --time_budget_s=2 --out="$RES/attention-$SUFFIX.md"
  # (2) the tiles, warps and stages of the Triton kernel (its backward ran at 28-38% of cuDNN's).
  step tune 100 python3 -m benchmarks.attention_tune --seq_lens=4096,16384
  step moe 50 python3 -m benchmarks.moe --out_dir="$RES"
  step decode 55 python3 -m benchmarks.decode --only_125m --out="$RES/decode-$SUFFIX.md"
  stamp done
} 2>&1 | tee "$OUT/run.log"
