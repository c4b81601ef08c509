"""Which tiles of the score matrix hold an allowed (query, key) pair: the loop bounds of every
tiled attention (the Pallas kernel and mllm's 'blockwise'), so masked tiles are skipped, not computed.

Query t sits at key index i = q_offset + t. With causal, key j is visible iff j <= i; a window W
additionally needs i - j < W (and j - i < W when not causal). A query block's visible keys are
one interval (the union of its rows' intervals), so [lo, hi) bounds are exact, not conservative.
No Pallas import here: these are plain integer formulas.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

# Masked logits use a large finite value, not -inf: a fully masked row then stays finite (and is
# zeroed explicitly) instead of producing NaN through exp(-inf - -inf).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def visible(distance, *, causal: bool, window: int | None):
  """Boolean array: may a query see a key `distance` = i − j indices before it (the rule above)."""
  ok = jnp.ones(jnp.shape(distance), bool)
  if causal:
    ok &= distance >= 0
  if window is not None:
    ok &= distance < window
    if not causal:
      ok &= distance > -window
  return ok


# Bounds work on Python ints (tests, brute-force checks) and on traced int32 scalars in kernels,
# where `//` is not lowered; all operands of _div are non-negative, so lax.div is floor division.
def _is_int(*xs):
  return all(isinstance(x, int) for x in xs)


def _max(a, b):
  return max(a, b) if _is_int(a, b) else jnp.maximum(a, b)


def _min(a, b):
  return min(a, b) if _is_int(a, b) else jnp.minimum(a, b)


def _div(a, b):
  return a // b if _is_int(a, b) else lax.div(a, b)


def _select(c, a, b):
  if isinstance(c, bool):
    return a if c else b
  # int32 operands, not Python ints: Pallas's Triton lowering (jax 0.10-0.11) gives a weakly typed
  # literal operand of select_n the predicate's type, i1, and the loop bound then fails to verify.
  return jnp.where(c, jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def kv_block_range(q_block, *, block_q, block_k, q_len, kv_len, q_offset, causal, window):
  """[lo, hi) of the key blocks that hold an allowed key for some real query of `q_block`."""
  i_first = q_block * block_q + q_offset
  i_last = _min(q_block * block_q + block_q, q_len) - 1 + q_offset
  j_end = kv_len
  if causal:
    j_end = _min(j_end, i_last + 1)
  elif window is not None:
    j_end = _min(j_end, i_last + window)
  j_start = 0 if window is None else _max(0, i_first - window + 1)
  lo, hi = _div(j_start, block_k), _div(_max(j_end, 0) + block_k - 1, block_k)
  # Nothing to visit when the key interval is empty or the block holds only padding rows.
  return lo, _select(j_start < j_end, _select(q_block * block_q < q_len, hi, lo), lo)


def q_block_range(kv_block, *, block_q, block_k, q_len, kv_len, q_offset, causal, window):
  """[lo, hi) of the query blocks in which some real query may attend a key of `kv_block`."""
  j_first = kv_block * block_k
  j_last = _min(j_first + block_k, kv_len) - 1
  t_start, t_end = 0, q_len
  if causal:
    t_start = _max(0, j_first - q_offset)
  elif window is not None:
    t_start = _max(0, j_first - window + 1 - q_offset)
  if window is not None:
    t_end = _max(0, _min(q_len, j_last + window - q_offset))
  lo, hi = _div(t_start, block_q), _div(t_end + block_q - 1, block_q)
  return lo, _select(t_start < t_end, _select(j_first < kv_len, hi, lo), lo)
