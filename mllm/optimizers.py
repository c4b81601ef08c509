"""Optimizers (`train.optimizer.kind`), each registered under its config name; Optax's own.

    adamw  AdamW (Loshchilov & Hutter 2019, Alg. 2): θ ← θ − η·(m̂/(√v̂+ε) + λθ), the decay
           decoupled and, by default, skipping norms, biases and embeddings (GPT-3, Llama).
    muon   Muon (Jordan et al. 2024; "Muon is Scalable", Liu et al. 2025, arXiv 2502.16982):
           the hidden matrices (attention's q, k, v, out; the FFN's and the experts' matrices; the
           router) step along the orthogonalised momentum, optax.contrib.muon's Newton-Schulz;
           everything else (embeddings, the output head, position tables, norms, biases) takes
           AdamW, with the same settings as `adamw`.

A variant is a class with `build(t, settings, schedule, params)` (t: the train section, settings:
its typed record or None, params: the trained parameters' structure) returning an Optax
transformation; one with keys of its own declares them as a frozen `Settings` dataclass
(mllm/variant_config.py), its section `train.optimizer.<name>`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from mllm.checks import number
from mllm.variant_config import at_least, setting


def _names(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)


def _is_embedding(names: tuple[str, ...]) -> bool:
  # The token table (also the tied head) and the position module's tables (learned, T5 buckets).
  return names[0] in ('embed', 'position')


def map_variables(fn, params: nnx.State) -> nnx.State:
  """`params` with each Variable's value replaced by fn(path names, variable)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, var: var.replace(fn(_names(path), var)),
    params,
    is_leaf=lambda x: isinstance(x, nnx.Variable),
  )


def hidden_matrix_multipliers(params: nnx.State, factor: float) -> nnx.State:
  """`factor` on each hidden matrix (those Muon would orthogonalise: `muon_dimensions`), 1 on the
  rest: µP's per-parameter rate multipliers (mllm/layers/parametrization.py)."""
  return map_variables(
    lambda names, var: factor if muon_dimensions(names, var) is not None else 1.0, params
  )


def weight_decay_mask(params: nnx.State, t) -> nnx.State:
  """True where the decoupled weight decay applies (t: the train section)."""

  def decays(names, var) -> bool:
    if not t.decay_embeddings and _is_embedding(names):
      return False
    gain = names[-1] in ('bias', 'sinks') or any('norm' in n or n == 'value_mix' for n in names)
    return t.decay_norms_and_biases or not gain

  return map_variables(decays, params)


def _sizes(params: nnx.State, which) -> tuple[int, int]:
  """(how many parameters `which(names, var)` picks, their total size)."""
  picked = jax.tree.leaves(map_variables(lambda n, v: bool(which(n, v)), params))
  sizes = [math.prod(leaf.shape) for leaf in jax.tree.leaves(params)]
  return sum(picked), sum(size for size, p in zip(sizes, picked, strict=True) if p)


def _decay_text(t, params: nnx.State) -> str:
  decayed = jax.tree.leaves(weight_decay_mask(params, t))
  return f'decay {t.weight_decay:g} on {sum(decayed)} of {len(decayed)} tensors'


class AdamW:
  """optax.adamw with train.b1, b2, eps, weight_decay and the decay mask."""

  @staticmethod
  def describe(t, settings, params: nnx.State) -> str:
    del settings
    return f'adamw (b1 {t.b1:g}, b2 {t.b2:g}, eps {t.eps:g}, {_decay_text(t, params)})'

  @staticmethod
  def build(t, settings, schedule, params: nnx.State) -> optax.GradientTransformation:
    del settings
    return optax.adamw(
      schedule,
      b1=t.b1,
      b2=t.b2,
      eps=t.eps,
      weight_decay=t.weight_decay,
      mask=weight_decay_mask(params, t),
    )


# Logical axes (mllm/train/sharding.py) that make a parameter a table or a vector, not a hidden
# matrix: Muon leaves them to AdamW (Jordan et al. 2024: embeddings and the head stay on AdamW).
_NOT_MATRIX_AXES = ('vocab', 'positions', 'relpos_buckets', 'norm', 'value_mix')


def muon_dimensions(names: tuple[str, ...], var: nnx.Variable) -> MuonDimensionNumbers | None:
  """How Muon sees a parameter as a matrix (x W = y: its reduction and output axes), or None if it
  is not a hidden matrix. Axes a layer scan stacks in front, and the experts' axis, are batch
  axes (each layer's, each expert's matrix is orthogonalised alone). A projection into the
  residual stream (out, down: its last axis 'embed') reduces over all its other axes; any other
  reduces over its first (q, k, v: 'embed' → heads × head_dim, one d × d matrix)."""
  axes_names = var.get_metadata().get('logical_axes') or ()
  lead = len(var.get_value().shape) - len(axes_names)
  axes = [(lead + i, n) for i, n in enumerate(axes_names) if n != 'expert']
  if names[-1] == 'bias' or len(axes) < 2 or any(n in _NOT_MATRIX_AXES for _, n in axes):
    return None
  if axes[-1][1] == 'embed':
    return MuonDimensionNumbers(tuple(a for a, _ in axes[:-1]), axes[-1][0])
  return MuonDimensionNumbers(axes[0][0], tuple(a for a, _ in axes[1:]))


@dataclasses.dataclass(frozen=True)
class MuonSettings:
  beta: float = setting(
    0.95, 'momentum decay', lambda key, v: number(key, v, 0.0, 0.999999, 'a momentum decay')
  )
  ns_steps: int = setting(5, 'Newton-Schulz iterations', at_least(1))
  nesterov: bool = setting(True, 'Nesterov momentum (Muon and its AdamW part alike: optax)')
  consistent_rms: float | None = setting(
    0.2,
    "Liu et al. 2025 (eq. 4): each matrix's update scaled to this RMS, AdamW's typical one, so "
    "AdamW's rate and decay carry over; None: Jordan's √max(1, fan_out/fan_in)",
    at_least(0.0),
  )
  adam_lr_ratio: float = setting(
    1.0, "the AdamW part's rate as a multiple of train.learning_rate's schedule", at_least(0.0)
  )


class Muon:
  """optax.contrib.muon on the hidden matrices (`muon_dimensions`), AdamW (as `adamw`) on the
  rest; train.weight_decay decays both, by the same mask."""

  Settings = MuonSettings

  @staticmethod
  def describe(t, settings: MuonSettings, params: nnx.State) -> str:
    n, size = _sizes(params, muon_dimensions)
    rest = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params)) - size
    rms = (
      'Jordan scaling' if settings.consistent_rms is None else f'rms {settings.consistent_rms:g}'
    )
    return (
      f'muon on {n} matrices ({size:,} parameters; β {settings.beta:g}, {settings.ns_steps} '
      f'Newton-Schulz steps, {rms}), adamw on the rest ({rest:,}); {_decay_text(t, params)}'
    )

  @staticmethod
  def build(t, settings: MuonSettings, schedule, params: nnx.State) -> optax.GradientTransformation:
    s = settings
    dimensions = map_variables(muon_dimensions, params)
    labels = map_variables(lambda _, var: 'adam' if var.get_value() is None else 'muon', dimensions)
    muon = optax.contrib.muon(
      schedule,
      ns_steps=s.ns_steps,
      beta=s.beta,
      nesterov=s.nesterov,
      weight_decay=t.weight_decay,
      weight_decay_mask=weight_decay_mask(params, t),
      consistent_rms=s.consistent_rms,
      muon_weight_dimension_numbers=dimensions,
    )
    adam_schedule = (
      (lambda count: s.adam_lr_ratio * schedule(count)) if s.adam_lr_ratio != 1 else schedule
    )
    adam = AdamW.build(t, None, adam_schedule, params)
    return optax.partition({'muon': muon, 'adam': adam}, labels)


OPTIMIZERS = {'adamw': AdamW, 'muon': Muon}
