"""mllm.ops.cross_entropy against a float64 NumPy formula (value and gradient), and optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mllm.ops.cross_entropy import cross_entropy


def reference(logits, targets, weights):
  """float64: loss_t = logsumexp(z_t) − z_t[y_t]; d(Σ w_t loss_t)/dz_t = w_t (softmax(z_t) − e_y)."""
  z = np.asarray(logits, np.float64)
  m = z.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
  loss = lse - np.take_along_axis(z, targets[..., None], -1)[..., 0]
  grad = np.exp(z - lse[..., None])
  np.put_along_axis(
    grad, targets[..., None], np.take_along_axis(grad, targets[..., None], -1) - 1, -1
  )
  return loss, grad * weights[..., None]


@pytest.mark.parametrize('dtype, tol', [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_value_and_gradient_equal_the_float64_formula(dtype, tol):
  rng = np.random.default_rng(0)
  B, T, V = 2, 5, 97
  logits = jnp.asarray(rng.normal(0, 4, (B, T, V)), dtype)
  logits = logits.at[0, 0, 3].set(60.0)  # a large logit: the logsumexp must stay finite
  targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  weights = jnp.asarray(rng.uniform(0, 1, (B, T)), jnp.float32)

  loss, grad = jax.jit(jax.value_and_grad(lambda z: jnp.sum(cross_entropy(z, targets) * weights)))(
    logits
  )
  want_loss, want_grad = reference(np.asarray(logits, np.float32), np.asarray(targets), weights)

  per_token = cross_entropy(logits, targets)
  assert per_token.dtype == jnp.float32 and per_token.shape == (B, T)
  np.testing.assert_allclose(per_token, want_loss, rtol=1e-6, atol=1e-5)  # float32 arithmetic
  np.testing.assert_allclose(loss, (want_loss * weights).sum(), rtol=1e-6)
  assert grad.dtype == dtype  # the gradient leaves in the logits' dtype
  np.testing.assert_allclose(np.asarray(grad, np.float64), want_grad, rtol=tol, atol=tol * 1e-2)


def test_float32_logits_give_optax_values_and_gradients():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(0, 2, (3, 4, 33)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 33, (3, 4)), jnp.int32)

  def ours(z):
    return cross_entropy(z, targets).mean()

  def theirs(z):
    return optax.softmax_cross_entropy_with_integer_labels(z, targets).mean()

  np.testing.assert_allclose(ours(logits), theirs(logits), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(theirs)(logits), atol=1e-7)


def test_loss_and_log_z_with_a_z_loss_equal_the_float64_formula():
  """Σ w_t loss_t + c · Σ v_t logZ_t²: its gradient is w_t (softmax − e_y) + 2c v_t logZ_t softmax
  (float64 NumPy), through both outputs' cotangents."""
  from mllm.ops.cross_entropy import cross_entropy_and_logsumexp

  rng = np.random.default_rng(1)
  B, T, V, c = 2, 5, 61, 0.3
  logits = jnp.asarray(rng.normal(2, 3, (B, T, V)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  w = jnp.asarray(rng.uniform(0, 1, (B, T)), jnp.float32)
  v = jnp.asarray(rng.uniform(0, 1, (B, T)), jnp.float32)

  def objective(z):
    loss, log_z = cross_entropy_and_logsumexp(z, targets)
    return jnp.sum(loss * w) + c * jnp.sum(log_z**2 * v)

  value, grad = jax.jit(jax.value_and_grad(objective))(logits)
  z = np.asarray(logits, np.float64)
  lse = np.log(np.exp(z).sum(-1))
  softmax = np.exp(z - lse[..., None])
  want_loss, want_ce_grad = reference(z, np.asarray(targets), np.asarray(w, np.float64))
  want_value = (want_loss * np.asarray(w)).sum() + c * (lse**2 * np.asarray(v)).sum()
  want_grad = want_ce_grad + 2 * c * (np.asarray(v) * lse)[..., None] * softmax
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad, np.float64), want_grad, rtol=1e-4, atol=1e-6)
  loss, log_z = cross_entropy_and_logsumexp(logits, targets)
  np.testing.assert_allclose(log_z, lse, rtol=1e-6)
  np.testing.assert_allclose(loss, cross_entropy(logits, targets), rtol=0, atol=0)
