"""`impl='splash'`: JAX's splash attention kernel (jax.experimental.pallas.ops.tpu.splash_attention)
behind mllm's attention contract.

Splash is a TPU kernel with block-sparse static masks (causal, local) evaluated from iota in the
kernel, segment ids, GQA (query head n reads KV head n // (N / K)) and its own backward. It takes one
example at a time, q [N, T, H] and k/v [K, S, H] with T and S multiples of its blocks, applies no
softmax scale (its soft cap, `attn_logits_soft_cap`, caps the logits it sees: q already scaled,
so Gemma 2's cap · tanh(q·kᵀ·scale / cap) as every implementation here) and has no additive
bias: so this adapter
- scales q, goes head-major, pads T and S to the blocks, and vmaps over the batch;
- builds the static mask once per shape (a host-side computation, cached) with the query offset
  (bottom-right by default) and masks padded keys with a segment id no query has;
- zeroes the rows of queries that see no key: splash would return the mean of v or NaN there.
ALiBi and learned biases go to 'pallas' / 'blockwise' (its record says it lacks them). Off a TPU it runs
in the Pallas HLO interpreter (slow; for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mllm.ops import mesh as on_mesh
from pallas_kernels.block_ranges import visible
from pallas_kernels.common import pad_to, round_up

BLOCK = 128  # splash's block sizes must divide the padded lengths; its own default


@functools.lru_cache(maxsize=32)
def _kernel(
  n_heads: int,
  Tp: int,
  Sp: int,
  causal: bool,
  window: int | None,
  offset: int,
  block_q: int,
  block_k: int,
  softcap: float | None,
  interpret: bool,
):
  """A splash kernel for one mask and shape (mask processing runs on the host: cached)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  shape = (Tp, Sp)
  if window is not None:  # the `window` most recent keys, self included (and ahead if not causal)
    base = sa.LocalMask(shape, window_size=(window - 1, 0 if causal else window - 1), offset=offset)
  elif causal:
    base = sa.CausalMask(shape, offset=offset)
  else:
    base = sa.FullMask(shape)
  blocks = sa.BlockSizes(
    block_q=block_q,
    block_kv=block_k,
    block_kv_compute=block_k,
    block_q_dkv=block_q,
    block_kv_dkv=block_k,
    block_kv_dkv_compute=block_k,
    block_q_dq=block_q,
    block_kv_dq=block_k,
  )
  # Concrete mask arrays even when first built inside a jit trace: the cache outlives traces.
  with jax.ensure_compile_time_eval():
    return sa.make_splash_mha_single_device(
      sa.MultiHeadMask([base] * n_heads),
      block_sizes=blocks,
      attn_logits_soft_cap=softcap,
      interpret=interpret,
    )


def _static_rows_with_keys(T: int, S: int, causal: bool, window: int | None, offset: int):
  """[T] bool (NumPy): does query t see any key by the causal/window rule alone."""
  d = (offset + np.arange(T))[:, None] - np.arange(S)[None, :]  # i - j
  with jax.ensure_compile_time_eval():  # static: a value, even inside a jit trace
    return np.asarray(visible(d, causal=causal, window=window)).any(-1)


def _rows_with_keys(q_seg_BT, kv_seg_BS, T, S, causal, window, offset, chunk=256):
  """[B, T] bool: does query t see a key with its segment id; chunks of queries at a time, so
  only a [B, chunk, S] boolean ever exists."""
  Tp = round_up(T, chunk)
  q_seg = pad_to(q_seg_BT, 1, Tp)
  j = jnp.arange(S)

  def block(t0):
    i = offset + t0 + jnp.arange(chunk)
    ok = visible(i[:, None] - j[None, :], causal=causal, window=window)  # [chunk, S]
    seg = lax.dynamic_slice_in_dim(q_seg, t0, chunk, axis=1)
    return jnp.any(ok[None] & (seg[:, :, None] == kv_seg_BS[:, None, :]), axis=-1)

  rows = lax.map(block, jnp.arange(0, Tp, chunk))  # [n_chunks, B, chunk]
  return rows.transpose(1, 0, 2).reshape(q_seg_BT.shape[0], Tp)[:, :T]


def tile_problem(key: str, value: int) -> str | None:
  """Why splash cannot take `value` as a tile (block_q / block_k), or None: the config check
  (model.attention.block_q, ...) and the call share it."""
  if value % BLOCK:
    return (
      f'splash tiles queries and keys in multiples of {BLOCK}; allowed: 128, 256, 512, ..., or '
      f'None for {BLOCK}'
    )
  return None


def _segment_ids(mask, B: int, T: int, S: int, Tp: int, Sp: int):
  """(query ids [B, T], key ids [B, S], both padded to [B, Tp] / [B, Sp]): the caller's segment
  ids (or 0); a padded key gets an id below every query's, so no query sees it."""
  segments = mask.q_segment_ids is not None

  def ids(x, length):
    return jnp.broadcast_to(jnp.asarray(x if segments else 0, jnp.int32), (B, length))

  q_ids, kv_ids = ids(mask.q_segment_ids, T), ids(mask.kv_segment_ids, S)
  pad_id = jnp.minimum(jnp.min(q_ids), jnp.min(kv_ids)) - 1
  q_ids_p = pad_to(q_ids, 1, Tp, 'edge')
  kv_ids_p = jnp.where(jnp.arange(Sp) < S, pad_to(kv_ids, 1, Sp), pad_id)
  return q_ids, kv_ids, q_ids_p, kv_ids_p


def splash_attention(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  *,
  mask,
  bias,
  rel_values,
  scale: float,
  softcap: float | None = None,
  sinks=None,
  dropout_rate: float = 0.0,
  dropout_rng=None,
  block_q: int | None = None,
  block_k: int | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """softmax(softcap(q kᵀ scale), masked) v through splash; the contract of mllm.ops.attention.attend."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa

  del bias, rel_values, sinks, dropout_rate, dropout_rng  # refused before the call (its record)
  B, T, N, _H = q_BTNH.shape
  S, _K = k_BSKH.shape[1], k_BSKH.shape[2]
  offset = mask.static_offset(T, S, 'splash')
  bq, bk = block_q or BLOCK, block_k or BLOCK
  for name, b in (('block_q', bq), ('block_k', bk)):
    if problem := tile_problem(name, b):
      raise ValueError(f'{name}={b}: {problem}')
  Tp, Sp = round_up(T, bq), round_up(S, bk)
  if interpret is None:
    interpret = on_mesh.backend() != 'tpu'
  softcap = None if softcap is None else float(softcap)
  kernel = _kernel(N, Tp, Sp, mask.causal, mask.window, offset, bq, bk, softcap, bool(interpret))

  def head_major(x, length):  # [B, L, heads, H] -> [B, heads, Lp, H]
    return pad_to(x, 1, length).transpose(0, 2, 1, 3)

  q = head_major((q_BTNH.astype(jnp.float32) * scale).astype(q_BTNH.dtype), Tp)
  k, v = head_major(k_BSKH, Sp), head_major(v_BSKH, Sp)
  segments = mask.q_segment_ids is not None
  q_ids = kv_ids = None
  if segments or Sp > S:
    q_ids, kv_ids, q_ids_p, kv_ids_p = _segment_ids(mask, B, T, S, Tp, Sp)
    out = jax.vmap(lambda q, k, v, qi, ki: kernel(q, k, v, segment_ids=sa.SegmentIds(qi, ki)))(
      q, k, v, q_ids_p, kv_ids_p
    )
  else:
    out = jax.vmap(kernel)(q, k, v)
  out_BTNH = out.transpose(0, 2, 1, 3)[:, :T]
  keep = _static_rows_with_keys(T, S, mask.causal, mask.window, offset)[None]  # [1, T]
  if segments:
    keep = keep & _rows_with_keys(q_ids, kv_ids, T, S, mask.causal, mask.window, offset)
  elif keep.all():
    return out_BTNH.astype(q_BTNH.dtype)
  return jnp.where(keep[:, :, None, None], out_BTNH, 0).astype(q_BTNH.dtype)
