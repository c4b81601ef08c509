"""Measurements a suite adds to each finished run (`Suite.extra_metrics` names one)."""
from __future__ import annotations

import statistics

import jax.numpy as jnp


def decode(config, workdir: str) -> dict:
  """Greedy decode speed of the trained model (batch 1, 16-token prompt, 64 new tokens, compile
  excluded, median of 3) and the KV cache's bytes per token: 2·layers·n_kv·head_dim·bytes."""
  from mllm.generate import generate_tokens, load_run
  from mllm.layers import resolved_head_dim
  model, _, _, saved = load_run(workdir, config)
  m = saved.model
  prompt = [list(range(1, 17))]
  timings, rates = {}, []
  generate_tokens(model, prompt, max_new_tokens=64)  # compiles
  for _ in range(3):
    generate_tokens(model, prompt, max_new_tokens=64, timings=timings)
    rates.append(64 / timings['decode_s'])
  kv_bytes = 2 * m.n_layers * m.n_kv_heads * resolved_head_dim(m) * jnp.dtype(m.dtype).itemsize
  return {'decode_tok_s': statistics.median(rates), 'kv_bytes_per_token': kv_bytes}


def moe_load(config, workdir: str) -> dict:
  """Expert load over the last 10% of the logged train steps, from metrics.jsonl: coefficient of
  variation and max/mean of the tokens per expert (averaged over MoE layers), drop rate, and dead
  experts (under 1% of the mean load, summed over layers). A dense run reports nothing."""
  import os

  import numpy as np

  from mllm.train.metrics import read_metrics
  records = [r for r in read_metrics(os.path.join(workdir, 'metrics.jsonl'))
             if r['split'] == 'train']
  records = records[-max(1, len(records) // 10):]
  layers = sorted({k for r in records for k in r if k.endswith('/tokens_per_expert')})
  if not layers:
    return {}
  cv, peak, dead = [], [], 0
  for key in layers:
    load = np.mean([r[key] for r in records if key in r], axis=0)
    cv.append(float(load.std() / load.mean()))
    peak.append(float(load.max() / load.mean()))
    dead += int((load < 0.01 * load.mean()).sum())
  drops = [r['moe/drop_rate'] for r in records if 'moe/drop_rate' in r]
  return {'load_cv': float(np.mean(cv)), 'max_over_mean': float(np.mean(peak)),
          'dead_experts': dead, 'drop_rate': float(np.mean(drops)) if drops else 0.0}


EXTRAPOLATION_FACTORS = (2, 4, 8, 16)
EVAL_TOKENS = 32_768  # per length: the batch shrinks as the context grows


def extrapolation(config, workdir: str) -> dict:
  """Validation loss at k times the training context (k in EXTRAPOLATION_FACTORS), the trained
  parameters unchanged: `evaluate` with data.seq_len = model.max_seq_len = k·L, as
  `launch.py --mode=eval --config.data.seq_len=... --config.model.max_seq_len=...` does. Learned
  positions have no entry past their table: NaN (n/a)."""
  import math

  from ml_collections import config_dict

  from mllm.config import set_path, validate
  from mllm.train import evaluate
  length = config.data.seq_len
  out = {}
  for k in EXTRAPOLATION_FACTORS:
    if config.model.position.kind == 'learned':
      out[f'loss_at_{k}L'] = math.nan
      continue
    longer = config_dict.ConfigDict(config.to_dict())
    for path, value in {'data.seq_len': k * length, 'model.max_seq_len': k * length,
                        'data.batch_size': max(1, EVAL_TOKENS // (k * length)),
                        'train.eval_batches': 1}.items():
      set_path(longer, path, value)
    validate(longer)
    out[f'loss_at_{k}L'] = evaluate(longer, workdir)['loss']
  return out


MEASURES = {'decode': decode, 'moe_load': moe_load, 'extrapolation': extrapolation}
