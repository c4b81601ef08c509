"""Next-token cross-entropy from logits in the compute dtype, with a hand-written backward.

    loss_t = logsumexp(z_t) − z_t[y_t],   ∂loss_t/∂z_t = softmax(z_t) − onehot(y_t)

Why not `optax.softmax_cross_entropy_with_integer_labels(logits.astype(float32), ...)`: autodiff
keeps the float32 copy of the [B, T, V] logits for the backward pass, so a bf16 model writes and
reads it in full (at GPT-2's vocabulary, 32 × 1024 tokens: 6.6 GB, about 9.5 of a 72 ms H100 step
in four passes, benchmarks/results/gpu-h100-2.md). Here the residuals are the logits as the head
computed them (bf16) and the per-token logsumexp; every pass reads bf16 and upcasts inside its
fusion, the arithmetic stays float32, and the gradient leaves in the logits' dtype (what the
head's matmul transposes to anyway). For float32 logits it is the same computation as optax's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


@jax.custom_vjp
def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
  """Per-token −log softmax(logits)[target] (float32, shape of targets), logits of any float
  dtype; targets are integer ids in [0, V)."""
  return _loss_and_logsumexp(logits_BTV, targets_BT)[0]


def _loss_and_logsumexp(logits_BTV, targets_BT):
  z_BTV = logits_BTV.astype(jnp.float32)
  lse_BT = jax.nn.logsumexp(z_BTV, axis=-1)
  target_BT = jnp.take_along_axis(z_BTV, targets_BT[..., None], axis=-1)[..., 0]
  return lse_BT - target_BT, lse_BT


def _forward(logits_BTV, targets_BT):
  loss_BT, lse_BT = _loss_and_logsumexp(logits_BTV, targets_BT)
  return loss_BT, (logits_BTV, targets_BT, lse_BT)


def _backward(residuals, g_BT):
  logits_BTV, targets_BT, lse_BT = residuals
  p_BTV = jnp.exp(logits_BTV.astype(jnp.float32) - lse_BT[..., None])
  is_target = targets_BT[..., None] == jnp.arange(logits_BTV.shape[-1], dtype=targets_BT.dtype)
  d_BTV = (p_BTV - is_target.astype(jnp.float32)) * g_BT[..., None].astype(jnp.float32)
  no_cotangent = np.zeros(targets_BT.shape, dtype=jax.dtypes.float0)  # integer input
  return d_BTV.astype(logits_BTV.dtype), no_cotangent


cross_entropy.defvjp(_forward, _backward)


@jax.custom_vjp
def cross_entropy_and_logsumexp(logits_BTV: jax.Array, targets_BT: jax.Array):
  """(per-token cross-entropy, per-token log Z = logsumexp(logits)), both float32 and both
  differentiable: ∂/∂z_t of a·loss_t + b·logZ_t is a·(softmax − onehot) + b·softmax, so an
  objective may add PaLM's z-loss (c · logZ², Chowdhery et al. 2022, sec. 5) at no extra pass."""
  return _loss_and_logsumexp(logits_BTV, targets_BT)


def _forward_both(logits_BTV, targets_BT):
  loss_BT, lse_BT = _loss_and_logsumexp(logits_BTV, targets_BT)
  return (loss_BT, lse_BT), (logits_BTV, targets_BT, lse_BT)


def _backward_both(residuals, cotangents):
  logits_BTV, targets_BT, lse_BT = residuals
  g_BT, g_lse_BT = cotangents
  p_BTV = jnp.exp(logits_BTV.astype(jnp.float32) - lse_BT[..., None])
  is_target = targets_BT[..., None] == jnp.arange(logits_BTV.shape[-1], dtype=targets_BT.dtype)
  d_BTV = (p_BTV - is_target.astype(jnp.float32)) * g_BT[..., None].astype(jnp.float32)
  d_BTV = d_BTV + p_BTV * g_lse_BT[..., None].astype(jnp.float32)
  no_cotangent = np.zeros(targets_BT.shape, dtype=jax.dtypes.float0)
  return d_BTV.astype(logits_BTV.dtype), no_cotangent


cross_entropy_and_logsumexp.defvjp(_forward_both, _backward_both)
