"""What every flash-attention backend's wrapper shares: the checks of its inputs, padding, the
static mask rule the kernels read (tile_math's `rule`) and the custom_vjp around a forward /
backward pair. mllm.ops.blockwise (the plain-JAX loop) uses the padding and the custom_vjp too."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class MaskRule:
  """The static facts of one call: the softmax scale and soft cap (None: none), the mask
  (block_ranges / tile_math), GQA's group size, which side inputs exist, and how the kernels run.
  Each backend's config extends it with its tiles."""

  scale: float
  softcap: float | None
  causal: bool
  window: int | None
  q_offset: int
  q_len: int
  kv_len: int
  groups: int
  segments: bool
  alibi: bool
  interpret: bool
  precision: lax.Precision | None


def check_inputs(q_BTNH, k_BSKH, v_BSKH, q_segment_ids, kv_segment_ids, window) -> None:
  """ValueError for shapes, dtypes or masks no kernel takes."""
  B, _, N, H = q_BTNH.shape
  K = k_BSKH.shape[2]
  if k_BSKH.shape != v_BSKH.shape or k_BSKH.shape[0] != B or k_BSKH.shape[3] != H or N % K:
    raise ValueError(f'bad shapes q={q_BTNH.shape} k={k_BSKH.shape} v={v_BSKH.shape}')
  if not q_BTNH.dtype == k_BSKH.dtype == v_BSKH.dtype:  # the MMAs want equal operand types
    raise ValueError(f'q, k, v dtypes differ: {q_BTNH.dtype}, {k_BSKH.dtype}, {v_BSKH.dtype}')
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError('pass both q_segment_ids and kv_segment_ids, or neither')
  if window is not None and window < 1:
    raise ValueError(f'window must be >= 1, got {window}')


def default_positions(T: int, S: int, q_offset: int, q_positions, kv_positions):
  """ALiBi's positions: the caller's, else the query's key index i = q_offset + t and j."""
  return (
    q_offset + jnp.arange(T) if q_positions is None else q_positions,
    jnp.arange(S) if kv_positions is None else kv_positions,
  )


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def pad_to(x, axis, size, mode='constant'):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, mode=mode)


def padded_ids(x, batch: int, length: int, padded: int):
  """Per-token int32 ids [B, padded]; edge padding keeps every block's [min, max] id range that
  of its real tokens."""
  return pad_to(jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch, length)), 1, padded, 'edge')


def block_min_max(ids_BL, block: int):
  """Per-block [min, max] of ids [B, L] (L a multiple of block): two [B, L // block] arrays, what
  a kernel compares to skip a tile pair whose segment ids cannot meet."""
  blocks = ids_BL.reshape(ids_BL.shape[0], -1, block)
  return blocks.min(-1), blocks.max(-1)


def flash_vjp(forward, backward):
  """attend(cfg, q, k, v, side) -> (out, lse) with FlashAttention's custom VJP:
  forward(cfg, q, k, v, side) -> (out, lse) saves (q, k, v, side, out, lse);
  backward(cfg, *saved, d_out, d_lse) -> (dq, dk, dv). The side inputs (ids, positions, slopes)
  get no gradient. The lse's cotangent (zero unless a caller uses it, as attention sinks do:
  mllm/ops/kernels.py) enters each row as ∂lse/∂S = P: dS = P ⊙ (dP − delta + d_lse), so a
  backward subtracts it from its delta (a kernel's base-2 lse: `lse_grad_term(d_lse)`)."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def attend(cfg, q, k, v, side):
    return forward(cfg, q, k, v, side)

  def fwd(cfg, q, k, v, side):
    out, lse = forward(cfg, q, k, v, side)
    return (out, lse), (q, k, v, side, out, lse)

  def bwd(cfg, saved, cotangents):
    d_out, d_lse = cotangents
    return (*backward(cfg, *saved, d_out, d_lse), jax.tree.map(lambda _: None, saved[3]))

  attend.defvjp(fwd, bwd)
  return attend


LOG2_E = 1.4426950408889634  # log2(e): the kernels' lse is base 2


def lse_grad_term(d_lse):
  """What a base-2 lse's cotangent takes from each row's delta = rowsum(dO ⊙ O) (`flash_vjp`)."""
  return d_lse.astype(jnp.float32) * LOG2_E
