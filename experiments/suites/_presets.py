"""Run sizes shared by the language-model suites (dotted overrides of configs/base.py)."""

# Seconds per run on 2 cores: the runner's tests.
TINY = {
  'model.d_model': 32,
  'model.n_layers': 1,
  'model.n_heads': 2,
  'model.n_kv_heads': 2,
  'model.max_seq_len': 32,
  'data.seq_len': 32,
  'data.batch_size': 4,
  'train.steps': 6,
  'train.warmup_steps': 1,
  'train.eval_every': 0,
  'train.eval_batches': 2,
  'train.log_every': 1,
  'train.checkpoint_every': 1000,
  'train.tensorboard': False,
}

# d_model 128 (8 heads of 16), 4 layers, 500 steps of 16 × 128 tokens (1 M tokens) on the
# built-in corpus: about 2.5 minutes a run on 2 cores (230 ms a step), so a 9-variant suite with 3
# seeds stays under 90 minutes.
CPU = {
  'model.d_model': 128,
  'model.max_seq_len': 128,
  'data.seq_len': 128,
  'data.batch_size': 16,
  'train.steps': 500,
  'train.eval_every': 0,
  'train.eval_batches': 32,
  'train.tensorboard': False,
}

# ~125 M parameters (the GPU measurement plan asks for one suite within 10 minutes); not run on a GPU
# yet: benchmarks/results/gpu-h200.md.
GPU = {
  'model.d_model': 768,
  'model.n_layers': 12,
  'model.n_heads': 12,
  'model.n_kv_heads': 12,
  'model.max_seq_len': 1024,
  'data.seq_len': 1024,
  'data.batch_size': 32,
  'model.dtype': 'bfloat16',
  'train.steps': 2000,
  'train.eval_batches': 32,
}

PRESETS = {'tiny': TINY, 'cpu': CPU, 'gpu': GPU}

# The cpu preset's FFN for the tables first run after `ffn_4m` (the headline `positions_4m` and the
# suites of the 2024-26 choices): GELU, the best row of both FFN tables at this size under the
# preset's fan_in init (which `init_gelu` chose for a GELU model): `ffn` at 1 M tokens, GELU −0.042
# against ReLU and SwiGLU +0.006; `ffn_4m` at 4 M tokens (10 seeds), GELU −0.035 [−0.062, −0.009]
# and SwiGLU +0.156. The tables committed before keep configs/base.py's SwiGLU (a run's identity
# is its whole config). Not for a suite whose rows choose the FFN: a preset's dotted key overrides
# a row's choice (tests/test_experiments.py checks that no such suite takes it).
CPU_FFN = {'model.ffn.kind': 'gelu'}
PRESETS_CPU_GELU = {**PRESETS, 'cpu': {**CPU, **CPU_FFN}}
