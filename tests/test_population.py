"""Populations (mllm/train/population.py): K runs of one shape as one vmapped program. Each member
against its solo run: the same initial state, then step by step the same losses and parameters
(members differing in seed and in learning rate), with dropout drawing from each member's seed."""

from __future__ import annotations

import jax
import numpy as np
from conftest import tiny_config

from mllm.train.population import Member, Population, unstack
from mllm.train.sharding import make_mesh
from mllm.train.state import setup
from mllm.train.step import make_train_step, synthetic_batch

STEPS = 6
MEMBERS = [Member(0, 3e-3), Member(1, 1e-2)]  # another seed and another rate


def batches(config, members, step):
  """Each member's own batch at `step` ([K, B, T] stacked, and one per member)."""
  own = [
    synthetic_batch(config, np.random.default_rng([m.seed, step, i])) for i, m in enumerate(members)
  ]
  return jax.tree.map(lambda *xs: np.stack(xs), *own), own


def test_each_member_computes_what_its_solo_run_computes():
  """Measured (2-core CPU, 2026-11-29): the first step's loss 1 ulp off its solo run's (2.4e-7 at
  a loss of 3.5: the vmapped forward sums in another order), 2 ulps after 6 steps, parameters
  within 6e-8; the learning rates bitwise equal."""
  config = tiny_config(model__dropout=0.1, train__warmup_steps=2, train__steps=STEPS)
  mesh = make_mesh(config.mesh)
  population = Population(config, MEMBERS, mesh)
  states = population.init()
  solos = []
  for k, member in enumerate(MEMBERS):
    train_setup, init = setup(member.config(config), mesh)
    solo = init()
    for a, b in zip(jax.tree.leaves(unstack(states, k)), jax.tree.leaves(solo)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same initial state
    solos.append((make_train_step(train_setup), solo))
  worst = 0.0
  for step in range(STEPS):
    stacked, own = batches(config, MEMBERS, step)
    states, metrics = population.step(states, stacked)
    for k, (solo_step, solo) in enumerate(solos):
      solo, solo_metrics = solo_step(solo, own[k])
      solos[k] = (solo_step, solo)
      np.testing.assert_array_equal(metrics['learning_rate'][k], solo_metrics['learning_rate'])
      worst = max(worst, abs(float(metrics['loss'][k]) - float(solo_metrics['loss'])))
  for k, (_, solo) in enumerate(solos):
    for a, b in zip(jax.tree.leaves(unstack(states, k)), jax.tree.leaves(solo)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert worst < 1e-6
  assert abs(float(metrics['loss'][0]) - float(metrics['loss'][1])) > 1e-3  # two runs, not one
