"""The output's stabilisers: PaLM's z-loss (train.z_loss_coef; the step logs the mean log Z, equal
to the model's own logits' logsumexp; with the z-loss on, training pulls log Z towards 0) and
Gemma 2's final-logit soft-capping (model.final_logit_softcap)."""

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


def test_final_logit_softcap_is_cap_tanh_of_the_uncapped_logits_with_the_same_parameters():
  """Gemma 2's soft-capping changes no parameter (the same names and values from the same seed)
  and maps each logit z to cap · tanh(z / cap): bounded by the cap, near z where |z| ≪ cap."""
  import jax.numpy as jnp
  from flax import nnx

  from mllm.train.state import initial_model

  plain = initial_model(tiny_config())
  capped = initial_model(tiny_config(model__final_logit_softcap=0.5))
  a, b = nnx.state(plain, nnx.Param), nnx.state(capped, nnx.Param)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  tokens = jnp.arange(32).reshape(2, 16) % 32
  z = np.asarray(plain(tokens), np.float64)
  assert np.abs(z).max() > 0.5  # the cap binds somewhere
  np.testing.assert_allclose(capped(tokens), 0.5 * np.tanh(z / 0.5), rtol=1e-5, atol=1e-6)


def test_a_soft_capped_model_is_not_exported_to_a_class_without_it(tmp_path):
  import pytest

  from mllm.interop.hf import HFExportError, to_hf
  from mllm.train.state import initial_model

  config = tiny_config(model__final_logit_softcap=30.0)
  with pytest.raises(HFExportError, match=r'^model\.final_logit_softcap=30\.0: '):
    to_hf(config, initial_model(config), str(tmp_path / 'out'))
