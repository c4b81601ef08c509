"""The stabilisers of the stability harness: PaLM's z-loss (train.z_loss_coef; the step logs the
mean log Z, equal to the model's own logits' logsumexp; with the z-loss on, training pulls log Z
towards 0) and Gemma 2's soft-capping of the final logits (model.final_logit_softcap) and of the
attention logits (model.attention.logit_softcap; its math per implementation is
tests/test_attention_impls.py's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BASE, tiny_config
from flax import nnx

import mllm
from mllm.checks import ConfigError
from mllm.interop.hf import HFExportError, to_hf
from mllm.train.sharding import global_batch, make_mesh
from mllm.train.state import initial_model, setup
from mllm.train.step import make_eval_step, make_train_step, synthetic_batch


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


def _assert_same_parameters(model_a, model_b):
  """The same parameter names and values (a toggle that does not change them)."""
  a, b = nnx.state(model_a, nnx.Param), nnx.state(model_b, nnx.Param)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_final_logit_softcap_is_cap_tanh_of_the_uncapped_logits_with_the_same_parameters():
  """Gemma 2's soft-capping changes no parameter (the same names and values from the same seed)
  and maps each logit z to cap · tanh(z / cap): bounded by the cap, near z where |z| ≪ cap."""
  plain = initial_model(tiny_config())
  capped = initial_model(tiny_config(model__final_logit_softcap=0.5))
  _assert_same_parameters(plain, capped)
  tokens = jnp.arange(32).reshape(2, 16) % 32
  z = np.asarray(plain(tokens), np.float64)
  assert np.abs(z).max() > 0.5  # the cap binds somewhere
  np.testing.assert_allclose(capped(tokens), 0.5 * np.tanh(z / 0.5), rtol=1e-5, atol=1e-6)


def test_a_soft_capped_model_is_not_exported_to_a_class_without_it(tmp_path):
  for key in ('final_logit_softcap', 'attention__logit_softcap'):
    config = tiny_config(**{f'model__{key}': 30.0})
    shown = key.replace('__', '.')
    with pytest.raises(HFExportError, match=rf'^model\.{shown}=30\.0: '):
      to_hf(config, initial_model(config), str(tmp_path / 'out'))


def test_the_attention_logit_softcap_changes_no_parameter_and_reaches_every_layer():
  """The same parameters with and without the cap; a cap far above every logit computes the
  uncapped model, a cap of 0.05 flattens each layer's attention towards uniform, which changes
  the logits (the op's math is checked in float64 elsewhere)."""
  plain = initial_model(tiny_config(model__attention__impl='xla'))
  models = {
    cap: initial_model(
      tiny_config(model__attention__impl='xla', model__attention__logit_softcap=cap)
    )
    for cap in (1e5, 0.05)
  }
  for model in models.values():
    _assert_same_parameters(plain, model)
  tokens = jnp.arange(32).reshape(2, 16) % 32
  z = np.asarray(plain(tokens))
  np.testing.assert_allclose(models[1e5](tokens), z, rtol=1e-4, atol=1e-5)
  assert np.abs(np.asarray(models[0.05](tokens)) - z).max() > 1e-3


def test_an_attention_impl_without_a_soft_cap_is_refused_in_one_line():
  with pytest.raises(ConfigError) as err:
    mllm.load_config(
      BASE,
      {
        'model.attention.impl': 'cudnn',
        'model.attention.logit_softcap': 30.0,
        'model.dtype': 'bfloat16',
      },
    )
  assert str(err.value).splitlines() == [str(err.value)]
  assert "model.attention.impl='cudnn'" in str(err.value) and 'logit_softcap=30.0' in str(err.value)


@pytest.mark.parametrize('n_layers,scan_layers', [(1, False), (2, True)])
def test_the_eval_step_reports_the_largest_allowed_attention_logit(n_layers, scan_layers):
  """max over layers, heads and allowed (causal) pairs of q·kᵀ/√H, against float64 from the
  parameters: layer 0's attention input is RMSNorm(embedding) (no positions, so no rotation).
  One layer: exactly its maximum; two (scanned): at least layer 0's."""
  config = tiny_config(
    model__position__kind='none', model__n_layers=n_layers, model__scan_layers=scan_layers
  )
  mesh = make_mesh(config.mesh)
  train_setup, init = setup(config, mesh)
  params = init()['params']
  batch = synthetic_batch(config, np.random.default_rng(1))
  eval_step = make_eval_step(train_setup, np.ones(config.model.vocab_size, np.float32))
  got = float(eval_step(params, global_batch(batch, mesh))['max_attention_logit'])

  def first(x):  # layer 0's array
    x = np.asarray(x, np.float64)
    return x[0] if scan_layers else x

  block = params['blocks'] if scan_layers else params['blocks'][0]
  x = np.asarray(params['embed']['embedding'], np.float64)[batch['inputs']]
  x = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + config.model.norm.eps)
  x = x * first(block['attention_norm']['scale'])
  q = np.einsum('btd,dnh->btnh', x, first(block['attention']['query']['kernel']))
  k = np.einsum('btd,dkh->btkh', x, first(block['attention']['key']['kernel']))
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  logits = np.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(q.shape[-1])
  T = logits.shape[-1]
  want = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf).max()
  if n_layers == 1:
    np.testing.assert_allclose(got, want, rtol=1e-5)
  else:
    assert got >= want * (1 - 1e-5)
