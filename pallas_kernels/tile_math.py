"""The math of one (query tile, key tile) pair, shared by every flash-attention backend.

The Triton kernel (flash_attention_triton.py) and the Mosaic TPU kernel (flash_attention_tpu.py) differ
in how they walk the tiles and where they keep state; what they do to a tile is this. Scores are
in base 2 (logits * log2 e, so exp2 replaces exp and the saved LSE is base 2). Row statistics
(m, l, lse, delta) may be vectors `(t,)` (Triton) or columns `(t, 1)` (TPU, whose vector layout
wants 2-D values): every function here broadcasts them either way.

`rule` is the kernel's static config: scale, softcap, causal, window, q_offset, kv_len, segments,
alibi, precision (duck-typed; each backend has its own dataclass).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax

from pallas_kernels.block_ranges import MASK_VALUE

LOG2E = math.log2(math.e)


def dot(a, b, ca: int, cb: int, rule):
  """a · b contracting a's axis ca with b's axis cb, accumulated in float32."""
  return lax.dot_general(
    a, b, (((ca,), (cb,)), ((), ())), precision=rule.precision, preferred_element_type=jnp.float32
  )


def _across(x, shape):
  """A row statistic, (t,) or (t, 1), broadcast across a (t, s) tile. Explicitly: Mosaic GPU's
  layout inference follows a broadcast_in_dim of a row vector, not a (t, 1) intermediate."""
  return lax.broadcast_in_dim(x, shape, [0]) if x.ndim == 1 else jnp.broadcast_to(x, shape)


def _row_reduce(fn, x_ts, like):
  """fn over the key axis, shaped like the statistic `like` ((t,) or (t, 1))."""
  return fn(x_ts, axis=1, keepdims=like.ndim == 2)


def scores(q_tH, k_sH, i_t1, j_1s, rule, **kw):
  """(base-2 masked scores, mask (None when nothing needs masking), the raw q·kᵀ) of a tile:
  q·kᵀ, then `mask_logits` (whose keywords it takes). The backward reads q·kᵀ again
  (`through_softcap`); the forward drops it."""
  logits_ts = dot(q_tH, k_sH, 1, 1, rule)
  return *mask_logits(logits_ts, i_t1, j_1s, rule, **kw), logits_ts


def softcapped(x_ts, cap: float | None):
  """Attention-logit soft-capping (Gemma 2, Team et al. 2024): cap · tanh(x / cap) of the scaled
  logits x = q·kᵀ·scale, before ALiBi and the mask; x itself when cap is None."""
  return x_ts if cap is None else cap * jnp.tanh(x_ts / cap)


def softcap_slope(x_ts, cap: float):
  """d(cap · tanh(x / cap)) / dx = 1 − tanh²(x / cap)."""
  t_ts = jnp.tanh(x_ts / cap)
  return 1.0 - t_ts * t_ts


def through_softcap(ds_ts, logits_ts, rule):
  """A score gradient carried back through the cap (`softcap_slope`), x = q·kᵀ·scale recomputed
  from the raw `logits_ts` (either orientation: elementwise)."""
  if rule.softcap is None:
    return ds_ts
  return ds_ts * softcap_slope(logits_ts * rule.scale, rule.softcap)


def mask_logits(
  logits_ts,
  i_t1,
  j_1s,
  rule,
  *,
  kv_padded: bool,
  qseg_t1=None,
  kseg_1s=None,
  qpos_t1=None,
  kpos_1s=None,
  slope=None,
):
  """q·kᵀ of a tile (float32, unscaled) to base-2 masked scores, and the mask.

  i_t1 / j_1s: the tile's query index i = q_offset + t (a column) and key index j (a row);
  qseg/kseg, qpos/kpos the same way. kv_padded: the tile may hold padding keys (j >= kv_len).
  The mask rule is block_ranges.visible's, plus equal segment ids; ALiBi adds
  slope * (kpos - qpos) (Press et al. 2022, eq. in sec. 3), after the soft cap (`softcapped`),
  so a cap bounds what q and k learn and leaves ALiBi's distance penalty whole.
  """
  if rule.softcap is None:
    s_ts = logits_ts * (rule.scale * LOG2E)
  else:
    s_ts = softcapped(logits_ts * rule.scale, rule.softcap) * LOG2E
  if rule.alibi:
    s_ts += (slope * LOG2E) * (kpos_1s - qpos_t1).astype(jnp.float32)
  conds = []
  if kv_padded:
    conds.append(j_1s < rule.kv_len)
  if rule.causal:
    conds.append(j_1s <= i_t1)
  if rule.window is not None:
    conds.append(i_t1 - j_1s < rule.window)
    if not rule.causal:
      conds.append(j_1s - i_t1 < rule.window)
  if rule.segments:
    conds.append(qseg_t1 == kseg_1s)
  if not conds:
    return s_ts, None
  mask_ts = functools.reduce(jnp.logical_and, conds)
  return jnp.where(mask_ts, s_ts, MASK_VALUE), mask_ts


def masked_exp2(x_ts, mask_ts):
  # Zeroing (not just the MASK_VALUE logit) keeps a row with no allowed key at l == 0, p == 0.
  p_ts = jnp.exp2(x_ts)
  return p_ts if mask_ts is None else jnp.where(mask_ts, p_ts, 0.0)


def softmax_update(m_t, l_t, s_ts, mask_ts):
  """The statistics part of one key tile of FlashAttention-2's forward (Dao 2023, Alg. 1 lines
  8-10): the tile's probabilities p, the rescale alpha of the old accumulator, the new m and l."""
  m_new_t = jnp.maximum(m_t, _row_reduce(jnp.max, s_ts, m_t))
  alpha_t = jnp.exp2(m_t - m_new_t)
  p_ts = masked_exp2(s_ts - _across(m_new_t, s_ts.shape), mask_ts)
  return p_ts, alpha_t, m_new_t, alpha_t * l_t + _row_reduce(jnp.sum, p_ts, l_t)


def online_softmax_step(acc_tH, m_t, l_t, s_ts, mask_ts, v_sH, rule):
  """One key tile of the forward: m, l and the unnormalised accumulator after it."""
  p_ts, alpha_t, m_t, l_t = softmax_update(m_t, l_t, s_ts, mask_ts)
  acc_tH = _across(alpha_t, acc_tH.shape) * acc_tH + dot(p_ts.astype(v_sH.dtype), v_sH, 1, 0, rule)
  return acc_tH, m_t, l_t


def finish_rows(acc_tH, m_t, l_t):
  """The normalised output and the base-2 log-sum-exp; a row with no allowed key gives 0."""
  l_t = jnp.where(l_t == 0.0, 1.0, l_t)
  return acc_tH / _across(l_t, acc_tH.shape), m_t + jnp.log2(l_t)


def grad_tile(s_ts, mask_ts, logits_ts, do_tH, v_sH, lse_t, delta_t, rule):
  """P and dS / scale of a tile (Dao 2023, Alg. 2 lines 11-14), from its masked scores and its
  raw q·kᵀ (for the soft cap's derivative)."""
  p_ts = masked_exp2(s_ts - _across(lse_t, s_ts.shape), mask_ts)
  dp_ts = dot(do_tH, v_sH, 1, 1, rule)
  ds_ts = p_ts * (dp_ts - _across(delta_t, dp_ts.shape))
  return p_ts, through_softcap(ds_ts, logits_ts, rule)
