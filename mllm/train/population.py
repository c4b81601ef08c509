"""Populations: K runs of one shape trained as one compiled program.

A suite's rows are many runs that share every shape: a row's seeds, its learning-rate grid. Vmapped
over a leading member axis (PureJaxRL's whole-run vmap, Lu et al. 2022), one step updates all K
at about the cost of one while an accelerator is not yet full; each member is still its own run:

    member k = (seed_k, learning_rate_k)   its initial parameters, dropout and data order come
                                           from seed_k, its schedule peaks at learning_rate_k

and computes what its solo run computes: the same initial state (the run's initializer, one
compiled program, called with each member's seed, then stacked), the same schedule (evaluated per
member outside the vmap, with the solo run's constants), the same update (`StepParts.step` with an
optimizer whose rate is that value). tests/test_population.py measures how closely (the vmapped
forward may sum in another order).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mllm.config import load_config
from mllm.layers.parametrization import learning_rate_factors
from mllm.train.optimizer import learning_rate_schedule, make_optimizer
from mllm.train.state import TrainSetup, TrainState, setup, split_trained
from mllm.train.step import StepParts, synthetic_batch

AUTO = 'auto'  # a population's size chosen from the device's memory (fit_population)
MOST_MEMBERS = 64  # auto never goes above: past it a small model's step is no longer launch-bound


@dataclasses.dataclass(frozen=True)
class Member:
  """One run of a population: what differs from the others."""

  seed: int
  learning_rate: float

  def config(self, config):
    """The solo run's config: `config` with this member's seed and rate."""
    return load_config(config, {'seed': self.seed, 'train.learning_rate': self.learning_rate})


def stack(trees: list) -> object:
  """K trees of one structure as one tree with a leading member axis."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree, k: int) -> object:
  """Member k's tree from a stacked one."""
  return jax.tree.map(lambda x: x[k], tree)


class Population:
  """K members (`Member`) of the run `config` describes, on `mesh`: `init()` → the stacked
  state, `step(states, batches, alive)` → (states, metrics), each with a leading member axis; a
  member's batches are its own ([K, B, T] inputs); a member not `alive` ([K] bool) keeps its
  state (a diverged member, frozen while the others go on)."""

  def __init__(self, config, members: list[Member], mesh, made=None):
    """`made`: (TrainSetup, init) that `setup` already returned for the first member's config
    (a loop that opened the members' runs has them), else made here."""
    if not members:
      raise ValueError('a population needs at least one member')
    self.members = tuple(members)
    self.configs = [m.config(config) for m in members]
    # One structure for all (the members share every shape); each member its own schedule.
    self.setup, self._init = made or setup(self.configs[0], mesh)
    scale = learning_rate_factors(self.configs[0].model)[0]
    schedules = [learning_rate_schedule(c.train, scale) for c in self.configs]
    self.step = _population_step(self.setup, schedules)

  def init(self) -> TrainState:
    """Every member's state at step 0, drawn as its solo run draws it, stacked."""
    return self.stacked([self._init(m.seed) for m in self.members])

  def stacked(self, states: list) -> TrainState:
    """The members' states as one, on the mesh as a solo run's are (each device holds its
    shard of every member: the member axis is not split)."""
    return jax.device_put(stack(states), self.shardings())

  def shardings(self):
    """The stacked state's shardings: each leaf's solo sharding with a member axis in front."""
    return jax.tree.map(
      lambda x: NamedSharding(x.sharding.mesh, PartitionSpec(None, *x.sharding.spec)),
      self.setup.abstract_state,
    )


def _population_step(train_setup: TrainSetup, schedules: list):
  """The jitted, vmapped step of members of `train_setup`'s shape, member k's learning rate by
  step `schedules[k]`."""
  parts = StepParts(train_setup)  # the switches of the shape, shared by every member
  t = train_setup.config.train
  trained = split_trained(train_setup.abstract_params)[0]
  rates = learning_rate_factors(train_setup.config.model)

  def member_step(state, batch, rate):
    # The member's optimizer: its solo run's, at the rate its own schedule gave for this step.
    tx, _ = make_optimizer(t, trained, rates, schedule=lambda count: rate)
    return parts.step(state, batch, tx, lambda count: rate)

  def step(states: TrainState, batches, alive_K) -> tuple[TrainState, dict]:
    rates_K = jnp.stack([schedule(states['step'][k]) for k, schedule in enumerate(schedules)])
    new, metrics = jax.vmap(member_step)(states, batches, rates_K)

    def kept(new_x, old_x):  # a frozen member's arrays stay as they were
      return jnp.where(alive_K.reshape((-1,) + (1,) * (new_x.ndim - 1)), new_x, old_x)

    return jax.tree.map(kept, new, states), metrics

  return jax.jit(step, donate_argnums=0)


def step_bytes(population: Population, states=None, batches=None) -> int:
  """Device bytes `population`'s step needs, as XLA's memory analysis of the compiled step
  reports them: arguments and outputs (the donated state counted once) and temporaries, per
  device. Compiles the step for `states` and `batches` (by default their shapes: nothing is
  allocated or run)."""
  k, config = len(population.members), population.setup.config
  if states is None:
    states = jax.tree.map(
      lambda x, sharding: jax.ShapeDtypeStruct((k, *x.shape), x.dtype, sharding=sharding),
      population.setup.abstract_state,
      population.shardings(),
    )
  if batches is None:
    batches = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((k, *x.shape), x.dtype), synthetic_batch(config)
    )
  alive = jax.ShapeDtypeStruct((k,), jnp.bool_)
  memory = population.step.lower(states, batches, alive).compile().memory_analysis()
  return (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
  )


def fit_population(
  config, mesh, budget_bytes: int, most: int = MOST_MEMBERS, bytes_of=None
) -> tuple[int, int]:
  """(K, its step's bytes): the members of `config`'s shape whose step fits in `budget_bytes`,
  up to `most`. K comes from the bytes at 1 and 2 members (a fixed part and a member's share:
  `bytes_of(k)`, by default step_bytes), then is compiled to confirm it fits, shrunk in
  proportion until it does. A step of one member that does not fit is a ValueError."""
  if bytes_of is None:
    made = setup(config, mesh)

    def bytes_of(k):
      members = [Member(seed, config.train.learning_rate) for seed in range(k)]
      return step_bytes(Population(config, members, mesh, made))

  measured = {1: bytes_of(1)}
  if measured[1] > budget_bytes:
    raise ValueError(
      f'one run of this shape needs {measured[1] / 2**20:,.1f} MiB a step; the budget is '
      f'{budget_bytes / 2**20:,.1f} MiB'
    )
  if most == 1:
    return 1, measured[1]
  measured[2] = bytes_of(2)
  share = max(measured[2] - measured[1], 1)
  k = int(min(most, max(1, (budget_bytes - (measured[1] - share)) // share)))
  while True:
    if k not in measured:
      measured[k] = bytes_of(k)
    if measured[k] <= budget_bytes:
      return k, measured[k]
    k = max(1, min(k - 1, int(k * budget_bytes / measured[k])))


def device_budget(fraction: float = 0.75) -> int | None:
  """Bytes a population may take on this process's first device: `fraction` of what its
  allocator can still hand out (the rest for evaluation and the data). None on a CPU, where a
  population is no faster than its runs one after another (benchmarks/results/population-cpu.md),
  or where the device does not report its memory."""
  device = jax.local_devices()[0]
  if device.platform == 'cpu':
    return None
  stats = device.memory_stats() or {}
  if 'bytes_limit' not in stats:
    return None
  return int(fraction * (stats['bytes_limit'] - stats.get('bytes_in_use', 0)))
