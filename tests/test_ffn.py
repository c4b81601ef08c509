"""Feed-forward networks (mllm/layers/ffn.py) against float64 NumPy, and the parameter matching."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mllm
from mllm.layers.ffn import DENSE_FFNS, FFNS, hidden_dim

_erf = np.vectorize(math.erf)

# Activations written out in float64.
NP_ACTIVATIONS = {
  'relu': lambda z: np.maximum(z, 0.0),
  'relu2': lambda z: np.maximum(z, 0.0) ** 2,  # Primer (So et al. 2021)
  'gelu': lambda z: 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0))),
  # Hendrycks & Gimpel 2016, sec. 2: GPT-2's approximation
  'gelu_tanh': lambda z: 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))),
  'swish': lambda z: z / (1.0 + np.exp(-z)),
  'glu': lambda z: 1.0 / (1.0 + np.exp(-z)),
  'bilinear': lambda z: z,
  'geglu': lambda z: 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0))),
  'geglu_tanh': lambda z: 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))),
  'swiglu': lambda z: z / (1.0 + np.exp(-z)),
  'reglu': lambda z: np.maximum(z, 0.0),
}
UNGATED = ('relu', 'relu2', 'gelu', 'gelu_tanh', 'swish')
GATED = ('glu', 'bilinear', 'geglu', 'geglu_tanh', 'swiglu', 'reglu', 'clamped_swiglu')


def np_clamped_swiglu(g, u, alpha=1.702, limit=7.0):
  """gpt-oss's hidden layer as its reference code writes it (torch: gate.clamp(max=limit),
  up.clamp(-limit, limit), glu = gate·sigmoid(gate·alpha), (up + 1)·glu), in float64."""
  g = np.minimum(g, limit)
  u = np.clip(u, -limit, limit)
  return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))


# Gated FFNs whose hidden layer is not act(x·W_gate) ⊗ x·W_up.
NP_HIDDEN = {'clamped_swiglu': np_clamped_swiglu}


def test_registry_is_complete():
  assert set(DENSE_FFNS) == set(UNGATED) | set(GATED)
  assert set(FFNS) == set(DENSE_FFNS) | {'moe'}  # the MoE registers itself (mllm/layers/moe.py)
  for kind in UNGATED:
    assert not FFNS[kind].gated
  for kind in GATED:
    assert FFNS[kind].gated


def _linear_np(layer, x, use_bias):
  w = np.asarray(layer.kernel[...], np.float64)
  y = x @ w
  if use_bias:
    y = y + np.asarray(layer.bias[...], np.float64)
  else:
    assert layer.bias is None
  return y


def _randomize_biases(module, rng):
  for name in ('gate', 'up', 'down'):
    layer = getattr(module, name, None)
    if layer is not None and layer.bias is not None:
      layer.bias[...] = jnp.asarray(rng.normal(size=layer.bias[...].shape), jnp.float32)


@pytest.mark.parametrize('use_bias', [False, True])
@pytest.mark.parametrize('kind', sorted(DENSE_FFNS))
def test_ffn_matches_numpy(kind, use_bias):
  rng = np.random.default_rng(0)
  d_model, d_ff = 8, 12
  ffn = FFNS[kind](d_model, d_ff, use_bias=use_bias, init_std=0.5, out_std=0.5, rngs=nnx.Rngs(0))
  _randomize_biases(ffn, rng)
  x = rng.normal(size=(2, 3, d_model))
  out = ffn(jnp.asarray(x, jnp.float32))
  chex.assert_shape(out, (2, 3, d_model))
  assert out.dtype == jnp.float32

  act = NP_ACTIVATIONS.get(kind)
  chex.assert_shape(ffn.up.kernel[...], (d_model, d_ff))
  chex.assert_shape(ffn.down.kernel[...], (d_ff, d_model))
  if kind in NP_HIDDEN:
    h = NP_HIDDEN[kind](_linear_np(ffn.gate, x, use_bias), _linear_np(ffn.up, x, use_bias))
  elif kind in GATED:
    chex.assert_shape(ffn.gate.kernel[...], (d_model, d_ff))
    h = act(_linear_np(ffn.gate, x, use_bias)) * _linear_np(ffn.up, x, use_bias)
  else:
    assert getattr(ffn, 'gate', None) is None  # no gate matrix, so no gate parameters
    h = act(_linear_np(ffn.up, x, use_bias))
  ref = _linear_np(ffn.down, h, use_bias)
  chex.assert_trees_all_close(np.asarray(out, np.float64), ref, rtol=1e-4, atol=1e-4)


def test_the_clamped_swiglu_clamps_where_gpt_oss_does():
  """Pre-activations well past the limit L = 7 (and α, L set off their defaults): the gate is cut
  above only, the up path both ways."""
  from mllm.layers.ffn import ClampedSwiGLU

  rng = np.random.default_rng(2)
  g, u = rng.normal(scale=12.0, size=(2, 64)), rng.normal(scale=12.0, size=(2, 64))
  assert (g > 7).any() and (g < -7).any() and (u > 7).any() and (u < -7).any()
  for settings in (None, ClampedSwiGLU.Settings(alpha=1.0, limit=3.0)):
    hidden = ClampedSwiGLU.hidden_with(settings)
    want = np_clamped_swiglu(g, u, **({} if settings is None else {'alpha': 1.0, 'limit': 3.0}))
    got = hidden(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)


def test_gelu_is_exact_not_tanh():
  """At z = −3 the exact and tanh GELUs differ by ~3e-4 (well above float32 error)."""
  ffn = FFNS['gelu'](1, 1, use_bias=False, init_std=0.5, out_std=0.5, rngs=nnx.Rngs(0))
  ffn.up.kernel[...] = jnp.ones((1, 1), jnp.float32)
  ffn.down.kernel[...] = jnp.ones((1, 1), jnp.float32)
  z = np.array([-3.0, -1.5, 0.7, 2.5])
  out = np.asarray(ffn(jnp.asarray(z[:, None], jnp.float32)))[:, 0]
  exact = NP_ACTIVATIONS['gelu'](z)
  tanh = NP_ACTIVATIONS['gelu_tanh'](z)
  np.testing.assert_allclose(out, exact, atol=1e-6)
  assert np.max(np.abs(exact - tanh)) > 1e-4


def _n_params(module):
  return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(module, nnx.Param)))


def _ffn_cfg(kind, **overrides):
  return mllm.load_config(
    f'configs/base.py:ffn={kind}', {f'model.ffn.{k}': v for k, v in overrides.items()}
  ).model.ffn


@pytest.mark.parametrize('kind', GATED)
def test_gated_param_count_matches_ungated(kind):
  cfg = _ffn_cfg(kind)
  assert cfg.match_params and cfg.multiple_of == 8 and cfg.d_ff is None
  for d in (128, 256, 512, 768, 1024):
    h = hidden_dim(cfg, d)
    assert h % 8 == 0
    ffn = nnx.eval_shape(
      lambda: FFNS[kind](d, h, use_bias=False, init_std=0.02, out_std=0.02, rngs=nnx.Rngs(0))  # noqa: B023 (runs within this iteration)
    )
    gated = _n_params(ffn)
    assert gated == 3 * d * h
    ungated = 2 * d * 4 * d
    assert abs(gated - ungated) / ungated < 0.01, (kind, d, h, gated, ungated)


@pytest.mark.parametrize('kind', UNGATED)
def test_ungated_param_count_and_hidden_dim(kind):
  cfg = _ffn_cfg(kind)
  for d in (128, 768):
    h = hidden_dim(cfg, d)
    assert h == 4 * d  # match_params applies to gated FFNs only
    ffn = nnx.eval_shape(
      lambda: FFNS[kind](d, h, use_bias=False, init_std=0.02, out_std=0.02, rngs=nnx.Rngs(0))  # noqa: B023 (runs within this iteration)
    )
    assert _n_params(ffn) == 2 * d * 4 * d
  # With biases: + d_ff + d_model.
  ffn = nnx.eval_shape(
    lambda: FFNS[kind](16, 64, use_bias=True, init_std=0.02, out_std=0.02, rngs=nnx.Rngs(0))
  )
  assert _n_params(ffn) == 2 * 16 * 64 + 64 + 16


@pytest.mark.parametrize('kind', sorted(DENSE_FFNS))
def test_hidden_dim_without_match_params(kind):
  assert hidden_dim(_ffn_cfg(kind, match_params=False), 96) == 4 * 96
  assert hidden_dim(_ffn_cfg(kind, match_params=False, d_ff=100), 96) == 100


def _nearest_multiple(target, m):
  """The multiple of m closest to target (at least m), by search."""
  candidates = [m * j for j in range(1, int(target // m) + 3)]
  return min(candidates, key=lambda c: abs(c - target))


@pytest.mark.parametrize(
  'd_model,d_ff,m',
  [(100, None, 64), (100, 400, 7), (96, 1000, 32), (4, None, 64), (256, None, 256), (512, 2000, 1)],
)
def test_hidden_dim_multiple_of_rounding(d_model, d_ff, m):
  cfg = _ffn_cfg('swiglu', d_ff=d_ff, multiple_of=m)
  h = hidden_dim(cfg, d_model)
  base = d_ff if d_ff is not None else 4 * d_model
  assert h % m == 0 and h >= m
  assert h == _nearest_multiple(2 * base / 3, m)


def test_hidden_dim_examples():
  # 4·4096·2/3 = 10922.67 → nearest multiple of 256 is 11008 (Llama-7B's FFN size).
  assert hidden_dim(_ffn_cfg('swiglu', multiple_of=256), 4096) == 11008
  # 4·768·2/3 = 2048 exactly.
  assert hidden_dim(_ffn_cfg('geglu'), 768) == 2048
  # Explicit d_ff on a gated FFN with match_params: 2/3 of it.
  assert hidden_dim(_ffn_cfg('reglu', d_ff=3000), 512) == 2000
