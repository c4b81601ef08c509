"""Attention sinks (`model.attention.sinks`, gpt-oss): `attend` with a sink logit per query head
against the float64 reference (tests/attention_reference.py: the sink in the normalizer, its
analytic gradient), 'xla' and 'blockwise' alike, GQA, windows and a row with no visible key; the
kernels without sinks refused in one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import attention_with_grads, relative_error
from conftest import tiny_config

from mllm import ConfigError
from mllm.ops.attention import AttentionMask, attend

B, T, N, K, H = 2, 12, 4, 2, 8


def _inputs(seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (B, T, N, H))
  k = jax.random.normal(keys[1], (B, T, K, H))
  v = jax.random.normal(keys[2], (B, T, K, H))
  d_out = jax.random.normal(keys[3], (B, T, N, H))
  sinks = jnp.asarray([-1.0, 0.0, 1.5, 3.0])  # from negligible to a head mostly at rest
  return q, k, v, d_out, sinks


CASES = [
  ('xla', None),
  ('xla', 3),
  ('blockwise', None),
  ('blockwise', 3),
  # The kernels (interpreted here) take sinks through their log-sum-exp and its cotangent.
  ('pallas', 3),
  ('pallas_tpu', 3),
  ('pallas_mgpu', 3),
]


@pytest.mark.parametrize('impl,window', CASES)
def test_sinks_match_the_float64_reference_forward_and_backward(impl, window):
  q, k, v, d_out, sinks = _inputs()
  half = impl == 'pallas_mgpu'  # wgmma: bfloat16 inputs, float32 accumulation
  if half:
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  blocks = dict(block_q=4, block_k=4) if impl in ('xla', 'blockwise') else {}
  # Sequence 1's first three queries see no key (segment 0 holds no key for them): a row the sink
  # alone normalizes, whose output and gradients must be 0.
  seg = np.zeros((B, T), np.int32)
  seg[1, :3] = 1
  kv_seg = seg.copy()
  kv_seg[1, :3] = 2
  mask = AttentionMask(
    causal=True, window=window, q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(kv_seg)
  )

  def loss(q, k, v, sinks):
    out = attend(q, k, v, mask=mask, sinks=sinks, impl=impl, **blocks)
    return jnp.sum(out.astype(jnp.float32) * d_out), out

  # One jitted program: called eagerly, each operation of the forward and backward (interpreted
  # kernels included) would be a program of its own.
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  (_, out), grads = step(q, k, v, sinks)
  want, (dq, dk, dv, _, d_sinks) = attention_with_grads(
    q, k, v, d_out, sinks=sinks, window=window, q_seg=seg, kv_seg=kv_seg
  )
  tolerance = (2e-2, 3e-2) if half else (1e-5, 1e-4)
  assert relative_error(out, want) < tolerance[0]
  for name, got, ref in zip(('dq', 'dk', 'dv', 'd_sinks'), grads, (dq, dk, dv, d_sinks)):
    assert relative_error(got, ref) < tolerance[1], name
  np.testing.assert_array_equal(np.asarray(out)[1, :3], 0.0)
  # The sinks change the result (a sink of 3 takes most of its head's mass).
  plain = attention_with_grads(q, k, v, window=window, q_seg=seg, kv_seg=kv_seg)
  assert relative_error(want, plain) > 0.1


def test_a_kernel_without_sinks_is_refused_in_one_line():
  with pytest.raises(
    ConfigError, match=r"^model\.attention\.impl='cudnn': cudnn has no attention sinks"
  ):
    tiny_config(
      model__attention__sinks=True, model__attention__impl='cudnn', model__dtype='bfloat16'
    )
  q, k, v, _, sinks = _inputs()
  allowed = 'xla, blockwise, pallas, pallas_tpu, pallas_mgpu, auto'
  with pytest.raises(
    ValueError, match=rf"impl='splash' cannot compute learned attention sinks .*with it: {allowed}$"
  ):
    attend(q, k, v, mask=AttentionMask(), sinks=sinks, impl='splash')
