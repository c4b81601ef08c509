"""One attention function, several implementations (`model.attention.impl`).

    attend(q, k, v, mask=..., bias=...) = softmax(q·kᵀ·scale + bias) v        (Vaswani et al. 2017, eq. 1)

Shapes: q [B, T, N, H], k/v [B, S, K, H] with N a multiple of K. Grouped-query attention (GQA, MQA when
K = 1) works by viewing the N query heads as K groups of N/K heads that share one K/V head; K and V
are never repeated in memory.

What an implementation needs to know about the mask and the positional terms comes in two small
objects, so a blockwise or Pallas kernel (a later issue) can skip whole blocks and compute ALiBi
in-kernel instead of reading an [N, T, S] tensor:
  - `AttentionMask`: causal, sliding window, segment ids (packed documents), query offset.
  - `ScoreBias`: ALiBi slopes with positions, and/or a dense learned bias (T5, Shaw's key term).
  - `RelativeValues`: Shaw's value term, Σ_j p_ij · a^V[index_ij], added to the output.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

# Masked logits use a large finite value, not -inf: a fully masked row then stays finite (and is
# zeroed explicitly below) instead of producing NaN through exp(-inf - -inf).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@struct.dataclass
class AttentionMask:
  """Which (query, key) pairs may attend. Indices, not positions, define order.

  causal: key index j ≤ query index i. window: additionally i − j < window (the `window` most recent
  keys, the query itself included; Mistral's sliding window). Segment ids: only equal ids attend.
  q_offset: index of query 0 in the key sequence; None means S − T, i.e. the queries are the last T
  keys (bottom-right alignment, as in chunked prefill and decoding).
  """
  causal: bool = struct.field(pytree_node=False, default=True)
  window: int | None = struct.field(pytree_node=False, default=None)
  q_segment_ids: jax.Array | None = None  # [B, T]
  kv_segment_ids: jax.Array | None = None  # [B, S]
  q_offset: jax.Array | int | None = None  # scalar or [B]

  def allowed(self, q_len: int, kv_len: int) -> jax.Array:
    """Boolean [B or 1, 1, T, S]: True where query i may attend key j."""
    offset = kv_len - q_len if self.q_offset is None else self.q_offset
    q_idx = jnp.reshape(jnp.asarray(offset), (-1, 1)) + jnp.arange(q_len)  # [B|1, T]
    k_idx = jnp.arange(kv_len)
    distance = q_idx[:, :, None] - k_idx[None, None, :]  # [B|1, T, S], i − j
    ok = jnp.ones(distance.shape, dtype=bool)
    if self.causal:
      ok &= distance >= 0
    if self.window is not None:
      ok &= distance < self.window
      if not self.causal:
        ok &= distance > -self.window
    if self.q_segment_ids is not None:
      ok &= self.q_segment_ids[:, :, None] == self.kv_segment_ids[:, None, :]
    return ok[:, None]


@struct.dataclass
class ScoreBias:
  """Additive terms on the scaled attention logits, from a positional scheme.

  alibi_slopes [N] with q_positions [B, T] and kv_positions [B, S] add m_h·(pos_k − pos_q)
  (Press et al. 2022, sec. 3), which a kernel can compute on the fly. dense [B|1, N|1, T, S] is a
  learned bias (T5, Shaw's key term): autodiff gives its gradient through 'xla'.
  """
  alibi_slopes: jax.Array | None = None
  q_positions: jax.Array | None = None
  kv_positions: jax.Array | None = None
  dense: jax.Array | None = None

  def materialize(self) -> jax.Array:
    """The whole bias as one [B|1, N|1, T, S] float32 array."""
    total = 0.0
    if self.alibi_slopes is not None:
      rel_BTS = (self.kv_positions[:, None, :] - self.q_positions[:, :, None]).astype(jnp.float32)
      total = total + self.alibi_slopes.astype(jnp.float32)[None, :, None, None] * rel_BTS[:, None]
    if self.dense is not None:
      total = total + self.dense.astype(jnp.float32)
    return jnp.asarray(total)


@struct.dataclass
class RelativeValues:
  """Shaw et al. (2018) eq. 3: out_i += Σ_j p_ij · table[index_ij]. table [R, H], index [B|1, T, S]."""
  table: jax.Array
  index: jax.Array


def _split_heads_bias(bias_BNTS: jax.Array, n_kv: int) -> jax.Array:
  """[B|1, N|1, T, S] → [B|1, K|1, G|1, T, S] to line up with grouped logits."""
  b, n, t, s = bias_BNTS.shape
  if n == 1:
    return bias_BNTS[:, :, None]
  return bias_BNTS.reshape(b, n_kv, n // n_kv, t, s)


def xla_attention(q_BTNH, k_BSKH, v_BSKH, *, mask: AttentionMask, bias: ScoreBias | None,
                  rel_values: RelativeValues | None, scale: float, dropout_rate: float = 0.0,
                  dropout_rng: jax.Array | None = None) -> jax.Array:
  """The reference: materializes the [B, N, T, S] scores and lets XLA fuse what it can."""
  B, T, N, H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
  logits_BKGTS = jnp.einsum('btkgh,bskh->bkgts', q_BTKGH, k_BSKH,
                            preferred_element_type=jnp.float32) * scale
  if bias is not None:
    logits_BKGTS = logits_BKGTS + _split_heads_bias(bias.materialize(), K)
  allowed = mask.allowed(T, S)[:, :, None]  # [B|1, 1, 1, T, S]
  logits_BKGTS = jnp.where(allowed, logits_BKGTS, MASK_VALUE)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1)
  # A query with no visible key (e.g. padding) gets a zero output, never an average of masked values.
  probs_BKGTS = jnp.where(jnp.any(allowed, axis=-1, keepdims=True), probs_BKGTS, 0.0)
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs_BKGTS.shape)
    probs_BKGTS = jnp.where(keep, probs_BKGTS / (1.0 - dropout_rate), 0.0)
  out_BTKGH = jnp.einsum('bkgts,bskh->btkgh', probs_BKGTS.astype(v_BSKH.dtype), v_BSKH,
                         preferred_element_type=jnp.float32)
  if rel_values is not None:
    n_rel = rel_values.table.shape[0]
    onehot_BTSR = jax.nn.one_hot(rel_values.index, n_rel, dtype=jnp.float32)
    weights_BKGTR = jnp.einsum('bkgts,btsr->bkgtr', probs_BKGTS, onehot_BTSR)
    out_BTKGH = out_BTKGH + jnp.einsum('bkgtr,rh->btkgh', weights_BKGTR,
                                       rel_values.table.astype(jnp.float32))
  return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


# name → implementation. The kernels issue adds 'blockwise', 'pallas', 'cudnn' and 'auto'.
ATTENTION_IMPLS: dict[str, Callable[..., jax.Array]] = {
    'xla': xla_attention,
}


def attend(q_BTNH, k_BSKH, v_BSKH, *, mask: AttentionMask, bias: ScoreBias | None = None,
           rel_values: RelativeValues | None = None, scale: float | None = None,
           impl: str = 'xla', dropout_rate: float = 0.0,
           dropout_rng: jax.Array | None = None) -> jax.Array:
  """softmax(q·kᵀ·scale + bias)·v (+ Shaw's value term), by the implementation named `impl`."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention impl={impl!r}; allowed: {', '.join(sorted(ATTENTION_IMPLS))}")
  n_heads, n_kv = q_BTNH.shape[2], k_BSKH.shape[2]
  if n_heads % n_kv:
    raise ValueError(f'query heads ({n_heads}) must be a multiple of key/value heads ({n_kv})')
  if scale is None:
    scale = q_BTNH.shape[-1] ** -0.5
  return ATTENTION_IMPLS[impl](q_BTNH, k_BSKH, v_BSKH, mask=mask, bias=bias, rel_values=rel_values,
                               scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng)
