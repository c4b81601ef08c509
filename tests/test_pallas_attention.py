"""pallas_kernels.flash_attention_triton against a float64 NumPy reference (output and dq, dk, dv).

Every case also poisons (NaN) the K/V blocks that the kernel must skip -- blocks outside every
query block's causal/window range, or whose segment ids cannot meet a query block's -- so a
kernel that masks instead of skipping returns NaN and fails.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import alibi_bias, attention_with_grads
from attention_reference import allowed_mask as reference_mask

from pallas_kernels import flash_attention_triton as fa

F32_TOL, BF16_TOL = 1e-5, 2e-2
TRITON_DEPRECATED = tuple(map(int, jax.__version__.split('.')[:2])) >= (0, 11)


def allowed_mask(T, S, *, causal, window, q_offset, q_seg=None, kv_seg=None):
  """[B or 1, T, S] bool: the framework's mask rule (tests/attention_reference.py)."""
  B = 1 if q_seg is None else q_seg.shape[0]
  return reference_mask(
    B, T, S, causal=causal, window=window, q_offset=q_offset, q_seg=q_seg, kv_seg=kv_seg
  )


def reference(
  q, k, v, do, *, scale, softcap, causal, window, q_offset, q_seg, kv_seg, slopes, q_pos, kv_pos
):
  """float64 output and (dq, dk, dv) from tests/attention_reference.py."""
  bias = None if slopes is None else alibi_bias(slopes, q_pos, kv_pos)
  o, (dq, dk, dv, _) = attention_with_grads(
    q,
    k,
    v,
    do,
    scale=scale,
    softcap=softcap,
    bias=bias,
    causal=causal,
    window=window,
    q_offset=q_offset,
    q_seg=q_seg,
    kv_seg=kv_seg,
  )
  return o, dq, dk, dv


def rel_err(got, ref):
  got = np.asarray(got, np.float64)
  assert np.isfinite(got).all(), 'non-finite values'
  return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


def must_skip_blocks(T, S, bq, bk, *, causal, window, q_offset, q_seg, kv_seg):
  """[B, S // bk] bool: key blocks that every query block must skip, by brute force: no
  causal/window-allowed pair, or disjoint [min, max] segment-id ranges (the kernel's test)."""
  band = allowed_mask(T, S, causal=causal, window=window, q_offset=q_offset)[0]
  B = 1 if q_seg is None else q_seg.shape[0]
  skip = np.ones((B, S // bk), bool)  # whole blocks only; a partial last block is kept
  for b in range(B):
    for kb in range(S // bk):
      for t0 in range(0, T, bq):
        tile = band[t0 : t0 + bq, kb * bk : (kb + 1) * bk]
        if not tile.any():
          continue
        if q_seg is not None:
          qs, ks = q_seg[b, t0 : t0 + bq], kv_seg[b, kb * bk : (kb + 1) * bk]
          if qs.max() < ks.min() or ks.max() < qs.min():
            continue
        skip[b, kb] = False
  return skip


def case(
  name,
  *,
  G,
  H,
  causal=True,
  window=None,
  shape='square',
  explicit_offset=False,
  segments=None,
  alibi=False,
  dtype='float32',
  blocks=(16, 16),
  expect_skip=False,
  softcap=None,
):
  return pytest.param(
    dict(
      G=G,
      H=H,
      causal=causal,
      window=window,
      shape=shape,
      explicit_offset=explicit_offset,
      segments=segments,
      alibi=alibi,
      dtype=dtype,
      blocks=blocks,
      expect_skip=expect_skip,
      softcap=softcap,
    ),
    id=name,
  )


CASES = [
  case('causal-mha', G=1, H=16),
  case('noncausal-gqa2-h64', G=2, H=64, causal=False, shape='short_q', blocks=(32, 16)),
  case('causal-gqa4-bottom-right', G=4, H=16, shape='short_q'),
  case('causal-mqa8-q-offset', G=8, H=16, shape='short_q', explicit_offset=True, expect_skip=True),
  case('causal-window', G=2, H=16, window=13, blocks=(16, 32)),
  case(
    'noncausal-window-q-offset',
    G=1,
    H=16,
    causal=False,
    window=9,
    shape='mid_q',
    explicit_offset=True,
    expect_skip=True,
  ),
  case('alibi-h80', G=2, H=80, alibi=True),
  case('packed-docs-causal', G=2, H=16, segments='packed', alibi=True),
  case('unsorted-segments-noncausal', G=4, H=16, causal=False, segments='random', expect_skip=True),
  case('more-queries-than-keys', G=1, H=16, shape='tall_q'),
  case('bf16-everything', G=4, H=80, window=20, segments='packed', alibi=True, dtype='bfloat16'),
  case('bf16-noncausal-h64', G=2, H=64, causal=False, dtype='bfloat16', blocks=(32, 32)),
  case('default-blocks-h64', G=2, H=64, blocks=(None, None)),
  # A cap of 1.5 on logits ~N(0, 1) bends most of them: the tanh and its slope both matter.
  case('softcap-alibi-packed-gqa', G=2, H=16, segments='packed', alibi=True, softcap=1.5),
]


def make_inputs(p, seed, unit: int = 1, B: int = 2):
  """Inputs of a case; `unit` multiplies every length (a TPU kernel's key blocks are >= 128)."""
  rng = np.random.default_rng(seed)
  K = 2 if p['G'] < 8 else 1
  N = K * p['G']
  T = int(rng.integers(33, 97))
  S = T
  if p['shape'] == 'short_q':  # S - T >= 48 leaves whole key blocks past an explicit q_offset
    T = int(rng.integers(17, 41))
    S = int(rng.integers(T + 48, 97))
  elif p['shape'] == 'tall_q':
    T, S = int(rng.integers(56, 97)), int(rng.integers(17, 41))
  elif p['shape'] == 'mid_q':  # unattended whole key blocks before and after the queries
    T, S = int(rng.integers(17, 25)), int(rng.integers(89, 97))
  q_offset = None
  if p['explicit_offset']:
    q_offset = unit * int(
      rng.integers(24, S - T - 39) if p['shape'] == 'mid_q' else rng.integers(0, S - T - 47)
    )
  T, S = unit * T, unit * S
  off = S - T if q_offset is None else q_offset
  q_seg = kv_seg = q_pos = kv_pos = slopes = None
  if p['segments'] == 'packed':  # sorted documents, queries aligned with their keys
    kv_seg = np.stack([np.cumsum(rng.random(S) < 0.06 / unit) for _ in range(B)]).astype(np.int32)
    q_seg = kv_seg[:, np.clip(off + np.arange(T), 0, S - 1)].copy()
    q_seg[0, T // 2] = 99  # a document with no keys: output exactly 0
    starts = np.maximum.accumulate(
      np.where(np.diff(kv_seg, prepend=-1) != 0, np.arange(S), 0), axis=1
    )
    kv_pos = (np.arange(S) - starts).astype(np.int32)  # positions restart per document
    q_pos = kv_pos[:, np.clip(off + np.arange(T), 0, S - 1)]
  elif p['segments'] == 'random':  # unsorted ids; one key block with an id no query has
    q_seg = rng.integers(0, 3, (B, T)).astype(np.int32)
    kv_seg = rng.integers(0, 3, (B, S)).astype(np.int32)
    kv_seg[:, 16 * unit : 32 * unit] = 7
    q_seg[-1, 3] = -5  # below every key id: exactly 0, and no query block range reaches 7
  if p['alibi']:
    slopes = (2.0 ** (-8.0 * np.arange(1, N + 1) / N)).astype(np.float32)
    if q_pos is None:
      q_pos = np.broadcast_to(off + np.arange(T), (B, T)).astype(np.int32)
      kv_pos = np.broadcast_to(np.arange(S), (B, S)).astype(np.int32)
  dtype = jnp.dtype(p['dtype'])

  # Round through the kernel dtype so the reference sees exactly the kernel's inputs.
  def draw(*shape):
    return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype))

  q, k, v, do = (
    draw(B, T, N, p['H']),
    draw(B, S, K, p['H']),
    draw(B, S, K, p['H']),
    draw(B, T, N, p['H']),
  )
  return dict(
    q=q,
    k=k,
    v=v,
    do=do,
    q_offset=q_offset,
    off=off,
    q_seg=q_seg,
    kv_seg=kv_seg,
    q_pos=q_pos,
    kv_pos=kv_pos,
    slopes=slopes,
    dtype=dtype,
  )


def run_kernel(q, k, v, do, attention=fa.flash_attention, **kw):
  extras = {
    n: kw.pop(n)
    for n in ('q_segment_ids', 'kv_segment_ids', 'alibi_slopes', 'q_positions', 'kv_positions')
  }
  attn = functools.partial(attention, **kw)

  @jax.jit
  def fwd_bwd(q, k, v, do, extras):
    o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, **extras), q, k, v)
    return o, vjp(do)

  o, grads = fwd_bwd(q, k, v, do, extras)
  return o, *grads


def check_against_reference(p, seed, attention=fa.flash_attention, unit=1, B=2):
  """Output and gradients within tolerance of float64; the key blocks every query block must
  skip are NaN-poisoned; a query with no allowed key gives exactly 0 (output and dq)."""
  x = make_inputs(p, seed, unit, B)
  B, T, N, H = x['q'].shape
  S = x['k'].shape[1]
  scale = H**-0.5
  bq, bk = p['blocks']
  common = dict(scale=scale, softcap=p['softcap'], causal=p['causal'], window=p['window'])
  o_ref, dq_ref, dk_ref, dv_ref = reference(
    x['q'],
    x['k'],
    x['v'],
    x['do'],
    q_offset=x['off'],
    q_seg=x['q_seg'],
    kv_seg=x['kv_seg'],
    slopes=x['slopes'],
    q_pos=x['q_pos'],
    kv_pos=x['kv_pos'],
    **common,
  )

  k, v = x['k'].copy(), x['v'].copy()
  n_poisoned = 0
  if bk is not None:
    skip = must_skip_blocks(
      T,
      S,
      bq,
      bk,
      q_offset=x['off'],
      q_seg=x['q_seg'],
      kv_seg=x['kv_seg'],
      causal=p['causal'],
      window=p['window'],
    )
    for b, kb in zip(*np.nonzero(skip)):
      rows = slice(kb * bk, (kb + 1) * bk)
      for arr in (k, v):
        arr[slice(None) if skip.shape[0] == 1 else b, rows] = np.nan
      n_poisoned += 1
  assert (n_poisoned > 0) == p['expect_skip']

  o, dq, dk, dv = run_kernel(
    x['q'],
    k,
    v,
    x['do'],
    attention,
    q_offset=x['q_offset'],
    q_segment_ids=x['q_seg'],
    kv_segment_ids=x['kv_seg'],
    alibi_slopes=x['slopes'],
    q_positions=x['q_pos'],
    kv_positions=x['kv_pos'],
    block_q=bq,
    block_k=bk,
    **common,
  )
  assert o.dtype == x['dtype'] and o.shape == (B, T, N, H)
  assert dk.dtype == x['dtype'] and dk.shape == k.shape
  tol = F32_TOL if x['dtype'] == jnp.float32 else BF16_TOL
  for name, got, ref in (
    ('out', o, o_ref),
    ('dq', dq, dq_ref),
    ('dk', dk, dk_ref),
    ('dv', dv, dv_ref),
  ):
    err = rel_err(got, ref)
    assert err < tol, f'{name}: relative error {err:.2e} >= {tol}'
  if x['q_seg'] is not None:
    orphans = ~allowed_mask(
      T,
      S,
      causal=p['causal'],
      window=p['window'],
      q_offset=x['off'],
      q_seg=x['q_seg'],
      kv_seg=x['kv_seg'],
    ).any(-1)  # [B, T]
    assert orphans.any()
    assert (np.asarray(o)[orphans] == 0).all() and (np.asarray(dq)[orphans] == 0).all()


@pytest.mark.parametrize('p', CASES)
def test_matches_float64_reference(p, request):
  check_against_reference(p, seed=sum(map(ord, request.node.callspec.id)))


BOUNDS_CONFIGS = [
  dict(q_len=T, kv_len=S, q_offset=off, causal=c, window=w, block_q=bq, block_k=bk)
  for (T, S, off) in [(128, 128, 0), (50, 90, 40), (50, 90, 7), (90, 50, -40), (33, 33, 0)]
  for c in (True, False)
  for w in (None, 1, 20, 32)
  for (bq, bk) in [(32, 32), (16, 64)]
]


def brute_force_blocks(q_len, kv_len, q_offset, causal, window, block_q, block_k):
  """Set of (query block, key block) pairs holding at least one allowed pair of real tokens."""
  ok = allowed_mask(q_len, kv_len, causal=causal, window=window, q_offset=q_offset)[0]
  return {(t // block_q, j // block_k) for t, j in zip(*np.nonzero(ok))}


@pytest.mark.parametrize('cfg', BOUNDS_CONFIGS)
def test_loop_bounds_visit_exactly_the_blocks_with_allowed_pairs(cfg):
  want = brute_force_blocks(**cfg)
  nq = -(-cfg['q_len'] // cfg['block_q']) + 1  # one extra block of pure padding
  nk = -(-cfg['kv_len'] // cfg['block_k']) + 1
  by_q = {(qb, kb) for qb in range(nq) for kb in range(*fa.kv_block_range(qb, **cfg))}
  by_k = {(qb, kb) for kb in range(nk) for qb in range(*fa.q_block_range(kb, **cfg))}
  assert by_q == want
  assert by_k == want


def test_causal_and_window_skip_counts():
  cfg = dict(q_len=128, kv_len=128, q_offset=0, causal=True, block_q=32, block_k=32)

  def visits(window):
    return sum(len(range(*fa.kv_block_range(qb, window=window, **cfg))) for qb in range(4))

  assert visits(None) == 10  # of 16: stops at the diagonal
  assert visits(32) == 7  # diagonal block and the one before it


def test_bounds_traced_match_python():
  cfg = dict(q_len=50, kv_len=90, q_offset=7, causal=False, window=20, block_q=16, block_k=32)
  traced = jax.jit(lambda b: (fa.kv_block_range(b, **cfg), fa.q_block_range(b, **cfg)))
  for b in range(4):
    got = jax.tree.map(int, traced(jnp.int32(b)))
    assert got == (fa.kv_block_range(b, **cfg), fa.q_block_range(b, **cfg))


def test_default_blocks_and_validation():
  for kind in ('hopper', 'gpu', 'cpu'):
    for head_dim in (16, 64, 80, 128, 256):
      blocks, _ = fa.default_tiling(head_dim, kind)
      assert all(b >= 16 and b & (b - 1) == 0 for b in blocks)
      # The padded length is a multiple of both passes' tiles: the larger a multiple of the other.
      assert max(blocks[0], blocks[2]) % min(blocks[0], blocks[2]) == 0
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match='powers of two'):
    fa.flash_attention(q, q, q, scale=1.0, block_q=24)
  with pytest.raises(ValueError, match='powers of two'):
    fa.flash_attention(q, q, q, scale=1.0, block_k=8)
  with pytest.raises(ValueError, match='shapes'):
    fa.flash_attention(q, q[:, :, :1, :8], q[:, :, :1, :8], scale=1.0)
  with pytest.raises(ValueError, match='both'):
    fa.flash_attention(q, q, q, scale=1.0, q_segment_ids=jnp.zeros((1, 8), jnp.int32))


@pytest.mark.parametrize('p', [case('packed-causal-h80', G=2, H=80, segments='packed')])
def test_forward_and_backward_tiles_may_differ(p, monkeypatch):
  """Default tiles larger in the forward than in the backward (as on Hopper at head_dim 128,
  scaled down for the interpreter): queries pad to the larger, and output and gradients still
  match float64."""
  monkeypatch.setattr(
    fa, 'default_tiling', lambda *_: (fa.BlockSizes(32, 32, 16, 16), fa.Launch(4, 2, 4, 2))
  )
  check_against_reference({**p, 'blocks': (None, None)}, seed=7)


@pytest.mark.parametrize('kind,tiles,warps', [('hopper', (2, 4), (8, 4)), ('gpu', (4, 4), (4, 4))])
def test_each_pass_lowers_with_its_own_tiles_and_warps(kind, tiles, warps, monkeypatch):
  """At head_dim 128 a Hopper GPU's forward runs 128-row tiles with 8 warps and its two backward
  kernels 64-row tiles with 4 (tuned, gpu-h100-3.md); other GPUs 64 and 4 in both (an A100's
  shared memory). Read from the lowered kernels: the grid's query blocks of T 256, num_warps."""
  import re

  monkeypatch.setattr(fa, 'gpu_kind', lambda: kind)
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  attn = functools.partial(fa.flash_attention, scale=0.125, causal=True, interpret=False)
  hlo = lower_fwd_bwd_for_h100(attn, q, q, q, q).as_text()
  calls = re.findall(r'__gpu\$xla\.gpu\.triton\(.*?grid_z = (\d+) .*?num_warps = (\d+)', hlo)
  assert len(calls) == 3  # forward, dK/dV, dQ: in that order
  (fwd_grid, fwd_warps), _, (dq_grid, dq_warps) = [(int(g), int(w)) for g, w in calls]
  assert (fwd_grid, dq_grid) == tiles and (fwd_warps, dq_warps) == warps
  assert int(calls[1][1]) == warps[1]


def lower_fwd_bwd_for_h100(attn, q, k, v, d_out, **extras):
  """Forward + backward of attn(q, k, v, **extras) lowered for CUDA on any host (interpret off)."""
  names = tuple(extras)

  def fwd_bwd(q, k, v, d_out, *ex):
    o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, **dict(zip(names, ex))), q, k, v)
    return o, vjp(d_out)

  # jax 0.11 deprecated Pallas's Triton backend: each Triton lowering warns, and must.
  warns = (
    pytest.warns(DeprecationWarning, match='Pallas Triton backend is deprecated')
    if TRITON_DEPRECATED
    else contextlib.nullcontext()
  )
  # With no GPU attached, jax >= 0.11 asks which GPU the Triton kernel is for: an H100 (sm_90),
  # named by an abstract device on the mesh the lowering sees.
  h100 = jax.sharding.AbstractMesh(
    (1,),
    ('x',),
    abstract_device=jax.sharding.AbstractDevice(
      device_kind='NVIDIA H100', num_cores=None, platform='gpu'
    ),
  )
  with warns, jax.sharding.use_abstract_mesh(h100):
    return (
      jax.jit(fwd_bwd).trace(q, k, v, d_out, *extras.values()).lower(lowering_platforms=('cuda',))
    )


@pytest.mark.parametrize('dtype,H,extras', [(jnp.bfloat16, 128, True), (jnp.float32, 80, False)])
def test_lowers_to_triton_for_gpu(dtype, H, extras):
  """Cross-lowers forward + backward for CUDA (interpret=False) on any host: runs the Pallas
  Triton lowering (power-of-two tensor shapes, supported ops). Where jaxlib compiles during
  lowering (newer jaxlib, GPU image) this also runs the Triton compiler."""
  B, T, S, N, K = 2, 200, 200, 12, 4  # ragged lengths, a group of 3 query heads
  q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
  kv = jax.ShapeDtypeStruct((B, S, K, H), dtype)
  ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
  ex = (ids, ids, jax.ShapeDtypeStruct((N,), jnp.float32), ids, ids) if extras else ()
  names = ('q_segment_ids', 'kv_segment_ids', 'alibi_slopes', 'q_positions', 'kv_positions')
  attn = functools.partial(  # with the extras, a soft cap too (tanh lowers to Triton)
    fa.flash_attention,
    scale=0.125,
    softcap=30.0 if extras else None,
    causal=extras,
    window=64,
    interpret=False,
  )
  hlo = lower_fwd_bwd_for_h100(attn, q, kv, kv, q, **dict(zip(names, ex))).as_text()
  assert hlo.count('__gpu$xla.gpu.triton') + hlo.count('triton_kernel_call') == 3


@pytest.mark.parametrize(
  'causal,window,segments',
  [(False, None, False), (False, None, True), (True, None, False), (False, 32, False)],
)
def test_triton_modules_pass_the_mlir_verifier(causal, window, segments, monkeypatch):
  """Every Triton module of forward + backward verifies, as the GPU's Triton compiler requires
  before it compiles (the cross-lowering above does not verify). Non-causal attention without a
  window failed on an H200 (2026-11-26, 'scf.for' bounds of two types): a loop bound from a
  select of Python ints took the predicate's type, i1."""
  from jax._src.pallas.triton import lowering as triton_lowering

  lower, verified = triton_lowering.lower_jaxpr_to_triton_module, []

  def lower_and_verify(*args, **kwargs):
    result = lower(*args, **kwargs)
    with result.module.context:
      verified.append(result.module.operation.verify())  # raises MLIRError naming the op
    return result

  monkeypatch.setattr(triton_lowering, 'lower_jaxpr_to_triton_module', lower_and_verify)
  q = jax.ShapeDtypeStruct((1, 96, 4, 64), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((1, 96), jnp.int32)
  attn = functools.partial(
    fa.flash_attention, scale=0.125, causal=causal, window=window, interpret=False
  )

  segments = dict(q_segment_ids=ids, kv_segment_ids=ids) if segments else {}
  lower_fwd_bwd_for_h100(attn, q, q, q, q, **segments)
  assert verified == [True] * 3
