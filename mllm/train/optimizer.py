"""The learning-rate schedule (warm-up, then a decay) and the update: global-norm clipping, then
the optimizer `train.optimizer.kind` names (mllm/optimizers.py: AdamW, Muon)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mllm.layers.parametrization import learning_rate_scale
from mllm.optimizers import OPTIMIZERS, hidden_matrix_multipliers
from mllm.variant_config import settings_of


def learning_rate_schedule(t, scale: float = 1.0) -> optax.Schedule:
  """Linear warm-up to `t.learning_rate` × `scale` (the parametrization's, `peak_learning_rate`),
  then the `t.schedule` decay.

  Step k (counting from 0) uses the rate at k + 1, so the first update is not wasted on a zero rate
  and the last one lands on the final value.
  """
  schedule = _schedule(t, t.learning_rate * scale)
  return lambda count: schedule(count + 1)


def peak_learning_rate(config) -> float:
  """The peak rate a run trains at: train.learning_rate × the parametrization's scale (the
  standard one's lr_base_d_model / d_model)."""
  return config.train.learning_rate * learning_rate_scale(config.model)


def _schedule(t, peak: float) -> optax.Schedule:
  warmup = t.warmup_steps
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


def make_optimizer(
  t,
  params: nnx.State,
  rates: tuple[float, float] = (1.0, 1.0),
  schedule: optax.Schedule | None = None,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """`optax.chain(clip_by_global_norm, <train.optimizer>)` for the `train` config section (t),
  then each hidden matrix's rate multiplier. rates: the model's parametrization's (factor on the
  peak rate, hidden matrices' multiplier), `learning_rate_factors(model config)`: µP's (1, 1/m).
  The decoupled decay, part of the update, is multiplied with it (as µP's reference MuAdamW).
  `schedule`: the rate by step, if not `learning_rate_schedule`'s (a population member's,
  mllm/train/population.py)."""
  peak_scale, hidden_rate = rates
  schedule = schedule or learning_rate_schedule(t, peak_scale)
  optimizer = OPTIMIZERS[t.optimizer.kind]
  parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
  parts.append(optimizer.build(t, settings_of(optimizer, t.optimizer), schedule, params))
  if hidden_rate != 1.0:
    multipliers = hidden_matrix_multipliers(params, hidden_rate)
    parts.append(
      optax.stateless(lambda updates, _: jax.tree.map(jnp.multiply, updates, multipliers))
    )
  return optax.chain(*parts), schedule


def trained_params(model: nnx.Module) -> nnx.State:
  """The parameters the optimizer trains (nnx.Param; not an MoE's rule-updated ExpertBias)."""
  return nnx.state(model, nnx.Param)


def describe_optimizer(t, params: nnx.State) -> str:
  """One line: the optimizer `t.optimizer` names, its settings and what it updates how."""
  optimizer = OPTIMIZERS[t.optimizer.kind]
  return optimizer.describe(t, settings_of(optimizer, t.optimizer), params)
