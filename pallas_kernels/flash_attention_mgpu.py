"""FlashAttention forward for Hopper GPUs in Pallas's Mosaic GPU backend, FA3's structure (Shah et
al. 2024): per CTA two compute warpgroups, each owning a 64-row query tile, and one producer
warpgroup streaming K/V tiles into a ring of `steps` shared-memory slots with TMA, the slots
handed over by barriers (ready: the copy landed; consumed: both compute warpgroups are done).
Q·Kᵀ and P·V are warpgroup MMAs (wgmma) with float32 accumulators.

The tile math is the other backends' (tile_math.py). Skipping: the producer streams the union of
the two tiles' key-block ranges (block_ranges.kv_block_range), and a compute warpgroup computes
only the blocks of its own range whose segment-id [min, max] meets its tile's; it still arrives
on every consumed barrier, so the ring stays in step.

Interpret mode (CPU, tests): JAX's Mosaic GPU interpreter has no rule for a register-held MMA
operand or `run_state` (jax 0.10.2 and 0.11.2), nor, in 0.10.2, for a transposed shared-memory
operand, which is how Q·Kᵀ and P·V are written for the hardware. In interpret mode exactly those two products are `jnp.dot`s on the same
shared-memory tiles; everything else (TMA copies, barriers, warpgroups, masks, the softmax) is
what the GPU runs. The hardware path is checked by lowering for CUDA on CPU (tests).
Layout: q [B, T, N, H], k/v [B, S, K, H] (the caller's; TMA reads a head's rows with a stride).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tile_math as tm
from pallas_kernels.common import (MaskRule, block_min_max, check_inputs, default_positions,
                                    pad_to, padded_ids, round_up)
from pallas_kernels.block_ranges import MASK_VALUE, kv_block_range

BLOCK_Q = 64   # rows of a warpgroup's query tile: wgmma's M
HEAD_MULTIPLE = 64  # head_dim is padded to this: one 128-byte swizzle row of 16-bit elements
DEFAULT_BLOCK_K, DEFAULT_STEPS = 128, 2


@dataclasses.dataclass(frozen=True)
class _Cfg(MaskRule):
  block_k: int
  steps: int

  def ranges(self):
    return dict(block_q=BLOCK_Q, block_k=self.block_k, q_len=self.q_len, kv_len=self.kv_len,
                q_offset=self.q_offset, causal=self.causal, window=self.window)


def _interpret_params():
  # Private in jax 0.10.2 and 0.11 alike (plgpu does not export it).
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415
  return InterpretGPUParams()


def _union(r0, r1):
  """The smallest range holding two [lo, hi) ranges, either of which may be empty."""
  (lo0, hi0), (lo1, hi1) = r0, r1
  e0, e1 = hi0 > lo0, hi1 > lo1
  lo = jnp.where(e0, jnp.where(e1, jnp.minimum(lo0, lo1), lo0), jnp.where(e1, lo1, 0))
  hi = jnp.where(e0, jnp.where(e1, jnp.maximum(hi0, hi1), hi0), jnp.where(e1, hi1, 0))
  return lo, hi


def _kernel(*refs, cfg, dtype, Hp):
  refs = list(refs)
  q_ref, k_ref, v_ref = refs[:3]
  refs = refs[3:]
  take = lambda use, n: [refs.pop(0) for _ in range(n)] if use else [None] * n
  qseg_ref, kseg_ref, qmin_ref, qmax_ref, kmin_ref, kmax_ref = take(cfg.segments, 6)
  qpos_ref, kpos_ref, slopes_ref = take(cfg.alibi, 3)
  o_ref, lse_ref, q_s, k_s, v_s = refs[:5]
  refs = refs[5:]
  qseg_s, kseg_s = take(cfg.segments, 2)
  qpos_s, kpos_s = take(cfg.alibi, 2)
  lse_s, q_bar, k_bar, v_bar, k_done, v_done = refs
  bq, bk, steps = BLOCK_Q, cfg.block_k, cfg.steps

  b, h, wg = lax.axis_index('b'), lax.axis_index('h'), lax.axis_index('wg')
  tile = lax.axis_index('q')
  ranges = [kv_block_range(2 * tile + w, **cfg.ranges()) for w in (0, 1)]
  lo, hi = _union(*ranges)  # what the producer streams

  @pl.when(wg < 2)
  def _compute():
    qb = 2 * tile + wg
    r0 = qb * bq
    my_lo = jnp.where(wg == 0, ranges[0][0], ranges[1][0])
    my_hi = jnp.where(wg == 0, ranges[0][1], ranges[1][1])
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(r0, bq), h], q_s.at[wg], q_bar.at[wg])
    if cfg.segments:
      plgpu.copy_gmem_to_smem(qseg_ref.at[b, pl.ds(r0, bq)], qseg_s.at[wg], q_bar.at[wg])
    if cfg.alibi:
      plgpu.copy_gmem_to_smem(qpos_ref.at[b, pl.ds(r0, bq)], qpos_s.at[wg], q_bar.at[wg])
    plgpu.barrier_wait(q_bar.at[wg])
    slope = slopes_ref[h] if cfg.alibi else None
    shape = (bq, bk)
    i_ts = cfg.q_offset + r0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    rows = lambda x: lax.broadcast_in_dim(x, shape, [0])  # a query's value across its keys
    qseg_ts = rows(qseg_s[wg]) if cfg.segments else None
    qpos_ts = rows(qpos_s[wg]) if cfg.alibi else None

    def step(j, carry):
      slot = lax.rem(j - lo, steps)
      plgpu.barrier_wait(k_bar.at[slot])
      plgpu.barrier_wait(v_bar.at[slot])

      def compute(carry):
        acc, m, l = carry
        if cfg.interpret:
          logits = jnp.dot(q_s[wg], k_s[slot].T, preferred_element_type=jnp.float32)
        else:
          logits = pl.run_scoped(
              lambda r: (plgpu.wgmma(r, q_s.at[wg], k_s.at[slot].transpose((1, 0))),
                         r[...])[1], plgpu.ACC(shape, jnp.float32))
        cols = lambda x: lax.broadcast_in_dim(x, shape, [1])  # a key's value across queries
        s, mask = tm.mask_logits(
            logits, i_ts, j * bk + lax.broadcasted_iota(jnp.int32, shape, 1), cfg,
            kv_padded=bool(cfg.kv_len % bk), qseg_t1=qseg_ts,
            kseg_1s=cols(kseg_s[slot]) if cfg.segments else None, qpos_t1=qpos_ts,
            kpos_1s=cols(kpos_s[slot]) if cfg.alibi else None, slope=slope)
        p, alpha, m, l = tm.softmax_update(m, l, s, mask)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p = p.astype(dtype)
        if cfg.interpret:
          acc = acc + jnp.dot(p, v_s[slot], preferred_element_type=jnp.float32)
        else:
          acc = pl.run_state(lambda r: plgpu.wgmma(r[0], p, v_s.at[slot]))(
              (plgpu.ACC.init(acc),))[0]
        return acc, m, l

      visit = (j >= my_lo) & (j < my_hi)
      if cfg.segments:
        visit &= (qmin_ref[b, qb] <= kmax_ref[b, j]) & (kmin_ref[b, j] <= qmax_ref[b, qb])
      carry = lax.cond(visit, compute, lambda c: c, carry)
      plgpu.barrier_arrive(k_done.at[slot])
      plgpu.barrier_arrive(v_done.at[slot])
      return carry

    init = (jnp.zeros((bq, Hp), jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(lo, hi, step, init)
    l = jnp.where(l == 0.0, 1.0, l)  # no allowed key: acc == 0, so the output is 0
    q_s[wg] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
    lse_s[wg] = m + jnp.log2(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s.at[wg], o_ref.at[b, pl.ds(r0, bq), h])
    plgpu.copy_smem_to_gmem(lse_s.at[wg], lse_ref.at[b, h, pl.ds(r0, bq)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _producer():
    kv_head = lax.div(h, cfg.groups)

    @pl.loop(lo, hi)
    def _(j):
      slot = lax.rem(j - lo, steps)

      @pl.when(j - lo >= steps)
      def _():  # the slot's previous block is consumed by both compute warpgroups
        plgpu.barrier_wait(k_done.at[slot])
        plgpu.barrier_wait(v_done.at[slot])

      keys = pl.ds(j * bk, bk)
      plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kv_head], k_s.at[slot], k_bar.at[slot])
      if cfg.segments:
        plgpu.copy_gmem_to_smem(kseg_ref.at[b, keys], kseg_s.at[slot], k_bar.at[slot])
      if cfg.alibi:
        plgpu.copy_gmem_to_smem(kpos_ref.at[b, keys], kpos_s.at[slot], k_bar.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kv_head], v_s.at[slot], v_bar.at[slot])

    # Wait out the last blocks too: free on the GPU, and the interpreter checks that every
    # thread that waits on a barrier sees all its phases.
    @pl.loop(jnp.maximum(hi - steps, lo), hi)
    def _(j):
      slot = lax.rem(j - lo, steps)
      plgpu.barrier_wait(k_done.at[slot])
      plgpu.barrier_wait(v_done.at[slot])


def _forward(cfg, q_BTNH, k_BSKH, v_BSKH, side):
  """(out [B, Tp, N, Hp], base-2 lse [B, N, Tp]) of padded inputs."""
  B, Tp, N, Hp = q_BTNH.shape
  bq, bk, steps, dtype = BLOCK_Q, cfg.block_k, cfg.steps, q_BTNH.dtype
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  scratch = [plgpu.SMEM((2, bq, Hp), dtype, transforms=tiled),
             plgpu.SMEM((steps, bk, Hp), dtype, transforms=tiled),
             plgpu.SMEM((steps, bk, Hp), dtype, transforms=tiled)]
  if cfg.segments:
    scratch += [plgpu.SMEM((2, bq), jnp.int32), plgpu.SMEM((steps, bk), jnp.int32)]
  if cfg.alibi:
    scratch += [plgpu.SMEM((2, bq), jnp.int32), plgpu.SMEM((steps, bk), jnp.int32)]
  # A TMA copy is one arrival on its barrier: a Q or K tile lands with its side inputs.
  copies = 1 + int(cfg.segments) + int(cfg.alibi)
  scratch += [plgpu.SMEM((2, bq), jnp.float32),
              plgpu.Barrier(num_arrivals=copies, num_barriers=2),  # a warpgroup's Q tile landed
              plgpu.Barrier(num_arrivals=copies, num_barriers=steps),
              plgpu.Barrier(num_barriers=steps),
              plgpu.Barrier(num_arrivals=2, num_barriers=steps),
              plgpu.Barrier(num_arrivals=2, num_barriers=steps)]
  call = plgpu.kernel(
      functools.partial(_kernel, cfg=cfg, dtype=dtype, Hp=Hp),
      out_type=(jax.ShapeDtypeStruct(q_BTNH.shape, dtype),
                jax.ShapeDtypeStruct((B, N, Tp), jnp.float32)),
      scratch_types=scratch, grid=(N, Tp // (2 * bq), B), grid_names=('h', 'q', 'b'),
      num_threads=3, thread_name='wg',
      compiler_params=plgpu.CompilerParams(
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret_params() if cfg.interpret else None)
  return call(q_BTNH, k_BSKH, v_BSKH, *side)


def flash_attention_forward(q_BTNH, k_BSKH, v_BSKH, *, scale: float, causal: bool = True,
                            window: int | None = None, q_offset: int | None = None,
                            q_segment_ids=None, kv_segment_ids=None, alibi_slopes=None,
                            q_positions=None, kv_positions=None, block_k: int | None = None,
                            steps: int | None = None, interpret: bool | None = None):
  """(softmax(q kᵀ scale + alibi, masked) v, base-2 log-sum-exp [B, N, T]), forward only.

  The contract of pallas_kernels.flash_attention.flash_attention (masks, offset, GQA, ALiBi, a
  query with no allowed key gives 0), for bfloat16 / float16 inputs (wgmma's). block_k: key rows
  per pipeline slot (a multiple of 64); steps: slots in the ring (>= 2). interpret: run in JAX's
  Mosaic GPU interpreter (default: when the backend is not a GPU).
  """
  B, T, N, H = q_BTNH.shape
  _, S, K, _ = k_BSKH.shape
  check_inputs(q_BTNH, k_BSKH, v_BSKH, q_segment_ids, kv_segment_ids, window)
  if q_BTNH.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f'the Mosaic GPU kernel takes bfloat16 or float16 inputs; got {q_BTNH.dtype}')
  bk = DEFAULT_BLOCK_K if block_k is None else block_k
  steps = DEFAULT_STEPS if steps is None else steps
  if bk < 64 or bk % 64 or steps < 2:
    raise ValueError(f'block_k must be a multiple of 64 and steps >= 2; got {bk}, {steps}')
  if interpret is None:
    interpret = jax.default_backend() != 'gpu'
  q_offset = S - T if q_offset is None else int(q_offset)
  bk = min(bk, round_up(S, 64))
  Tp, Sp, Hp = round_up(T, 2 * BLOCK_Q), round_up(S, bk), round_up(H, HEAD_MULTIPLE)

  segments, alibi = q_segment_ids is not None, alibi_slopes is not None
  if alibi:
    q_positions, kv_positions = default_positions(T, S, q_offset, q_positions, kv_positions)

  def ids(x, length, padded):
    return padded_ids(x, B, length, padded)

  side = []
  if segments:
    q_ids, kv_ids = ids(q_segment_ids, T, Tp), ids(kv_segment_ids, S, Sp)
    side += [q_ids, kv_ids, *block_min_max(q_ids, BLOCK_Q), *block_min_max(kv_ids, bk)]
  if alibi:
    side += [ids(q_positions, T, Tp), ids(kv_positions, S, Sp),
             jnp.asarray(alibi_slopes, jnp.float32)]
  cfg = _Cfg(scale=float(scale), causal=bool(causal), window=window, q_offset=q_offset,
             q_len=T, kv_len=S, groups=N // K, block_k=bk, steps=steps, segments=segments,
             alibi=alibi, interpret=bool(interpret), precision=None)

  def pad(x, length):
    return pad_to(pad_to(x, 1, length), 3, Hp)

  o, lse = _forward(cfg, pad(q_BTNH, Tp), pad(k_BSKH, Sp), pad(v_BSKH, Sp), side)
  return o[:, :T, :, :H], lse[:, :, :T]
