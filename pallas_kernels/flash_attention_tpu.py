"""FlashAttention-2 forward and backward as Pallas kernels lowered by Mosaic TPU; on CPU they run
in JAX's TPU interpreter (`interpret=True` here passes `pltpu.InterpretParams()`).

The tile math is the Triton kernel's (tile_math.py); what differs is how the tiles are walked,
the TPU way (jax's ops/tpu/flash_attention.py is the model):
- head-major inside: q [B, N, T, H], k/v [B, K, S, H], H padded to a multiple of 128 lanes;
- the key-block loop is the last grid axis, marked "arbitrary", with m, l and the accumulator in
  VMEM scratch, initialised and flushed under `pl.when` (forward: Dao 2023 Alg. 1);
- a skipped block costs no DMA: the K/V index_map clamps the key block into the query block's
  [lo, hi) of block_ranges, so a skipped step names the block already resident, and `pl.when`
  guards the compute. Segment ids skip by their per-block [min, max] (scalar-prefetched);
- row statistics (lse, delta) and query-side ids/positions are lane-broadcast to (rows, 128),
  key-side ones sublane-broadcast to (8, keys): the layouts Mosaic tiles natively;
- backward (Alg. 2): delta = rowsum(dO * O) in jnp, then dK/dV over the grid
  (B, K, key blocks, G, query blocks) -- a KV head's G query heads visited consecutively, so its
  dK/dV block accumulates in scratch with no atomics and K/V are never repeated -- and dQ over
  (B, N, query blocks, key blocks).
ALiBi slopes sit in SMEM, an (8, N) block read as slopes[0, n].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tile_math as tm
from pallas_kernels.block_ranges import MASK_VALUE, kv_block_range, q_block_range
from pallas_kernels.common import (
  LOG2_E,
  MaskRule,
  block_min_max,
  check_inputs,
  default_positions,
  flash_vjp,
  lse_grad_term,
  pad_to,
  padded_ids,
  round_up,
)

LANES, SUBLANES = 128, 8
DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K = 128, 128


@dataclasses.dataclass(frozen=True)
class _Cfg(MaskRule):
  block_q: int
  block_k: int

  def ranges(self):
    return dict(
      block_q=self.block_q,
      block_k=self.block_k,
      q_len=self.q_len,
      kv_len=self.kv_len,
      q_offset=self.q_offset,
      causal=self.causal,
      window=self.window,
    )


class _Extras(NamedTuple):
  """Side inputs in kernel layout (None when unused); never differentiated."""

  seg_ranges: tuple | None  # (q_min [B, nq], q_max, kv_min [B, nk], kv_max), scalar-prefetched
  q_seg: jax.Array | None  # [B, Tp, 128]
  kv_seg: jax.Array | None  # [B, 8, Sp]
  q_pos: jax.Array | None  # [B, Tp, 128]
  kv_pos: jax.Array | None  # [B, 8, Sp]
  slopes: jax.Array | None  # [8, N] float32


def _clamp(x, lo, hi, n):
  """x into [lo, hi), or lo when the range is empty -- the block a skipped step keeps resident --
  and always a real block of the n (an empty range may start past the end)."""
  return jnp.minimum(jnp.minimum(jnp.maximum(x, lo), jnp.maximum(hi - 1, lo)), n - 1)


def _pairs_meet(cfg, ranges, b, qb, kb):
  """May a query block and a key block share a segment id ([min, max] ranges intersect)?"""
  if not cfg.segments:
    return True
  q_min, q_max, kv_min, kv_max = ranges
  return (q_min[b, qb] <= kv_max[b, kb]) & (kv_min[b, kb] <= q_max[b, qb])


def _tile_scores(cfg, q_tH, k_sH, qb, kb, sides, slope):
  """tile_math.scores with the tile's indices and side inputs in TPU layout."""
  q_seg_ref, kv_seg_ref, q_pos_ref, kv_pos_ref = sides
  bq, bk = cfg.block_q, cfg.block_k
  i_t1 = qb * bq + cfg.q_offset + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
  j_1s = kb * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  col = lambda ref: None if ref is None else ref[:, :1]  # (rows, 128) -> (rows, 1)
  row = lambda ref: None if ref is None else ref[:1, :]  # (8, keys) -> (1, keys)
  return tm.scores(
    q_tH,
    k_sH,
    i_t1,
    j_1s,
    cfg,
    kv_padded=bool(cfg.kv_len % bk),
    qseg_t1=col(q_seg_ref),
    kseg_1s=row(kv_seg_ref),
    qpos_t1=col(q_pos_ref),
    kpos_1s=row(kv_pos_ref),
    slope=slope,
  )


def _split_refs(cfg, refs, n_main: int, n_out: int):
  """(segment-range prefetch refs, main inputs, side inputs, slopes, outputs, scratch)."""
  refs = list(refs)
  ranges = [refs.pop(0) for _ in range(4)] if cfg.segments else None
  main = [refs.pop(0) for _ in range(n_main)]
  take = lambda use: refs.pop(0) if use else None
  sides = (take(cfg.segments), take(cfg.segments), take(cfg.alibi), take(cfg.alibi))
  slopes = take(cfg.alibi)
  outs = [refs.pop(0) for _ in range(n_out)]
  return ranges, main, sides, slopes, outs, refs


# ---------------------------------------------------------------------------------------------
# Kernels. Grid axes are named in the comments; t = query rows of a tile, s = key rows.
# ---------------------------------------------------------------------------------------------


def _fwd_kernel(*refs, cfg):
  """Grid (B, N, query blocks, key blocks)."""
  ranges, (q_ref, k_ref, v_ref), sides, slopes_ref, (o_ref, lse_ref), scratch = _split_refs(
    cfg, refs, 3, 2
  )
  m_ref, l_ref, acc_ref = scratch
  b, n, qb, kb = (pl.program_id(a) for a in range(4))

  @pl.when(kb == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  lo, hi = kv_block_range(qb, **cfg.ranges())

  @pl.when((lo <= kb) & (kb < hi) & _pairs_meet(cfg, ranges, b, qb, kb))
  def _step():
    slope = slopes_ref[0, n] if cfg.alibi else None
    s_ts, mask_ts, _ = _tile_scores(cfg, q_ref[...], k_ref[...], qb, kb, sides, slope)
    acc, m_t1, l_t1 = tm.online_softmax_step(
      acc_ref[...], m_ref[:, :1], l_ref[:, :1], s_ts, mask_ts, v_ref[...], cfg
    )
    acc_ref[...] = acc
    m_ref[...] = jnp.broadcast_to(m_t1, m_ref.shape)
    l_ref[...] = jnp.broadcast_to(l_t1, l_ref.shape)

  @pl.when(kb == pl.num_programs(3) - 1)
  def _flush():
    o_tH, lse_t1 = tm.finish_rows(acc_ref[...], m_ref[:, :1], l_ref[:, :1])
    o_ref[...] = o_tH.astype(o_ref.dtype)
    lse_ref[...] = jnp.broadcast_to(lse_t1, lse_ref.shape)


def _dkv_kernel(*refs, cfg):
  """Grid (B, K, key blocks, G, query blocks): the G heads of a group one after the other."""
  ranges, main, sides, slopes_ref, (dk_ref, dv_ref), (dk_acc, dv_acc) = _split_refs(cfg, refs, 6, 2)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = main
  b, kh, kb, g, qb = (pl.program_id(a) for a in range(5))

  @pl.when((g == 0) & (qb == 0))
  def _init():
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

  lo, hi = q_block_range(kb, **cfg.ranges())

  @pl.when((lo <= qb) & (qb < hi) & _pairs_meet(cfg, ranges, b, qb, kb))
  def _step():
    slope = slopes_ref[0, kh * cfg.groups + g] if cfg.alibi else None
    q_tH, do_tH = q_ref[...], do_ref[...]
    s_ts, mask_ts, logits_ts = _tile_scores(cfg, q_tH, k_ref[...], qb, kb, sides, slope)
    p_ts, ds_ts = tm.grad_tile(
      s_ts, mask_ts, logits_ts, do_tH, v_ref[...], lse_ref[:, :1], delta_ref[:, :1], cfg
    )
    dv_acc[...] += tm.dot(p_ts.astype(do_tH.dtype), do_tH, 0, 0, cfg)
    dk_acc[...] += tm.dot(ds_ts.astype(q_tH.dtype), q_tH, 0, 0, cfg)

  @pl.when((g == cfg.groups - 1) & (qb == pl.num_programs(4) - 1))
  def _flush():
    dk_ref[...] = (dk_acc[...] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(*refs, cfg):
  """Grid (B, N, query blocks, key blocks)."""
  ranges, main, sides, slopes_ref, (dq_ref,), (dq_acc,) = _split_refs(cfg, refs, 6, 1)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = main
  b, n, qb, kb = (pl.program_id(a) for a in range(4))

  @pl.when(kb == 0)
  def _init():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  lo, hi = kv_block_range(qb, **cfg.ranges())

  @pl.when((lo <= kb) & (kb < hi) & _pairs_meet(cfg, ranges, b, qb, kb))
  def _step():
    slope = slopes_ref[0, n] if cfg.alibi else None
    k_sH = k_ref[...]
    s_ts, mask_ts, logits_ts = _tile_scores(cfg, q_ref[...], k_sH, qb, kb, sides, slope)
    _, ds_ts = tm.grad_tile(
      s_ts, mask_ts, logits_ts, do_ref[...], v_ref[...], lse_ref[:, :1], delta_ref[:, :1], cfg
    )
    dq_acc[...] += tm.dot(ds_ts.astype(k_sH.dtype), k_sH, 1, 0, cfg)

  @pl.when(kb == pl.num_programs(3) - 1)
  def _flush():
    dq_ref[...] = (dq_acc[...] * cfg.scale).astype(dq_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call builders. Index maps receive the grid indices, then the scalar-prefetch refs.
# ---------------------------------------------------------------------------------------------


def _side_specs(cfg, ex, q_block, kv_block):
  """BlockSpecs of the side inputs, given index maps (grid..., *prefetch) -> (b, q blk) and
  -> (b, kv blk)."""
  specs = []
  if cfg.segments or cfg.alibi:
    q_spec = pl.BlockSpec((None, cfg.block_q, LANES), lambda *a: (*q_block(*a), 0))
    kv_spec = pl.BlockSpec(
      (None, SUBLANES, cfg.block_k), lambda *a: (kv_block(*a)[0], 0, kv_block(*a)[1])
    )
    specs += [q_spec, kv_spec] * (int(cfg.segments) + int(cfg.alibi))
  if cfg.alibi:
    specs.append(pl.BlockSpec(ex.slopes.shape, lambda *_: (0, 0), memory_space=pltpu.SMEM))
  return specs


def _side_args(ex):
  return [x for x in (ex.q_seg, ex.kv_seg, ex.q_pos, ex.kv_pos, ex.slopes) if x is not None]


def _call(kernel, cfg, ex, grid, semantics, in_specs, out_specs, out_shape, scratch, args, name):
  prefetch = list(ex.seg_ranges) if cfg.segments else []
  return pl.pallas_call(
    functools.partial(kernel, cfg=cfg),
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(prefetch),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      scratch_shapes=scratch,
    ),
    out_shape=out_shape,
    name=name,
    compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
    interpret=pltpu.InterpretParams() if cfg.interpret else False,
  )(*prefetch, *args, *_side_args(ex))


def _forward(cfg, q_BNTH, k_BKSH, v_BKSH, ex):
  B, N, Tp, Hp = q_BNTH.shape
  bq, bk, G = cfg.block_q, cfg.block_k, cfg.groups

  def kv_blk(b, n, i, j, *_):  # the visited key block, or the one already resident
    return b, _clamp(j, *kv_block_range(i, **cfg.ranges()), k_BKSH.shape[2] // bk)

  q_tile = pl.BlockSpec((None, None, bq, Hp), lambda b, n, i, j, *_: (b, n, i, 0))
  kv_tile = pl.BlockSpec(
    (None, None, bk, Hp), lambda b, n, i, j, *_: (b, lax.div(n, G), kv_blk(b, n, i, j)[1], 0)
  )
  rows = pl.BlockSpec((None, None, bq, LANES), lambda b, n, i, j, *_: (b, n, i, 0))
  side = _side_specs(cfg, ex, lambda b, n, i, j, *_: (b, i), kv_blk)
  grid = (B, N, Tp // bq, k_BKSH.shape[2] // bk)
  return _call(
    _fwd_kernel,
    cfg,
    ex,
    grid,
    ('parallel', 'parallel', 'parallel', 'arbitrary'),
    [q_tile, kv_tile, kv_tile, *side],
    [q_tile, rows],
    [
      jax.ShapeDtypeStruct(q_BNTH.shape, q_BNTH.dtype),
      jax.ShapeDtypeStruct((B, N, Tp, LANES), jnp.float32),
    ],
    [
      pltpu.VMEM((bq, LANES), jnp.float32),
      pltpu.VMEM((bq, LANES), jnp.float32),
      pltpu.VMEM((bq, Hp), jnp.float32),
    ],
    (q_BNTH, k_BKSH, v_BKSH),
    'flash_attention_tpu_fwd',
  )


def _backward(cfg, q_BNTH, k_BKSH, v_BKSH, ex, o_BNTH, lse_BNT1, do_BNTH, d_lse_BNT1):
  B, N, Tp, Hp = q_BNTH.shape
  K, Sp = k_BKSH.shape[1], k_BKSH.shape[2]
  bq, bk, G = cfg.block_q, cfg.block_k, cfg.groups
  delta = jnp.einsum('bnth,bnth->bnt', o_BNTH.astype(jnp.float32), do_BNTH.astype(jnp.float32))
  # The lse leaves lane-broadcast: its lanes' cotangents add up.
  delta = delta - lse_grad_term(d_lse_BNT1.sum(-1))
  delta_BNT1 = jnp.broadcast_to(delta[..., None], (B, N, Tp, LANES))
  args = (q_BNTH, k_BKSH, v_BKSH, do_BNTH, lse_BNT1, delta_BNT1)

  # dK/dV: grid (B, K, key blocks, G, query blocks).
  def q_blk(b, h, j, g, i, *_):
    return b, _clamp(i, *q_block_range(j, **cfg.ranges()), Tp // bq)

  q_tile = pl.BlockSpec(
    (None, None, bq, Hp), lambda b, h, j, g, i, *_: (b, h * G + g, q_blk(b, h, j, g, i)[1], 0)
  )
  rows = pl.BlockSpec(
    (None, None, bq, LANES), lambda b, h, j, g, i, *_: (b, h * G + g, q_blk(b, h, j, g, i)[1], 0)
  )
  kv_tile = pl.BlockSpec((None, None, bk, Hp), lambda b, h, j, g, i, *_: (b, h, j, 0))
  side = _side_specs(cfg, ex, q_blk, lambda b, h, j, g, i, *_: (b, j))
  dk, dv = _call(
    _dkv_kernel,
    cfg,
    ex,
    (B, K, Sp // bk, G, Tp // bq),
    ('parallel', 'parallel', 'parallel', 'arbitrary', 'arbitrary'),
    [q_tile, kv_tile, kv_tile, q_tile, rows, rows, *side],
    [kv_tile, kv_tile],
    [jax.ShapeDtypeStruct(k_BKSH.shape, k_BKSH.dtype)] * 2,
    [pltpu.VMEM((bk, Hp), jnp.float32)] * 2,
    args,
    'flash_attention_tpu_dkv',
  )

  # dQ: grid (B, N, query blocks, key blocks), like the forward.
  def kv_blk(b, n, i, j, *_):
    return b, _clamp(j, *kv_block_range(i, **cfg.ranges()), Sp // bk)

  q_tile = pl.BlockSpec((None, None, bq, Hp), lambda b, n, i, j, *_: (b, n, i, 0))
  rows = pl.BlockSpec((None, None, bq, LANES), lambda b, n, i, j, *_: (b, n, i, 0))
  kv_tile = pl.BlockSpec(
    (None, None, bk, Hp), lambda b, n, i, j, *_: (b, lax.div(n, G), kv_blk(b, n, i, j)[1], 0)
  )
  side = _side_specs(cfg, ex, lambda b, n, i, j, *_: (b, i), kv_blk)
  dq = _call(
    _dq_kernel,
    cfg,
    ex,
    (B, N, Tp // bq, Sp // bk),
    ('parallel', 'parallel', 'parallel', 'arbitrary'),
    [q_tile, kv_tile, kv_tile, q_tile, rows, rows, *side],
    q_tile,
    jax.ShapeDtypeStruct(q_BNTH.shape, q_BNTH.dtype),
    [pltpu.VMEM((bq, Hp), jnp.float32)],
    args,
    'flash_attention_tpu_dq',
  )
  return dq, dk, dv


_flash = flash_vjp(_forward, _backward)


# ---------------------------------------------------------------------------------------------
# The public function: [B, T, N, H] in and out, like pallas_kernels.flash_attention_triton.
# ---------------------------------------------------------------------------------------------


def _block(requested, default, length, multiple, name):
  b = default if requested is None else requested
  if b < multiple or b % multiple:
    raise ValueError(f'{name} must be a positive multiple of {multiple} on TPU, got {b}')
  return min(b, round_up(length, multiple))


def _tiling(block_q, block_k, T: int, S: int, H: int):
  """(bq, bk, Tp, Sp, Hp): the tiles of both passes (the requested ones, else the defaults) and
  the lengths and head dim they pad to."""
  bq = _block(block_q, DEFAULT_BLOCK_Q, T, SUBLANES, 'block_q')
  bk = _block(block_k, DEFAULT_BLOCK_K, S, LANES, 'block_k')
  return bq, bk, round_up(T, bq), round_up(S, bk), round_up(H, LANES)


def _lanes(x_BT):
  """[B, T] -> [B, T, 128]: one query per sublane row."""
  return jnp.broadcast_to(x_BT[:, :, None], (*x_BT.shape, LANES))


def _sublanes(x_BS):
  """[B, S] -> [B, 8, S]: one key per lane."""
  return jnp.broadcast_to(x_BS[:, None, :], (x_BS.shape[0], SUBLANES, x_BS.shape[1]))


def _side_inputs(
  cfg, B, N, Tp, Sp, q_segment_ids, kv_segment_ids, q_positions, kv_positions, slopes
) -> _Extras:
  """The side inputs cfg asks for, in kernel layout: segment ids and their per-block [min, max],
  ALiBi positions (by default the key index) and the N slopes; None where unused."""
  T, S = cfg.q_len, cfg.kv_len
  if cfg.alibi:
    q_positions, kv_positions = default_positions(T, S, cfg.q_offset, q_positions, kv_positions)

  def ids(x, length, padded):
    return padded_ids(x, B, length, padded)

  seg_ranges = q_seg = kv_seg = q_pos = kv_pos = slopes_8N = None
  if cfg.segments:
    q_ids, kv_ids = ids(q_segment_ids, T, Tp), ids(kv_segment_ids, S, Sp)
    seg_ranges = (*block_min_max(q_ids, cfg.block_q), *block_min_max(kv_ids, cfg.block_k))
    q_seg, kv_seg = _lanes(q_ids), _sublanes(kv_ids)
  if cfg.alibi:
    q_pos, kv_pos = _lanes(ids(q_positions, T, Tp)), _sublanes(ids(kv_positions, S, Sp))
    slopes_8N = jnp.broadcast_to(jnp.asarray(slopes, jnp.float32)[None], (SUBLANES, N))
  return _Extras(seg_ranges, q_seg, kv_seg, q_pos, kv_pos, slopes_8N)


def _head_major(x, length: int, Hp: int):
  """[B, L, heads, H] -> [B, heads, length, Hp], zero-padded."""
  return pad_to(pad_to(x, 1, length), 3, Hp).transpose(0, 2, 1, 3)


def flash_attention(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  *,
  scale: float,
  softcap: float | None = None,
  causal: bool = True,
  window: int | None = None,
  q_offset: int | None = None,
  q_segment_ids=None,
  kv_segment_ids=None,
  alibi_slopes=None,
  q_positions=None,
  kv_positions=None,
  block_q: int | None = None,
  block_k: int | None = None,
  interpret: bool | None = None,
  return_lse: bool = False,
) -> jax.Array:
  """softmax(softcap(q k^T * scale) + alibi, masked) v on TPU; GQA when N is a multiple of K.

  The same contract as pallas_kernels.flash_attention_triton.flash_attention: query t (key index
  i = q_offset + t, default S - T) may attend key j iff (not causal or j <= i) and (window is
  None or (i - j < window and (causal or j - i < window))) and equal segment ids; ALiBi adds
  alibi_slopes[n] * (kv_positions[b, j] - q_positions[b, t]) after the soft cap (softcap: cap ·
  tanh(x / cap), None for none); a query with no allowed key returns 0. block_q (a multiple of
  8) and block_k (of 128) tile both passes. interpret: run in JAX's TPU interpreter (default:
  when the backend is not a TPU).
  """
  B, T, N, H = q_BTNH.shape
  _, S, K, _ = k_BSKH.shape
  check_inputs(q_BTNH, k_BSKH, v_BSKH, q_segment_ids, kv_segment_ids, window)
  if interpret is None:
    interpret = jax.default_backend() != 'tpu'
  q_offset = S - T if q_offset is None else int(q_offset)
  bq, bk, Tp, Sp, Hp = _tiling(block_q, block_k, T, S, H)
  cfg = _Cfg(
    scale=float(scale),
    softcap=None if softcap is None else float(softcap),
    causal=bool(causal),
    window=window,
    q_offset=q_offset,
    q_len=T,
    kv_len=S,
    groups=N // K,
    block_q=bq,
    block_k=bk,
    segments=q_segment_ids is not None,
    alibi=alibi_slopes is not None,
    interpret=bool(interpret),
    precision=lax.Precision.HIGHEST if q_BTNH.dtype == jnp.float32 else None,
  )
  ex = _side_inputs(
    cfg, B, N, Tp, Sp, q_segment_ids, kv_segment_ids, q_positions, kv_positions, alibi_slopes
  )
  o, lse = _flash(
    cfg, _head_major(q_BTNH, Tp, Hp), _head_major(k_BSKH, Sp, Hp), _head_major(v_BSKH, Sp, Hp), ex
  )
  o = o.transpose(0, 2, 1, 3)[:, :T, :, :H]
  if return_lse:  # natural log, [B, N, T]
    return o, lse[:, :, :T, 0] / LOG2_E
  return o
