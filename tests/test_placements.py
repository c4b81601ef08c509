"""Norm placements (`model.norm.placement`): a two-layer model's logits under each placement against
the block written out in float64 NumPy from the model's own weights (mllm/model.py's equations:
pre, post, sandwich as Gemma 2 / Peri-LN, output as OLMo 2)."""

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
from mllm.layers.norms import PLACEMENTS

EPS = 1e-6


def _rmsnorm(x, scale):
  return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + EPS) * scale


def _relu_ffn(x, up, down):
  return np.maximum(x @ up, 0.0) @ down


def _reference_logits(params, tokens, placement, n_layers):
  f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
  x = f64(params['embed']['embedding'])[tokens]
  for i in range(n_layers):
    layer = params['blocks'][i]
    norm = {name: f64(layer[name]['scale']) for name in layer if name.endswith('norm')}
    attention = {n: f64(layer['attention'][n]['kernel']) for n in ('query', 'key', 'value', 'out')}
    up, down = f64(layer['ffn']['up']['kernel']), f64(layer['ffn']['down']['kernel'])
    sublayers = (
      (
        functools.partial(causal_layer_attention, weights=attention),
        'attention_norm',
        'attention_out_norm',
      ),
      (functools.partial(_relu_ffn, up=up, down=down), 'ffn_norm', 'ffn_out_norm'),
    )
    for f, name, out_name in sublayers:
      if placement == 'pre':
        x = x + f(_rmsnorm(x, norm[name]))
      elif placement == 'post':
        x = _rmsnorm(x + f(x), norm[name])
      elif placement == 'sandwich':
        x = x + _rmsnorm(f(_rmsnorm(x, norm[name])), norm[out_name])
      else:
        assert placement == 'output', placement
        x = x + _rmsnorm(f(x), norm[name])
  x = _rmsnorm(x, f64(params['final_norm']['scale']))
  return x @ f64(params['embed']['embedding']).T


@pytest.mark.parametrize('placement', PLACEMENTS)
def test_each_placement_matches_its_equation_in_float64(placement):
  cfg = tiny_config(f'pos=none,ffn=relu,norm=rmsnorm,placement={placement}', model__n_layers=2)
  model = mllm.build_model(cfg, rngs=nnx.Rngs(0))
  # Norm gains away from 1, each its own, so a norm applied in the wrong place shows.
  rng = np.random.default_rng(0)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if path[-1] == 'scale':
      var[...] = jnp.asarray(rng.uniform(0.5, 1.5, var[...].shape), jnp.float32)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  names = {p[2] for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)) if p[0] == 'blocks'}
  sandwich = {'attention_out_norm', 'ffn_out_norm'}
  assert (sandwich <= names) == (placement == 'sandwich') and 'attention_norm' in names
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (12,), 0, cfg.model.vocab_size))
  got = np.asarray(model(jnp.asarray(tokens)[None]))[0]
  want = _reference_logits(params, tokens, placement, cfg.model.n_layers)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_placements_differ():
  """The four placements give four different functions of the same weights (the test above could
  not tell them apart otherwise)."""
  tokens = jnp.arange(8)[None] % 32
  outs = []
  for placement in PLACEMENTS:
    cfg = tiny_config(f'pos=none,ffn=relu,norm=rmsnorm,placement={placement}')
    outs.append(np.asarray(mllm.build_model(cfg, rngs=nnx.Rngs(0))(tokens)))
  for i in range(len(outs)):
    for j in range(i):
      assert np.abs(outs[i] - outs[j]).max() > 1e-3, (PLACEMENTS[i], PLACEMENTS[j])


def test_olmo2s_qk_norm_over_whole_projections_is_read_only_with_qk_norm():
  """OLMo 2's QK-norm (`attention.qk_norm_over='projection'`, checked against transformers in
  test_hf_interop.py) normalizes all heads' q at once: one gain of n_heads·head_dim."""
  from mllm import ConfigError

  cfg = tiny_config(
    'placement=output', model__attention__qk_norm=True, model__attention__qk_norm_over='projection'
  )
  layer = nnx.eval_shape(lambda: mllm.build_model(cfg, rngs=nnx.Rngs(0))).blocks[0].attention
  n, k, h = cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.d_model // cfg.model.n_heads
  assert layer.query_norm.scale.shape == (n * h,) and layer.key_norm.scale.shape == (k * h,)
  with pytest.raises(
    ConfigError, match=r"^model\.attention\.qk_norm_over='projection': read only with"
  ):
    tiny_config(model__attention__qk_norm_over='projection')
