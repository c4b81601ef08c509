"""Populations (mllm/train/population.py): K runs of one shape as one vmapped program. Each member
against its solo run: the same initial state, then step by step the same losses and parameters
(members differing in seed and in learning rate), with dropout drawing from each member's seed."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from conftest import tiny_config

from mllm.train.population import Member, Population, step_bytes, unstack
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
  within 6e-8; the learning rates bitwise equal at XLA's default optimisation level, 1 ulp apart
  at make test's level 0 (the schedule compiled in another program)."""
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
    states, metrics = population.step(states, stacked, np.ones(len(MEMBERS), bool))
    for k, (solo_step, solo) in enumerate(solos):
      solo, solo_metrics = solo_step(solo, own[k])
      solos[k] = (solo_step, solo)
      np.testing.assert_allclose(metrics['learning_rate'][k], solo_metrics['learning_rate'], 2e-7)
      worst = max(worst, abs(float(metrics['loss'][k]) - float(solo_metrics['loss'])))
  for k, (_, solo) in enumerate(solos):
    for a, b in zip(jax.tree.leaves(unstack(states, k)), jax.tree.leaves(solo)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert worst < 1e-6
  assert abs(float(metrics['loss'][0]) - float(metrics['loss'][1])) > 1e-3  # two runs, not one
  # The step's memory as fit_population reads it (from shapes alone) is the compiled step's,
  # and holds at least every member's state and batch.
  held = sum(x.nbytes for x in jax.tree.leaves((states, stacked)))
  assert step_bytes(population) == step_bytes(population, states, stacked) >= held


# --- The population's loop: each member an ordinary run in its own workdir ----------------------


def _loop_config(corpus, tmp_path, **extra):
  from conftest import make_config

  return make_config(
    corpus,
    str(tmp_path / 'cache'),
    **{'train.steps': 12, 'train.checkpoint_every': 4, 'train.log_every': 1, **extra},
  )


def _records(workdir):
  from mllm.paths import RunDir
  from mllm.train.metrics import read_metrics

  return [r for r in read_metrics(RunDir(workdir).metrics)]


def test_a_stopped_population_resumes_bitwise_and_each_member_is_an_ordinary_run(corpus, tmp_path):
  from conftest import load_state

  from mllm.train.evaluation import evaluate
  from mllm.train.population_loop import train_population

  config = _loop_config(corpus, tmp_path)
  reference = [str(tmp_path / f'reference-{k}') for k in range(2)]
  done = train_population(config, MEMBERS, reference, progress=False)
  resumed = [str(tmp_path / f'resumed-{k}') for k in range(2)]
  train_population(config, MEMBERS, resumed, stop_after=6, progress=False)  # saves step 6
  again = train_population(config, MEMBERS, resumed, progress=False)
  for k, member in enumerate(MEMBERS):
    member_config = member.config(config)
    a, b = load_state(member_config, resumed[k]), load_state(member_config, reference[k])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    trained = [r['loss'] for r in _records(resumed[k]) if r['split'] == 'train']
    assert trained == [r['loss'] for r in _records(reference[k]) if r['split'] == 'train']
    assert len(trained) == 12 and trained[-1] < trained[0]
    assert again[k]['eval']['loss'] == done[k]['eval']['loss']
    # Alone, as any run: its workdir evaluates to what the population's final eval said.
    assert evaluate(member_config, reference[k])['loss'] == pytest.approx(done[k]['eval']['loss'])


def test_a_diverging_member_is_frozen_and_recorded_while_the_other_goes_on(corpus, tmp_path):
  from mllm.train.checkpoint import Checkpointer
  from mllm.train.population_loop import DIVERGED, train_population

  # Saved every step; the second member's update overflows at step 2 (measured), after a save.
  config = _loop_config(corpus, tmp_path, **{'train.steps': 6, 'train.checkpoint_every': 1})
  members = [Member(0, 3e-3), Member(1, 1e9)]
  workdirs = [str(tmp_path / f'm{k}') for k in range(2)]
  out = train_population(config, members, workdirs, progress=False)
  assert out[0]['diverged'] is None and out[0]['eval'] is not None
  bad = out[1]['diverged']
  assert bad is not None and os.path.isfile(os.path.join(workdirs[1], DIVERGED))
  steps = Checkpointer(workdirs[1], read_only=True).all_steps()
  assert steps and all(s < bad['step'] for s in steps), (steps, bad)  # nothing after it saved
  assert Checkpointer(workdirs[0], read_only=True).all_steps()[-1] == 6
  assert max(r['step'] for r in _records(workdirs[1]) if r['split'] == 'train') < bad['step']
  # Launched again, the population knows the member diverged: it stays frozen, as recorded.
  again = train_population(config, members, workdirs, progress=False)
  assert again[1]['diverged'] == bad and again[0]['diverged'] is None


def test_a_population_records_each_member_as_run_one_records_a_run(corpus, tmp_path):
  from experiments.run import read_result, run_one, run_population

  config = _loop_config(corpus, tmp_path, **{'train.steps': 6})
  configs = [m.config(config) for m in MEMBERS]
  workdirs = [str(tmp_path / f'p{k}') for k in range(2)]
  results = run_population(configs, workdirs, progress=False)
  solo = run_one(configs[0], str(tmp_path / 'solo'), progress=False)
  for k, result in enumerate(results):
    assert read_result(workdirs[k]) == result
    assert set(result) == set(solo)  # the same record: the ledger and reports see a run
    assert result['learning_rate'] == MEMBERS[k].learning_rate and result['steps'] == 6
  assert results[0]['eval_loss'] == pytest.approx(solo['eval_loss'], abs=1e-5)
  assert results[0]['curve']['step'] == solo['curve']['step']
  other = MEMBERS[1].config(_loop_config(corpus, tmp_path, **{'model.n_layers': 1}))
  with pytest.raises(ValueError, match=r'^model.n_layers=1: the runs of a population differ'):
    run_population([configs[0], other], workdirs, progress=False)


# --- Sizing a population to the device's memory -----------------------------------------------


def test_the_fitted_population_is_the_largest_that_fits_its_budget():
  """fit_population's search on stand-in memory curves (no compile): a linear one gives the
  largest K under the budget at once; one growing faster than its first two points say is
  shrunk until it fits; `most` caps K; one member over the budget is a one-line error."""
  from mllm.train.population import fit_population

  config, mesh = tiny_config(), None
  asked = []

  def linear(k):
    asked.append(k)
    return 100 + 10 * k

  assert fit_population(config, mesh, 175, bytes_of=linear) == (7, 170)
  assert sorted(set(asked)) == [1, 2, 7]  # the guess confirmed with one more compile

  def growing(k):  # above the line through its first two points
    return 100 + 10 * k + k * k

  k, used = fit_population(config, mesh, 300, bytes_of=growing)
  assert used <= 300 and growing(k + 1) > 300 - 60  # fits, and not far below what would
  assert fit_population(config, mesh, 10**9, most=8, bytes_of=linear) == (8, 180)
  assert fit_population(config, mesh, 10**9, most=1, bytes_of=linear) == (1, 110)
  with pytest.raises(ValueError, match=r'^one run of this shape needs 0.0 MiB a step; the budget'):
    fit_population(config, mesh, 50, bytes_of=linear)


def test_a_cpu_has_no_budget_for_populations():
  """On a CPU, populations gain nothing (benchmarks/results/population-cpu.md): no budget, so
  --population=auto trains runs one by one."""
  from mllm.train.population import device_budget

  assert jax.local_devices()[0].platform == 'cpu'
  assert device_budget() is None
