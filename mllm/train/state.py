"""The training state: a plain dict {step, params, opt_state, rng}, sharded on the mesh.

Unrolled layers are initialized layer by layer (`layered_init`): one compiled program per
distinct layer shape, reused for every layer, so start-up compile time does not grow with depth.

The NNX model is split once into a static graphdef, its saved variables (`params`: the trained
nnx.Param leaves, plus any MoE `ExpertBias`, which a rule updates and the optimizer never sees),
and the rest (dropout RNG streams, reseeded from `rng` and the step inside the jitted step, so a
resumed run draws the same dropout masks as an uninterrupted one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.tree_util import DictKey

from mllm.config import require_loaded
from mllm.layers.moe import moe_layers
from mllm.layers.parametrization import learning_rate_factors
from mllm.model import CHECKPOINTED, Block, Transformer, make_stem, make_tail, rng_stand_ins
from mllm.ops.mesh import traced_on
from mllm.train.optimizer import make_optimizer
from mllm.train.sharding import opt_state_shardings, param_shardings, replicated
from mllm.validation import check_on_mesh

TrainState = (
  dict  # {'step': int32[], 'params': nnx.State, 'opt_state': optax state, 'rng': uint32[2]}
)


def split_trained(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(the nnx.Param leaves, which the optimizer trains; the rest: ExpertBias, possibly empty)."""
  return nnx.split_state(params, nnx.Param, ...)


@dataclasses.dataclass
class ModelSetup:
  """The model's structure and its parameters' shardings on a mesh: what evaluation and
  generation need to restore parameters and run the model (no optimizer)."""

  config: Any
  graphdef: nnx.GraphDef
  rest: nnx.State  # non-parameter state (RNG streams); not trained, not checkpointed
  mesh: jax.sharding.Mesh
  abstract_params: nnx.State  # ShapeDtypeStructs carrying their shardings (Orbax restores onto it)
  param_shardings: nnx.State

  def abstract_model(self) -> nnx.Module:
    """The model with ShapeDtypeStructs for parameters: its structure, to count, not to run."""
    return nnx.merge(self.graphdef, self.abstract_params, self.rest)

  def merge(self, params: nnx.State) -> nnx.Module:
    # Fresh Variables for the RNG streams in the caller's trace, so reseeding them is allowed.
    return nnx.merge(self.graphdef, params, jax.tree.map(lambda x: x, self.rest))


@dataclasses.dataclass
class TrainSetup(ModelSetup):
  """What the step functions close over: the model's structure and its optimizer."""

  tx: optax.GradientTransformation
  schedule: optax.Schedule
  abstract_state: TrainState  # as abstract_params, for the whole train state
  shardings: TrainState


def initial_model(config, seed=None):
  """The run's model at step 0: parameters drawn from `seed` (default `config.seed`), as training
  starts. `config` is a RunConfig (load_config validated it); the machine's checks are
  `check_on_mesh`."""
  require_loaded(config, 'the train state')
  seed = config.seed if seed is None else seed
  return Transformer(config.model, rngs=nnx.Rngs(params=seed, dropout=seed + 1))


class _RunParts(NamedTuple):
  """What setup and abstract_state share."""

  abstract_model: nnx.Module
  rest: nnx.State  # stand-ins for its RNG streams (model.rng_stand_ins)
  tx: optax.GradientTransformation
  schedule: Callable[[int], float]
  init: Callable[..., TrainState]  # init(seed=config.seed): the train state at step 0


def _parts(config) -> _RunParts:
  abstract_model = nnx.eval_shape(lambda: initial_model(config))
  rest = rng_stand_ins(abstract_model)
  _, abstract_params, _ = nnx.split(abstract_model, CHECKPOINTED, ...)
  rates = learning_rate_factors(config.model)  # the parametrization's (µP: 1/m on hidden matrices)
  tx, schedule = make_optimizer(config.train, split_trained(abstract_params)[0], rates)

  def init(seed=None) -> TrainState:
    _, params, _ = nnx.split(initial_model(config, seed), CHECKPOINTED, ...)
    return initial_state(params, tx, config.seed if seed is None else seed)

  return _RunParts(abstract_model, rest, tx, schedule, init)


def initial_state(params: nnx.State, tx, seed: int) -> TrainState:
  """The train state at step 0 around freshly drawn `params`: Adam's zeros, the run's RNG key."""
  return {
    'step': jnp.zeros((), jnp.int32),
    'params': params,
    'opt_state': tx.init(split_trained(params)[0]),
    'rng': jax.random.key_data(jax.random.key(seed)),
  }


def abstract_state(config) -> TrainState:
  """The train state's structure (ShapeDtypeStructs, no shardings, nothing allocated)."""
  return jax.eval_shape(_parts(config).init)


def model_setup(config, mesh) -> ModelSetup:
  """The model's structure and parameter shardings on `mesh`, built without an optimizer."""
  check_on_mesh(config, mesh)
  with traced_on(mesh):  # choices made at construction (MoE dispatch) are for the mesh's devices
    abstract_model = nnx.eval_shape(lambda: initial_model(config))
  graphdef, params, _ = nnx.split(abstract_model, CHECKPOINTED, ...)
  shardings = param_shardings(params, mesh)
  abstract = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings
  )
  return ModelSetup(config, graphdef, rng_stand_ins(abstract_model), mesh, abstract, shardings)


def setup(config, mesh) -> tuple[TrainSetup, Callable[..., TrainState]]:
  """Structure, optimizer and shardings of a run; returns it with a jitted initializer,
  `init(seed=config.seed)` (another seed: the state of the same run drawn from it, as a
  population's members are)."""
  check_on_mesh(config, mesh)
  with traced_on(mesh):  # choices made at construction (MoE dispatch) are for the mesh's devices
    abstract_model, rest, tx, schedule, init = _parts(config)
  graphdef = nnx.split(abstract_model, CHECKPOINTED, ...)[0]
  abstract = jax.eval_shape(init)
  p_shardings = param_shardings(abstract['params'], mesh)
  shardings = {
    'step': replicated(mesh),
    'params': p_shardings,
    # Moments mirror the parameters and are sharded like them; counters are replicated.
    'opt_state': opt_state_shardings(
      abstract['opt_state'],
      split_trained(abstract['params'])[0],
      split_trained(p_shardings)[0],
      mesh,
    ),
    'rng': replicated(mesh),
  }
  abstract = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
  )
  train_setup = TrainSetup(
    config=config,
    graphdef=graphdef,
    rest=rest,
    mesh=mesh,
    abstract_params=abstract['params'],
    param_shardings=p_shardings,
    tx=tx,
    schedule=schedule,
    abstract_state=abstract,
    shardings=shardings,
  )
  if config.model.scan_layers:  # one scanned layer: the whole-model program compiles quickly
    return train_setup, jax.jit(init, out_shardings=shardings)
  return train_setup, layered_init(config, tx, abstract, shardings)


def _leaves_by_path(tree, prefix: tuple = ()) -> dict:
  """{key path: leaf} of `tree`, each path under `prefix`."""
  return {prefix + path: leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _saved(built) -> nnx.State | dict[str, nnx.State]:
  """The saved variables of a module, or of a {name: module or None} dict of them."""
  if isinstance(built, dict):
    return {name: nnx.state(m, CHECKPOINTED) for name, m in built.items() if m is not None}
  return nnx.state(built, CHECKPOINTED)


def layered_init(
  config, tx, abstract: TrainState, shardings: TrainState
) -> Callable[[], TrainState]:
  """The whole-model init (`_parts`) of an unrolled model, as a few small programs.

  nnx.Rngs draws each key as fold_in(key, count), count advancing by one per draw. So the model
  is built part by part in its construction order (stem, layer 0..n-1, tail; model.Transformer),
  each part by a jitted program that takes the RNG streams' (key, count) state and returns the
  part's parameters and the advanced state: the same keys, the same parameters, bit for bit, as
  one program building everything. Every layer of one config (dense, MoE) reuses one program,
  where the whole-model program held n_layers copies for XLA to compile. The seeds are inputs,
  not constants, so XLA has nothing to constant-fold.
  """
  # The state around the parameters (step, Adam's zeros, RNG key): one program.
  not_params = {k: v for k, v in shardings.items() if k != 'params'}
  state_around = jax.jit(
    lambda params, seed: {k: initial_state(params, tx, seed)[k] for k in not_params},
    out_shardings=not_params,
  )
  cfg = config.model
  param_shardings = _leaves_by_path(shardings['params'])
  rng_graphdef = nnx.graphdef(nnx.eval_shape(lambda: nnx.Rngs(params=0, dropout=1)))

  def seeded(seeds) -> nnx.Rngs:  # nnx.Rngs(params=seed, dropout=seed + 1), as initial_model
    return nnx.Rngs(params=jax.random.key(seeds[0]), dropout=jax.random.key(seeds[1]))

  def resumed(rng_state) -> nnx.Rngs:
    return nnx.merge(rng_graphdef, rng_state)

  def part_program(build, make_rngs, arg, prefix=()):
    """(jit of arg -> (the part's saved state, the RNG state), the RNG state's structure); the
    part's arrays come out with the shardings of their place, `prefix`, in the model."""

    def run(arg):
      rngs = make_rngs(arg)
      return _saved(build(cfg, rngs=rngs)), nnx.state(rngs)

    out = jax.eval_shape(run, arg)
    out_shardings = (
      jax.tree_util.tree_map_with_path(lambda path, _: param_shardings[prefix + path], out[0]),
      shardings['step'],  # replicated
    )
    return jax.jit(run, out_shardings=out_shardings), out[1]

  def make_block(moe: bool):
    return lambda cfg, rngs: Block(cfg, moe=moe, rngs=rngs)

  def seeds_of(seed) -> np.ndarray:  # numpy: valid on every host
    return np.asarray([seed, seed + 1], np.int32)

  seeds = seeds_of(config.seed)
  stem, rng_state = part_program(make_stem, seeded, jax.ShapeDtypeStruct(seeds.shape, seeds.dtype))
  is_moe = [i in moe_layers(cfg) for i in range(cfg.n_layers)]
  layer = lambda i: (DictKey('blocks'), DictKey(i))  # noqa: E731
  # One program per distinct layer config, laid out like the first layer of that config.
  blocks = {
    moe: part_program(make_block(moe), resumed, rng_state, layer(is_moe.index(moe)))[0]
    for moe in sorted(set(is_moe))
  }
  tail = part_program(make_tail, resumed, rng_state)[0]

  def init(seed=None) -> TrainState:
    seed = config.seed if seed is None else seed
    parts, rng = stem(seeds_of(seed))
    values = _leaves_by_path(parts)
    for i, moe in enumerate(is_moe):
      block, rng = blocks[moe](rng)
      values |= _leaves_by_path(block, layer(i))
    parts, _ = tail(rng)
    values |= _leaves_by_path(parts)
    params = jax.tree_util.tree_map_with_path(lambda path, _: values[path], abstract['params'])
    return {'params': params, **state_around(params, np.int32(seed))}

  return init
