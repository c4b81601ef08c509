"""PaLM's output z-loss (train.z_loss_coef): the step logs the output's mean log Z, equal to the
model's own logits' logsumexp; with the z-loss on, training pulls log Z towards 0."""

from __future__ import annotations

import jax
import numpy as np
from conftest import tiny_config

from mllm.train.sharding import global_batch, make_mesh
from mllm.train.state import setup
from mllm.train.step import make_train_step, synthetic_batch


def _train(coef: float, steps: int = 12):
  config = tiny_config(
    train__z_loss_coef=coef, train__learning_rate=3e-2, train__warmup_steps=0, data__batch_size=4
  )
  mesh = make_mesh(config.mesh)
  train_setup, init = setup(config, mesh)
  step, state = make_train_step(train_setup), init()
  batch = synthetic_batch(config, np.random.default_rng(0))
  # The initial logits' mean log Z, straight from the model (before the state is donated).
  logits = train_setup.merge(state['params'])(batch['inputs'], positions=batch['positions'])
  direct = float(np.mean(np.asarray(jax.nn.logsumexp(logits, axis=-1))))
  logged = []
  for _ in range(steps):
    state, metrics = step(state, global_batch(batch, mesh))
    logged.append(float(metrics['log_z']))
  return direct, logged


def test_the_logged_log_z_is_the_logits_logsumexp_and_the_z_loss_pulls_it_to_zero():
  direct, without = _train(0.0)
  np.testing.assert_allclose(without[0], direct, rtol=1e-5)  # step 1 logs its inputs' log Z
  _, with_z = _train(1e-1)
  # Measured (CPU): log Z 3.92 → 2.81 with the z-loss, → 5.44 without, over 12 steps.
  assert with_z[-1] < with_z[0] - 0.5, with_z
  assert without[-1] - with_z[-1] > 1.5, (with_z, without)
