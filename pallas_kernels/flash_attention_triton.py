"""FlashAttention-2 forward and backward in Pallas (Triton-style GPU kernels; CPU via interpret=True).

Forward = Algorithm 1 of FlashAttention-2 (Dao 2023, arXiv:2307.08691): one program per
(batch, query head, query block) keeps its Q tile resident, streams K/V tiles with an online
softmax (running max m, running sum l, unnormalized accumulator) and saves the per-row log-sum-exp.
Backward = Algorithm 2: delta = rowsum(dO * O) as a jnp preprocess, then one kernel per
(batch, KV head, key block) accumulating dK/dV over every query head of its GQA group (so no
atomics and K/V are never repeated), and one kernel per (batch, query head, query block) for dQ.

Layout: q [B, T, N, H], k/v [B, S, K, H] with query head n reading KV head n // (N // K) through
the BlockSpec index maps. Query t sits at key position q_offset + t (default S - T, bottom-right).
The wrapper pads T and S to a multiple of the (power-of-two) blocks and H to a power of two
(>= 16) with zeros; padded keys are masked, padded queries and head columns are sliced off.
Scores live in base 2 (logits * log2 e) so the kernels use exp2; the saved LSE is base 2 too.

Skipping: the key-block loop of a query block runs only over [kv_block_range) -- it stops at the
causal diagonal and starts at the first block inside the sliding window -- and the backward
query-block loop over [q_block_range). With segment ids, a (query block, key block) pair whose
[min, max] id ranges do not intersect is skipped by a lax.cond (sound for unsorted ids too).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import tile_math as tm
from pallas_kernels.block_ranges import MASK_VALUE, kv_block_range, q_block_range
from pallas_kernels.common import (
  LOG2_E,
  MaskRule,
  check_inputs,
  default_positions,
  flash_vjp,
  lse_grad_term,
  pad_to,
  padded_ids,
  round_up,
)


class BlockSizes(NamedTuple):
  block_q: int
  block_k: int
  block_q_bwd: int
  block_k_bwd: int


def _pad_head_dim(h: int) -> int:
  return max(16, pl.next_power_of_2(h))  # tl.dot wants every dimension >= 16


class Launch(NamedTuple):
  """Triton's warps and software-pipeline stages of the forward and of the backward kernels."""

  num_warps: int
  num_stages: int
  num_warps_bwd: int
  num_stages_bwd: int


def default_tiling(head_dim: int, backend: str) -> tuple[BlockSizes, Launch]:
  """Block sizes (powers of two) and launch settings for a head_dim on 'hopper' (an H100/H200:
  227 KiB of shared memory a block), another 'gpu' (an A100's 163 KiB) or 'cpu' (interpret
  mode, which ignores warps and stages)."""
  if backend == 'cpu':
    # The interpreter pays per loop iteration, not per flop: fewer, larger tiles are faster.
    return BlockSizes(128, 128, 128, 128), Launch(4, 2, 4, 2)
  # The backward kernels hold four tiles plus two f32 accumulators, hence smaller blocks.
  Hp = _pad_head_dim(head_dim)
  if Hp >= 256:  # not tuned on hardware
    return BlockSizes(64, 64, 32, 32), Launch(8, 2, 8, 2)
  if Hp > 64 and backend == 'hopper':
    # Tuned on an H100 (benchmarks/results/gpu-h100-3.md, D 128, N 4096, causal, bf16): the
    # forward alone ran best on 128 x 128 tiles with 8 warps and 3 stages (1.14 ms, 0.57 of
    # cuDNN, against 1.58 on 64 x 64), the backward on 64 x 64 with 4 warps and 2 stages (128-row
    # tiles in 3 stages exceed its shared memory; in 2, forward+backward took 4.5 ms, not 3.9).
    return BlockSizes(128, 128, 64, 64), Launch(8, 3, 4, 2)
  if Hp > 64:  # 64 x 64 in both passes: gpu-h100.md's tuning, which fits an A100's memory
    return BlockSizes(64, 64, 64, 64), Launch(4, 2, 4, 2)
  return BlockSizes(128, 128, 64, 64), Launch(4, 2, 4, 2)  # head_dim <= 64: not tuned


def gpu_kind() -> str:
  """'hopper' where JAX's first device has compute capability 9.x, else 'gpu'."""
  capability = getattr(jax.devices()[0], 'compute_capability', None)
  return 'hopper' if isinstance(capability, str) and capability.startswith('9.') else 'gpu'


DEFAULT_BLOCKS = {kind: default_tiling(128, kind)[0] for kind in ('hopper', 'gpu', 'cpu')}


@dataclasses.dataclass(frozen=True)
class _Cfg(MaskRule):
  blocks: BlockSizes
  launch: Launch

  def ranges(self, bwd: bool):
    bq, bk = self.blocks[2:] if bwd else self.blocks[:2]
    return dict(
      block_q=bq,
      block_k=bk,
      q_len=self.q_len,
      kv_len=self.kv_len,
      q_offset=self.q_offset,
      causal=self.causal,
      window=self.window,
    )


class _Extras(NamedTuple):
  """Optional per-token side inputs (None when unused); never differentiated."""

  q_seg_BT: jax.Array | None
  kv_seg_BS: jax.Array | None
  q_pos_BT: jax.Array | None
  kv_pos_BS: jax.Array | None
  slopes_N: jax.Array | None


def _scores(q_tH, k_sH, t0, j0, qseg_t, kseg_s, qpos_t, kpos_s, slope, cfg):
  """tile_math.scores for a tile starting at query row t0 and key j0 (vectors become columns)."""
  i_t1 = (t0 + cfg.q_offset + jnp.arange(q_tH.shape[0]))[:, None]
  j_1s = (j0 + jnp.arange(k_sH.shape[0]))[None, :]
  col = lambda x: None if x is None else x[:, None]
  row = lambda x: None if x is None else x[None, :]
  # Only a block-size that does not divide kv_len lets a visited tile hold padding keys.
  return tm.scores(
    q_tH,
    k_sH,
    i_t1,
    j_1s,
    cfg,
    kv_padded=bool(cfg.kv_len % k_sH.shape[0]),
    qseg_t1=col(qseg_t),
    kseg_1s=row(kseg_s),
    qpos_t1=col(qpos_t),
    kpos_1s=row(kpos_s),
    slope=slope,
  )


def _unless_disjoint(cfg, seg_range, seg_other, step, carry):
  """step(carry), skipped when the two tiles' segment-id [min, max] ranges cannot meet."""
  if not cfg.segments:
    return step(carry)
  lo, hi = seg_range
  meet = (jnp.min(seg_other) <= hi) & (lo <= jnp.max(seg_other))
  return lax.cond(meet, step, lambda c: c, carry)


def _fwd_kernel(
  q_ref, k_ref, v_ref, qseg_ref, kseg_ref, qpos_ref, kpos_ref, slopes_ref, o_ref, lse_ref, *, cfg
):
  n, qb = pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.blocks[:2]
  t0 = qb * bq
  q_tH = q_ref[...]
  qseg_t = qseg_ref[...] if cfg.segments else None
  seg_range = (jnp.min(qseg_t), jnp.max(qseg_t)) if cfg.segments else None
  qpos_t = qpos_ref[...] if cfg.alibi else None
  slope = slopes_ref[n] if cfg.alibi else None

  def body(kb, carry):
    j0 = kb * bk
    kseg_s = kseg_ref[pl.ds(j0, bk)] if cfg.segments else None

    def step(carry):
      acc_tH, m_t, l_t = carry
      kpos_s = kpos_ref[pl.ds(j0, bk)] if cfg.alibi else None
      s_ts, mask_ts, _ = _scores(
        q_tH, k_ref[pl.ds(j0, bk), :], t0, j0, qseg_t, kseg_s, qpos_t, kpos_s, slope, cfg
      )
      return tm.online_softmax_step(acc_tH, m_t, l_t, s_ts, mask_ts, v_ref[pl.ds(j0, bk), :], cfg)

    return _unless_disjoint(cfg, seg_range, kseg_s, step, carry)

  lo, hi = kv_block_range(qb, **cfg.ranges(bwd=False))
  init = (
    jnp.zeros(q_tH.shape, jnp.float32),
    jnp.full((bq,), MASK_VALUE, jnp.float32),
    jnp.zeros((bq,), jnp.float32),
  )
  o_tH, lse_t = tm.finish_rows(*lax.fori_loop(lo, hi, body, init))
  o_ref[...] = o_tH.astype(o_ref.dtype)
  lse_ref[...] = lse_t


def _grad_tile(
  q_tH, k_sH, v_sH, do_tH, lse_t, delta_t, t0, j0, qseg_t, kseg_s, qpos_t, kpos_s, slope, cfg
):
  s_ts, mask_ts, logits_ts = _scores(q_tH, k_sH, t0, j0, qseg_t, kseg_s, qpos_t, kpos_s, slope, cfg)
  return tm.grad_tile(s_ts, mask_ts, logits_ts, do_tH, v_sH, lse_t, delta_t, cfg)


def _dkv_kernel(
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  qseg_ref,
  kseg_ref,
  qpos_ref,
  kpos_ref,
  slopes_ref,
  dk_ref,
  dv_ref,
  *,
  cfg,
):
  kh, kb = pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.blocks[2:]
  j0 = kb * bk
  k_sH, v_sH = k_ref[...], v_ref[...]
  kseg_s = kseg_ref[...] if cfg.segments else None
  seg_range = (jnp.min(kseg_s), jnp.max(kseg_s)) if cfg.segments else None
  kpos_s = kpos_ref[...] if cfg.alibi else None
  lo, hi = q_block_range(kb, **cfg.ranges(bwd=True))  # the same for every head of the group

  def head_body(g, carry):
    slope = slopes_ref[kh * cfg.groups + g] if cfg.alibi else None

    def q_body(qb, carry):
      rows = pl.ds(qb * bq, bq)
      qseg_t = qseg_ref[rows] if cfg.segments else None

      def step(carry):
        dk_sH, dv_sH = carry
        q_tH, do_tH = q_ref[rows, g, :], do_ref[rows, g, :]
        qpos_t = qpos_ref[rows] if cfg.alibi else None
        p_ts, ds_ts = _grad_tile(
          q_tH,
          k_sH,
          v_sH,
          do_tH,
          lse_ref[g, rows],
          delta_ref[g, rows],
          qb * bq,
          j0,
          qseg_t,
          kseg_s,
          qpos_t,
          kpos_s,
          slope,
          cfg,
        )
        dv_sH += tm.dot(p_ts.astype(do_tH.dtype), do_tH, 0, 0, cfg)
        dk_sH += tm.dot(ds_ts.astype(q_tH.dtype), q_tH, 0, 0, cfg)
        return dk_sH, dv_sH

      return _unless_disjoint(cfg, seg_range, qseg_t, step, carry)

    return lax.fori_loop(lo, hi, q_body, carry)

  zeros_sH = jnp.zeros(k_sH.shape, jnp.float32)
  dk_sH, dv_sH = lax.fori_loop(0, cfg.groups, head_body, (zeros_sH, zeros_sH))
  dk_ref[...] = (dk_sH * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_sH.astype(dv_ref.dtype)


def _dq_kernel(
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  qseg_ref,
  kseg_ref,
  qpos_ref,
  kpos_ref,
  slopes_ref,
  dq_ref,
  *,
  cfg,
):
  n, qb = pl.program_id(1), pl.program_id(2)
  bq, bk = cfg.blocks[2:]
  q_tH, do_tH, lse_t, delta_t = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  qseg_t = qseg_ref[...] if cfg.segments else None
  seg_range = (jnp.min(qseg_t), jnp.max(qseg_t)) if cfg.segments else None
  qpos_t = qpos_ref[...] if cfg.alibi else None
  slope = slopes_ref[n] if cfg.alibi else None

  def body(kb, dq_tH):
    keys = pl.ds(kb * bk, bk)
    kseg_s = kseg_ref[keys] if cfg.segments else None

    def step(dq_tH):
      k_sH = k_ref[keys, :]
      kpos_s = kpos_ref[keys] if cfg.alibi else None
      _, ds_ts = _grad_tile(
        q_tH,
        k_sH,
        v_ref[keys, :],
        do_tH,
        lse_t,
        delta_t,
        qb * bq,
        kb * bk,
        qseg_t,
        kseg_s,
        qpos_t,
        kpos_s,
        slope,
        cfg,
      )
      return dq_tH + tm.dot(ds_ts.astype(k_sH.dtype), k_sH, 1, 0, cfg)

    return _unless_disjoint(cfg, seg_range, kseg_s, step, dq_tH)

  lo, hi = kv_block_range(qb, **cfg.ranges(bwd=True))
  dq_tH = lax.fori_loop(lo, hi, body, jnp.zeros(q_tH.shape, jnp.float32))
  dq_ref[...] = (dq_tH * cfg.scale).astype(dq_ref.dtype)


def _side_specs(ex, q_spec, kv_spec):
  """BlockSpecs of the optional inputs, given those of a query-long and a key-long id array."""

  def opt(x, spec):
    return None if x is None else spec

  slopes = None if ex.slopes_N is None else pl.BlockSpec(ex.slopes_N.shape, lambda *_: (0,))
  return [
    opt(ex.q_seg_BT, q_spec),
    opt(ex.kv_seg_BS, kv_spec),
    opt(ex.q_pos_BT, q_spec),
    opt(ex.kv_pos_BS, kv_spec),
    slopes,
  ]


def _call(kernel, cfg, grid, in_specs, out_specs, out_shape, args, name, bwd=False):
  warps, stages = cfg.launch[2:] if bwd else cfg.launch[:2]
  return pl.pallas_call(
    functools.partial(kernel, cfg=cfg),
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    interpret=cfg.interpret,
    name=name,
    # A Triton dataclass also selects the Triton (not Mosaic GPU) lowering.
    compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
  )(*args)


def _per_q_block_specs(ex, bq, Sp, Hp, G):
  """Specs for a grid (B, N, query blocks): a Q-like tile, all keys of the KV head, row stats."""
  q_tile = pl.BlockSpec((None, bq, None, Hp), lambda b, n, i: (b, i, n, 0))
  kv_all = pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0))
  row_tile = pl.BlockSpec((None, None, bq), lambda b, n, i: (b, n, i))
  side = _side_specs(
    ex,
    pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
    pl.BlockSpec((None, Sp), lambda b, n, i: (b, 0)),
  )
  return q_tile, kv_all, row_tile, side


def _forward(cfg, q_BTNH, k_BSKH, v_BSKH, ex):
  B, Tp, N, Hp = q_BTNH.shape
  bq = cfg.blocks.block_q
  q_tile, kv_all, row_tile, side = _per_q_block_specs(ex, bq, k_BSKH.shape[1], Hp, cfg.groups)
  return _call(
    _fwd_kernel,
    cfg,
    (B, N, Tp // bq),
    [q_tile, kv_all, kv_all, *side],
    [q_tile, row_tile],
    [
      jax.ShapeDtypeStruct(q_BTNH.shape, q_BTNH.dtype),
      jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
    ],
    (q_BTNH, k_BSKH, v_BSKH, *ex),
    'flash_attention_fwd',
  )


def _backward(cfg, q_BTNH, k_BSKH, v_BSKH, ex, o_BTNH, lse_BNT, do_BTNH, d_lse_BNT):
  B, Tp, N, Hp = q_BTNH.shape
  Sp, K, G = k_BSKH.shape[1], k_BSKH.shape[2], cfg.groups
  bq, bk = cfg.blocks[2:]
  delta_BNT = jnp.einsum('btnh,btnh->bnt', o_BTNH.astype(jnp.float32), do_BTNH.astype(jnp.float32))
  delta_BNT = delta_BNT - lse_grad_term(d_lse_BNT)
  args = (q_BTNH, k_BSKH, v_BSKH, do_BTNH, lse_BNT, delta_BNT, *ex)

  # dK/dV: grid (B, K, key blocks); a program reads the queries of all G heads of its group.
  q_group = pl.BlockSpec((None, Tp, G, Hp), lambda b, h, j: (b, 0, h, 0))
  kv_tile = pl.BlockSpec((None, bk, None, Hp), lambda b, h, j: (b, j, h, 0))
  rows_group = pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))
  side = _side_specs(
    ex,
    pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)),
    pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
  )
  dk_BSKH, dv_BSKH = _call(
    _dkv_kernel,
    cfg,
    (B, K, Sp // bk),
    [q_group, kv_tile, kv_tile, q_group, rows_group, rows_group, *side],
    [kv_tile, kv_tile],
    [jax.ShapeDtypeStruct(k_BSKH.shape, k_BSKH.dtype)] * 2,
    args,
    'flash_attention_dkv',
    bwd=True,
  )

  q_tile, kv_all, row_tile, side = _per_q_block_specs(ex, bq, Sp, Hp, G)
  dq_BTNH = _call(
    _dq_kernel,
    cfg,
    (B, N, Tp // bq),
    [q_tile, kv_all, kv_all, q_tile, row_tile, row_tile, *side],
    q_tile,
    jax.ShapeDtypeStruct(q_BTNH.shape, q_BTNH.dtype),
    args,
    'flash_attention_dq',
    bwd=True,
  )
  return dq_BTNH, dk_BSKH, dv_BSKH


_flash = flash_vjp(_forward, _backward)


def _block(requested, default, length):
  b = default if requested is None else requested
  if b < 16 or b & (b - 1):  # Triton tensors are power-of-two sized; tl.dot needs >= 16
    raise ValueError(f'block sizes must be powers of two >= 16, got {b}')
  return min(b, max(16, pl.next_power_of_2(length)))


def _tiling(block_q, block_k, T: int, S: int, H: int, default: BlockSizes):
  """(blocks, Tp, Sp, Hp): the tiles of both passes (the requested ones, else `default`) and the
  lengths and head dim they pad to."""
  blocks = BlockSizes(
    _block(block_q, default.block_q, T),
    _block(block_k, default.block_k, S),
    _block(block_q, default.block_q_bwd, T),
    _block(block_k, default.block_k_bwd, S),
  )
  # Powers of two: the larger of the fwd/bwd blocks is a multiple of the smaller.
  Tp = round_up(T, max(blocks.block_q, blocks.block_q_bwd))
  Sp = round_up(S, max(blocks.block_k, blocks.block_k_bwd))
  return blocks, Tp, Sp, _pad_head_dim(H)


def _side_inputs(cfg, B, Tp, Sp, q_segment_ids, kv_segment_ids, q_positions, kv_positions, slopes):
  """The side inputs cfg asks for: segment ids and ALiBi positions (by default the key index) as
  [B, padded] int32, the slopes as float32; None where unused."""
  T, S = cfg.q_len, cfg.kv_len
  if cfg.alibi:
    q_positions, kv_positions = default_positions(T, S, cfg.q_offset, q_positions, kv_positions)

  def side(x, length, padded, use):
    return padded_ids(x, B, length, padded) if use else None

  return _Extras(
    side(q_segment_ids, T, Tp, cfg.segments),
    side(kv_segment_ids, S, Sp, cfg.segments),
    side(q_positions, T, Tp, cfg.alibi),
    side(kv_positions, S, Sp, cfg.alibi),
    jnp.asarray(slopes, jnp.float32) if cfg.alibi else None,
  )


def _pad(x, length: int, Hp: int):
  """[B, L, heads, H] zero-padded to [B, length, heads, Hp]."""
  return pad_to(pad_to(x, 1, length), 3, Hp)


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
  num_warps: int | None = None,
  num_stages: int | None = None,
  interpret: bool | None = None,
  return_lse: bool = False,
) -> jax.Array:
  """softmax(softcap(q k^T * scale) + alibi, masked) v; GQA when N is a multiple of K.

  Query t may attend key j iff (not causal or j <= i) and (window is None or (i - j < window and
  (causal or j - i < window))) and equal segment ids, where i = q_offset + t (default S - T).
  ALiBi adds alibi_slopes[n] * (kv_positions[b, j] - q_positions[b, t]); positions default to
  i and j. softcap: cap · tanh(x / cap) of the scaled logits x (Gemma 2), None for none. A query
  with no allowed key returns 0. block_q/block_k (powers of two, >= 16) set the
  tiles of both passes; by default default_tiling() picks them. return_lse: also each row's
  log-sum-exp [B, N, T] (natural log; differentiable: attention sinks use it).
  """
  B, T, N, H = q_BTNH.shape
  _, S, K, _ = k_BSKH.shape
  check_inputs(q_BTNH, k_BSKH, v_BSKH, q_segment_ids, kv_segment_ids, window)
  if interpret is None:
    interpret = jax.default_backend() == 'cpu'
  q_offset = S - T if q_offset is None else int(q_offset)
  default_blocks, default_launch = default_tiling(H, 'cpu' if interpret else gpu_kind())
  blocks, Tp, Sp, Hp = _tiling(block_q, block_k, T, S, H, default_blocks)
  cfg = _Cfg(
    scale=float(scale),
    softcap=None if softcap is None else float(softcap),
    causal=bool(causal),
    window=window,
    q_offset=q_offset,
    q_len=T,
    kv_len=S,
    groups=N // K,
    blocks=blocks,
    launch=Launch(
      *(given or default for given, default in zip((num_warps, num_stages) * 2, default_launch))
    ),
    interpret=bool(interpret),
    segments=q_segment_ids is not None,
    alibi=alibi_slopes is not None,
    # Triton's default f32 dot is TF32 (~1e-3 error); ask for IEEE f32 on f32 inputs.
    precision=lax.Precision.HIGHEST if q_BTNH.dtype == jnp.float32 else None,
  )
  ex = _side_inputs(
    cfg, B, Tp, Sp, q_segment_ids, kv_segment_ids, q_positions, kv_positions, alibi_slopes
  )
  o, lse = _flash(cfg, _pad(q_BTNH, Tp, Hp), _pad(k_BSKH, Sp, Hp), _pad(v_BSKH, Sp, Hp), ex)
  if return_lse:  # natural log, [B, N, T]
    return o[:, :T, :, :H], lse[:, :, :T] / LOG2_E
  return o[:, :T, :, :H]
