"""Normalizations (mllm/layers/norms.py) against float64 NumPy formulas."""

from __future__ import annotations

import math

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mllm
from mllm.layers.norms import NORMS, Identity, LayerNorm, PartialRMSNorm, RMSNorm


def _np_rms(x, scale, eps, bias=None, k=None):
  x = np.asarray(x, np.float64)
  part = x if k is None else x[..., :k]
  y = x / np.sqrt(np.mean(part**2, axis=-1, keepdims=True) + eps) * scale
  return y if bias is None else y + bias


def _np_layernorm(x, scale, bias, eps):
  x = np.asarray(x, np.float64)
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)  # biased
  y = (x - mu) / np.sqrt(var + eps) * scale
  return y if bias is None else y + bias


def _set_params(norm, rng, dim):
  scale = rng.normal(size=dim) + 1.0
  norm.scale[...] = jnp.asarray(scale, jnp.float32)
  bias = None
  if norm.bias is not None:
    bias = rng.normal(size=dim)
    norm.bias[...] = jnp.asarray(bias, jnp.float32)
  return scale, bias


def test_rmsnorm_lecture_example():
  norm = RMSNorm(2, eps=0.0)
  out = norm(jnp.asarray([[3.0, 4.0]]))
  np.testing.assert_allclose(np.asarray(out)[0], [0.8485, 1.1314], atol=1e-4)
  np.testing.assert_allclose(
    np.asarray(out)[0], [3 / math.sqrt(12.5), 4 / math.sqrt(12.5)], rtol=1e-6
  )


@pytest.mark.parametrize('use_bias', [False, True])
@pytest.mark.parametrize('eps', [1e-6, 0.5])
def test_rmsnorm_matches_numpy(use_bias, eps):
  rng = np.random.default_rng(0)
  d = 12
  norm = RMSNorm(d, eps=eps, use_bias=use_bias)
  assert (norm.bias is not None) == use_bias
  scale, bias = _set_params(norm, rng, d)
  x = rng.normal(size=(2, 3, d)) * 3.0
  out = norm(jnp.asarray(x, jnp.float32))
  chex.assert_shape(out, x.shape)
  assert out.dtype == jnp.float32
  chex.assert_trees_all_close(
    np.asarray(out, np.float64), _np_rms(x, scale, eps, bias), rtol=1e-5, atol=1e-5
  )


def test_rmsnorm_eps_is_inside_the_sqrt():
  # With a large eps the two placements differ clearly: x / sqrt(ms + eps) vs x / (sqrt(ms) + eps).
  x = np.array([[0.3, -0.4, 0.1, 0.2]])
  out = np.asarray(RMSNorm(4, eps=1.0)(jnp.asarray(x, jnp.float32)), np.float64)
  np.testing.assert_allclose(out, x / np.sqrt((x**2).mean() + 1.0), rtol=1e-6)
  assert not np.allclose(out, x / (np.sqrt((x**2).mean()) + 1.0), rtol=1e-3)


@pytest.mark.parametrize('use_bias', [False, True])
@pytest.mark.parametrize('eps', [1e-5, 0.5])
def test_layernorm_matches_numpy(use_bias, eps):
  rng = np.random.default_rng(1)
  d = 10
  norm = LayerNorm(d, eps=eps, use_bias=use_bias)
  assert (norm.bias is not None) == use_bias
  scale, bias = _set_params(norm, rng, d)
  x = rng.normal(size=(3, 4, d)) * 2.0 + 1.5
  out = norm(jnp.asarray(x, jnp.float32))
  chex.assert_shape(out, x.shape)
  chex.assert_trees_all_close(
    np.asarray(out, np.float64), _np_layernorm(x, scale, bias, eps), rtol=1e-5, atol=1e-5
  )


def test_layernorm_has_bias_by_default_and_uses_biased_variance():
  norm = LayerNorm(4, eps=0.0)
  assert norm.bias is not None
  x = np.array([[1.0, 2.0, 3.0, 4.0]])
  out = np.asarray(norm(jnp.asarray(x, jnp.float32)), np.float64)
  # Biased variance of [1,2,3,4] is 1.25 (unbiased would be 5/3).
  np.testing.assert_allclose(out, (x - 2.5) / math.sqrt(1.25), rtol=1e-6)


@pytest.mark.parametrize('use_bias', [False, True])
def test_partial_rmsnorm_matches_numpy(use_bias):
  rng = np.random.default_rng(2)
  d, p = 16, 0.3  # k = ceil(4.8) = 5
  norm = PartialRMSNorm(d, eps=1e-6, p=p, use_bias=use_bias)
  scale, bias = _set_params(norm, rng, d)
  x = rng.normal(size=(2, 3, d))
  out = norm(jnp.asarray(x, jnp.float32))
  chex.assert_trees_all_close(
    np.asarray(out, np.float64),
    _np_rms(x, scale, 1e-6, bias, k=math.ceil(p * d)),
    rtol=1e-5,
    atol=1e-5,
  )


def test_partial_rmsnorm_p1_equals_rmsnorm():
  rng = np.random.default_rng(3)
  d = 8
  x = jnp.asarray(rng.normal(size=(4, d)), jnp.float32)
  scale = jnp.asarray(rng.normal(size=d), jnp.float32)
  partial, full = PartialRMSNorm(d, p=1.0), RMSNorm(d)
  partial.scale[...] = scale
  full.scale[...] = scale
  chex.assert_trees_all_close(partial(x), full(x), rtol=1e-6, atol=1e-6)


def test_partial_rmsnorm_uses_only_first_features():
  rng = np.random.default_rng(4)
  d, eps = 8, 1e-6
  norm = PartialRMSNorm(d, eps=eps, p=0.25)
  x = rng.normal(size=(3, d))
  out = np.asarray(norm(jnp.asarray(x, jnp.float32)), np.float64)
  rms2 = np.sqrt((x[:, :2] ** 2).mean(-1, keepdims=True) + eps)
  np.testing.assert_allclose(out, x / rms2, rtol=1e-5)
  # Changing features 2..7 does not change the statistic: feature 0's output is unchanged.
  x2 = x.copy()
  x2[:, 2:] *= 10.0
  out2 = np.asarray(norm(jnp.asarray(x2, jnp.float32)), np.float64)
  np.testing.assert_allclose(out2[:, :2], out[:, :2], rtol=1e-6)
  # ...whereas for a full RMSNorm it would.
  full = np.asarray(RMSNorm(d, eps=eps)(jnp.asarray(x, jnp.float32)), np.float64)
  assert not np.allclose(full, out, rtol=1e-3)


@pytest.mark.parametrize('cls', [RMSNorm, LayerNorm, PartialRMSNorm])
def test_bfloat16_input_with_fp32_stats(cls):
  rng = np.random.default_rng(5)
  d = 32
  norm = cls(d, fp32=True, **({'p': 0.5} if cls is PartialRMSNorm else {}))
  norm.scale[...] = jnp.asarray(rng.normal(size=d) + 1.0, jnp.float32)
  x_bf16 = jnp.asarray(rng.normal(size=(2, 5, d)) * 4.0, jnp.bfloat16)
  out = norm(x_bf16)
  assert out.dtype == jnp.bfloat16
  chex.assert_shape(out, x_bf16.shape)
  ref = norm(x_bf16.astype(jnp.float32))
  assert ref.dtype == jnp.float32
  np.testing.assert_allclose(
    np.asarray(out.astype(jnp.float32)), np.asarray(ref), rtol=1.6e-2, atol=1.6e-2
  )


def test_use_bias_adds_shift():
  rng = np.random.default_rng(6)
  d = 6
  x = jnp.asarray(rng.normal(size=(3, d)), jnp.float32)
  shift = rng.normal(size=d)
  for cls in (RMSNorm, LayerNorm, PartialRMSNorm):
    own = {'p': 0.5} if cls is PartialRMSNorm else {}
    with_bias = cls(d, use_bias=True, **own)
    without = cls(d, use_bias=False, **own)
    assert without.bias is None
    with_bias.bias[...] = jnp.asarray(shift, jnp.float32)
    np.testing.assert_allclose(
      np.asarray(with_bias(x)) - np.asarray(without(x)),
      np.broadcast_to(shift, (3, d)),
      rtol=1e-5,
      atol=1e-6,
    )


def test_identity_norm():
  x = jnp.asarray(np.random.default_rng(7).normal(size=(2, 3)), jnp.float32)
  chex.assert_trees_all_equal(Identity(3)(x), x)


@pytest.mark.parametrize('kind', sorted(NORMS))
def test_from_config_builds_each_kind(kind):
  cfg = mllm.load_config(
    'configs/base.py',
    {
      'model.norm.kind': kind,
      'model.norm.eps': 0.25,
      **({'model.norm.partial_rmsnorm.p': 0.5} if kind == 'partial_rmsnorm' else {}),
    },
  )
  d = 8
  norm = NORMS[kind].from_config(cfg.model, d, rngs=nnx.Rngs(0))
  assert type(norm) is NORMS[kind]
  rng = np.random.default_rng(8)
  x = rng.normal(size=(2, d))
  out = np.asarray(norm(jnp.asarray(x, jnp.float32)), np.float64)
  if kind == 'none':
    np.testing.assert_allclose(out, x, rtol=1e-6)
    return
  assert norm.eps == 0.25 and norm.fp32 is True
  chex.assert_shape(norm.scale[...], (d,))
  ones = np.ones(d)
  if kind == 'layernorm':
    assert norm.bias is not None  # use_bias=None → layernorm default True
    ref = _np_layernorm(x, ones, None, 0.25)
  elif kind == 'rmsnorm':
    assert norm.bias is None
    ref = _np_rms(x, ones, 0.25)
  else:
    assert norm.bias is None and norm.p == 0.5
    ref = _np_rms(x, ones, 0.25, k=4)
  np.testing.assert_allclose(out, ref, rtol=1e-5)


@pytest.mark.parametrize('kind', ['rmsnorm', 'layernorm'])
@pytest.mark.parametrize('use_bias', [True, False])
def test_from_config_use_bias_override(kind, use_bias):
  cfg = mllm.load_config(f'configs/base.py:norm={kind}', {'model.norm.use_bias': use_bias})
  norm = NORMS[kind].from_config(cfg.model, 4, rngs=nnx.Rngs(0))
  assert (norm.bias is not None) == use_bias


def test_from_config_param_dtype():
  cfg = mllm.load_config('configs/base.py:norm=rmsnorm', {'model.param_dtype': 'bfloat16'})
  norm = NORMS['rmsnorm'].from_config(cfg.model, 4, rngs=nnx.Rngs(0))
  assert norm.scale[...].dtype == jnp.bfloat16


@pytest.mark.parametrize('cls', [RMSNorm, LayerNorm])
def test_unit_offset_stores_w_of_the_gain_one_plus_w(cls):
  """`norm.unit_offset` (Gemma, Qwen3-Next): the parameter w starts at 0 and the gain is 1 + w."""
  rng = np.random.default_rng(3)
  d = 10
  norm = cls(d, unit_offset=True)
  np.testing.assert_array_equal(norm.scale[...], 0.0)  # γ = 1 at the start, as without it
  w = rng.normal(size=d)
  norm.scale[...] = jnp.asarray(w, jnp.float32)
  bias = None if norm.bias is None else np.asarray(norm.bias[...], np.float64)
  x = rng.normal(size=(3, d)) * 2.0
  want = _np_rms(x, 1.0 + w, 1e-6) if cls is RMSNorm else _np_layernorm(x, 1.0 + w, bias, 1e-6)
  np.testing.assert_allclose(
    np.asarray(norm(jnp.asarray(x, jnp.float32))), want, rtol=1e-5, atol=1e-5
  )


def test_unit_offset_without_a_gain_is_refused_in_one_line():
  from conftest import tiny_config

  from mllm import ConfigError

  with pytest.raises(
    ConfigError, match=r"^model\.norm\.unit_offset=True: model\.norm\.kind='none' has no gain"
  ):
    tiny_config('norm=none', model__norm__unit_offset=True)
