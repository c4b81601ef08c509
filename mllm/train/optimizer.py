"""AdamW with a warm-up schedule, global-norm clipping and a weight-decay mask (Optax).

AdamW (Loshchilov & Hutter 2019, Alg. 2): decay is decoupled, θ ← θ − η·(m̂/(√v̂+ε) + λθ), and by
default skips norms, biases and embeddings (as GPT-3 and Llama do).
"""

from __future__ import annotations

import jax
import optax
from flax import nnx


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


def _is_embedding(names: tuple[str, ...]) -> bool:
  # The token table (also the tied head) and the position module's tables (learned, T5 buckets).
  return names[0] in ('embed', 'position')


def weight_decay_mask(params: nnx.State, t) -> nnx.State:
  """True where AdamW decays the parameter."""

  def decays(path, var):
    names = tuple(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)
    if not t.decay_embeddings and _is_embedding(names):
      return var.replace(False)
    if not t.decay_norms_and_biases and (names[-1] == 'bias' or any('norm' in n for n in names)):
      return var.replace(False)
    return var.replace(True)

  return jax.tree_util.tree_map_with_path(
    decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )


def make_optimizer(t, params: nnx.State) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """`optax.chain(clip_by_global_norm, adamw)` for the `train` config section."""
  schedule = learning_rate_schedule(t)
  parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
  parts.append(
    optax.adamw(
      schedule,
      b1=t.b1,
      b2=t.b2,
      eps=t.eps,
      weight_decay=t.weight_decay,
      mask=weight_decay_mask(params, t),
    )
  )
  return optax.chain(*parts), schedule
