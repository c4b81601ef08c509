"""Validation: the metrics of a parameter set over the validation split (`run_eval`, which the
training loop calls too), and `evaluate`, which reads a run's latest checkpoint and changes
nothing in its folder."""

from __future__ import annotations

import math
import os

import jax

from mllm.checks import ConfigError, InputError
from mllm.paths import RunDir, existing_dir
from mllm.train.checkpoint import Checkpointer
from mllm.train.cluster import maybe_initialize_distributed
from mllm.train.resume import check_resumable, mismatch_error
from mllm.train.sharding import global_batch, make_mesh
from mllm.train.state import model_setup
from mllm.train.state_signature import StateMismatch
from mllm.train.step import eval_summary, make_eval_step


def run_eval(eval_step, params, data, mesh, max_batches: int) -> dict | None:
  """Validation metrics, or None when the validation split is empty."""
  batches = data.eval_batches(max_batches)
  if not len(batches):
    return None
  totals = {'loss_sum': 0.0, 'tokens': 0.0, 'bytes': 0.0, 'log_z_sum': 0.0}
  peak = -math.inf
  for batch in batches:
    out = jax.device_get(eval_step(params, global_batch(batch, mesh)))
    for k in totals:
      totals[k] += float(out[k])  # summed in float64 on the host
    peak = max(peak, float(out['max_attention_logit']))
  return eval_summary({**totals, 'max_attention_logit': peak})


def evaluate(config, workdir: str) -> dict:
  """Validation loss, perplexity and bits per byte of `workdir`'s latest checkpoint.

  Reads only the parameters (so optimizer settings may differ from the run's) and changes nothing
  in the workdir: an unreadable newest step is passed over, not moved.
  """
  from mllm.data import build_data

  maybe_initialize_distributed()
  existing_dir('--workdir', workdir, 'the workdir of a training run')
  if not os.path.isdir(RunDir(workdir).checkpoints):
    raise InputError(
      '--workdir', workdir, 'has no checkpoint to evaluate; allowed: the workdir of a training run'
    )
  mesh = make_mesh(config.mesh)
  model = model_setup(config, mesh)
  abstract_params = model.abstract_params
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    check_resumable(workdir, config, ckpt, abstract_params, params_only=True)
    step, params = ckpt.restore_latest(abstract_params, params_only=True, set_aside=False)
  except StateMismatch as err:
    raise mismatch_error(workdir, config, ckpt, err.step, err.diff, params_only=True) from None
  finally:
    ckpt.close()
  if step is None:
    raise InputError(
      '--workdir', workdir, 'has no checkpoint to evaluate; allowed: the workdir of a training run'
    )
  data = build_data(
    config, workdir, process_index=jax.process_index(), process_count=jax.process_count()
  )
  result = run_eval(
    make_eval_step(model, data.tokenizer.token_bytes),
    params,
    data,
    mesh,
    config.train.eval_batches,
  )
  if result is None:
    raise ConfigError(
      'data.val_fraction',
      config.data.val_fraction,
      'the validation split is empty; allowed: a larger fraction or more documents',
    )
  result['step'] = step
  return result
