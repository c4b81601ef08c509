"""The hand-written backward passes (attention without bias, bias-free FFNs) equal autodiff."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mllm.layers.ffn import DENSE_FFNS as FFNS  # the dense ones (the MoE's: test_moe.py)
from mllm.ops import attention as A
from pallas_kernels.block_ranges import MASK_VALUE


def _autodiff_attention(q, k, v, mask, scale):
  """softmax(q·kᵀ·scale)·v written with plain einsums, differentiated by JAX."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  logits = jnp.einsum('btkgh,bskh->bkgts', q.reshape(B, T, K, N // K, H), k) * scale
  allowed = mask.allowed(T, S)[:, :, None]
  probs = jax.nn.softmax(jnp.where(allowed, logits, MASK_VALUE), axis=-1)
  probs = jnp.where(jnp.any(allowed, axis=-1, keepdims=True), probs, 0.0)
  return jnp.einsum('bkgts,bskh->btkgh', probs, v).reshape(B, T, N, H)


@pytest.mark.parametrize(
  'n_heads,n_kv,t,s,mask',
  [
    (8, 2, 16, 16, A.AttentionMask()),
    (4, 4, 12, 20, A.AttentionMask(window=5)),
    (2, 1, 8, 8, A.AttentionMask(causal=False)),
    (
      6,
      3,
      16,
      16,
      A.AttentionMask(
        q_segment_ids=jnp.array([[0] * 8 + [1] * 8, [5] * 16]),  # row 2: no visible key at all
        kv_segment_ids=jnp.array([[0] * 8 + [1] * 8, [6] * 16]),
      ),
    ),
  ],
)
def test_attention_gradients_match_autodiff(n_heads, n_kv, t, s, mask):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(2, t, n_heads, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, s, n_kv, 8)), jnp.float32) for _ in range(2))
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

  fast = functools.partial(A.attend, mask=mask, scale=0.3)
  ref = functools.partial(_autodiff_attention, mask=mask, scale=0.3)

  @jax.jit  # both outputs and their gradients in one program (op by op, the reference dominated)
  def outputs_and_grads(q, k, v):
    def run(fn):
      out, vjp = jax.vjp(fn, q, k, v)
      return out, vjp(w)  # the gradients of sum(out · w)

    return run(fast), run(ref)

  (got_out, got), (want_out, want) = outputs_and_grads(q, k, v)
  np.testing.assert_allclose(got_out, want_out, atol=2e-5, rtol=2e-5)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def test_attention_bfloat16_gradients_keep_dtype():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(1, 8, 4, 8)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.normal(size=(1, 8, 2, 8)), jnp.bfloat16) for _ in range(2))
  grads = jax.grad(
    lambda q, k, v: A.attend(q, k, v, mask=A.AttentionMask()).astype(jnp.float32).sum(),
    argnums=(0, 1, 2),
  )(q, k, v)
  assert [g.dtype for g in grads] == [jnp.bfloat16] * 3


@pytest.mark.parametrize('kind', list(FFNS))
def test_ffn_gradients_match_autodiff(kind):
  ffn = FFNS[kind](
    16, 24, use_bias=False, init_std=0.3, out_std=0.3, dtype=jnp.float32, rngs=nnx.Rngs(0)
  )
  graphdef, params = nnx.split(ffn)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 16)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, 16)), jnp.float32)

  def loss(params, x, fast):
    m = nnx.merge(graphdef, params)
    if fast:
      y = m(x)
    else:  # autodiff through the layers, the variant's own hidden layer between them
      y = m.down(m.hidden_with(m.settings)(m.gate(x) if m.gated else None, m.up(x)))
    return (y * w).sum()

  (l_fast, g_fast), (l_ref, g_ref) = (
    jax.value_and_grad(loss, argnums=(0, 1))(params, x, fast) for fast in (True, False)
  )
  np.testing.assert_allclose(l_fast, l_ref, rtol=1e-6)
  for got, want in zip(jax.tree.leaves(g_fast), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
