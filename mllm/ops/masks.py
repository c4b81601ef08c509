"""What an attention implementation needs to know about the mask and the positional terms, as
small objects, so that the tiled implementations skip whole blocks and compute ALiBi in-kernel
instead of reading an [N, T, S] tensor:
  - `AttentionMask`: causal, sliding window, segment ids (packed documents), query offset.
  - `ScoreBias`: ALiBi slopes with positions, and/or a dense learned bias (T5, Shaw's key term).
  - `RelativeValues`: Shaw's value term, Σ_j p_ij · a^V[index_ij], added to the output.
Which implementation computes which of these terms is its record's business
(`AttentionImpl.lacks` in mllm/ops/attention.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.block_ranges import visible


@struct.dataclass
class AttentionMask:
  """Which (query, key) pairs may attend. Indices, not positions, define order.

  causal: key index j ≤ query index i. window: additionally i − j < window (the `window` most recent
  keys, the query itself included; Mistral's sliding window). Segment ids: only equal ids attend.
  q_offset: index of query 0 in the key sequence; None means S − T, i.e. the queries are the last T
  keys (bottom-right alignment, as in chunked prefill and decoding).
  q_positions / kv_positions (decoding with a KV cache): order by these per-sequence positions
  instead of by index, and a key at a negative position is an empty cache slot (never attended).
  'xla' and 'blockwise' read them, 'cudnn' as a dense mask; see `attend` for the others.
  """

  causal: bool = struct.field(pytree_node=False, default=True)
  window: int | None = struct.field(pytree_node=False, default=None)
  q_segment_ids: jax.Array | None = None  # [B, T]
  kv_segment_ids: jax.Array | None = None  # [B, S]
  q_offset: jax.Array | int | None = None  # scalar or [B]
  q_positions: jax.Array | None = None  # [B, T]
  kv_positions: jax.Array | None = None  # [B, S]

  def offset(self, q_len: int, kv_len: int):
    """Key index of query 0: q_offset, or kv_len − q_len (bottom-right) when it is None."""
    return kv_len - q_len if self.q_offset is None else self.q_offset

  def static_offset(self, q_len: int, kv_len: int, impl: str) -> int:
    """The offset as a Python int, for implementations that decide block skipping at trace time."""
    try:
      return int(self.offset(q_len, kv_len))
    except (TypeError, jax.errors.ConcretizationTypeError):
      raise ValueError(
        f"attention impl={impl!r} needs a static q_offset (a Python int or None); "
        "got a traced array: use impl='xla' for per-example offsets"
      ) from None

  def allowed(self, q_len: int, kv_len: int) -> jax.Array:
    """Boolean [B or 1, 1, T, S]: True where query i may attend key j."""
    if self.kv_positions is not None:
      distance = self.q_positions[:, :, None] - self.kv_positions[:, None, :]  # [B, T, S]
      ok = visible(distance, causal=self.causal, window=self.window)
      ok &= (self.kv_positions >= 0)[:, None, :]
      return ok[:, None]
    offset = self.offset(q_len, kv_len)
    q_idx = jnp.reshape(jnp.asarray(offset), (-1, 1)) + jnp.arange(q_len)  # [B|1, T]
    k_idx = jnp.arange(kv_len)
    distance = q_idx[:, :, None] - k_idx[None, None, :]  # [B|1, T, S], i − j
    ok = visible(distance, causal=self.causal, window=self.window)
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
