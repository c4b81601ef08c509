"""Next-token sampling (`sample`): greedy at temperature 0, else softmax(logits / temperature) restricted to the
top_k most likely tokens and to the smallest set whose probability reaches top_p (nucleus sampling,
Holtzman et al. 2020), drawn from a key folded with the step, so a seed fixes the output. An
optional repetition penalty (CTRL) first scales down the logits of tokens already in the sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def penalize_repeats(logits_BV: jax.Array, seen_BV: jax.Array, penalty: float) -> jax.Array:
  """CTRL's repetition penalty (Keskar et al. 2019, eq. 2, as in HF transformers): the logit of a
  token already in the sequence is divided by `penalty` if positive, multiplied if negative."""
  penalized = jnp.where(logits_BV > 0, logits_BV / penalty, logits_BV * penalty)
  return jnp.where(seen_BV, penalized, logits_BV)


def sample(
  logits_BV: jax.Array,
  key: jax.Array,
  *,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
) -> jax.Array:
  """Next tokens [B] (int32). temperature 0: argmax; top_k 0 and top_p 1: no truncation."""
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits = logits_BV.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
    kept = (before < top_p).at[:, 0].set(True)  # the likeliest token is always kept
    threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
