"""Positional schemes (mllm/layers/positions.py) against the papers' formulas in float64 NumPy."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from mllm.layers.positions import (
  PositionContext,
  ShawTables,
  alibi_slopes,
  shaw_relative_index,
  sinusoidal_embedding,
  t5_relative_bucket,
)
from mllm.layers.rope import apply_rope, rope_angles, rope_frequencies_2d, rope_inverse_frequencies
from mllm.ops.attention import AttentionMask, ScoreBias, attend


def _rng(seed=0):
  return np.random.default_rng(seed)


# ---------------------------------------------------------------------------------------------
# NumPy references.
# ---------------------------------------------------------------------------------------------


def _np_thetas(d, base=10000.0):
  """θ_i = base^(−2(i−1)/d), i = 1..d/2 (Su et al. 2021, eq. 15), float64."""
  i = np.arange(1, d // 2 + 1, dtype=np.float64)
  return base ** (-2.0 * (i - 1) / d)


def _np_rotation_matrix(m, d, layout, base=10000.0, thetas=None):
  """The d×d block rotation R_{Θ,m}; for 'half' the 2-D planes are (i, i + d/2). `thetas`: the
  d/2 frequencies (default θ_i = base^(−2i/d))."""
  R = np.zeros((d, d), np.float64)
  for i, th in enumerate(_np_thetas(d, base) if thetas is None else thetas):
    c, s = math.cos(m * th), math.sin(m * th)
    a, b = (2 * i, 2 * i + 1) if layout == 'interleaved' else (i, i + d // 2)
    R[a, a], R[a, b] = c, -s
    R[b, a], R[b, b] = s, c
  return R


def _np_rope(x, positions, layout, base=10000.0, thetas=None):
  """x [B, T, N, H] float64, positions [B, T]: out[b,t,n] = R_{pos[b,t]} x[b,t,n]."""
  x = np.asarray(x, np.float64)
  B, T, _N, H = x.shape
  out = np.empty_like(x)
  for b in range(B):
    for t in range(T):
      R = _np_rotation_matrix(float(positions[b, t]), H, layout, base, thetas)
      out[b, t] = x[b, t] @ R.T
  return out


def _perm(x):
  """P x = concat(x[0::2], x[1::2]) along head_dim."""
  return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


# ---------------------------------------------------------------------------------------------
# 1. Lecture worked examples.
# ---------------------------------------------------------------------------------------------


def test_rope_lecture_example_d4_m1():
  x = jnp.asarray([1.0, 0.0, 0.0, 1.0], jnp.float32).reshape(1, 1, 1, 4)
  out = apply_rope(x, jnp.asarray([[1]]), layout='interleaved')
  chex.assert_shape(out, (1, 1, 1, 4))
  np.testing.assert_allclose(
    np.asarray(out).reshape(4), [0.5403, 0.8415, -0.0099998, 0.99995], atol=1e-4
  )
  # The first pair is exactly (cos 1, sin 1): check tighter than the printed digits.
  np.testing.assert_allclose(
    np.asarray(out).reshape(4),
    [math.cos(1), math.sin(1), -math.sin(0.01), math.cos(0.01)],
    atol=1e-6,
  )


def test_rope_lecture_complex_form_example():
  xq = jnp.asarray([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]], jnp.float32).reshape(1, 2, 1, 4)
  out = np.asarray(apply_rope(xq, jnp.asarray([[0, 1]]), layout='interleaved')).reshape(2, 4)
  np.testing.assert_allclose(out[0], [1.0, 0.0, 0.0, 1.0], atol=1e-6)
  np.testing.assert_allclose(out[1], [-0.8415, 0.5403, 0.99995, 0.00999], atol=1e-4)


# ---------------------------------------------------------------------------------------------
# 2-5. RoPE structure.
# ---------------------------------------------------------------------------------------------


def test_rope_half_and_interleaved_differ_by_permutation():
  rng = _rng(1)
  x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
  pos = rng.integers(0, 50, size=(2, 5))
  half = apply_rope(jnp.asarray(_perm(x)), jnp.asarray(pos), layout='half')
  inter = apply_rope(jnp.asarray(x), jnp.asarray(pos), layout='interleaved')
  chex.assert_trees_all_close(np.asarray(half), _perm(np.asarray(inter)), atol=1e-6)
  # And the two layouts are genuinely different maps on the same input.
  other = apply_rope(jnp.asarray(x), jnp.asarray(pos), layout='half')
  assert not np.allclose(np.asarray(other), np.asarray(inter), atol=1e-3)


@pytest.mark.parametrize('layout', ['interleaved', 'half'])
@pytest.mark.parametrize('base', [10000.0, 500.0])
def test_rope_matches_rotation_matrix_reference(layout, base):
  rng = _rng(2)
  x = rng.normal(size=(2, 4, 3, 8))
  pos = rng.integers(0, 40, size=(2, 4))
  out = apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), theta=base, layout=layout)
  chex.assert_shape(out, x.shape)
  assert out.dtype == jnp.float32
  chex.assert_trees_all_close(
    np.asarray(out, np.float64), _np_rope(x, pos, layout, base), atol=2e-5, rtol=1e-5
  )


def test_rope_positions_1d_broadcast():
  rng = _rng(3)
  x = rng.normal(size=(2, 4, 1, 6))
  pos = np.array([3, 0, 7, 2])
  out = apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), layout='half')
  ref = _np_rope(x, np.broadcast_to(pos, (2, 4)), 'half')
  chex.assert_trees_all_close(np.asarray(out, np.float64), ref, atol=2e-5)


@pytest.mark.parametrize('layout', ['interleaved', 'half'])
def test_rope_scores_depend_only_on_relative_distance(layout):
  rng = _rng(4)
  d = 16
  q = jnp.asarray(rng.normal(size=(1, 1, 1, d)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, d)), jnp.float32)

  def score(m, n):
    qm = apply_rope(q, jnp.asarray([[m]]), layout=layout)
    kn = apply_rope(k, jnp.asarray([[n]]), layout=layout)
    return float(jnp.sum(qm * kn))

  for m, n in [(5, 2), (3, 9), (0, 0)]:
    base_score = score(m, n)
    for c in (1, 7, 100, 1000):
      assert abs(score(m + c, n + c) - base_score) < 2e-3, (m, n, c)
  # And the score does change with the distance (not trivially constant).
  assert abs(score(5, 2) - score(5, 4)) > 1e-2


@pytest.mark.parametrize('s', [2, 4])
def test_rope_position_interpolation(s):
  rng = _rng(5)
  x = jnp.asarray(rng.normal(size=(2, 6, 2, 8)), jnp.float32)
  pos = rng.integers(0, 100, size=(2, 6))
  scaled = apply_rope(x, jnp.asarray(pos), scaling={'kind': 'linear', 'factor': s})
  direct = apply_rope(x, jnp.asarray(pos / s, jnp.float32))
  chex.assert_trees_all_close(scaled, direct, atol=1e-5)
  # Against the float64 rotation-matrix reference at positions m / s.
  chex.assert_trees_all_close(
    np.asarray(scaled, np.float64), _np_rope(x, pos / s, 'half'), atol=5e-5
  )
  # Interpolation really changes the result.
  assert not np.allclose(np.asarray(scaled), np.asarray(apply_rope(x, jnp.asarray(pos))), atol=1e-3)


# ---------------------------------------------------------------------------------------------
# 6. NTK, YaRN, llama3 frequencies.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'd,theta,s', [(128, 10000.0, 4.0), (64, 10000.0, 8.0), (16, 500000.0, 2.0)]
)
def test_ntk_inverse_frequencies(d, theta, s):
  inv, attn = rope_inverse_frequencies(d, theta, {'kind': 'ntk', 'factor': s})
  i = np.arange(d // 2, dtype=np.float64)
  expected = 1.0 / (theta * s ** (d / (d - 2))) ** (2 * i / d)
  assert inv.shape == (d // 2,)
  np.testing.assert_allclose(inv, expected, rtol=1e-12)
  assert attn == 1.0
  # The highest frequency is untouched; the lowest is divided by (about) s.
  assert inv[0] == 1.0
  orig_lowest = 1.0 / theta ** ((d - 2) / d)
  np.testing.assert_allclose(inv[-1], orig_lowest / s, rtol=1e-12)


def test_no_scaling_inverse_frequencies():
  inv, attn = rope_inverse_frequencies(32, 10000.0, None)
  np.testing.assert_allclose(inv, _np_thetas(32), rtol=1e-12)
  assert attn == 1.0


def _np_yarn(d, theta, s, L, beta_fast=32.0, beta_slow=1.0, truncate=True):
  """YaRN (Peng et al. 2023, and its reference code), written out in float64; `truncate` False:
  the ramp's ends as computed, not floored and ceiled (gpt-oss, transformers' `truncate`)."""
  pos_freqs = theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  extrap = 1.0 / pos_freqs
  interp = 1.0 / (s * pos_freqs)

  def corr_dim(num_rotations):
    return (d * math.log(L / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

  low, high = corr_dim(beta_fast), corr_dim(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, d - 1)
  if low == high:
    high += 0.001
  ramp = np.array([min(max((j - low) / (high - low), 0.0), 1.0) for j in range(d // 2)])
  extrap_factor = 1.0 - ramp
  inv = interp * (1 - extrap_factor) + extrap * extrap_factor
  mscale = 0.1 * math.log(s) + 1.0 if s > 1 else 1.0
  return inv, mscale, low, high


@pytest.mark.parametrize(
  'd,theta,s,L', [(128, 10000.0, 4.0, 2048), (64, 10000.0, 16.0, 4096), (128, 500000.0, 8.0, 8192)]
)
def test_yarn_inverse_frequencies(d, theta, s, L):
  inv, attn = rope_inverse_frequencies(
    d,
    theta,
    {'kind': 'yarn', 'factor': s, 'beta_fast': 32.0, 'beta_slow': 1.0},
    original_max_len=L,
  )
  ref, mscale, low, high = _np_yarn(d, theta, s, L)
  np.testing.assert_allclose(inv, ref, rtol=1e-12)
  np.testing.assert_allclose(attn, 0.1 * math.log(s) + 1.0, rtol=1e-12)
  np.testing.assert_allclose(attn, mscale, rtol=1e-12)
  orig = _np_thetas(d, theta)
  # The ramp is non-trivial for these settings.
  assert 0 < low < math.ceil(high) < d // 2
  # High-frequency dims (below `low`) keep their frequency; the lowest are divided by s.
  np.testing.assert_allclose(inv[: low + 1], orig[: low + 1], rtol=1e-12)
  hi = math.ceil(high)
  np.testing.assert_allclose(inv[hi:], orig[hi:] / s, rtol=1e-12)
  # In between, strictly between the two.
  mid = slice(low + 1, hi)
  assert np.all(inv[mid] < orig[mid]) and np.all(inv[mid] > orig[mid] / s)


def test_yarn_without_truncation_keeps_the_ramps_fractional_ends():
  """gpt-oss's YaRN (θ 150000, s 32, L 4096, truncate false): the ramp between the correction
  dims as computed; rounding them moves every frequency inside the ramp."""
  d, theta, s, L = 64, 150000.0, 32.0, 4096
  spec = {'kind': 'yarn', 'factor': s, 'beta_fast': 32.0, 'beta_slow': 1.0, 'truncate': False}
  inv, _ = rope_inverse_frequencies(d, theta, spec, original_max_len=L)
  ref, _, low, high = _np_yarn(d, theta, s, L, truncate=False)
  np.testing.assert_allclose(inv, ref, rtol=1e-12)
  assert low != math.floor(low) and high != math.ceil(high)
  rounded, _ = rope_inverse_frequencies(d, theta, {**spec, 'truncate': True}, original_max_len=L)
  assert np.abs(rounded / inv - 1).max() > 1e-2


def test_yarn_attention_factor_scales_cos_sin():
  s = 4.0
  scaling = {'kind': 'yarn', 'factor': s}
  cos, sin = rope_angles(jnp.arange(10)[None], 16, 10000.0, scaling, original_max_len=64)
  chex.assert_shape(cos, (1, 10, 8))
  np.testing.assert_allclose(
    np.asarray(cos) ** 2 + np.asarray(sin) ** 2, (0.1 * math.log(s) + 1.0) ** 2, rtol=1e-5
  )


def test_yarn_with_its_own_attention_factor_keeps_its_frequencies():
  d, theta, s, L = 64, 10000.0, 4.0, 64
  spec = {'kind': 'yarn', 'factor': s, 'attention_factor': 1.03}
  inv, attn = rope_inverse_frequencies(d, theta, spec, original_max_len=L)
  np.testing.assert_allclose(inv, _np_yarn(d, theta, s, L)[0], rtol=1e-12)
  assert attn == 1.03
  cos, sin = rope_angles(jnp.arange(10)[None], d, theta, spec, original_max_len=L)
  np.testing.assert_allclose(np.asarray(cos) ** 2 + np.asarray(sin) ** 2, 1.03**2, rtol=1e-5)


def _np_mscale(s, m=1.0):
  """DeepSeek-V2's yarn_get_mscale, written out: 0.1·m·ln(s) + 1, and 1 for s <= 1."""
  return 0.1 * m * math.log(s) + 1.0 if s > 1 else 1.0


@pytest.mark.parametrize(
  'params,expected',
  [
    ({'mscale': 0.9, 'mscale_all_dim': 0.7}, _np_mscale(4.0, 0.9) / _np_mscale(4.0, 0.7)),
    ({'mscale': 1.0, 'mscale_all_dim': 1.0}, 1.0),  # DeepSeek-V3's own: cos/sin unscaled
    ({'mscale': 0.9}, None),  # one of them alone: transformers falls back to the paper's
    ({'mscale_all_dim': 0.7}, None),
    ({'attention_factor': 1.2, 'mscale': 0.9, 'mscale_all_dim': 0.7}, 1.2),  # given: it wins
    ({}, None),
  ],
)
def test_yarn_attention_factor_from_hugging_face_fields(params, expected):
  from mllm.layers.rope import hf_attention_factor

  got = hf_attention_factor(params, 4.0)
  assert got == pytest.approx(expected, rel=1e-15) if expected is not None else got is None


def test_deepseek_mscale_all_dim_gives_back_the_softmax_scale_it_made():
  """Export writes the mscale_all_dim whose DeepSeek scale qk^(-1/2)·mscale(s, m)² is the
  model's exactly (its shortest decimal where one does); a scale no float gives is an ulp off."""
  from mllm.layers.rope import deepseek_mscale_all_dim, deepseek_softmax_scale

  rng = np.random.default_rng(0)
  for _ in range(2000):
    qk, s = int(rng.choice([24, 96, 192])), float(rng.choice([2.0, 4.0, 40.0]))
    m = float(rng.uniform(0.05, 3.0))
    scale = deepseek_softmax_scale(qk, s, m)
    np.testing.assert_allclose(scale, qk**-0.5 * _np_mscale(s, m) ** 2, rtol=1e-14)
    back = deepseek_mscale_all_dim(scale, qk, s)
    assert deepseek_softmax_scale(qk, s, back) == scale
  assert deepseek_mscale_all_dim(deepseek_softmax_scale(192, 40.0, 0.77), 192, 40.0) == 0.77
  assert deepseek_mscale_all_dim(24**-0.5, 24, 4.0) is None  # the plain scale: no mscale
  nearest = deepseek_softmax_scale(24, 4.0, deepseek_mscale_all_dim(0.25, 24, 4.0))
  assert nearest != 0.25 and abs(nearest - 0.25) <= np.spacing(0.25)  # no float m gives 0.25


def _np_llama3(d, theta, factor, L, low, high):
  """HF transformers' `_compute_llama3_parameters`, element by element."""
  inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  low_wl, high_wl = L / low, L / high
  out = []
  for f in inv:
    wl = 2 * math.pi / f
    if wl < high_wl:
      out.append(f)
    elif wl > low_wl:
      out.append(f / factor)
    else:
      smooth = (L / wl - low) / (high - low)
      out.append((1 - smooth) * f / factor + smooth * f)
  return np.array(out)


def test_llama3_inverse_frequencies():
  d, theta, factor, L, low, high = 128, 500000.0, 8.0, 8192, 1.0, 4.0
  inv, attn = rope_inverse_frequencies(
    d,
    theta,
    {
      'kind': 'llama3',
      'factor': factor,
      'low_freq_factor': low,
      'high_freq_factor': high,
    },
    original_max_len=L,
  )
  ref = _np_llama3(d, theta, factor, L, low, high)
  np.testing.assert_allclose(inv, ref, rtol=1e-12)
  assert attn == 1.0
  orig = _np_thetas(d, theta)
  wl = 2 * math.pi / orig
  # All three bands are present for these settings.
  assert np.any(wl < L / high) and np.any(wl > L / low)
  assert np.any((wl >= L / high) & (wl <= L / low))
  np.testing.assert_allclose(inv[wl < L / high], orig[wl < L / high], rtol=1e-12)
  np.testing.assert_allclose(inv[wl > L / low], orig[wl > L / low] / factor, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# 7. 2-D RoPE (Pixtral).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize('head_dim,height,width', [(16, 3, 5), (32, 4, 2)])
def test_rope_frequencies_2d(head_dim, height, width):
  theta = 10000.0
  out = rope_frequencies_2d(head_dim, height, width, theta)
  chex.assert_shape(out, (height, width, head_dim // 2))
  freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  fh = np.outer(np.arange(height), freqs[::2])
  fw = np.outer(np.arange(width), freqs[1::2])
  ref = np.concatenate(
    [np.tile(fh[:, None, :], (1, width, 1)), np.tile(fw[None, :, :], (height, 1, 1))], axis=-1
  )
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-6, atol=1e-7)
  # Row index drives the first half, column index the second.
  a = np.asarray(out)
  q = head_dim // 4
  assert np.all(a[:, 0, :q] == a[:, -1, :q]) and np.all(a[0, :, q:] == a[-1, :, q:])


# ---------------------------------------------------------------------------------------------
# 8-9. ALiBi.
# ---------------------------------------------------------------------------------------------


def _paper_get_slopes(n):
  """Press et al.'s reference `get_slopes`."""

  def get_slopes_power_of_2(n):
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))
    ratio = start
    return [start * ratio**i for i in range(n)]

  if math.log2(n).is_integer():
    return get_slopes_power_of_2(n)
  closest = 2 ** math.floor(math.log2(n))
  return get_slopes_power_of_2(closest) + _paper_get_slopes(2 * closest)[0::2][: n - closest]


def test_alibi_slopes_8_heads():
  np.testing.assert_allclose(alibi_slopes(8), [1 / 2**h for h in range(1, 9)], rtol=1e-12)


def test_alibi_slopes_16_heads():
  np.testing.assert_allclose(alibi_slopes(16), [2.0 ** (-h / 2) for h in range(1, 17)], rtol=1e-12)


@pytest.mark.parametrize('n', [1, 2, 3, 5, 6, 8, 12, 20, 32])
def test_alibi_slopes_match_paper_code(n):
  out = np.asarray(alibi_slopes(n))
  assert out.shape == (n,)
  np.testing.assert_allclose(out, _paper_get_slopes(n), rtol=1e-12)


def test_alibi_bias_materialize():
  rng = _rng(6)
  n_heads = 6
  slopes = np.asarray(_paper_get_slopes(n_heads))
  q_pos = rng.integers(0, 20, size=(2, 3))
  kv_pos = rng.integers(0, 20, size=(2, 5))
  bias = ScoreBias(
    alibi_slopes=jnp.asarray(slopes, jnp.float32),
    q_positions=jnp.asarray(q_pos),
    kv_positions=jnp.asarray(kv_pos),
  ).materialize()
  chex.assert_shape(bias, (2, n_heads, 3, 5))
  ref = slopes[None, :, None, None] * (kv_pos[:, None, None, :] - q_pos[:, None, :, None])
  np.testing.assert_allclose(np.asarray(bias, np.float64), ref, rtol=1e-6, atol=1e-6)


def test_alibi_bias_in_attention():
  """attend() with ALiBi equals softmax(q·k·scale + m_h (j − i)) v under a causal mask."""
  rng = _rng(7)
  B, T, N, H = 1, 4, 2, 4
  q, k, v = (rng.normal(size=(B, T, N, H)) for _ in range(3))
  slopes = np.asarray(_paper_get_slopes(N))
  pos = np.arange(T)[None]
  bias = ScoreBias(
    alibi_slopes=jnp.asarray(slopes, jnp.float32),
    q_positions=jnp.asarray(pos),
    kv_positions=jnp.asarray(pos),
  )
  out = attend(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), mask=AttentionMask(), bias=bias)
  scale = H**-0.5
  ref = np.zeros((B, T, N, H))
  for n in range(N):
    for i in range(T):
      e = np.array([q[0, i, n] @ k[0, j, n] * scale + slopes[n] * (j - i) for j in range(i + 1)])
      a = np.exp(e - e.max())
      a /= a.sum()
      ref[0, i, n] = a @ v[0, : i + 1, n]
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 10. T5 buckets.
# ---------------------------------------------------------------------------------------------


def _hf_t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
  """HF T5's `_relative_position_bucket`, one Python int at a time (logs in float32, as HF)."""
  bucket = 0
  if bidirectional:
    num_buckets //= 2
    if relative_position > 0:
      bucket += num_buckets
    relative_position = abs(relative_position)
  else:
    relative_position = -min(relative_position, 0)
  max_exact = num_buckets // 2
  if relative_position < max_exact:
    return bucket + relative_position
  ratio = np.float32(relative_position) / np.float32(max_exact)
  large = max_exact + int(
    np.float32(np.log(ratio, dtype=np.float32))
    / np.float32(math.log(max_distance / max_exact))
    * np.float32(num_buckets - max_exact)
  )
  return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize('bidirectional', [True, False])
def test_t5_relative_bucket(bidirectional):
  rel = np.arange(-300, 301)
  out = np.asarray(
    t5_relative_bucket(
      jnp.asarray(rel, jnp.int32), bidirectional=bidirectional, num_buckets=32, max_distance=128
    )
  )
  ref = np.array([_hf_t5_bucket(int(r), bidirectional, 32, 128) for r in rel])
  np.testing.assert_array_equal(out, ref)
  # Sanity: buckets are in range and saturate beyond max_distance.
  assert out.min() >= 0 and out.max() <= 31
  if bidirectional:
    assert out[rel == 300][0] == 31 and out[rel == -300][0] == 15 and out[rel == 0][0] == 0
    assert out[rel == 1][0] == 17 and out[rel == -1][0] == 1
  else:
    assert np.all(out[rel >= 0] == 0) and out[rel == -300][0] == 31 and out[rel == -5][0] == 5


# ---------------------------------------------------------------------------------------------
# 11. Shaw et al. (2018).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize('k', [0, 1, 2, 4])
def test_shaw_relative_index(k):
  rng = _rng(8)
  q_pos = rng.integers(0, 12, size=(2, 4))
  kv_pos = rng.integers(0, 12, size=(2, 6))
  out = shaw_relative_index(jnp.asarray(q_pos), jnp.asarray(kv_pos), k)
  chex.assert_shape(out, (2, 4, 6))
  assert out.dtype == jnp.int32
  ref = np.empty((2, 4, 6), np.int64)
  for b in range(2):
    for i in range(4):
      for j in range(6):
        ref[b, i, j] = max(-k, min(k, kv_pos[b, j] - q_pos[b, i])) + k
  np.testing.assert_array_equal(np.asarray(out), ref)


@pytest.mark.parametrize('k,n_heads,n_kv', [(1, 2, 2), (2, 4, 2)])
def test_shaw_attention_matches_paper_equations(k, n_heads, n_kv):
  rng = _rng(9)
  B, T, H = 2, 6, 4
  q = rng.normal(size=(B, T, n_heads, H))
  kk = rng.normal(size=(B, T, n_kv, H))
  v = rng.normal(size=(B, T, n_kv, H))
  pos = np.stack([np.arange(T), np.arange(T) + 3])  # absolute offset must not matter
  tables = ShawTables(
    n_relative=2 * k + 1, head_dim=H, init_std=0.5, param_dtype=jnp.float32, rngs=nnx.Rngs(0)
  )
  aK = np.asarray(tables.key[...], np.float64)
  aV = np.asarray(tables.value[...], np.float64)
  context = PositionContext(
    relative_index=shaw_relative_index(jnp.asarray(pos), jnp.asarray(pos), k)
  )
  scale = H**-0.5
  qj = jnp.asarray(q, jnp.float32)
  bias, rel_values = tables(qj, context, scale)
  chex.assert_shape(bias.dense, (B, n_heads, T, T))
  out = attend(
    qj,
    jnp.asarray(kk, jnp.float32),
    jnp.asarray(v, jnp.float32),
    mask=AttentionMask(causal=True),
    bias=bias,
    rel_values=rel_values,
    scale=scale,
  )
  chex.assert_shape(out, (B, T, n_heads, H))

  group = n_heads // n_kv
  ref = np.zeros((B, T, n_heads, H))
  for b in range(B):
    for n in range(n_heads):
      kvh = n // group
      for i in range(T):
        js = range(i + 1)
        idx = [min(max(pos[b, j] - pos[b, i], -k), k) + k for j in js]
        e = np.array(
          [(q[b, i, n] @ kk[b, j, kvh] + q[b, i, n] @ aK[r]) * scale for j, r in zip(js, idx)]
        )
        alpha = np.exp(e - e.max())
        alpha /= alpha.sum()
        ref[b, i, n] = sum(a * (v[b, j, kvh] + aV[r]) for a, j, r in zip(alpha, js, idx))
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# 12. Sinusoids.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize('d', [8, 32])
def test_sinusoidal_embedding(d):
  pos = np.array([[0, 1, 2, 7], [50, 3, 100, 11]])
  out = sinusoidal_embedding(jnp.asarray(pos), d)
  chex.assert_shape(out, (2, 4, d))
  ref = np.zeros((2, 4, d))
  for i in range(d // 2):
    ref[..., 2 * i] = np.sin(pos / 10000 ** (2 * i / d))
    ref[..., 2 * i + 1] = np.cos(pos / 10000 ** (2 * i / d))
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=5e-5)


# ---------------------------------------------------------------------------------------------
# Property tests (hypothesis): invariants that hold for any input, not just the sampled grids.
# ---------------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(
  num_buckets=st.integers(4, 64), max_distance=st.integers(40, 1000), bidirectional=st.booleans()
)
def test_t5_buckets_are_bounded_and_monotone_in_distance(num_buckets, max_distance, bidirectional):
  rel = jnp.arange(-1500, 1501, dtype=jnp.int32)
  buckets = np.asarray(
    t5_relative_bucket(
      rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
  )
  assert buckets.min() >= 0 and buckets.max() < num_buckets
  past = buckets[:1501][::-1]  # distances 0, 1, 2, ... into the past
  assert (np.diff(past) >= 0).all()
  # Every distance beyond max_distance shares the last bucket of its direction.
  assert len(set(past[max_distance:].tolist())) == 1


@settings(max_examples=40, deadline=None)
@given(
  m=st.integers(0, 5000),
  n=st.integers(0, 5000),
  shift=st.integers(0, 5000),
  layout=st.sampled_from(['half', 'interleaved']),
)
def test_rope_score_is_shift_invariant_for_any_positions(m, n, shift, layout):
  key_q, key_k = jax.random.split(jax.random.key(m * 7919 + n))
  q = jax.random.normal(key_q, (1, 1, 1, 16))
  k = jax.random.normal(key_k, (1, 1, 1, 16))

  def score(a, b):
    qa = apply_rope(q, jnp.array([[a]]), layout=layout)
    kb = apply_rope(k, jnp.array([[b]]), layout=layout)
    return float(jnp.sum(qa * kb))

  # float32 angles at positions up to 1e4 carry ~1e-3 rad error; scores are O(4).
  assert abs(score(m, n) - score(m + shift, n + shift)) < 5e-2


# ---------------------------------------------------------------------------------------------
# Partial RoPE (`model.position.rope.fraction`): GPT-NeoX's rotary_pct, transformers'
# partial_rotary_factor.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize('layout', ['half', 'interleaved'])
@pytest.mark.parametrize('fraction,rotated', [(0.25, 4), (0.5, 8), (0.3, 4)])
def test_partial_rope_rotates_the_first_dims_with_their_own_frequencies(layout, fraction, rotated):
  """The model's scheme at fraction f rotates the first r = int(f·H) dims as full RoPE of a head
  of r dims (frequencies θ^(−2i/r), as GPT-NeoX) and passes the other H − r through."""
  from conftest import tiny_config

  from mllm.layers.positions import POSITIONS

  cfg = tiny_config(
    f'pos=rope,model.position.rope.fraction={fraction},model.position.rope.layout={layout}',
    model__d_model=64,
    model__n_heads=4,
    model__n_kv_heads=4,
  ).model
  scheme = POSITIONS['rope'].from_config(cfg, rngs=nnx.Rngs(0))
  rng = _rng(7)
  x = rng.normal(size=(2, 5, 3, 16))
  pos = rng.integers(0, 60, size=(2, 5))
  got = np.asarray(
    scheme.context(jnp.asarray(pos), jnp.asarray(pos)).rotate(jnp.asarray(x, jnp.float32))
  )
  np.testing.assert_allclose(got[..., :rotated], _np_rope(x[..., :rotated], pos, layout), atol=2e-5)
  np.testing.assert_array_equal(got[..., rotated:], x[..., rotated:].astype(np.float32))


def _p_rope_scheme(fraction, layout, more='', **extra):
  from conftest import tiny_config

  from mllm.layers.positions import POSITIONS

  cfg = tiny_config(
    f'pos=rope,model.position.rope.fraction={fraction},model.position.rope.layout={layout},'
    'model.position.rope.frequencies=highest' + (f',{more}' if more else ''),
    model__d_model=64,
    model__n_heads=4,
    model__n_kv_heads=4,
    **extra,
  ).model
  return POSITIONS['rope'].from_config(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize('fraction,rotated', [(0.25, 4), (0.5, 8)])
def test_p_rope_is_full_rope_with_its_lowest_frequencies_removed(fraction, rotated):
  """p-RoPE (Barbero et al. 2024 §6): full RoPE of the head (θ_i = θ^(−2i/H)) with the lowest
  (1 − f)·H/2 frequencies set to 0. Interleaved, its planes (2i, 2i + 1) are mllm's first r dims,
  so the float64 rotation with those θ_i zeroed is the model's exactly; 'half' pairs (i, i + H/2),
  the same rotation on a fixed permutation of the head (the first r/2 and the r/2 after H/2)."""
  H = 16
  thetas = 10000.0 ** (-np.arange(0, H, 2) / H)
  thetas[rotated // 2 :] = 0.0  # the lowest frequencies removed: those planes never turn
  rng = _rng(11)
  x = rng.normal(size=(2, 5, 3, H))
  pos = rng.integers(0, 60, size=(2, 5))

  def model_rotates(layout, x):
    context = _p_rope_scheme(fraction, layout).context(jnp.asarray(pos), jnp.asarray(pos))
    return np.asarray(context.rotate(jnp.asarray(x, jnp.float32)))

  got = model_rotates('interleaved', x)
  np.testing.assert_allclose(got, _np_rope(x, pos, 'interleaved', thetas=thetas), atol=2e-5)
  half = np.r_[0 : rotated // 2, H // 2 : H // 2 + rotated // 2]  # the paper's turning dims
  order = np.r_[half, np.setdiff1d(np.arange(H), half)]  # ... first, as mllm rotates them
  got = model_rotates('half', x[..., order])
  np.testing.assert_allclose(got, _np_rope(x, pos, 'half', thetas=thetas)[..., order], atol=2e-5)
  # The removed frequencies are the lowest: GPT-NeoX's spread (θ^(−2i/r)) is another rotation.
  spread = _np_rope(x[..., :rotated], pos, 'interleaved')
  assert np.abs(got[..., :rotated] - spread).max() > 0.1


def test_p_rope_under_yarn_keeps_the_scaled_full_heads_highest_frequencies():
  """With YaRN, p-RoPE's θ_i and cos/sin factor are full RoPE's scaled ones (those checked against
  transformers), truncated: YaRN's ramp reads each wavelength against the whole head's."""
  from mllm.layers.rope import rope_inverse_frequencies

  yarn = 'model.position.rope.scaling.kind=yarn,model.position.rope.scaling.yarn.factor=4.0'
  scheme = _p_rope_scheme(0.5, 'half', yarn, model__max_seq_len=64)
  inv_freq, factor = rope_inverse_frequencies(16, 10000.0, scheme.scaling, 64)
  assert factor > 1.0  # YaRN's temperature: the factor is in play
  pos = np.arange(40)
  context = scheme.context(jnp.asarray(pos)[None], jnp.asarray(pos)[None])
  want = np.cos(pos[:, None] * inv_freq[None, :4]) * factor
  np.testing.assert_allclose(np.asarray(context.cos)[0], want, atol=1e-5)
  spread, _ = rope_inverse_frequencies(8, 10000.0, scheme.scaling, 64)
  assert not np.allclose(spread, inv_freq[:4])  # an 8-dim head's scaled frequencies differ


def test_p_rope_frequencies_are_refused_in_one_line_at_fraction_1():
  from conftest import tiny_config

  from mllm import ConfigError

  with pytest.raises(
    ConfigError,
    match=r"^model\.position\.rope\.frequencies='highest': .*at fraction 1 every one is kept; "
    r"allowed with model\.position\.rope\.fraction=1\.0: 'spread'$",
  ):
    tiny_config('pos=rope,model.position.rope.frequencies=highest')
  with pytest.raises(ConfigError, match=r"^model\.position\.rope\.frequencies='low': "):
    tiny_config('pos=rope,model.position.rope.fraction=0.5,model.position.rope.frequencies=low')


def test_partial_rope_fraction_is_refused_in_one_line_where_it_rotates_an_odd_count():
  from conftest import tiny_config

  from mllm import ConfigError

  # head_dim 16: 0.1 · 16 = 1.6 → 1 dimension, which a rotation cannot pair.
  with pytest.raises(
    ConfigError, match=r"^model\.position\.rope\.fraction=0\.1: rotates int\(0\.1·16\) = 1 "
  ):
    tiny_config('pos=rope,model.position.rope.fraction=0.1', model__d_model=64, model__n_heads=4)
  with pytest.raises(
    ConfigError, match=r'^model\.position\.rope\.fraction=1\.5: .*0 < fraction <= 1'
  ):
    tiny_config('pos=rope,model.position.rope.fraction=1.5')
