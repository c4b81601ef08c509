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

from mllm.config import load_config
from mllm.layers.parametrization import learning_rate_factors
from mllm.train.optimizer import learning_rate_schedule, make_optimizer
from mllm.train.state import TrainSetup, TrainState, setup, split_trained
from mllm.train.step import StepParts


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
    return stack([self._init(m.seed) for m in self.members])


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
