"""The training state: a plain dict {step, params, opt_state, rng}, sharded on the mesh.

The NNX model is split once into a static graphdef, its saved variables (`params`: the trained
nnx.Param leaves, plus any MoE `ExpertBias`, which a rule updates and the optimizer never sees),
and the rest (dropout RNG streams, reseeded from `rng` and the step inside the jitted step, so a
resumed run draws the same dropout masks as an uninterrupted one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mllm.model import SAVED, build_model, placeholder_rest
from mllm.ops.mesh import traced_on
from mllm.train.optimizer import make_optimizer
from mllm.train.sharding import param_shardings, replicated
from mllm.validation import check_expert_axis

TrainState = (
  dict  # {'step': int32[], 'params': nnx.State, 'opt_state': optax state, 'rng': uint32[2]}
)


def split_trained(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(the nnx.Param leaves, which the optimizer trains; the rest: ExpertBias, possibly empty)."""
  return nnx.split_state(params, nnx.Param, ...)


@dataclasses.dataclass
class TrainSetup:
  """What the step functions close over: the model's structure and its optimizer."""

  config: Any
  graphdef: nnx.GraphDef
  rest: nnx.State  # non-parameter state (RNG streams); not trained, not checkpointed
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  mesh: jax.sharding.Mesh
  abstract_state: TrainState  # ShapeDtypeStructs carrying their shardings (Orbax restores onto it)
  shardings: TrainState

  def merge(self, params: nnx.State) -> nnx.Module:
    # Fresh Variables for the RNG streams in the caller's trace, so reseeding them is allowed.
    return nnx.merge(self.graphdef, params, jax.tree.map(lambda x: x, self.rest))


def initial_model(config):
  """The run's model at step 0: parameters drawn from `config.seed`, as training starts."""
  return build_model(config, rngs=nnx.Rngs(params=config.seed, dropout=config.seed + 1))


def _parts(config):
  """(abstract model, optimizer, schedule, init) of a run: what setup and abstract_state share."""
  abstract_model = nnx.eval_shape(lambda: initial_model(config))
  _, abstract_params, _ = nnx.split(abstract_model, SAVED, ...)
  tx, schedule = make_optimizer(config.train, split_trained(abstract_params)[0])

  def init() -> TrainState:
    _, params, _ = nnx.split(initial_model(config), SAVED, ...)
    return {
      'step': jnp.zeros((), jnp.int32),
      'params': params,
      'opt_state': tx.init(split_trained(params)[0]),
      'rng': jax.random.key_data(jax.random.key(config.seed)),
    }

  return abstract_model, tx, schedule, init


def abstract_state(config) -> TrainState:
  """The train state's structure (ShapeDtypeStructs, no shardings, nothing allocated)."""
  return jax.eval_shape(_parts(config)[3])


def setup(config, mesh) -> tuple[TrainSetup, Callable[[], TrainState]]:
  """Structure, optimizer and shardings of a run; returns it with a jitted initializer."""
  with traced_on(mesh):  # choices made at construction (MoE dispatch) are for the mesh's devices
    abstract_model, tx, schedule, init = _parts(config)
  if 'expert' in mesh.shape:
    check_expert_axis(config.model, mesh.shape['expert'])  # a -1 axis is known only now
  graphdef = nnx.split(abstract_model, SAVED, ...)[0]
  abstract = jax.eval_shape(init)
  p_shardings = param_shardings(abstract['params'], mesh)
  shardings = {
    'step': replicated(mesh),
    'params': p_shardings,
    # Adam's moments mirror the parameters and are sharded like them; counters are replicated.
    'opt_state': optax.tree_map_params(
      tx,
      lambda _, s: s,
      abstract['opt_state'],
      split_trained(p_shardings)[0],
      transform_non_params=lambda _: replicated(mesh),
      is_leaf=lambda x: isinstance(x, nnx.Variable),
    ),
    'rng': replicated(mesh),
  }
  abstract = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )
  train_setup = TrainSetup(
    config, graphdef, placeholder_rest(abstract_model), tx, schedule, mesh, abstract, shardings
  )
  return train_setup, jax.jit(init, out_shardings=shardings)
