"""FlashAttention for Hopper GPUs in Pallas's Mosaic GPU backend, FA3's structure (Shah et al.
2024): per CTA two compute warpgroups, each owning a 64-row tile, and one producer warpgroup
streaming the other side's tiles into a ring of `steps` shared-memory slots with TMA, the slots
handed over by barriers (ready: the copy landed; consumed: both compute warpgroups are done).
Every product is a warpgroup MMA (wgmma) with a float32 accumulator.

- forward: a CTA owns 2 query tiles and streams K/V blocks (Q·Kᵀ, then P·V).
- dq: the same walk; per key block S = Q·Kᵀ, dP = dO·Vᵀ, dS = P ∘ (dP − δ), dQ += dS·K.
- dk/dv: a CTA owns 2 key tiles of one KV head and streams (head of its group, query block)
  tiles of Q, dO, LSE and δ = rowsum(dO ∘ O): Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO,
  dK += dSᵀ·Q (FlashAttention-2, Dao 2023, Alg. 2). Working in the transposed orientation keeps
  the key rows as wgmma's M; GQA's group sums in the accumulator, never in HBM.

The tile math is the other backends' (tile_math.py). Skipping: the producer streams the union of
the two tiles' block ranges (block_ranges), and a compute warpgroup computes only the blocks of
its own range whose segment-id [min, max] meets its tile's; it still arrives on every consumed
barrier, so the ring stays in step.

Interpret mode (CPU, tests): JAX's Mosaic GPU interpreter has no rule for a register-held MMA
operand or `run_state` (jax 0.10.2 and 0.11.2), nor, in 0.10.2, for a transposed shared-memory
operand. In interpret mode exactly the products are `jnp.dot`s on the same shared-memory tiles;
everything else (TMA copies, barriers, warpgroups, masks, the softmax) is what the GPU runs. The
hardware path is checked by lowering for CUDA on CPU (tests). The interpreter runs each warpgroup
as a thread whose ops execute on XLA's CPU thread pool, one pool thread held by the kernel launch
and one by each warpgroup blocked on a barrier: a pool of fewer than 4 threads (by default one per
core) can deadlock, so interpret mode needs NPROC >= 4 set before JAX starts (`_check_pool`).
Layout: q [B, T, N, H], k/v [B, S, K, H] (the caller's; TMA reads a head's rows with a stride).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

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

TILE = 64  # rows of a compute warpgroup's tile (queries, or keys in dk/dv): wgmma's M
HEAD_MULTIPLE = 64  # head_dim is padded to this: one 128-byte swizzle row of 16-bit elements
# Tuned on an H100 (benchmarks/results/gpu-h100.md, D 128, N 4096, causal, bf16): block_k 64 with
# 3 ring slots ran forward+backward at 251 TFLOP/s against 190 for (128, 2) before; its forward
# (300) is 6% under the best forward alone (block_k 64, 2 slots: 318). Training takes both.
DEFAULT_BLOCK_K, DEFAULT_STEPS = 64, 3
_TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class _Cfg(MaskRule):
  block_k: int
  steps: int

  def ranges(self, block_k=None):
    return dict(
      block_q=TILE,
      block_k=block_k or self.block_k,
      q_len=self.q_len,
      kv_len=self.kv_len,
      q_offset=self.q_offset,
      causal=self.causal,
      window=self.window,
    )


def _interpret_params():
  # Private in jax 0.10.2 and 0.11 alike (plgpu does not export it).
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  return InterpretGPUParams()


INTERPRETER_THREADS = 4  # the kernel launch + 3 warpgroups, each holding an XLA CPU pool thread


def _check_pool():
  """Refuse to interpret with an XLA CPU pool too small to run every warpgroup at once: XLA sizes
  it by $NPROC, else by the cores this process may use, when JAX starts."""
  nproc = os.environ.get('NPROC', '')
  threads = int(nproc) if nproc.isdigit() else len(os.sched_getaffinity(0))
  if threads < INTERPRETER_THREADS:
    source = 'NPROC' if nproc.isdigit() else "this machine's cores"
    raise RuntimeError(
      f'the Mosaic GPU interpreter needs >= {INTERPRETER_THREADS} XLA CPU threads (the kernel '
      f'launch and 3 warpgroups each hold one while they wait on barriers) but has {threads} '
      f'({source}), and would deadlock; set NPROC=8 in the environment before JAX starts'
    )


def _union(r0, r1):
  """The smallest range holding two [lo, hi) ranges, either of which may be empty."""
  (lo0, hi0), (lo1, hi1) = r0, r1
  e0, e1 = hi0 > lo0, hi1 > lo1
  lo = jnp.where(e0, jnp.where(e1, jnp.minimum(lo0, lo1), lo0), jnp.where(e1, lo1, 0))
  hi = jnp.where(e0, jnp.where(e1, jnp.maximum(hi0, hi1), hi0), jnp.where(e1, hi1, 0))
  return lo, hi


def _mine(wg, ranges):
  return (
    jnp.where(wg == 0, ranges[0][0], ranges[1][0]),
    jnp.where(wg == 0, ranges[0][1], ranges[1][1]),
  )


def _dot_t(a_ref, b_ref, interpret):
  """a · bᵀ of two shared-memory tiles in float32: wgmma with a transposed operand."""
  if interpret:
    return jnp.dot(a_ref[...], b_ref[...].T, preferred_element_type=jnp.float32)
  shape = (a_ref.shape[0], b_ref.shape[0])
  return pl.run_scoped(
    lambda r: (plgpu.wgmma(r, a_ref, b_ref.transpose((1, 0))), r[...])[1],
    plgpu.ACC(shape, jnp.float32),
  )


def _dot_add(acc, a, b_ref, interpret):
  """acc + a · b: `a` in registers, `b` a shared-memory tile (wgmma into a live accumulator)."""
  if interpret:
    return acc + jnp.dot(a, b_ref[...], preferred_element_type=jnp.float32)
  return pl.run_state(lambda r: plgpu.wgmma(r[0], a, b_ref))((plgpu.ACC.init(acc),))[0]


def _produce(lo, hi, steps, copy, done_bars):
  """The producer warpgroup: block j of [lo, hi) goes to slot (j - lo) % steps once both compute
  warpgroups released the slot's previous block (`copy(j, slot)` starts its TMA copies)."""

  @pl.loop(lo, hi)
  def _(j):
    slot = lax.rem(j - lo, steps)

    @pl.when(j - lo >= steps)
    def _():
      for bar in done_bars:
        plgpu.barrier_wait(bar.at[slot])

    copy(j, slot)

  # Wait out the last blocks too: free on the GPU, and the interpreter checks that every
  # thread that waits on a barrier sees all its phases.
  @pl.loop(jnp.maximum(hi - steps, lo), hi)
  def _(j):
    for bar in done_bars:
      plgpu.barrier_wait(bar.at[lax.rem(j - lo, steps)])


def _copy_tile(gmem, smem, indices, slot, bar):
  """TMA copies of one tile's arrays, gmem[i].at[indices[i]] into smem[i].at[slot], each one
  arrival on `bar`; an absent array (None) is skipped."""
  for src, dst, index in zip(gmem, smem, indices):
    if src is not None:
      plgpu.copy_gmem_to_smem(src.at[index], dst.at[slot], bar)


def _copy_query_tile(gmem, smem, slot, bar, b, h, rows):
  """Q and, of dO, LSE, δ, segment ids and positions, those that exist (gmem / smem: 6-tuples;
  [B, T, N, H] tiles, [B, N, T] row statistics, [B, T] ids)."""
  tile, stats, ids = (b, rows, h), (b, h, rows), (b, rows)
  _copy_tile(gmem, smem, (tile, tile, stats, stats, ids, ids), slot, bar)


def _copy_key_tile(gmem, smem, slot, bar, b, kv_head, keys):
  """K, V, segment ids and positions, those that exist (gmem / smem: 4-tuples)."""
  tile, ids = (b, keys, kv_head), (b, keys)
  _copy_tile(gmem, smem, (tile, tile, ids, ids), slot, bar)


def _kv_producer(
  cfg,
  b,
  kv_head,
  lo,
  hi,
  k_ref,
  v_ref,
  kseg_ref,
  kpos_ref,
  k_s,
  v_s,
  kseg_s,
  kpos_s,
  k_bar,
  v_bar,
  k_done,
  v_done,
):
  """Streams key blocks [lo, hi) of one KV head, their segment ids and positions with K."""

  def copy(j, slot):
    keys = pl.ds(j * cfg.block_k, cfg.block_k)
    # V has a barrier of its own: Q·Kᵀ starts before V lands.
    _copy_key_tile(
      (k_ref, None, kseg_ref, kpos_ref),
      (k_s, None, kseg_s, kpos_s),
      slot,
      k_bar.at[slot],
      b,
      kv_head,
      keys,
    )
    _copy_key_tile(
      (None, v_ref, None, None), (None, v_s, None, None), slot, v_bar.at[slot], b, kv_head, keys
    )

  _produce(lo, hi, cfg.steps, copy, (k_done, v_done))


def _kv_ring(cfg, dtype, Hp):
  """Scratch of a K/V stream: tiles, side inputs, ready and consumed barriers."""
  bk, steps = cfg.block_k, cfg.steps
  ring = [
    plgpu.SMEM((steps, bk, Hp), dtype, transforms=_TILED),
    plgpu.SMEM((steps, bk, Hp), dtype, transforms=_TILED),
  ]
  ring += [plgpu.SMEM((steps, bk), jnp.int32)] * (int(cfg.segments) + int(cfg.alibi))
  copies = 1 + int(cfg.segments) + int(cfg.alibi)  # a TMA copy is one arrival on its barrier
  return ring + [
    plgpu.Barrier(num_arrivals=copies, num_barriers=steps),
    plgpu.Barrier(num_barriers=steps),
    plgpu.Barrier(num_arrivals=2, num_barriers=steps),
    plgpu.Barrier(num_arrivals=2, num_barriers=steps),
  ]


def _split(refs, cfg, n_main, n_out, n_own):
  """The kernel's refs: main inputs, side inputs (segments: ids and block [min, max] of both
  sides; ALiBi: positions and slopes), outputs, this kernel's own scratch, then the K/V ring."""
  refs = list(refs)
  take = lambda use, n: [refs.pop(0) for _ in range(n)] if use else [None] * n
  main = take(True, n_main)
  seg = take(cfg.segments, 6)
  alibi = take(cfg.alibi, 3)
  outs = take(True, n_out)
  own = take(True, n_own)
  return main, seg, alibi, outs, own, refs


def _tile_scores(cfg, logits, i, j, qseg, kseg, qpos, kpos, slope, kv_padded):
  """Base-2 masked scores of a tile whose query and key indices are the full-shape `i`, `j`
  (either orientation: the mask and ALiBi are elementwise)."""
  return tm.mask_logits(
    logits,
    i,
    j,
    cfg,
    kv_padded=kv_padded,
    qseg_t1=qseg,
    kseg_1s=kseg,
    qpos_t1=qpos,
    kpos_1s=kpos,
    slope=slope,
  )


def _q_tile_kernel(*refs, cfg, dtype, Hp, grad):
  """Forward (grad=False) or dq (grad=True): a CTA owns query tiles 2·q and 2·q + 1."""
  (
    main,
    (qseg_ref, kseg_ref, qmin_ref, qmax_ref, kmin_ref, kmax_ref),
    (qpos_ref, kpos_ref, slopes_ref),
    outs,
    own,
    ring,
  ) = _split(refs, cfg, 6 if grad else 3, 1 if grad else 2, 5 if grad else 3)
  q_ref, k_ref, v_ref = main[:3]
  do_ref, lse_ref, delta_ref = main[3:] if grad else (None, None, None)
  if grad:
    q_s, do_s, lse_s, delta_s, q_bar = own
  else:
    (q_s, lse_s, q_bar), do_s, delta_s = own, None, None
  qseg_s = ring.pop(0) if cfg.segments else None
  qpos_s = ring.pop(0) if cfg.alibi else None
  k_s, v_s, *side_s = ring[:-4]
  kseg_s = side_s.pop(0) if cfg.segments else None
  kpos_s = side_s.pop(0) if cfg.alibi else None
  k_bar, v_bar, k_done, v_done = ring[-4:]
  bq, bk = TILE, cfg.block_k

  b, h, wg = lax.axis_index('b'), lax.axis_index('h'), lax.axis_index('wg')
  tile = lax.axis_index('q')
  ranges = [kv_block_range(2 * tile + w, **cfg.ranges()) for w in (0, 1)]
  lo, hi = _union(*ranges)  # what the producer streams

  @pl.when(wg < 2)
  def _compute():
    qb = 2 * tile + wg
    r0 = qb * bq
    my_lo, my_hi = _mine(wg, ranges)
    rows = pl.ds(r0, bq)
    _copy_query_tile(
      (q_ref, do_ref, lse_ref, delta_ref, qseg_ref, qpos_ref),
      (q_s, do_s, lse_s, delta_s, qseg_s, qpos_s),
      wg,
      q_bar.at[wg],
      b,
      h,
      rows,
    )
    plgpu.barrier_wait(q_bar.at[wg])
    slope = slopes_ref[h] if cfg.alibi else None
    shape = (bq, bk)
    i_ts = cfg.q_offset + r0 + lax.broadcasted_iota(jnp.int32, shape, 0)
    across = lambda x: lax.broadcast_in_dim(x, shape, [0])  # a query's value across its keys
    down = lambda x: lax.broadcast_in_dim(x, shape, [1])  # a key's value across queries
    qseg_ts = across(qseg_s[wg]) if cfg.segments else None
    qpos_ts = across(qpos_s[wg]) if cfg.alibi else None
    if grad:
      lse_ts, delta_ts = across(lse_s[wg]), across(delta_s[wg])

    def step(j, carry):
      slot = lax.rem(j - lo, cfg.steps)
      plgpu.barrier_wait(k_bar.at[slot])
      plgpu.barrier_wait(v_bar.at[slot])

      def compute(carry):
        logits = _dot_t(q_s.at[wg], k_s.at[slot], cfg.interpret)
        s, mask = _tile_scores(
          cfg,
          logits,
          i_ts,
          j * bk + lax.broadcasted_iota(jnp.int32, shape, 1),
          qseg_ts,
          down(kseg_s[slot]) if cfg.segments else None,
          qpos_ts,
          down(kpos_s[slot]) if cfg.alibi else None,
          slope,
          bool(cfg.kv_len % bk),
        )
        if grad:
          p = tm.masked_exp2(s - lse_ts, mask)
          dp = _dot_t(do_s.at[wg], v_s.at[slot], cfg.interpret)
          ds = tm.through_softcap(p * (dp - delta_ts), logits, cfg).astype(dtype)
          return _dot_add(carry, ds, k_s.at[slot], cfg.interpret)
        acc, m, l = carry
        p, alpha, m, l = tm.softmax_update(m, l, s, mask)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return _dot_add(acc, p.astype(dtype), v_s.at[slot], cfg.interpret), m, l

      visit = (j >= my_lo) & (j < my_hi)
      if cfg.segments:
        visit &= (qmin_ref[b, qb] <= kmax_ref[b, j]) & (kmin_ref[b, j] <= qmax_ref[b, qb])
      carry = lax.cond(visit, compute, lambda c: c, carry)
      plgpu.barrier_arrive(k_done.at[slot])
      plgpu.barrier_arrive(v_done.at[slot])
      return carry

    zeros = jnp.zeros((bq, Hp), jnp.float32)
    if grad:
      dq = lax.fori_loop(lo, hi, step, zeros)
      q_s[wg] = (dq * cfg.scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_s.at[wg], outs[0].at[b, rows, h])
    else:
      init = (zeros, jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32))
      acc, m, l = lax.fori_loop(lo, hi, step, init)
      l = jnp.where(l == 0.0, 1.0, l)  # no allowed key: acc == 0, so the output is 0
      q_s[wg] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
      lse_s[wg] = m + jnp.log2(l)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_s.at[wg], outs[0].at[b, rows, h])
      plgpu.copy_smem_to_gmem(lse_s.at[wg], outs[1].at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _producer():
    _kv_producer(
      cfg,
      b,
      lax.div(h, cfg.groups),
      lo,
      hi,
      k_ref,
      v_ref,
      kseg_ref,
      kpos_ref,
      k_s,
      v_s,
      kseg_s,
      kpos_s,
      k_bar,
      v_bar,
      k_done,
      v_done,
    )


def _dkv_kernel(*refs, cfg, dtype, Hp):
  """dk, dv: a CTA owns key tiles 2·k and 2·k + 1 of one KV head."""
  (
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref),
    (qseg_ref, kseg_ref, qmin_ref, qmax_ref, kmin_ref, kmax_ref),
    (qpos_ref, kpos_ref, slopes_ref),
    (dk_ref, dv_ref),
    own,
    side,
  ) = _split(refs, cfg, 6, 2, 9)
  k_s, v_s, q_s, do_s, lse_s, delta_s, kv_bar, ready, done = own
  kseg_s, qseg_s = (side.pop(0), side.pop(0)) if cfg.segments else (None, None)
  kpos_s, qpos_s = (side.pop(0), side.pop(0)) if cfg.alibi else (None, None)
  bq, bk, steps = TILE, TILE, cfg.steps

  b, kv_head, wg = lax.axis_index('b'), lax.axis_index('h'), lax.axis_index('wg')
  tile = lax.axis_index('k')
  ranges = [q_block_range(2 * tile + w, **cfg.ranges(TILE)) for w in (0, 1)]
  lo, hi = _union(*ranges)
  n_q = hi - lo  # streamed per head of the group; item n is (head n // n_q, block lo + n % n_q)

  @pl.when(wg < 2)
  def _compute():
    kb = 2 * tile + wg
    keys = pl.ds(kb * bk, bk)
    my_lo, my_hi = _mine(wg, ranges)
    _copy_key_tile(
      (k_ref, v_ref, kseg_ref, kpos_ref),
      (k_s, v_s, kseg_s, kpos_s),
      wg,
      kv_bar.at[wg],
      b,
      kv_head,
      keys,
    )
    plgpu.barrier_wait(kv_bar.at[wg])
    shape = (bk, bq)  # transposed: keys are the rows
    j_st = kb * bk + lax.broadcasted_iota(jnp.int32, shape, 0)
    down = lambda x: lax.broadcast_in_dim(x, shape, [0])  # a key's value across queries
    across = lambda x: lax.broadcast_in_dim(x, shape, [1])  # a query's value across keys
    kseg_st = down(kseg_s[wg]) if cfg.segments else None
    kpos_st = down(kpos_s[wg]) if cfg.alibi else None

    def step(n, carry):
      slot = lax.rem(n, steps)
      g, qb = lax.div(n, n_q), lo + lax.rem(n, n_q)
      plgpu.barrier_wait(ready.at[slot])

      def compute(carry):
        dk, dv = carry
        slope = slopes_ref[kv_head * cfg.groups + g] if cfg.alibi else None
        i_st = cfg.q_offset + qb * bq + lax.broadcasted_iota(jnp.int32, shape, 1)
        logits = _dot_t(k_s.at[wg], q_s.at[slot], cfg.interpret)
        s, mask = _tile_scores(
          cfg,
          logits,
          i_st,
          j_st,
          across(qseg_s[slot]) if cfg.segments else None,
          kseg_st,
          across(qpos_s[slot]) if cfg.alibi else None,
          kpos_st,
          slope,
          bool(cfg.kv_len % bk),
        )
        p = tm.masked_exp2(s - across(lse_s[slot]), mask)
        dp = _dot_t(v_s.at[wg], do_s.at[slot], cfg.interpret)
        ds = tm.through_softcap(p * (dp - across(delta_s[slot])), logits, cfg)
        dv = _dot_add(dv, p.astype(dtype), do_s.at[slot], cfg.interpret)
        dk = _dot_add(dk, ds.astype(dtype), q_s.at[slot], cfg.interpret)
        return dk, dv

      visit = (qb >= my_lo) & (qb < my_hi)
      if cfg.segments:
        visit &= (kmin_ref[b, kb] <= qmax_ref[b, qb]) & (qmin_ref[b, qb] <= kmax_ref[b, kb])
      carry = lax.cond(visit, compute, lambda c: c, carry)
      plgpu.barrier_arrive(done.at[slot])
      return carry

    zeros = jnp.zeros((bk, Hp), jnp.float32)
    dk, dv = lax.fori_loop(0, n_q * cfg.groups, step, (zeros, zeros))
    k_s[wg] = (dk * cfg.scale).astype(dtype)
    v_s[wg] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_s.at[wg], dk_ref.at[b, keys, kv_head])
    plgpu.copy_smem_to_gmem(v_s.at[wg], dv_ref.at[b, keys, kv_head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _producer():
    def copy(n, slot):
      h = kv_head * cfg.groups + lax.div(n, n_q)
      rows = pl.ds((lo + lax.rem(n, n_q)) * bq, bq)
      _copy_query_tile(
        (q_ref, do_ref, lse_ref, delta_ref, qseg_ref, qpos_ref),
        (q_s, do_s, lse_s, delta_s, qseg_s, qpos_s),
        slot,
        ready.at[slot],
        b,
        h,
        rows,
      )

    _produce(0, n_q * cfg.groups, steps, copy, (done,))


def _call(kernel, cfg, out_type, scratch, grid, grid_names, args):
  return plgpu.kernel(
    kernel,
    out_type=out_type,
    scratch_types=scratch,
    grid=grid,
    grid_names=grid_names,
    num_threads=3,
    thread_name='wg',
    compiler_params=plgpu.CompilerParams(
      approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup
    ),
    interpret=_interpret_params() if cfg.interpret else None,
  )(*args)


def _q_side_scratch(cfg, rows):
  return [plgpu.SMEM(rows, jnp.int32)] * (int(cfg.segments) + int(cfg.alibi))


def _forward(cfg, q_BTNH, k_BSKH, v_BSKH, side):
  """(out [B, Tp, N, Hp], base-2 lse [B, N, Tp]) of padded inputs."""
  B, Tp, N, Hp = q_BTNH.shape
  dtype = q_BTNH.dtype
  copies = 1 + int(cfg.segments) + int(cfg.alibi)
  own = [
    plgpu.SMEM((2, TILE, Hp), dtype, transforms=_TILED),
    plgpu.SMEM((2, TILE), jnp.float32),
    plgpu.Barrier(num_arrivals=copies, num_barriers=2),
  ]  # a warpgroup's Q tile landed
  return _call(
    functools.partial(_q_tile_kernel, cfg=cfg, dtype=dtype, Hp=Hp, grad=False),
    cfg,
    (jax.ShapeDtypeStruct(q_BTNH.shape, dtype), jax.ShapeDtypeStruct((B, N, Tp), jnp.float32)),
    own + _q_side_scratch(cfg, (2, TILE)) + _kv_ring(cfg, dtype, Hp),
    (N, Tp // (2 * TILE), B),
    ('h', 'q', 'b'),
    (q_BTNH, k_BSKH, v_BSKH, *_side_for(cfg, side, cfg.block_k)),
  )


def _side_for(cfg, side, block_k):
  """Side inputs with the key-block [min, max] segment ids of this kernel's key blocks."""
  if not cfg.segments:
    return side
  q_ids, kv_ids, *rest = side
  return [q_ids, kv_ids, *block_min_max(q_ids, TILE), *block_min_max(kv_ids, block_k), *rest]


def _backward(cfg, q_BTNH, k_BSKH, v_BSKH, side, o_BTNH, lse_BNT, do_BTNH, d_lse_BNT):
  B, Tp, N, Hp = q_BTNH.shape
  Sp, K = k_BSKH.shape[1], k_BSKH.shape[2]
  dtype = q_BTNH.dtype
  delta_BNT = jnp.einsum('btnh,btnh->bnt', o_BTNH.astype(jnp.float32), do_BTNH.astype(jnp.float32))
  delta_BNT = delta_BNT - lse_grad_term(d_lse_BNT)
  main = (q_BTNH, k_BSKH, v_BSKH, do_BTNH, lse_BNT, delta_BNT)
  copies = 4 + int(cfg.segments) + int(cfg.alibi)
  tile = plgpu.SMEM((2, TILE, Hp), dtype, transforms=_TILED)
  stats = plgpu.SMEM((2, TILE), jnp.float32)
  own = [tile, tile, stats, stats, plgpu.Barrier(num_arrivals=copies, num_barriers=2)]
  dq = _call(
    functools.partial(_q_tile_kernel, cfg=cfg, dtype=dtype, Hp=Hp, grad=True),
    cfg,
    jax.ShapeDtypeStruct(q_BTNH.shape, dtype),
    own + _q_side_scratch(cfg, (2, TILE)) + _kv_ring(cfg, dtype, Hp),
    (N, Tp // (2 * TILE), B),
    ('h', 'q', 'b'),
    (*main, *_side_for(cfg, side, cfg.block_k)),
  )

  if cfg.interpret:
    # One kernel at a time: dq and dk/dv do not depend on each other, and run at once they would
    # hold 8 of XLA's CPU pool threads (`_check_pool` asks for the 4 that one kernel needs).
    dq, main = lax.optimization_barrier((dq, main))
  steps = cfg.steps
  ring = plgpu.SMEM((steps, TILE, Hp), dtype, transforms=_TILED)
  ring_stats = plgpu.SMEM((steps, TILE), jnp.float32)
  kv_copies = 2 + int(cfg.segments) + int(cfg.alibi)
  own = [
    tile,
    tile,
    ring,
    ring,
    ring_stats,
    ring_stats,
    plgpu.Barrier(num_arrivals=kv_copies, num_barriers=2),  # a warpgroup's K, V landed
    plgpu.Barrier(num_arrivals=copies, num_barriers=steps),  # a query block landed
    plgpu.Barrier(num_arrivals=2, num_barriers=steps),
  ]  # both warpgroups are done with it
  side_scratch = []
  for use in (cfg.segments, cfg.alibi):  # the key tiles' ids, then the streamed queries'
    side_scratch += [plgpu.SMEM((2, TILE), jnp.int32), plgpu.SMEM((steps, TILE), jnp.int32)] * use
  kv_out = jax.ShapeDtypeStruct(k_BSKH.shape, dtype)
  dk, dv = _call(
    functools.partial(_dkv_kernel, cfg=cfg, dtype=dtype, Hp=Hp),
    cfg,
    (kv_out, kv_out),
    own + side_scratch,
    (K, Sp // (2 * TILE), B),
    ('h', 'k', 'b'),
    (*main, *_side_for(cfg, side, TILE)),
  )
  return dq, dk, dv


# Each distinct kernel is traced and lowered once per step, not once per layer: under jit, every
# layer's call with the same shapes and config reuses the first one's jaxpr, which JAX lowers to one
# function that the step calls per layer. XLA's Mosaic GPU custom call compiles (LLVM, ptxas) once
# per hash of the serialized kernel, and jaxlib 0.11 stamps each lowering with a new
# `mosaic_gpu.dump_basename`: lowered per layer, a 12-layer step compiled 36 kernels, not 3
# (docs/kernels.md, "Compile time of the Mosaic GPU kernel"; tests/test_mgpu_compile.py).
_forward_once = jax.jit(_forward, static_argnums=0)
_flash = flash_vjp(_forward_once, jax.jit(_backward, static_argnums=0))


def _prepare(
  q_BTNH,
  k_BSKH,
  v_BSKH,
  *,
  scale,
  softcap,
  causal,
  window,
  q_offset,
  q_segment_ids,
  kv_segment_ids,
  alibi_slopes,
  q_positions,
  kv_positions,
  block_k,
  steps,
  interpret,
):
  """Checked, padded inputs, the side inputs and the static config."""
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
  if interpret:
    _check_pool()
  q_offset = S - T if q_offset is None else int(q_offset)
  bk = min(bk, round_up(S, 64))
  # Keys pad to whole forward blocks and whole pairs of the backward's 64-row key tiles.
  Tp, Sp, Hp = (
    round_up(T, 2 * TILE),
    round_up(S, math.lcm(bk, 2 * TILE)),
    round_up(H, HEAD_MULTIPLE),
  )

  segments, alibi = q_segment_ids is not None, alibi_slopes is not None
  if alibi:
    q_positions, kv_positions = default_positions(T, S, q_offset, q_positions, kv_positions)
  side = []
  if segments:
    side += [padded_ids(q_segment_ids, B, T, Tp), padded_ids(kv_segment_ids, B, S, Sp)]
  if alibi:
    side += [
      padded_ids(q_positions, B, T, Tp),
      padded_ids(kv_positions, B, S, Sp),
      jnp.asarray(alibi_slopes, jnp.float32),
    ]
  cfg = _Cfg(
    scale=float(scale),
    softcap=None if softcap is None else float(softcap),
    causal=bool(causal),
    window=window,
    q_offset=q_offset,
    q_len=T,
    kv_len=S,
    groups=N // K,
    block_k=bk,
    steps=steps,
    segments=segments,
    alibi=alibi,
    interpret=bool(interpret),
    precision=None,
  )
  pad = lambda x, length: pad_to(pad_to(x, 1, length), 3, Hp)
  return cfg, pad(q_BTNH, Tp), pad(k_BSKH, Sp), pad(v_BSKH, Sp), side


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
  steps: int | None = None,
  interpret: bool | None = None,
  return_lse: bool = False,
):
  """softmax(softcap(q kᵀ scale) + alibi, masked) v with FlashAttention's backward (custom VJP).

  The contract of pallas_kernels.flash_attention_triton.flash_attention (masks, offset, GQA, ALiBi, a
  query with no allowed key gives 0, the soft cap), for bfloat16 / float16 inputs (wgmma's). block_q: 64 or
  None (a warpgroup's tile); block_k: key rows per forward / dq pipeline slot (a multiple of 64);
  steps: slots in each ring (>= 2). interpret: run in JAX's Mosaic GPU interpreter (default: when
  the backend is not a GPU).
  """
  if block_q not in (None, TILE):
    raise ValueError(f'block_q must be {TILE} (a warpgroup tile) or None; got {block_q}')
  T, H = q_BTNH.shape[1], q_BTNH.shape[3]
  cfg, q, k, v, side = _prepare(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    scale=scale,
    softcap=softcap,
    causal=causal,
    window=window,
    q_offset=q_offset,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    alibi_slopes=alibi_slopes,
    q_positions=q_positions,
    kv_positions=kv_positions,
    block_k=block_k,
    steps=steps,
    interpret=interpret,
  )
  o, lse = _flash(cfg, q, k, v, side)
  if return_lse:  # natural log, [B, N, T]
    return o[:, :T, :, :H], lse[:, :, :T] / LOG2_E
  return o[:, :T, :, :H]


def flash_attention_forward(
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
  block_k: int | None = None,
  steps: int | None = None,
  interpret: bool | None = None,
):
  """(output, base-2 log-sum-exp [B, N, T]) of `flash_attention`, forward only."""
  T, H = q_BTNH.shape[1], q_BTNH.shape[3]
  cfg, q, k, v, side = _prepare(
    q_BTNH,
    k_BSKH,
    v_BSKH,
    scale=scale,
    softcap=softcap,
    causal=causal,
    window=window,
    q_offset=q_offset,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    alibi_slopes=alibi_slopes,
    q_positions=q_positions,
    kv_positions=kv_positions,
    block_k=block_k,
    steps=steps,
    interpret=interpret,
  )
  o, lse = _forward_once(cfg, q, k, v, side)
  return o[:, :T, :, :H], lse[:, :, :T]
