"""Multi-token prediction (`model.multi_token_prediction`, DeepSeek-V3 sec. 2.2): the main path is
the model without it (same parameters from the same seed, same logits); the second-next-token
logits are causal (position i sees tokens up to i + 1); the training step's objective is the
next-token loss plus the weighted second-next-token loss, recomputed here with optax over the
documented mask; the weight schedule; export refuses the extra module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_config
from flax import nnx

import mllm
from mllm.interop.hf import HFExportError, to_hf
from mllm.train.sharding import global_batch, make_mesh
from mllm.train.state import initial_model, setup
from mllm.train.step import StepParts, make_train_step, mtp_weight, synthetic_batch


def _tokens(seed=0, shape=(2, 10)):
  return jax.random.randint(jax.random.key(seed), shape, 0, 32, dtype=jnp.int32)


def test_the_main_path_is_the_model_without_it():
  with_mtp = mllm.build_model(tiny_config(model__multi_token_prediction=True), rngs=nnx.Rngs(0))
  without = mllm.build_model(tiny_config(), rngs=nnx.Rngs(0))
  main = {p: v for p, v in nnx.to_flat_state(nnx.state(with_mtp, nnx.Param)) if p[0] != 'mtp'}
  plain = dict(nnx.to_flat_state(nnx.state(without, nnx.Param)))
  assert main.keys() == plain.keys()
  for path in plain:
    np.testing.assert_array_equal(main[path][...], plain[path][...])
  tokens = _tokens()
  np.testing.assert_array_equal(with_mtp(tokens), without(tokens))


def test_the_second_next_token_logits_see_tokens_up_to_the_next_one():
  model = mllm.build_model(tiny_config(model__multi_token_prediction=True), rngs=nnx.Rngs(0))

  def mtp_logits(tokens):
    return model(tokens[:, :-1], next_tokens=tokens[:, 1:], return_moe_stats=True)[1]['mtp_logits']

  tokens = _tokens(1, (2, 11))
  base = np.asarray(mtp_logits(tokens))
  i = 5  # position i reads t_i (inputs) and t_{i+1} (next_tokens); t_{i+2} is what it predicts
  later = np.asarray(mtp_logits(tokens.at[:, i + 2].set((tokens[:, i + 2] + 1) % 32)))
  np.testing.assert_allclose(later[:, : i + 1], base[:, : i + 1], atol=1e-6)
  assert np.abs(later[:, i + 1] - base[:, i + 1]).max() > 1e-6  # position i + 1 reads it
  nearer = np.asarray(mtp_logits(tokens.at[:, i + 1].set((tokens[:, i + 1] + 1) % 32)))
  assert np.abs(nearer[:, i] - base[:, i]).max() > 1e-6


def test_the_objective_adds_the_weighted_second_next_token_loss():
  config = tiny_config(
    model__multi_token_prediction=True,
    train__mtp_coef=0.5,
    train__warmup_steps=0,
    data__batch_size=4,
  )
  mesh = make_mesh(config.mesh)
  train_setup, init = setup(config, mesh)
  state = init()
  batch = synthetic_batch(config, np.random.default_rng(0))
  batch['loss_mask'][1, 3:6] = 0.0  # some targets out of the loss: the MTP mask must follow

  # Jitted: called eagerly, the model and the objective build one program per operation (~230).
  @jax.jit
  def forward(params, batch):
    return train_setup.merge(params)(
      batch['inputs'],
      positions=batch['positions'],
      segment_ids=batch['segment_ids'],
      next_tokens=batch['targets'],
      return_moe_stats=True,
    )

  logits, stats = forward(state['params'], batch)
  mask = batch['loss_mask']
  ce = optax.softmax_cross_entropy_with_integer_labels
  main = float((ce(logits, batch['targets']) * mask).sum() / mask.sum())
  mtp_mask = (
    mask[:, :-1] * mask[:, 1:] * (batch['segment_ids'][:, :-1] == batch['segment_ids'][:, 1:])
  )
  mtp = float(
    (ce(stats['mtp_logits'][:, :-1], batch['targets'][:, 1:]) * mtp_mask).sum() / mtp_mask.sum()
  )
  # The differentiated objective: the main loss + 0.5 × the MTP loss (step 0: mtp_coef).
  parts = StepParts(train_setup)
  n_tokens = jnp.asarray(mask.sum())
  value, _ = jax.jit(
    lambda params, batch: parts.objective(
      params, batch, None, n_tokens, None, parts.mtp_terms(batch, jnp.asarray(0))
    )
  )(state['params'], batch)
  np.testing.assert_allclose(float(value), main + 0.5 * mtp, rtol=1e-5)
  _, metrics = make_train_step(train_setup)(state, global_batch(batch, mesh))
  np.testing.assert_allclose(float(metrics['loss']), main, rtol=1e-5)
  np.testing.assert_allclose(float(metrics['mtp_loss']), mtp, rtol=1e-5)


def test_the_weight_is_mtp_coef_then_mtp_coef_final():
  t = tiny_config(train__steps=100, train__mtp_coef=0.3, train__mtp_coef_final=0.1).train
  assert t.mtp_switch_at == 0.68
  weights = [float(mtp_weight(t, jnp.asarray(s))) for s in (0, 67, 68, 99)]
  np.testing.assert_allclose(weights, [0.3, 0.3, 0.1, 0.1], rtol=1e-6)


def test_export_refuses_the_extra_module(tmp_path):
  config = tiny_config(model__multi_token_prediction=True)
  with pytest.raises(HFExportError, match=r'^model\.multi_token_prediction=True'):
    to_hf(config, initial_model(config), str(tmp_path))
