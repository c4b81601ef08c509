"""Parametrizations (mllm/layers/parametrization.py): µP equals the standard parametrization at its
base width; at another width each of Tensor Programs V's factors is where it belongs; and the
coordinate check (experiments/coord_check.py) is flat in the width under µP where the standard
parametrization's grows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BASE, tiny_config
from flax import nnx

import mllm
from mllm.checks import ConfigError
from mllm.layers.parametrization import (
  attention_scale,
  learning_rate_factors,
  output_multiplier,
  width_multiplier,
)
from mllm.optimizers import hidden_matrix_multipliers
from mllm.train.state import initial_model, split_trained


def _model(config):
  return initial_model(config)


def test_mup_at_its_base_width_is_the_standard_parametrization():
  standard = tiny_config(model__d_model=32)
  mup = tiny_config('param=mup,mup.base_d_model=32', model__d_model=32)
  a, b = _model(standard), _model(mup)
  for x, y in zip(
    jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  tokens = jnp.arange(32).reshape(2, 16) % 32
  np.testing.assert_allclose(b(tokens), a(tokens), rtol=1e-6, atol=1e-6)
  assert width_multiplier(mup.model) == 1.0 and output_multiplier(mup.model) == 1.0


def test_mup_at_four_times_its_base_width_scales_each_part_as_tensor_programs_v():
  """m = 4: tables keep the base width's std 1/√base; logits × 1/4; the attention scale is
  √(base head dim)/d_head; hidden matrices' rates × 1/4, every other rate × 1."""
  config = tiny_config(
    'param=mup,mup.base_d_model=64',
    model__d_model=256,
    model__n_heads=4,
    model__n_kv_heads=4,
    model__vocab_size=512,
    model__tie_embeddings=False,
  )
  m = config.model
  assert width_multiplier(m) == 4.0 and output_multiplier(m) == 0.25
  model = _model(config)
  assert model.output_multiplier == 0.25
  table = np.asarray(model.embed.embedding[...])
  assert np.std(table) == pytest.approx(64**-0.5, rel=0.03)  # not 256^-1/2
  assert np.std(np.asarray(model.head.kernel[...])) == pytest.approx(64**-0.5, rel=0.03)
  query = np.asarray(model.blocks[0].attention.query.kernel[...])
  assert np.std(query) == pytest.approx(256**-0.5, rel=0.03)  # hidden: fan-in, as standard
  # d_head 64 here, 16 at the base width (64 / 4 heads): √16 / 64.
  assert model.blocks[0].attention.scale == pytest.approx(16**0.5 / 64)
  assert attention_scale(m, 64) == pytest.approx(0.0625)
  params = split_trained(nnx.state(model, nnx.Param))[0]
  assert learning_rate_factors(m) == (1.0, 0.25)  # the peak as given; hidden matrices' 1/m
  multipliers = {
    '/'.join(str(getattr(k, 'key', k)) for k in path[:-1]): float(v)
    for path, v in jax.tree_util.tree_leaves_with_path(hidden_matrix_multipliers(params, 0.25))
  }
  for name, value in multipliers.items():
    hidden = ('attention/' in name and 'kernel' in name) or '/ffn/' in name
    assert value == (0.25 if hidden else 1.0), name
  assert multipliers['embed/embedding'] == 1.0 and multipliers['head/kernel'] == 1.0


def test_a_mup_step_is_the_standard_step_times_each_parameters_multiplier():
  """The same parameters and gradients: µP's update equals AdamW's times the multipliers (the
  decoupled decay included), by one extra Optax transformation at the end of the chain."""
  from mllm.train.optimizer import make_optimizer

  config = tiny_config('param=mup,mup.base_d_model=16', model__d_model=32)
  params = split_trained(nnx.state(_model(config), nnx.Param))[0]
  grads = jax.tree.map(lambda x: 0.1 * jnp.sign(x) + 0.01, params)
  mup_tx, _ = make_optimizer(config.train, params, learning_rate_factors(config.model))
  std_tx, _ = make_optimizer(config.train, params)
  # Jitted: run eagerly, the two optimizers built ~100 single-operation programs.
  mup_update = jax.jit(lambda g, p: mup_tx.update(g, mup_tx.init(p), p)[0])(grads, params)
  std_update = jax.jit(lambda g, p: std_tx.update(g, std_tx.init(p), p)[0])(grads, params)
  factors = hidden_matrix_multipliers(params, learning_rate_factors(config.model)[1])
  for a, b, k in zip(
    jax.tree.leaves(mup_update), jax.tree.leaves(std_update), jax.tree.leaves(factors)
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b) * k, rtol=1e-6)
  assert sorted(set(map(float, jax.tree.leaves(factors)))) == [0.5, 1.0]


@pytest.mark.parametrize(
  'overrides,key',
  [
    ({'model.init': 'fixed'}, 'model.init'),
    ({'model.attention.softmax_scale': 0.1}, 'model.attention.softmax_scale'),
  ],
)
def test_mup_refuses_what_it_would_override_in_one_line(overrides, key):
  with pytest.raises(ConfigError) as err:
    mllm.load_config(f"{BASE}:param=mup", overrides)
  assert err.value.key == key and '\n' not in str(err.value)


def test_the_coordinate_check_is_flat_under_mup_and_grows_under_standard():
  """Widths 32 and 256 (8x), 8 steps at one rate on a learnable batch: under µP each block's
  output moves by the same amount at both widths (±25%) and the logits' move does not grow (its
  init part, h·W₀/m, vanishes as 1/√m: Tensor Programs V's readout); under the standard
  parametrization the blocks' move grows more than 3x and the logits' too."""
  from experiments import coord_check

  results = {
    p: {str(w): coord_check.measure(p, w, steps=8, lr=1e-2) for w in (32, 256)}
    for p in ('standard', 'mup')
  }
  for layer in ('block 0', 'block 1'):
    assert 0.75 < coord_check.growth(results, 'mup', layer) < 1.25, layer
    assert coord_check.growth(results, 'standard', layer) > 3.0, layer
  assert coord_check.growth(results, 'mup', 'logits') < 1.0
  assert coord_check.growth(results, 'standard', 'logits') > 1.2


def test_a_mup_model_away_from_its_base_width_is_not_exported_to_hugging_face(tmp_path):
  """transformers computes neither the 1/m logits nor the µP attention scale: refused in one line
  naming the key; at the base width it is the standard model, and exports."""
  from mllm.interop.hf import HFExportError, to_hf

  wide = tiny_config('param=mup,mup.base_d_model=8', model__d_model=16)
  with pytest.raises(
    HFExportError, match=r"^model\.(attention\.softmax_scale|parametrization\.kind)="
  ):
    to_hf(wide, _model(wide), str(tmp_path / 'wide'))
  base = tiny_config('param=mup,mup.base_d_model=16', model__d_model=16)
  to_hf(base, _model(base), str(tmp_path / 'base'))


def test_the_standard_parametrization_scales_the_given_rate_by_its_base_width():
  """The default config at d_model 96: its rate 3e-3, tuned at 256, peaks at 3e-3 · 256/96 = 8e-3
  in the schedule the step logs; with lr_base_d_model None the rate is as given; µP leaves it
  (it scales its hidden matrices instead) and does not read the standard section."""
  from mllm.train.optimizer import make_optimizer, peak_learning_rate

  width = {'model.d_model': 96, 'model.n_heads': 6, 'model.n_kv_heads': 6, 'train.warmup_steps': 10}
  cases = {
    'configs/base.py': 3e-3 * 256 / 96,
    'configs/base.py:lr_base_d_model=none': 3e-3,
    'configs/base.py:param=mup': 3e-3,
    'configs/base.py:lr_base_d_model=128': 3e-3 * 128 / 96,
  }
  for spec, want in cases.items():
    config = mllm.load_config(spec, width)
    assert peak_learning_rate(config) == pytest.approx(want, rel=1e-12), spec
    _, schedule = make_optimizer(config.train, {}, learning_rate_factors(config.model))
    assert float(schedule(9)) == pytest.approx(want, rel=1e-6), spec  # step 10: the peak
  at_base = mllm.load_config('configs/base.py')
  assert peak_learning_rate(at_base) == at_base.train.learning_rate  # 256 / 256
  with pytest.raises(
    ConfigError, match=r'^model\.parametrization\.standard\.lr_base_d_model=128: '
  ):
    mllm.load_config('configs/base.py:param=mup,lr_base_d_model=128')


def test_mup_width_sweeps_keep_the_scores_scale_where_the_heads_multiply():
  """mup_transfer and the coordinate check grow the width by adding heads of 16: each µP model's
  scores scale is then 1/√16, the standard one's, at every width (Tensor Programs V's 1/d_head
  changes only with the head's size). The setting's default, base_d_model / n_heads, would give
  √(base / n_heads) / 16 (x2 at a quarter of the base width): the mistake this guards."""
  from experiments import coord_check
  from experiments.run import resolve
  from experiments.suite import load_suite
  from mllm.layers.parametrization import attention_scale

  suite = load_suite('mup_transfer')
  configs = [
    resolve(suite, v, 'cpu', 0).model for v in suite.variants if v.name.startswith('mup-')
  ] + [coord_check.width_config('mup', w, lr=1e-2).model for w in (32, 64, 1024)]
  assert len(configs) == 8
  for model in configs:
    assert model.d_model // model.n_heads == 16
    assert attention_scale(model, 16) == pytest.approx(16**-0.5), model.d_model
