"""Per-layer patterns: every N-th layer global among sliding-window ones
(`model.attention.global_every`: Gemma 2 / 3), every N-th layer without RoPE
(`model.position.rope.nope_every`: Llama 4's iRoPE, SmolLM3) and the value residual
(`model.attention.value_residual`: ResFormer), against a float64 NumPy model that gives each layer
its own mask, rotation and values; scanned layers, which repeat the pattern's period, against
unrolled ones; the refusals."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import causal_layer_attention
from conftest import tiny_config
from flax import nnx

import mllm
from mllm import ConfigError
from mllm.layers.attention import layer_windows
from mllm.layers.positions import rotating_layers

EPS = 1e-6


def _rmsnorm(x, scale):
  return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + EPS) * scale


def _reference_logits(params, tokens, windows, rotates, value_mix=None):
  """The pre-LN RMSNorm / ReLU model in float64, layer i with window windows[i] and RoPE where
  rotates[i]; with `value_mix` [n_layers − 1, 2], layer i > 0 attends with
  λ₁·V_i + λ₂·V_0 (λ = value_mix[i − 1])."""
  f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
  x = f64(params['embed']['embedding'])[tokens]
  first = None
  for i, (window, rope) in enumerate(zip(windows, rotates)):
    layer = params['blocks'][i]
    weights = {n: f64(layer['attention'][n]['kernel']) for n in ('query', 'key', 'value', 'out')}
    h = _rmsnorm(x, f64(layer['attention_norm']['scale']))
    residual = None
    if value_mix is not None:
      if i == 0:
        first = np.einsum('td,dkh->kth', h, weights['value'])
      else:
        residual = (first, value_mix[i - 1])
    attend = functools.partial(
      causal_layer_attention, weights=weights, window=window, rope=rope, value_residual=residual
    )
    x = x + attend(h)
    h = _rmsnorm(x, f64(layer['ffn_norm']['scale']))
    x = x + np.maximum(h @ f64(layer['ffn']['up']['kernel']), 0.0) @ f64(
      layer['ffn']['down']['kernel']
    )
  x = _rmsnorm(x, f64(params['final_norm']['scale']))
  return x @ f64(params['embed']['embedding']).T


@pytest.mark.parametrize(
  'choices,windows,rotates',
  [
    ('window=3,model.attention.global_every=2', (3, None, 3, None), (True,) * 4),
    ('model.position.rope.nope_every=2', (None,) * 4, (True, False, True, False)),
    (
      'window=3,model.attention.global_every=4,model.position.rope.nope_every=4',
      (3, 3, 3, None),
      (True, True, True, False),
    ),
  ],
  ids=['gemma2_windows', 'nope_layers', 'irope'],
)
def test_each_layer_gets_its_window_and_rotation(choices, windows, rotates):
  cfg = tiny_config(f'pos=rope,ffn=relu,norm=rmsnorm,{choices}', model__n_layers=4)
  assert layer_windows(cfg.model) == windows and rotating_layers(cfg.model) == rotates
  model = mllm.build_model(cfg, rngs=nnx.Rngs(0))
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (10,), 0, cfg.model.vocab_size))
  got = np.asarray(model(jnp.asarray(tokens)[None]))[0]
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  want = _reference_logits(params, tokens, windows, rotates)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
  # ... and the reference tells the pattern apart from its absence.
  plain = _reference_logits(params, tokens, (windows[0],) * 4, (True,) * 4)
  assert np.abs(want - plain).max() > 1e-3


@pytest.mark.parametrize(
  'overrides,message',
  [
    (
      {'model.attention.global_every': 2},
      r'^model\.attention\.global_every=2: without model\.attention\.sliding_window',
    ),
    (
      {'model.attention.sliding_window': 3, 'model.attention.global_every': 1},
      r'^model\.attention\.global_every=1: allowed: an integer >= 2, or None$',
    ),
    (
      {
        'model.attention.sliding_window': 3,
        'model.attention.global_every': 2,
        'model.position.rope.nope_every': 3,
        'model.n_layers': 4,
        'model.scan_layers': True,
      },
      r'^model\.n_layers=4: model\.scan_layers=True scans whole periods of the layer pattern '
      r'\(model\.attention\.global_every and model\.position\.rope\.nope_every repeat every 6 '
      r'layers\); allowed: a multiple of 6, or model\.scan_layers=False$',
    ),
    (
      {
        'model.position.rope.nope_every': 2,
        'model.n_layers': 4,
        'model.scan_layers': True,
        'model.scan_unroll': 3,
      },
      r'^model\.scan_unroll=3: .*\(model\.position\.rope\.nope_every repeats every 2 layers\); '
      r'allowed: 1 \(one period\), or a multiple of 2$',
    ),
  ],
)
def test_patterns_that_cannot_hold_are_refused_in_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message):
    tiny_config('pos=rope', **{k.replace('.', '__'): v for k, v in overrides.items()})


def test_the_value_residual_mixes_each_layers_values_with_the_first_layers():
  cfg = tiny_config(
    'pos=rope,ffn=relu,norm=rmsnorm', model__n_layers=3, model__attention__value_residual=True
  )
  model = mllm.build_model(cfg, rngs=nnx.Rngs(0))
  assert model.value_mix.weights[...].shape == (2, 2)
  np.testing.assert_array_equal(model.value_mix.weights[...], 0.5)  # ResFormer's fixed (½, ½)
  # Away from the start, each its own, so a weight applied to the wrong layer or value shows.
  model.value_mix.weights[...] = jnp.asarray([[0.9, 0.3], [0.2, 1.1]], jnp.float32)
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (10,), 0, cfg.model.vocab_size))
  got = np.asarray(model(jnp.asarray(tokens)[None]))[0]
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  mix = np.asarray(params['value_mix']['weights'], np.float64)
  want = _reference_logits(params, tokens, (None,) * 3, (True,) * 3, value_mix=mix)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
  plain = _reference_logits(params, tokens, (None,) * 3, (True,) * 3)
  assert np.abs(want - plain).max() > 1e-3
  # A gain, not a matrix: Muon and µP leave it to AdamW at the base rate, and it is not decayed.
  from mllm.optimizers import muon_dimensions, weight_decay_mask

  weights = nnx.state(model, nnx.Param)['value_mix']['weights']
  assert muon_dimensions(('value_mix', 'weights'), weights) is None
  decayed = weight_decay_mask(nnx.state(model, nnx.Param), cfg.train)
  assert not decayed['value_mix']['weights'].get_value()
  assert decayed['blocks'][0]['attention']['value']['kernel'].get_value()
  # One layer: nothing to mix, no weights.
  one = nnx.eval_shape(
    lambda: mllm.build_model(
      tiny_config(model__n_layers=1, model__attention__value_residual=True), rngs=nnx.Rngs(0)
    )
  )
  assert one.value_mix is None


def test_scanned_layers_repeat_the_patterns_period_as_unrolled_layers_do():
  """Four scanned layers in two iterations of a period of two (windowed with RoPE, then global
  without it) with the value residual: the logits are the float64 reference's, and the loss's
  gradients the unrolled model's (layer 0 mixes its own values with weights (1, 0): its
  gradient flows through both terms, summed in another order)."""
  choices = 'pos=rope,ffn=relu,norm=rmsnorm,window=3,model.attention.global_every=2'
  extra = dict(
    model__n_layers=4, model__position__rope__nope_every=2, model__attention__value_residual=True
  )
  unrolled = mllm.build_model(tiny_config(choices, **extra), rngs=nnx.Rngs(0))
  scanned = mllm.build_model(
    tiny_config(choices, model__scan_layers=True, **extra), rngs=nnx.Rngs(0)
  )
  unrolled.value_mix.weights[...] = jnp.asarray([[0.9, 0.3], [0.2, 1.1], [0.7, -0.4]])
  params = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))
  stacked = {
    **params,
    'blocks': jax.tree.map(lambda *xs: jnp.stack(xs), *[params['blocks'][i] for i in range(4)]),
  }
  state = nnx.state(scanned, nnx.Param)
  nnx.replace_by_pure_dict(state, stacked)
  nnx.update(scanned, state)
  tokens = np.asarray(
    jax.random.randint(jax.random.key(1), (10,), 0, unrolled.embed.num_embeddings)
  )
  windows, rotates = (3, None, 3, None), (True, False, True, False)
  mix = np.asarray(params['value_mix']['weights'], np.float64)
  want = _reference_logits(params, tokens, windows, rotates, value_mix=mix)
  got = np.asarray(scanned(jnp.asarray(tokens)[None]))[0]
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)

  def loss(model):
    return jnp.mean(model(jnp.asarray(tokens)[None]) ** 2)

  gradient = nnx.jit(nnx.grad(loss))  # one program each (eager, the backward's ops one by one)
  grads = nnx.to_pure_dict(gradient(unrolled))
  scanned_grads = nnx.to_pure_dict(gradient(scanned))
  per_layer = [jax.tree.map(lambda x, i=i: x[i], scanned_grads['blocks']) for i in range(4)]
  for i in range(4):
    for a, b in zip(jax.tree.leaves(per_layer[i]), jax.tree.leaves(grads['blocks'][i])):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(
    scanned_grads['value_mix']['weights'], grads['value_mix']['weights'], rtol=1e-4, atol=1e-6
  )
