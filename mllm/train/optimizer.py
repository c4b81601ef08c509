"""The learning-rate schedule (warm-up, then a decay) and the update: global-norm clipping, then
the optimizer `train.optimizer.kind` names (mllm/optimizers.py: AdamW, Muon)."""

from __future__ import annotations

import jax
import optax
from flax import nnx

from mllm.optimizers import OPTIMIZERS
from mllm.variant_config import settings_of


def learning_rate_schedule(t) -> optax.Schedule:
  """Linear warm-up to `t.learning_rate`, then the `t.schedule` decay.

  Step k (counting from 0) uses the rate at k + 1, so the first update is not wasted on a zero rate
  and the last one lands on the final value.
  """
  schedule = _schedule(t)
  return lambda count: schedule(count + 1)


def _schedule(t) -> optax.Schedule:
  peak, warmup = t.learning_rate, t.warmup_steps
  floor = peak * t.min_lr_ratio
  if t.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, t.steps, end_value=floor)
  if t.schedule == 'linear':
    decay = optax.linear_schedule(peak, floor, t.steps - warmup)
  elif t.schedule == 'constant':
    decay = optax.constant_schedule(peak)
  elif t.schedule == 'inverse_sqrt':  # Vaswani et al. 2017, eq. 3: η ∝ 1/√step after warm-up

    def decay(count):
      return peak * jax.lax.rsqrt(1.0 + count / max(warmup, 1))
  else:
    raise ValueError(f'unknown schedule {t.schedule!r}')
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def make_optimizer(t, params: nnx.State) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """`optax.chain(clip_by_global_norm, <train.optimizer>)` for the `train` config section (t)."""
  schedule = learning_rate_schedule(t)
  optimizer = OPTIMIZERS[t.optimizer.kind]
  parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
  parts.append(optimizer.build(t, settings_of(optimizer, t.optimizer), schedule, params))
  return optax.chain(*parts), schedule


def trained_params(model: nnx.Module) -> nnx.State:
  """The parameters the optimizer trains (nnx.Param; not an MoE's rule-updated ExpertBias)."""
  return nnx.state(model, nnx.Param)


def describe_optimizer(t, params: nnx.State) -> str:
  """One line: the optimizer `t.optimizer` names, its settings and what it updates how."""
  optimizer = OPTIMIZERS[t.optimizer.kind]
  return optimizer.describe(t, settings_of(optimizer, t.optimizer), params)
