"""Measurements a suite adds to each finished run (`Suite.extra_metrics` names one, or several
joined by '+': 'layer_grad_norms+decode')."""

from __future__ import annotations

import statistics

import jax.numpy as jnp

from mllm.paths import RunDir


def decode(config, workdir: str) -> dict:
  """Greedy decode speed of the trained model (batch 1, 16-token prompt, 64 new tokens, compile
  excluded, median of 3) and the KV cache's bytes per token: layers·(what a layer keeps of a
  token: 2·n_kv·head_dim under MHA / GQA, d_c + d_R under MLA)·bytes."""
  from mllm.generation import generate_tokens, load_run
  from mllm.layers.attention import ATTENTIONS

  model, _, _, saved = load_run(workdir, config)
  m = saved.model
  prompt = [list(range(1, 17))]
  timings, rates = {}, []
  generate_tokens(model, prompt, max_new_tokens=64)  # compiles
  for _ in range(3):
    generate_tokens(model, prompt, max_new_tokens=64, timings=timings)
    rates.append(64 / timings['decode_s'])
  per_layer = sum(heads * dims for heads, dims in ATTENTIONS[m.attention.kind].cache_dims(m))
  kv_bytes = m.n_layers * per_layer * jnp.dtype(m.dtype).itemsize
  return {'decode_tok_s': statistics.median(rates), 'kv_bytes_per_token': kv_bytes}


def moe_load(config, workdir: str) -> dict:
  """Expert load over the last 10% of the logged train steps, from metrics.jsonl: coefficient of
  variation and max/mean of the tokens per expert (averaged over MoE layers), drop rate, and dead
  experts (under 1% of the mean load, summed over layers). A dense run reports nothing."""

  import numpy as np

  from mllm.train.metrics import read_metrics

  records = [r for r in read_metrics(RunDir(workdir).metrics) if r['split'] == 'train']
  records = records[-max(1, len(records) // 10) :]
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
  return {
    'load_cv': float(np.mean(cv)),
    'max_over_mean': float(np.mean(peak)),
    'dead_experts': dead,
    'drop_rate': float(np.mean(drops)) if drops else 0.0,
  }


EVAL_TOKENS = 32_768  # per length: the batch shrinks as the context grows


def base_length(config) -> int:
  """The context L the lengths are multiples of: the pre-training context a RoPE scaling names
  (position.rope.original_max_len), else the run's own data.seq_len."""
  return config.model.position.rope.original_max_len or config.data.seq_len


def loss_at_lengths(config, workdir: str, factors) -> dict:
  """Validation loss at k·L for k in `factors` (L = base_length), the trained parameters
  unchanged: `evaluate` with data.seq_len = model.max_seq_len = k·L, as `launch.py --mode=eval
  --config.data.seq_len=... --config.model.max_seq_len=...` does. Learned positions have no entry
  past their table: NaN (n/a)."""
  import math

  from ml_collections import config_dict

  from mllm.config import load_config
  from mllm.train import evaluate

  length = base_length(config)
  out = {}
  for k in factors:
    if config.model.position.kind == 'learned' and k * length > config.model.max_seq_len:
      out[f'loss_at_{k}L'] = math.nan
      continue
    longer = load_config(
      config_dict.ConfigDict(config.to_dict()),
      {
        'data.seq_len': k * length,
        'model.max_seq_len': k * length,
        'data.batch_size': max(1, EVAL_TOKENS // (k * length)),
        'train.eval_batches': 1,
      },
    )
    out[f'loss_at_{k}L'] = evaluate(longer, workdir)['loss']
  return out


def extrapolation(config, workdir: str) -> dict:
  """The ALiBi paper's test: loss at 2, 4, 8 and 16 times the training context."""
  return loss_at_lengths(config, workdir, (2, 4, 8, 16))


def context_extension(config, workdir: str) -> dict:
  """The PI paper's test: loss at 1, 2, 4 and 8 times the pre-training context."""
  return loss_at_lengths(config, workdir, (1, 2, 4, 8))


GRAD_BATCHES = 4


def _ffn_grad_norms(net, batches) -> list[float]:
  """‖∂loss/∂W_ffn‖ per layer (all of the block's FFN weights), mean over `batches`."""
  import jax
  import numpy as np
  import optax
  from flax import nnx

  graphdef, params, rest = nnx.split(net, nnx.Param, ...)

  @jax.jit
  def grads(params, rest, batch):
    def loss(params):
      logits = nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest))(batch["inputs"])
      ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jax.numpy.float32), batch['targets']
      )
      return (ce * batch['loss_mask']).sum() / batch['loss_mask'].sum()

    return jax.grad(loss)(params)

  per_batch = []
  for batch in batches:
    squares = {}
    for path, g in jax.tree_util.tree_flatten_with_path(grads(params, rest, batch))[0]:
      keys = [getattr(k, 'key', getattr(k, 'idx', None)) for k in path]
      if keys[0] != 'blocks' or 'ffn' not in keys:
        continue
      g = np.asarray(g, np.float64)
      index = next((k for k in keys[1:] if isinstance(k, int)), None)
      if index is None:  # scanned layers: one stacked array, layers on axis 0
        for i, row in enumerate(g.reshape(g.shape[0], -1)):
          squares[i] = squares.get(i, 0.0) + float((row**2).sum())
      else:
        squares[index] = squares.get(index, 0.0) + float((g**2).sum())
    per_batch.append([squares[i] ** 0.5 for i in sorted(squares)])
  return [float(x) for x in np.mean(per_batch, axis=0)]


def layer_grad_norms(config, workdir: str) -> dict:
  """Xiong et al. 2020, Fig. 3: the gradient norm of each layer's FFN weights at initialisation
  (this run's seed, before any step) and after training, on the run's first GRAD_BATCHES training
  batches. Post-LN's grow towards the output at initialisation; Pre-LN's stay level."""
  import itertools

  from mllm.data import build_data
  from mllm.generation import load_run
  from mllm.train.state import initial_model

  trained, _, _, saved = load_run(workdir, config)
  data = build_data(saved, workdir)
  batches = list(itertools.islice(data.train_iterator(), GRAD_BATCHES))
  fresh = initial_model(saved)
  fresh.eval()
  init, final = _ffn_grad_norms(fresh, batches), _ffn_grad_norms(trained, batches)
  return {
    'ffn_grad_norm_init': init,
    'ffn_grad_norm_final': final,
    'grad_ratio_init': init[-1] / init[0],
    'grad_ratio_final': final[-1] / final[0],
  }


class _Measures(dict):
  """name → measure; 'a+b' is the measure that runs a, then b, and records what both found."""

  def __missing__(self, name: str):
    if '+' not in name:
      raise KeyError(name)
    parts = [self[part] for part in name.split('+')]

    def every(config, workdir: str) -> dict:
      found = {}
      for measure in parts:
        found.update(measure(config, workdir))
      return found

    return every

  def __contains__(self, name) -> bool:
    return all(dict.__contains__(self, part) for part in str(name).split('+'))


MEASURES = _Measures(
  decode=decode,
  moe_load=moe_load,
  extrapolation=extrapolation,
  context_extension=context_extension,
  layer_grad_norms=layer_grad_norms,
)
