#!/bin/bash
# The GPU measurements (the project's GPU checklist), in phases of which two or three fit one call
# of under 10 minutes. Each step has its own time limit; the steps' logs and result files are packed
# into OUT/results.tgz as each one ends, so a step that runs out of time loses only itself.
#
#   bash benchmarks/gpu_checklist.sh OUT_DIR [SUFFIX] [PHASES]
#   bash benchmarks/gpu_checklist.sh /tmp/out h100 perf,tests,suite   # e.g. a call of ~9 minutes
#
# SUFFIX names the result files (h100, h200); PHASES is a comma list of (run in this order: the
# timed phases first, on a quiet machine)
#   perf     the 125M training step with document masking on and off, scanned and unrolled, each
#            profiled (top ops) with its compiled HLO and trace kept, and the same model trained
#            through launch.py (time to first step, MFU)
#   kernels  the Triton and Mosaic GPU kernels' tiles (benchmarks/attention_tune.py)
#   levers   the 125M step at batch 64 and on documents as long as the corpus's (no profile); the
#            training loop's step against its bare step (benchmarks/loop_overhead.py)
#   tests    the default test suite on the GPU (make test-gpu), beside the suite when both are named
#            (the whole suite took 344 s on 15 workers on an H100, 2026-11-27); TESTS_K='expr'
#            narrows it (pytest -k), e.g. TESTS_K='abort_after or worktree'.
#            On a warm machine where an earlier call's run was cut, it resumes: the tests that
#            earlier run reported (its log kept as tests-N.log) are deselected.
#   suite    a GPU suite end to end (the gpu preset, 2 variants, 1 seed, 100 steps, no lr tuning)
#   init     start-up at 12 and 24 layers, unrolled and scanned (benchmarks/init_time.py)
#   tables   the attention table (bf16, 16k tokens a batch, H 16, D 128), MoE layer, decoding
#   population  populations against sequential runs at the cpu preset's shape, K = 1, 4, 16, 64
#            (benchmarks/population.py; issue target: >= 10x sequential at K = 64)
#   ffn_suite   the whole `ffn` table (9 rows, 5 seeds, lr tuning included) at the cpu preset,
#            its runs in populations sized to the GPU's memory (--population=auto), timed end to
#            end (target: under 30 minutes); it resumes where a cut call left it (FFN_SUITE_S: the
#            limit of this call's share)
# default: tests,perf,kernels,suite (which does not fit one 10-minute call: pick).
#
# Run from the repository root on the GPU machine, with jax[cuda] and mllm's dependencies on the
# path. On the lent image (Python 3.12.3, jax 0.11.2, flax 0.12.10, pytest 9, no network) carry as
# wheels: ml-collections, grain, array-record, portpicker, tensorboardX (mllm's dependencies the
# image lacks), datasets, dill, multiprocess (tests of the parquet / HF sources), and pytest<9 with
# pytest-xdist (pyproject.toml's dev range: --dist loadgroup needs pytest 8). Not flax: the image's
# 0.12.10 matches its jax. Not ray (too large to carry): its tests are deselected here.
set -u
OUT=${1:?usage: gpu_checklist.sh OUT_DIR [SUFFIX] [PHASES]}
SUFFIX=${2:-gpu}
PHASES=${3:-tests,perf,kernels,suite}
RES=${RES:-/tmp/gpu_checklist}
PY=${PY:-python3}
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

stamp() { echo "=== $* ($(date -u +%H:%M:%S) UTC)"; }
pack() {  # atomic: the tests may end beside another step
  tar czf "$OUT/results.tgz.$BASHPID" -C "$RES" . 2>/dev/null && mv "$OUT/results.tgz.$BASHPID" "$OUT/results.tgz"
}
step() {  # step NAME LIMIT_S COMMAND...: run it under a limit, log it, keep the tail, pack
  local name=$1 limit=$2
  shift 2
  stamp "$name: start, limit ${limit}s: $*"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  stamp "$name: rc=$rc (124 = out of time) after $((SECONDS - t0)) s"
  tail -n 25 "$RES/$name.log"
  pack
}
has() { [[ ",$PHASES," == *",$1,"* ]]; }

# The 125M model of benchmarks/train_step.py (GPT-2 small's shape, Llama-style) for launch.py.
M125="--config.model.d_model=768 --config.model.n_layers=12 --config.model.n_heads=12
  --config.model.n_kv_heads=12 --config.model.vocab_size=50304 --config.model.max_seq_len=1024
  --config.data.seq_len=1024 --config.data.batch_size=32 --config.model.dtype=bfloat16"

{
  stamp "environment: phases $PHASES"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c 'import jax, flax, optax, pytest; print("jax", jax.__version__, "flax", flax.__version__,
          "optax", optax.__version__, "pytest", pytest.__version__, jax.devices())'
  git log --oneline -1 2>/dev/null || true

  if has perf; then
    # Unrolled layers, document mask on (the default: 'auto' picks for segment ids) and off, each
    # profiled (top ops from the trace); then scanned layers, and cuDNN given the dense mask.
    # The compiled programs (--hlo_dir) and the traces come back too: the scanned and unrolled
    # programs are compared, and a trace the reader cannot read is read again, on the CPU.
    # (cuDNN given the dense mask, 82 ms on the H100 of 2026-11-26: DENSE=1 runs it again.)
    step train_step ${STEP_S:-130} $PY -m benchmarks.train_step --models=125m --only=jax \
      --batch_size=32 --document_mask=both --scan_layers=off --profile_dir=/tmp/profile \
      --hlo_dir="$RES/hlo" --out="$RES/train_step-$SUFFIX.md"
    step train_step_scan ${SCAN_S:-45} $PY -m benchmarks.train_step --models=125m --only=jax \
      --batch_size=32 --document_mask=off --scan_layers=on --profile_dir=/tmp/profile \
      --hlo_dir="$RES/hlo" --out="$RES/train_step_scan-$SUFFIX.md"
    # Scanned layers k at a time (model.scan_unroll): fewer loop-carried copies, fusions across
    # the k layers of an iteration; the 21% scan gap (gpu-h100-2.md) at unroll 2, 3 and 4.
    for k in ${SCAN_UNROLLS:-2 3 4}; do
      step train_step_scan_unroll$k ${SCAN_S:-45} $PY -m benchmarks.train_step --models=125m \
        --only=jax --batch_size=32 --document_mask=off --scan_layers=on --scan_unroll=$k \
        --out="$RES/train_step_scan_unroll$k-$SUFFIX.md"
    done
    # The 125M step under glibc's own malloc (MALLOC_ARENA_MAX set: mllm.malloc leaves it), against
    # train_step's doc-mask-off row, which keeps freed memory (1.35x on a 2-core CPU; never measured
    # on a GPU host). GLIBC_AB=1 runs it.
    if [[ -n "${GLIBC_AB:-}" ]]; then
      step train_step_glibc_malloc 40 env MALLOC_ARENA_MAX=16 $PY -m benchmarks.train_step \
        --models=125m --only=jax --batch_size=32 --document_mask=off --scan_layers=off \
        --out="$RES/train_step_glibc_malloc-$SUFFIX.md"
    fi
    if [[ -n "${DENSE:-}" ]]; then
      step train_step_cudnn_dense 40 $PY -m benchmarks.train_step --models=125m --only=jax \
        --batch_size=32 --document_mask=on --impl=cudnn --out="$RES/train_step_cudnn-$SUFFIX.md"
    fi
    mkdir -p "$RES/traces"
    for f in /tmp/profile/*/plugins/profile/*/*.xplane.pb; do
      [[ -f "$f" ]] && cp "$f" "$RES/traces/$(basename "$(dirname "$(dirname "$(dirname "$(dirname "$f")")")")").xplane.pb"
    done
    pack
    # As a user runs it: launch.py, the default config family at 125M, packed documents; the
    # built-in corpus is built (BPE trained, text tokenized) on this fresh machine first.
    # Twice, the same command in two workdirs: the second reads the step from the compilation
    # cache (a different train.steps is a different program: the schedule is in the step).
    for run in launch_125m launch_125m_again; do
      step $run ${LAUNCH_S:-80} $PY launch.py --config=configs/rope_swiglu.py --workdir=/tmp/$run \
        $M125 --config.train.steps=40 --config.train.warmup_steps=4 --config.train.log_every=10 \
        --config.train.eval_every=0 --config.train.eval_batches=4 --config.train.checkpoint_every=1000
    done
  fi

  if has kernels; then
    # Mosaic GPU first: 'auto' picks it for packed documents on Hopper.
    # cuDNN is timed first at the same shape; each row prints its share of it.
    step tune_mgpu ${TUNE_MGPU_S:-40} $PY -m benchmarks.attention_tune --kernel=mgpu \
      --seq_lens=${TUNE_N:-4096} --repeats=3
    step tune_triton ${TUNE_TRITON_S:-35} $PY -m benchmarks.attention_tune \
      --seq_lens=${TUNE_N:-4096} --repeats=3
    # JAX's own Mosaic GPU attention at the same shape: what Mosaic GPU reaches (ours: forward
    # 0.75 of cuDNN, gpu-h100-3.md).
    step tune_jax_mgpu ${TUNE_JAX_S:-45} $PY -m benchmarks.attention_tune --kernel=jax_mgpu \
      --seq_lens=${TUNE_N:-4096} --mgpu_blocks=64,128 --mgpu_steps=2,3 --repeats=3
  fi

  if has tests; then
    # Deselected: Ray (not on the image), and the TPU kernels' tests (splash, pallas_tpu), which
    # only interpret there as on the CPU and take minutes. -vv: the Makefile's -q and one -v
    # cancel; one line per test keeps the failures' names when the limit cuts the run (the whole
    # run reached 47% in 170 s on 12 workers on an H100, 2026-11-26). With the suite phase too,
    # the tests run beside it (their timings are not measurements; the suite's are not either).
    # TESTS_S: this step's limit.
    # MLLM_FAILURE_LOG: each failure's traceback written as it happens (a cut run prints none).
    # Resuming a cut run on a warm machine: the tests its log reported are deselected
    # (MLLM_DESELECT, tests/conftest.py).
    : > "$RES/done.ids"
    if [[ -f "$RES/tests.log" ]]; then
      n=1; while [[ -f "$RES/tests-$n.log" ]]; do n=$((n + 1)); done
      mv "$RES/tests.log" "$RES/tests-$n.log"
      cat "$RES"/tests-*.log | grep -oE "(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) tests/[^ ]+" \
        | cut -d' ' -f2 | sort -u > "$RES/done.ids"
      echo "tests: resuming; $(wc -l < "$RES/done.ids") tests earlier runs reported are deselected"
    fi
    MLLM_DESELECT="$RES/done.ids" MLLM_FAILURE_LOG="$RES/failures.log" step tests ${TESTS_S:-360} \
      make test-gpu GPU_PYTHON=$PY GPU_WORKERS=${TEST_WORKERS:-14} \
      GPU_ARGS="-vv -p no:cacheprovider -k 'not ray and not splash and not pallas_tpu ${TESTS_K:+and ($TESTS_K)}'" &
    tests_pid=$!
  fi

  if has suite; then  # the runner, checkpoints and report on a GPU
    step suite ${SUITE_S:-150} $PY -m experiments ffn --preset=gpu --seeds=1 --no-tune_lr \
      --variants=relu,swiglu --steps=${SUITE_STEPS:-100} --out="$RES/suite"
    rm -rf "$RES"/suite/*/runs  # checkpoints: not needed back
    pack
  fi

  if has tests; then
    wait "$tests_pid"
    pkill -f "pytest" 2>/dev/null; sleep 2  # workers a cut run left behind would hold the GPU
    grep -E "(FAILED|ERROR) " "$RES/tests.log" | sed 's/^.*\(FAILED\|ERROR\) /\1 /' | sort -u | head -40
    grep -cE " PASSED" "$RES/tests.log" | sed 's/^/tests passed: /'
    head -c 6000 "$RES/failures.log" 2>/dev/null
  fi

  if has levers; then  # MFU levers the 11-27 profile suggests (gpu-h100-2.md), quiet machine
    step train_step_batch64 ${LEVER_S:-50} $PY -m benchmarks.train_step --models=125m \
      --only=jax --batch_size=64 --document_mask=on --out="$RES/train_step_b64-$SUFFIX.md"
    # Documents as long as the built-in corpus's (~4,500 tokens: nearly one causal segment a row),
    # where launch.py's step was 77-79 ms against the benchmark's 69: the Mosaic GPU kernel on
    # long segments?
    step train_step_long_docs ${LONG_S:-45} $PY -m benchmarks.train_step --models=125m --only=jax \
      --batch_size=32 --document_mask=on --doc_len_mean=4500 --out="$RES/train_step_long-$SUFFIX.md"
    # The loop's step against its bare jitted step at the cpu preset (a few ms a step on a GPU:
    # where the host's work between steps shows). benchmarks/results/loop-cpu.md has the CPU's.
    step loop_overhead ${LOOP_S:-60} $PY benchmarks/loop_overhead.py --steps=200 --repeats=3 \
      --out="$RES/loop-$SUFFIX.md"
  fi

  if has init; then  # start-up at 12 and 24 layers (the CPU's numbers: init_time-cpu.md)
    step init_time 45 $PY -m benchmarks.init_time --out="$RES/init_time-$SUFFIX.md"
  fi

  if has tables; then
    step attention 160 $PY -m benchmarks.attention --dtype=bfloat16 --tokens_per_batch=16384 \
      --heads=16 --head_dim=128 --causal=both --impls=xla,blockwise,pallas,pallas_mgpu,cudnn \
      --repeats=5 --time_budget_s=2 --out="$RES/attention-$SUFFIX.md"
    step moe 50 $PY -m benchmarks.moe --out_dir="$RES"
    # MoE at 125M (the checklist's item 6): a whole step, capacity against dropless dispatch.
    step train_step_moe ${MOE_S:-90} $PY -m benchmarks.train_step --models=125m_moe --only=jax \
      --batch_size=16 --document_mask=on --moe_dispatch=both --out="$RES/train_step_moe-$SUFFIX.md"
    step decode 55 $PY -m benchmarks.decode --only_125m --out="$RES/decode-$SUFFIX.md"
  fi
  if has population; then
    step population ${POPULATION_S:-240} $PY -m benchmarks.population --members=1,4,16,64,auto \
      --out="$RES/population-$SUFFIX.md"
  fi

  if has ffn_suite; then  # its runs stay in $RES between calls on a warm machine: it resumes
    step ffn_suite ${FFN_SUITE_S:-540} $PY -m experiments ffn --preset=cpu --tune_lr \
      --out="$RES/ffn_suite"
    grep -h "^Cost" "$RES"/ffn_suite/ffn/results.md 2>/dev/null
    tar czf "$OUT/ffn_suite.tgz" -C "$RES/ffn_suite" --exclude=runs . 2>/dev/null
  fi
  stamp done
} 2>&1 | tee "$OUT/run.log"
