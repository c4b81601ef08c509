"""'blockwise' attention: the FlashAttention algorithm in plain JAX, O(N) memory, any backend.

Queries are cut into blocks of `block_q` rows and keys into blocks of `block_k` columns. Each query
block keeps a running row max m, normalizer l and unnormalized output acc while it walks its key
blocks (online softmax; Milakov & Gimelshein 2018; Dao et al. 2022, Alg. 1):

    s = softcap(q·kᵀ·scale) + bias,  m' = max(m, rowmax s),  p = exp(s − m'),
    l' = l·exp(m − m') + rowsum p,  acc' = acc·exp(m − m') + p·v,   out = acc / l.

Only an [B, N, block_q, block_k] score block ever exists. A query block visits only the key
blocks that can hold a visible key: causal stops at the diagonal and a sliding window starts at the
window's first block (pallas_kernels/block_ranges.py, shared with the Pallas kernel), so skipped
blocks cost nothing; with segment ids a block pair whose id ranges do not intersect is skipped by
`lax.cond`. A mask ordered by per-sequence positions (the KV cache's, `AttentionMask.kv_positions`)
has no static ranges: every pair is visited unless its [min, max] positions show that no query
can see any key (a key block entirely in every query's future or outside its window), again by
`lax.cond`. With a cache whose slots hold positions in order, that skips the causal upper half.

Two backward passes, picked by what the scores contain:
  - fixed modifiers only (mask, ALiBi): a hand-written backward (Dao 2023, Alg. 2) that recomputes
    each score block from the saved log-sum-exp; one pass over key blocks accumulates dK and dV per
    key block and dQ in an O(N) buffer, so the whole step is O(N) memory;
  - learned modifiers (a dense T5/Shaw bias, Shaw's value term) or dropout: the same forward as a
    `lax.scan` under `jax.checkpoint` per query block, so autodiff gives every gradient (the
    bias's included) while storing only one query block's residuals at a time.

Layout: heads first, each block contiguous: q → [nq, B, K, G, bq, H], k/v → [nk, B, K, bk, H]
(G = N/K query heads per KV head), so GQA is a batched matmul over (B, K) and K/V are never
repeated. Lengths that are not a multiple of the block are padded; padded keys are masked, padded
queries are dropped.
"""

# ~480 lines, over the 450 this repository aims for, on purpose: it is one algorithm (the layout,
# the forward, two backwards, the entry point) read top to bottom, like the Pallas kernels, and a
# split would only trade length for private imports between its halves.

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.block_ranges import MASK_VALUE, kv_block_range, q_block_range, visible
from pallas_kernels.common import flash_vjp, pad_to, padded_ids, round_up
from pallas_kernels.tile_math import softcapped, through_softcap

DEFAULT_BLOCK = 512  # CPU: big enough for efficient matmuls; [B, N, 512, 512] f32 is 1 MiB per head


@dataclasses.dataclass(frozen=True)
class BlockLayout:
  """Static facts about one call: lengths, blocks, mask rules. Hashable, so custom_vjp can hold it."""

  T: int
  S: int
  block_q: int
  block_k: int
  causal: bool
  window: int | None
  q_offset: int
  scale: float
  alibi: bool
  segments: bool
  by_position: bool = False  # order and validity from the mask's per-sequence positions
  softcap: float | None = None  # cap · tanh(x / cap) of the scaled logits x (Gemma 2); None: none

  @property
  def n_q_blocks(self) -> int:
    return -(-self.T // self.block_q)

  @property
  def n_k_blocks(self) -> int:
    return -(-self.S // self.block_k)


def _ranges(lay: BlockLayout) -> dict:
  return dict(
    block_q=lay.block_q,
    block_k=lay.block_k,
    q_len=lay.T,
    kv_len=lay.S,
    q_offset=lay.q_offset,
    causal=lay.causal,
    window=lay.window,
  )


def _key_block_range(i, lay: BlockLayout):
  """Key blocks [lo, hi) that hold a key visible from query block i (traced or int). Ordered by
  positions, every block may: `_needed` decides per block pair at run time instead."""
  if lay.by_position:
    return 0, lay.n_k_blocks
  return kv_block_range(i, **_ranges(lay))


def _query_block_range(j, lay: BlockLayout):
  """Query blocks [lo, hi) that see some key of key block j."""
  if lay.by_position:
    return 0, lay.n_q_blocks
  return q_block_range(j, **_ranges(lay))


# ----------------------------------------------------------------------------------------------
# Block layout in and out.
# ----------------------------------------------------------------------------------------------


def _q_blocks(x_BTNH, n_kv, block):
  """[B, T, N, H] → [nq, B, K, G, bq, H]."""
  B, T, N, H = x_BTNH.shape
  n = round_up(T, block) // block
  x = pad_to(x_BTNH, 1, n * block).reshape(B, n, block, n_kv, N // n_kv, H)
  return x.transpose(1, 0, 3, 4, 2, 5)


def _from_q_blocks(x_nBKGqH, T):
  n, B, K, G, bq, H = x_nBKGqH.shape
  return x_nBKGqH.transpose(1, 0, 4, 2, 3, 5).reshape(B, n * bq, K * G, H)[:, :T]


def _k_blocks(x_BSKH, block):
  """[B, S, K, H] → [nk, B, K, bk, H]."""
  B, S, K, H = x_BSKH.shape
  n = round_up(S, block) // block
  return pad_to(x_BSKH, 1, n * block).reshape(B, n, block, K, H).transpose(1, 0, 3, 2, 4)


def _seq_blocks(x, B, T, block):
  """Per-token ints, [B, T] or broadcastable to it → [n, B, block] int32 (edge-padded, so block
  min/max stay real values)."""
  n = round_up(T, block) // block
  return padded_ids(x, B, T, n * block).reshape(B, n, block).transpose(1, 0, 2)


def _aux_arrays(mask, bias, B, T, S, n_heads, n_kv, block_q, block_k):
  """The non-differentiable per-token inputs, in block layout."""
  aux = {}
  if mask.q_segment_ids is not None:
    q_seg = _seq_blocks(mask.q_segment_ids, B, T, block_q)
    kv_seg = _seq_blocks(mask.kv_segment_ids, B, S, block_k)
    aux.update(
      q_seg=q_seg,
      kv_seg=kv_seg,
      q_seg_range=(q_seg.min(-1), q_seg.max(-1)),
      kv_seg_range=(kv_seg.min(-1), kv_seg.max(-1)),
    )
  if mask.kv_positions is not None:
    q_pos = _seq_blocks(mask.q_positions, B, T, block_q)
    kv_pos = _seq_blocks(mask.kv_positions, B, S, block_k)
    aux.update(
      mask_q_pos=q_pos,
      mask_kv_pos=kv_pos,
      q_pos_range=(q_pos.min(-1), q_pos.max(-1)),
      kv_pos_range=_valid_range(kv_pos),
    )
  if bias is not None and bias.alibi_slopes is not None:
    aux['slopes'] = bias.alibi_slopes.astype(jnp.float32).reshape(n_kv, n_heads // n_kv)
    aux['q_pos'] = _seq_blocks(bias.q_positions, B, T, block_q)
    aux['kv_pos'] = _seq_blocks(bias.kv_positions, B, S, block_k)
  return aux


def _valid_range(pos_nBb):
  """Per key block and sequence, (min, max) of the filled slots' (>= 0) positions; (big, -1)
  when none is filled."""
  big = jnp.iinfo(jnp.int32).max // 2
  return jnp.where(pos_nBb >= 0, pos_nBb, big).min(-1), pos_nBb.max(-1)


# ----------------------------------------------------------------------------------------------
# One score block.
# ----------------------------------------------------------------------------------------------


def _block_scores(q_BKGqH, k_BKbH, i, j, aux, lay: BlockLayout):
  """Scaled, soft-capped, biased and masked logits [B, K, G, bq, bk] (float32), the allowed mask
  and the raw q·kᵀ (the soft cap's backward reads it, tile_math.through_softcap)."""
  logits = jnp.einsum('bkgqh,bksh->bkgqs', q_BKGqH, k_BKbH, preferred_element_type=jnp.float32)
  s = softcapped(logits * lay.scale, lay.softcap)
  kj = j * lay.block_k + jnp.arange(lay.block_k)
  if lay.by_position:  # [B, bq, bk]: distance in positions; a key at position < 0 is empty
    kv_pos = aux['mask_kv_pos'][j]
    distance = aux['mask_q_pos'][i][:, :, None] - kv_pos[:, None, :]
    ok = visible(distance, causal=lay.causal, window=lay.window)
    ok = ok & ((kv_pos >= 0) & (kj < lay.S)[None, :])[:, None, :]
    ok = ok[:, None, None]
  else:
    t = i * lay.block_q + jnp.arange(lay.block_q)
    distance = (lay.q_offset + t)[:, None] - kj[None, :]
    ok = visible(distance, causal=lay.causal, window=lay.window) & (kj[None, :] < lay.S)
    ok = ok[None, None, None]
  if lay.segments:
    same = aux['q_seg'][i][:, :, None] == aux['kv_seg'][j][:, None, :]  # [B, bq, bk]
    ok = ok & same[:, None, None]
  if lay.alibi:
    rel = (aux['kv_pos'][j][:, None, :] - aux['q_pos'][i][:, :, None]).astype(jnp.float32)
    s = s + aux['slopes'][None, :, :, None, None] * rel[:, None, None]
  return jnp.where(ok, s, MASK_VALUE), ok, logits


def _blocks_overlap(i, j, aux):
  """False only when no batch row of query block i shares a segment id with key block j."""
  q_lo, q_hi = aux['q_seg_range'][0][i], aux['q_seg_range'][1][i]
  k_lo, k_hi = aux['kv_seg_range'][0][j], aux['kv_seg_range'][1][j]
  return jnp.any((q_lo <= k_hi) & (k_lo <= q_hi))


def _positions_meet(i, j, aux, lay):
  """False only when no sequence has a query of block i that may see a key of block j."""
  q_lo, q_hi = aux['q_pos_range'][0][i], aux['q_pos_range'][1][i]
  k_lo, k_hi = aux['kv_pos_range'][0][j], aux['kv_pos_range'][1][j]
  meet = k_hi >= 0  # the block holds a filled slot
  if lay.causal:
    meet &= k_lo <= q_hi
  if lay.window is not None:
    meet &= k_hi > q_lo - lay.window
    if not lay.causal:
      meet &= k_lo < q_hi + lay.window
  return jnp.any(meet)


def _needed(i, j, aux, lay):
  """Whether block pair (i, j) may hold an allowed pair, beyond the static ranges; None: yes."""
  needed = None
  if lay.segments:
    needed = _blocks_overlap(i, j, aux)
  if lay.by_position:
    meet = _positions_meet(i, j, aux, lay)
    needed = meet if needed is None else needed & meet
  return needed


def _skip_unless_overlap(step, i, j, aux, lay, carry):
  needed = _needed(i, j, aux, lay)
  if needed is None:
    return step(carry)
  return lax.cond(needed, step, lambda c: c, carry)


def _online_softmax_step(carry, s, ok, v_BKbH, dropout=None):
  """Fold one score block into (m, l, acc); masked entries contribute exactly nothing.

  `dropout(p)` drops probabilities after the normalizer l has seen them. Returns the new carry,
  the probabilities that reached acc, and the factor exp(m − m') that rescaled it.
  """
  m, l, acc = carry
  # m only keeps exp finite: acc / l does not depend on it, so where autodiff differentiates this
  # (a dense or relative-index bias) its gradient, which cancels, is not taken. Taking it also
  # broke: the max's gradient is sum(t · [s == max]) / count, and with a soft cap at XLA:CPU's
  # --xla_backend_optimization_level=0 (make test's) every row's count was 0 (measured
  # 2026-11-30): the max and the comparison read s computed twice, differently, so 0 / 0.
  # A sink's gradient still flows: it is the first m (`_initial_carry`), and this step's
  # exp(m − m_new) carries it into l.
  m_new = lax.stop_gradient(jnp.maximum(m, s.max(-1)))
  p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
  correction = jnp.exp(m - m_new)
  l = l * correction + p.sum(-1)
  if dropout is not None:
    p = dropout(p)
  acc = acc * correction[..., None] + jnp.einsum(
    'bkgqs,bksh->bkgqh', p.astype(v_BKbH.dtype), v_BKbH, preferred_element_type=jnp.float32
  )
  return (m_new, l, acc), p, correction


def _finish(m, l, acc):
  """out = acc / l and the log-sum-exp; a row that saw no key gives out 0 (never NaN)."""
  seen = l > 0
  safe_l = jnp.where(seen, l, 1.0)
  out = jnp.where(seen[..., None], acc / safe_l[..., None], 0.0)
  return out, jnp.where(seen, m + jnp.log(safe_l), 0.0)


def _initial_carry(q_BKGqH, sinks_KG=None):
  """(m, l, acc) before any key: empty, or with sinks the sink's own term already folded in
  (m = s, l = exp(s − s) = 1, acc = 0: a score that joins the normalizer and carries no value)."""
  shape = q_BKGqH.shape[:-1]
  if sinks_KG is None:
    m, l = jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32)
  else:
    m = jnp.broadcast_to(sinks_KG.astype(jnp.float32)[None, :, :, None], shape)
    l = jnp.ones(shape, jnp.float32)
  return m, l, jnp.zeros(q_BKGqH.shape, jnp.float32)


# ----------------------------------------------------------------------------------------------
# Fixed score modifiers: hand-written backward.
# ----------------------------------------------------------------------------------------------


def _flash_forward(lay, q_blocks, k_blocks, v_blocks, aux):
  def query_block(_, xs):
    i, q = xs

    def visit(j, carry):
      def step(carry):
        s, ok, _ = _block_scores(q, k_blocks[j], i, j, aux, lay)
        return _online_softmax_step(carry, s, ok, v_blocks[j])[0]

      return _skip_unless_overlap(step, i, j, aux, lay, carry)

    lo, hi = _key_block_range(i, lay)
    out, lse = _finish(*lax.fori_loop(lo, hi, visit, _initial_carry(q)))
    return None, (out.astype(q.dtype), lse)

  _, (out_blocks, lse_blocks) = lax.scan(query_block, None, (jnp.arange(lay.n_q_blocks), q_blocks))
  return out_blocks, lse_blocks


def _flash_backward(
  lay, q_blocks, k_blocks, v_blocks, aux, out_blocks, lse_blocks, d_out_blocks, d_lse_blocks
):
  """Dao 2023, Alg. 2, one pass: for each key block, walk the query blocks that see it. (The
  natural-log lse's cotangent, zero here, enters delta as flash_vjp says.)"""
  dtype = q_blocks.dtype
  delta_blocks = jnp.sum(d_out_blocks.astype(jnp.float32) * out_blocks.astype(jnp.float32), -1)
  delta_blocks = delta_blocks - d_lse_blocks.astype(jnp.float32)

  def key_block(dq_acc, xs):
    j, k, v = xs

    def visit(i, carry):
      def step(carry):
        dk, dv, dq_acc = carry
        q, d_out = q_blocks[i], d_out_blocks[i]
        s, ok, logits = _block_scores(q, k, i, j, aux, lay)
        p = jnp.where(ok, jnp.exp(s - lse_blocks[i][..., None]), 0.0)
        dv = dv + jnp.einsum(
          'bkgqs,bkgqh->bksh', p.astype(dtype), d_out, preferred_element_type=jnp.float32
        )
        dp = jnp.einsum('bkgqh,bksh->bkgqs', d_out, v, preferred_element_type=jnp.float32)
        ds = through_softcap(p * (dp - delta_blocks[i][..., None]), logits, lay).astype(dtype)
        dk = dk + jnp.einsum('bkgqs,bkgqh->bksh', ds, q, preferred_element_type=jnp.float32)
        dq_i = dq_acc[i] + jnp.einsum(
          'bkgqs,bksh->bkgqh', ds, k, preferred_element_type=jnp.float32
        )
        return dk, dv, lax.dynamic_update_index_in_dim(dq_acc, dq_i, i, 0)

      return _skip_unless_overlap(step, i, j, aux, lay, carry)

    lo, hi = _query_block_range(j, lay)
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv, dq_acc = lax.fori_loop(lo, hi, visit, (zeros, zeros, dq_acc))
    return dq_acc, ((dk * lay.scale).astype(k.dtype), dv.astype(v.dtype))

  dq_acc, (dk_blocks, dv_blocks) = lax.scan(
    key_block,
    jnp.zeros(q_blocks.shape, jnp.float32),
    (jnp.arange(lay.n_k_blocks), k_blocks, v_blocks),
  )
  return (dq_acc * lay.scale).astype(dtype), dk_blocks, dv_blocks


_flash = flash_vjp(_flash_forward, _flash_backward)


# ----------------------------------------------------------------------------------------------
# Learned score modifiers or dropout: rematerialized scans, autodiff backward.
# ----------------------------------------------------------------------------------------------


def _dense_bias_blocks(dense, n_kv, lay):
  """[B|1, N|1, T, S] → [nq, nk, B|1, K|1, G|1, bq, bk], float32."""
  b, n, _, _ = dense.shape
  nq, nk, bq, bk = lay.n_q_blocks, lay.n_k_blocks, lay.block_q, lay.block_k
  x = pad_to(pad_to(dense.astype(jnp.float32), 2, nq * bq), 3, nk * bk)
  k, g = (n_kv, n // n_kv) if n > 1 else (1, 1)
  x = x.reshape(b, k, g, nq, bq, nk, bk)
  return x.transpose(3, 5, 0, 1, 2, 4, 6)


def _index_blocks(index_BTS, batch, lay):
  """Shaw's relative index [B|1, T, S] → [nq, nk, B|1, bq, bk]."""
  nq, nk, bq, bk = lay.n_q_blocks, lay.n_k_blocks, lay.block_q, lay.block_k
  x = pad_to(pad_to(index_BTS.astype(jnp.int32), 1, nq * bq, 'edge'), 2, nk * bk, 'edge')
  x = jnp.broadcast_to(x, (batch,) + x.shape[1:])  # einsum does not broadcast a size-1 batch
  return x.reshape(batch, nq, bq, nk, bk).transpose(1, 3, 0, 2, 4)


def _learned(
  q_blocks,
  k_blocks,
  v_blocks,
  aux,
  lay,
  dense_blocks,
  rel_table,
  index_blocks,
  dropout_rate,
  dropout_rng,
  sinks_KG=None,
):
  n_rel = 0 if rel_table is None else rel_table.shape[0]

  @jax.checkpoint
  def query_block(i, q, dense_row, index_row):
    def visit(carry, xs):
      j, k, v, dense, index = xs

      def drop(p):  # keyed by the block pair, so the rematerialized pass draws the same mask
        block_rng = jax.random.fold_in(jax.random.fold_in(dropout_rng, i), j)
        keep = jax.random.bernoulli(block_rng, 1.0 - dropout_rate, p.shape)
        return jnp.where(keep, p / (1.0 - dropout_rate), 0.0)

      def step(carry):
        m, l, acc, acc_rel = carry
        s, ok, _ = _block_scores(q, k, i, j, aux, lay)
        if dense is not None:
          s = jnp.where(ok, s + dense, MASK_VALUE)
        (m, l, acc), p, correction = _online_softmax_step(
          (m, l, acc), s, ok, v, drop if dropout_rate > 0.0 else None
        )
        if index is not None:  # Shaw's value term: accumulate the weight of each relative index
          onehot = jax.nn.one_hot(index, n_rel, dtype=jnp.float32)  # [B|1, bq, bk, R]
          acc_rel = acc_rel * correction[..., None] + jnp.einsum('bkgqs,bqsr->bkgqr', p, onehot)
        return m, l, acc, acc_rel

      lo, hi = _key_block_range(i, lay)
      needed = (j >= lo) & (j < hi)
      extra = _needed(i, j, aux, lay)
      if extra is not None:
        needed &= extra
      return lax.cond(needed, step, lambda c: c, carry), None

    m, l, acc = _initial_carry(q, sinks_KG)
    acc_rel = jnp.zeros(q.shape[:-1] + (n_rel,), jnp.float32)
    xs = (jnp.arange(lay.n_k_blocks), k_blocks, v_blocks, dense_row, index_row)
    (m, l, acc, acc_rel), _ = lax.scan(visit, (m, l, acc, acc_rel), xs)
    out, _ = _finish(m, l, acc)
    if rel_table is not None:
      weights, _ = _finish(m, l, acc_rel)
      out = out + jnp.einsum('bkgqr,rh->bkgqh', weights, rel_table.astype(jnp.float32))
    return out.astype(q.dtype)

  def scan_body(_, xs):
    return None, query_block(*xs)

  xs = (jnp.arange(lay.n_q_blocks), q_blocks, dense_blocks, index_blocks)
  return lax.scan(scan_body, None, xs)[1]


# ----------------------------------------------------------------------------------------------
# Entry point.
# ----------------------------------------------------------------------------------------------


def blockwise_attention(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  *,
  mask,
  bias=None,
  rel_values=None,
  scale: float,
  softcap: float | None = None,
  sinks=None,
  dropout_rate: float = 0.0,
  dropout_rng=None,
  block_q: int | None = None,
  block_k: int | None = None,
) -> jax.Array:
  """softmax(softcap(q·kᵀ·scale) + bias)·v without materializing the scores; see the module
  docstring. `sinks` [N] (each query head's sink logit) start each row's online softmax with the
  sink's term; their gradient, like a learned bias's, comes from autodiff."""
  B, T, N, _H = q_BTNH.shape
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  block_q = min(block_q or DEFAULT_BLOCK, T)
  block_k = min(block_k or DEFAULT_BLOCK, S)
  by_position = mask.kv_positions is not None
  lay = BlockLayout(
    T=T,
    S=S,
    block_q=block_q,
    block_k=block_k,
    causal=mask.causal,
    window=mask.window,
    q_offset=0 if by_position else mask.static_offset(T, S, 'blockwise'),
    scale=float(scale),
    alibi=bias is not None and bias.alibi_slopes is not None,
    segments=mask.q_segment_ids is not None,
    by_position=by_position,
    softcap=None if softcap is None else float(softcap),
  )
  aux = _aux_arrays(mask, bias, B, T, S, N, K, block_q, block_k)
  q_blocks = _q_blocks(q_BTNH, K, block_q)
  k_blocks, v_blocks = _k_blocks(k_BSKH, block_k), _k_blocks(v_BSKH, block_k)
  dense = None if bias is None else bias.dense
  dropout = dropout_rate > 0.0 and dropout_rng is not None
  if dense is None and rel_values is None and not dropout and sinks is None:
    out_blocks = _flash(lay, q_blocks, k_blocks, v_blocks, aux)[0]
  else:
    dense_blocks = None if dense is None else _dense_bias_blocks(dense, K, lay)
    index_blocks = None if rel_values is None else _index_blocks(rel_values.index, B, lay)
    out_blocks = _learned(
      q_blocks,
      k_blocks,
      v_blocks,
      aux,
      lay,
      dense_blocks,
      None if rel_values is None else rel_values.table,
      index_blocks,
      dropout_rate if dropout else 0.0,
      dropout_rng,
      None if sinks is None else sinks.reshape(K, N // K),
    )
  return _from_q_blocks(out_blocks, T)
