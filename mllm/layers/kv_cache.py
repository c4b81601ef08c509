"""The key/value cache for autoregressive decoding: an argument of the model, not a mode.

    logits, cache = model(tokens_BT, positions=positions_BT, cache=cache)

Every layer keeps the (rotated) keys and values of past tokens, so a decode step attends to them
instead of recomputing them: O(layers · context · d) per token instead of a forward pass.

- k, v: [layers, B, S, n_kv_heads, head_dim] in the compute dtype. GQA and MQA shrink the cache by
  n_heads / n_kv_heads: the point of Shazeer (2019) and Ainslie et al. (2023). Under MLA k holds
  each token's latent c^KV [1, d_c] and v its shared rotated key k^R [1, d_R] (mllm/layers/mla.py):
  what each attention kind keeps is its `cache_dims`.
- positions [B, S]: the position of the token in each slot, −1 for an empty slot. Attention orders
  keys by these positions (`AttentionMask.kv_positions`), so sequences of a batch may be at
  different lengths and slots need not be in order.
- Slot of position p: p mod S. Without a sliding window S is the longest sequence the cache holds;
  with a window W, S = W is a rolling buffer (Mistral's reference implementation): memory O(W)
  however long the generation, each new token overwriting the one W positions back, which no
  query can see any more.

A forward pass with a cache writes the new keys into their slots, in place, and attends to the S
slots. Only a chunk of several tokens on a rolling buffer attends to [the S slots ; its T new keys]
before writing, so that it sees its own earlier tokens before they are overwritten.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
  k: jax.Array  # [L, B, S, K, H] (MLA: [L, B, S, 1, d_c])
  v: jax.Array  # [L, B, S, K, H] (MLA: [L, B, S, 1, d_R])
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


def rolling_window(cfg) -> int | None:
  """The window of the rolling buffer for the model config `cfg`: its sliding window where every
  layer has it; None (no rolling) where some layer attends globally, as it keeps every key."""
  return None if cfg.attention.global_every else cfg.attention.sliding_window


def cache_size(cfg, max_len: int) -> int:
  """`slots_for` the model config `cfg`."""
  return slots_for(rolling_window(cfg), max_len)


def empty_cache(
  layers: int, batch: int, size: int, k_tail: tuple[int, int], v_tail: tuple[int, int], dtype
) -> KVCache:
  """A cache of `size` empty slots per sequence, each keeping k [*k_tail] and v [*v_tail]."""
  lead = (layers, batch, size)
  return KVCache(
    k=jnp.zeros(lead + tuple(k_tail), dtype),
    v=jnp.zeros(lead + tuple(v_tail), dtype),
    positions=jnp.full((batch, size), -1, jnp.int32),
  )


# `model.attention.kind` → cache_dims(model config): what the cache keeps per token and layer, the
# (heads, dims) of its k and of its v. Each attention kind registers its own (attention.py, mla.py),
# so this module needs none of them.
CACHE_DIMS: dict[str, Callable] = {}


def init_cache(cfg, batch: int, max_len: int) -> KVCache:
  """An empty cache for `batch` sequences of up to `max_len` tokens (the model config `cfg`)."""
  k_tail, v_tail = CACHE_DIMS[cfg.attention.kind](cfg)
  return empty_cache(
    cfg.n_layers, batch, cache_size(cfg, max_len), k_tail, v_tail, jnp.dtype(cfg.dtype)
  )


def write_slots(positions_BT: jax.Array, size: int) -> jax.Array:
  """Slot of each new token, or `size` (out of range: not written) for padding (position < 0) and
  for a token a later token of the same pass overwrites (a chunk longer than a rolling buffer)."""
  valid = positions_BT >= 0
  last = jnp.max(jnp.where(valid, positions_BT, -1), axis=1, keepdims=True)
  keep = valid & (positions_BT > last - size)
  return jnp.where(keep, positions_BT % size, size)


@struct.dataclass
class CacheWrites:
  """A pass's writes into the cache as in-range indices (`plan_writes`), shared by every layer:
  token [b, t]'s value new[row[b, t], source[b, t]] goes to slot target[b, t] of row row[b, t]."""

  row: jax.Array  # [B, T]
  target: jax.Array  # [B, T]
  source: jax.Array  # [B, T]
  any: jax.Array  # [] whether the pass writes anything at all


def plan_writes(slots_BT: jax.Array, size: int) -> CacheWrites:
  """`write_slots`' slots (`size`: not written) as in-range writes. A token that is not written
  repeats the write of its row's last written token, or in a row that writes nothing, that of
  the first row that writes: the same slot and value, so the order of the duplicates cannot
  matter (a pass that writes nothing at all targets row 0's slot 0, and `scatter` writes back
  what is there). Why not out-of-range indices with mode='drop':
  their semantics are where XLA backends have gone wrong (the GPU's deterministic scatter,
  jax-ml/jax#27796; TPU's drop at some widths, vllm-project/tpu-inference#3334)."""
  B, T = slots_BT.shape
  written_BT = slots_BT < size
  t_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
  last_B = jnp.maximum(jnp.max(jnp.where(written_BT, t_BT, -1), axis=1), 0)
  writes_B = written_BT.any(axis=1)
  donor_B = jnp.where(writes_B, jnp.arange(B), jnp.argmax(writes_B))  # a row that writes
  source_B = last_B[donor_B]
  target_B = jnp.where(writes_B[donor_B], slots_BT[donor_B, source_B], 0)  # no row writes: slot 0
  return CacheWrites(
    row=jnp.where(written_BT, jnp.arange(B)[:, None], donor_B[:, None]),
    target=jnp.where(written_BT, slots_BT, target_B[:, None]),
    source=jnp.where(written_BT, t_BT, source_B[:, None]),
    any=writes_B.any(),
  )


def scatter(cache: jax.Array, new_BT: jax.Array, writes: CacheWrites, layer=None) -> jax.Array:
  """cache with new_BT's tokens written as `writes` plans (in-range indices only; a pass that
  writes nothing leaves it as it is): cache is [B, S, ...], or [L, B, S, ...] written at `layer`."""
  lead = () if layer is None else (layer,)
  values_BT = new_BT[writes.row, writes.source].astype(cache.dtype)
  # A pass that writes nothing rewrites slot 0 of row 0 as it is. The barrier keeps that read out
  # of the scatter's fusion, which would otherwise copy the whole cache to update it (+0.5 ms a
  # decoded token on the CPU).
  kept = jax.lax.optimization_barrier(cache[(*lead, 0, 0)])
  values_BT = jnp.where(writes.any, values_BT, kept)
  return cache.at[(*lead, writes.row, writes.target)].set(values_BT, mode='promise_in_bounds')


@struct.dataclass
class LayerCache:
  """One layer's view during a forward pass: the whole cache, this layer's index in it, and the
  writes of the new keys. The layer writes into the [L, ...] arrays directly, so with the cache
  donated every step updates it in place: no per-layer copy, no restacking of the layers."""

  k: jax.Array  # [L, B, S, K, H]
  v: jax.Array
  layer: jax.Array | int
  writes: CacheWrites  # where the new keys go
  write_first: bool = struct.field(pytree_node=False, default=True)

  def extend(self, k_BTKH, v_BTKH):
    """(keys and values to attend to, the updated (k, v) of all layers).

    write_first: write, then attend to the S slots (the mask's kv_positions are the updated
    cache's). Otherwise attend to [past S slots ; new T keys], then write: needed when a chunk
    is longer than a rolling buffer, whose later keys overwrite slots its earlier queries read."""
    k_all = scatter(self.k, k_BTKH, self.writes, self.layer)
    v_all = scatter(self.v, v_BTKH, self.writes, self.layer)
    if self.write_first:
      return (
        k_all[self.layer].astype(k_BTKH.dtype),
        v_all[self.layer].astype(v_BTKH.dtype),
        (k_all, v_all),
      )
    keys = jnp.concatenate([self.k[self.layer].astype(k_BTKH.dtype), k_BTKH], axis=1)
    values = jnp.concatenate([self.v[self.layer].astype(v_BTKH.dtype), v_BTKH], axis=1)
    return keys, values, (k_all, v_all)


def writes_first(q_len: int, window: int | None) -> bool:
  """Whether a pass of q_len tokens may write its keys before attending (`LayerCache.extend`):
  always for one token (the slot it overwrites holds a key W positions back, outside its window),
  and whenever there is no window (no rolling buffer, so no slot is reused within a pass)."""
  return q_len == 1 or window is None
