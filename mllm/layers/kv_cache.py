"""The key/value cache for autoregressive decoding: an argument of the model, not a mode.

    logits, cache = model(tokens_BT, positions=positions_BT, cache=cache)

Every layer keeps the (rotated) keys and values of past tokens, so a decode step attends to them
instead of recomputing them: O(layers · context · d) per token instead of a forward pass.

- k, v: [layers, B, S, n_kv_heads, head_dim] in the compute dtype. GQA and MQA shrink the cache by
  n_heads / n_kv_heads: the point of Shazeer (2019) and Ainslie et al. (2023).
- positions [B, S]: the position of the token in each slot, −1 for an empty slot. Attention orders
  keys by these positions (`AttentionMask.kv_positions`), so sequences of a batch may be at
  different lengths and slots need not be in order.
- Slot of position p: p mod S. Without a sliding window S is the longest sequence the cache holds;
  with a window W, S = W is a rolling buffer (Mistral's reference implementation): memory O(W)
  however long the generation, each new token overwriting the one W positions back, which no
  query can see any more.

A forward pass with a cache attends to [the cache's S slots ; this pass's T new keys], then writes
the new keys into their slots. The concatenation lets a chunk longer than a rolling buffer see its
own earlier tokens before they are overwritten.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mllm.layers import resolved_head_dim


@struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S, K, H]
  v: jax.Array  # [L, B, S, K, H]
  positions: jax.Array  # [B, S] int32, −1: empty

  @property
  def size(self) -> int:
    return self.positions.shape[1]

  @property
  def nbytes(self) -> int:
    return self.k.nbytes + self.v.nbytes + self.positions.nbytes


def slots_for(window: int | None, max_len: int) -> int:
  """Slots per sequence for sequences of up to max_len tokens: max_len, or the window if smaller."""
  return min(max_len, window) if window else max_len


def cache_size(cfg, max_len: int) -> int:
  """`slots_for` the model config `cfg`."""
  return slots_for(cfg.attention.sliding_window, max_len)


def empty_cache(layers: int, batch: int, size: int, kv_heads: int, head_dim: int,
                dtype) -> KVCache:
  """A cache of `size` empty slots per sequence."""
  shape = (layers, batch, size, kv_heads, head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 positions=jnp.full((batch, size), -1, jnp.int32))


def init_cache(cfg, batch: int, max_len: int) -> KVCache:
  """An empty cache for `batch` sequences of up to `max_len` tokens (the model config `cfg`)."""
  return empty_cache(cfg.n_layers, batch, cache_size(cfg, max_len), cfg.n_kv_heads,
                     resolved_head_dim(cfg), jnp.dtype(cfg.dtype))


def write_slots(positions_BT: jax.Array, size: int) -> jax.Array:
  """Slot of each new token, or `size` (out of range: not written) for padding (position < 0) and
  for a token a later token of the same pass overwrites (a chunk longer than a rolling buffer)."""
  valid = positions_BT >= 0
  last = jnp.max(jnp.where(valid, positions_BT, -1), axis=1, keepdims=True)
  keep = valid & (positions_BT > last - size)
  return jnp.where(keep, positions_BT % size, size)


def scatter(cache_BSKH: jax.Array, new_BTKH: jax.Array, slots_BT: jax.Array) -> jax.Array:
  """cache with new_BTKH[b, t] written at slot slots_BT[b, t] (out-of-range slots dropped)."""
  rows = jnp.arange(cache_BSKH.shape[0])[:, None]
  return cache_BSKH.at[rows, slots_BT].set(new_BTKH.astype(cache_BSKH.dtype), mode='drop')


@struct.dataclass
class LayerCache:
  """One layer's view during a forward pass: its past keys/values and where the new ones go."""
  k: jax.Array  # [B, S, K, H]
  v: jax.Array
  slots: jax.Array  # [B, T]

  def extend(self, k_BTKH, v_BTKH):
    """(keys, values to attend to: [past ; new], and the layer's updated cache k, v)."""
    keys = jnp.concatenate([self.k.astype(k_BTKH.dtype), k_BTKH], axis=1)
    values = jnp.concatenate([self.v.astype(v_BTKH.dtype), v_BTKH], axis=1)
    return keys, values, (scatter(self.k, k_BTKH, self.slots), scatter(self.v, v_BTKH, self.slots))
