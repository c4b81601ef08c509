"""attend() against a float64 NumPy reference: masks, GQA grouping, biases, Shaw values."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mllm.ops import attention as attention_ops
from mllm.ops.attention import AttentionMask, RelativeValues, ScoreBias

# One compiled program per test instead of dozens of eagerly dispatched small ops.
attend = jax.jit(attention_ops.attend, static_argnames=('impl', 'scale', 'dropout_rate'))


def reference_attention(
  q,
  k,
  v,
  *,
  causal=True,
  window=None,
  q_seg=None,
  kv_seg=None,
  q_offset=None,
  bias=None,
  rel_table=None,
  rel_index=None,
  scale=None,
):
  """Plain float64 softmax attention, one head and one query at a time."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  scale = H**-0.5 if scale is None else scale
  offset = S - T if q_offset is None else q_offset
  out = np.zeros((B, T, N, H))
  for b in range(B):
    for n in range(N):
      kv_head = n // (N // K)  # query head n reads the K/V head of its group
      for t in range(T):
        i = offset + t
        allowed = np.ones(S, bool)
        for j in range(S):
          if causal and j > i:
            allowed[j] = False
          if window is not None and not (i - j < window and (causal or j - i < window)):
            allowed[j] = False
          if q_seg is not None and q_seg[b, t] != kv_seg[b, j]:
            allowed[j] = False
        if not allowed.any():
          continue  # fully masked row: zeros
        logits = q[b, t, n] @ k[b, :, kv_head].T * scale
        if bias is not None:
          logits = logits + np.broadcast_to(bias, (B, N, T, S))[b, n, t]
        logits = np.where(allowed, logits, -np.inf)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        out[b, t, n] = p @ v[b, :, kv_head]
        if rel_table is not None:
          out[b, t, n] += sum(p[j] * rel_table[rel_index[b, t, j]] for j in range(S))
  return out


def _qkv(key, B, T, S, N, K, H, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(key, 3)
  return (
    jax.random.normal(kq, (B, T, N, H), dtype),
    jax.random.normal(kk, (B, S, K, H), dtype),
    jax.random.normal(kv, (B, S, K, H), dtype),
  )


@pytest.mark.parametrize('n_heads,n_kv', [(4, 4), (4, 2), (4, 1), (8, 1), (8, 2)])
@pytest.mark.parametrize('causal', [True, False])
def test_matches_reference_across_head_groupings(n_heads, n_kv, causal):
  q, k, v = _qkv(jax.random.key(0), 2, 7, 7, n_heads, n_kv, 8)
  out = attend(q, k, v, mask=AttentionMask(causal=causal))
  chex.assert_shape(out, (2, 7, n_heads, 8))
  np.testing.assert_allclose(out, reference_attention(q, k, v, causal=causal), rtol=1e-5, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv():
  """Grouping query heads over shared K/V equals MHA on K/V copied per head."""
  q, k, v = _qkv(jax.random.key(1), 2, 6, 6, 8, 2, 4)
  grouped = attend(q, k, v, mask=AttentionMask())
  repeated = attend(q, jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2), mask=AttentionMask())
  np.testing.assert_allclose(grouped, repeated, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('window', [1, 2, 3])
@pytest.mark.parametrize('causal', [True, False])
def test_sliding_window(window, causal):
  q, k, v = _qkv(jax.random.key(2), 1, 8, 8, 2, 1, 4)
  out = attend(q, k, v, mask=AttentionMask(causal=causal, window=window))
  ref = reference_attention(q, k, v, causal=causal, window=window)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_segments_and_fully_masked_rows():
  q, k, v = _qkv(jax.random.key(3), 2, 6, 6, 2, 2, 4)
  seg = jnp.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 2, 2, 2]])
  out = attend(q, k, v, mask=AttentionMask(q_segment_ids=seg, kv_segment_ids=seg))
  ref = reference_attention(q, k, v, q_seg=np.asarray(seg), kv_seg=np.asarray(seg))
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  # A query whose segment appears nowhere among the keys sees nothing: zeros, not NaN.
  q_seg = jnp.array([[0, 0, 9, 1, 1, 1], [0, 1, 1, 2, 2, 9]])
  out = attend(q, k, v, mask=AttentionMask(q_segment_ids=q_seg, kv_segment_ids=seg))
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(out[0, 2], 0.0)
  np.testing.assert_array_equal(out[1, 5], 0.0)


@pytest.mark.parametrize('q_len,kv_len,offset', [(3, 8, None), (1, 8, None), (4, 8, 2)])
def test_query_offset_bottom_right(q_len, kv_len, offset):
  """q_len ≠ kv_len: by default the queries are the last q_len keys (chunked prefill)."""
  q, k, v = _qkv(jax.random.key(4), 2, q_len, kv_len, 4, 2, 4)
  out = attend(q, k, v, mask=AttentionMask(q_offset=offset))
  np.testing.assert_allclose(
    out, reference_attention(q, k, v, q_offset=offset), rtol=1e-5, atol=1e-5
  )


def test_alibi_and_dense_bias():
  q, k, v = _qkv(jax.random.key(5), 2, 5, 5, 4, 2, 4)
  slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  dense = jax.random.normal(jax.random.key(6), (1, 4, 5, 5))
  bias = ScoreBias(alibi_slopes=slopes, q_positions=pos, kv_positions=pos, dense=dense)
  out = attend(q, k, v, mask=AttentionMask(), bias=bias)
  rel = np.arange(5)[None, :] - np.arange(5)[:, None]  # j − i
  ref_bias = np.asarray(slopes)[None, :, None, None] * rel + np.asarray(dense)
  np.testing.assert_allclose(out, reference_attention(q, k, v, bias=ref_bias), rtol=1e-5, atol=1e-5)


def test_relative_values():
  q, k, v = _qkv(jax.random.key(7), 1, 5, 5, 2, 1, 4)
  table = jax.random.normal(jax.random.key(8), (3, 4))
  index = jnp.clip(jnp.arange(5)[None, :] - jnp.arange(5)[:, None], -1, 1)[None] + 1
  out = attend(q, k, v, mask=AttentionMask(), rel_values=RelativeValues(table, index))
  ref = reference_attention(q, k, v, rel_table=np.asarray(table), rel_index=np.asarray(index))
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_inputs_accumulate_in_float32():
  q, k, v = _qkv(jax.random.key(9), 2, 16, 16, 4, 2, 16, jnp.bfloat16)
  out = attend(q, k, v, mask=AttentionMask())
  assert out.dtype == jnp.bfloat16
  ref = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-2, atol=2e-2)


def test_unknown_impl_and_bad_grouping_are_refused():
  q, k, v = _qkv(jax.random.key(0), 1, 2, 2, 3, 2, 4)
  with pytest.raises(ValueError, match='multiple of key/value heads'):
    attention_ops.attend(q, k, v, mask=AttentionMask())
  q, k, v = _qkv(jax.random.key(0), 1, 2, 2, 2, 2, 4)
  with pytest.raises(
    ValueError,
    match="allowed: auto, blockwise, cudnn, pallas, pallas_mgpu, pallas_tpu, splash, xla",
  ):
    attention_ops.attend(q, k, v, mask=AttentionMask(), impl='flash')


def test_dropout_is_inverted_and_keyed():
  q, k, v = _qkv(jax.random.key(10), 1, 6, 6, 2, 2, 4)
  mask = AttentionMask()
  a = attend(q, k, v, mask=mask, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  b = attend(q, k, v, mask=mask, dropout_rate=0.5, dropout_rng=jax.random.key(1))
  c = attend(q, k, v, mask=mask, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  assert not np.allclose(a, b)
  np.testing.assert_array_equal(a, c)
  # Averaged over many keys, inverted dropout leaves the expected output unchanged.
  keys = jax.random.split(jax.random.key(11), 4000)
  mean = jax.vmap(lambda r: attend(q, k, v, mask=mask, dropout_rate=0.5, dropout_rng=r))(keys)
  np.testing.assert_allclose(mean.mean(0), attend(q, k, v, mask=mask), atol=0.1)
