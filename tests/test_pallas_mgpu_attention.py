"""pallas_kernels.flash_attention_mgpu (Mosaic GPU: forward, dq and dk/dv kernels) in JAX's Mosaic
GPU interpreter against the float64 reference, with the Triton kernel's cases and checks: the key
blocks every query block must skip hold NaN, and a query with no allowed key gives exactly 0
(output and dq).

The interpreter cannot run the kernels' MMAs as written for the GPU (a transposed shared-memory
operand, a register-held operand inside run_state), so in interpret mode they are jnp.dots on the
same tiles; the GPU path is lowered for CUDA here instead, which checks its layouts, wgmma shapes
and shared-memory size. On a GPU backend the kernels default to compiling for real (interpret
off), so the same cases test the compiled kernels there (Hopper or newer: wgmma).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_attention import (
  BF16_TOL,
  allowed_mask,
  case,
  check_against_reference,
  make_inputs,
  must_skip_blocks,
  reference,
  rel_err,
)

from pallas_kernels import flash_attention_mgpu as fm


def mgpu_case(name, *, unit=2, B=1, slow=False, block_k=64, **kw):
  p = case(name, dtype='bfloat16', blocks=(fm.TILE, block_k), **kw)
  return pytest.param(
    {**p.values[0], 'unit': unit, 'B': B}, id=name, marks=[pytest.mark.slow] if slow else []
  )


# The interpreter runs each warpgroup as a thread with simulated TMA and barriers (~20-50 s a
# case here): the case the others cover runs with -m slow.
CASES = [
  mgpu_case('causal-gqa2', G=2, H=64, slow=True),
  mgpu_case(
    'causal-gqa2-q-offset',
    G=2,
    H=64,
    shape='short_q',
    explicit_offset=True,
    expect_skip=True,
    slow=True,
  ),
  mgpu_case(
    'noncausal-window-q-offset',
    unit=4,
    G=1,
    H=64,
    causal=False,
    window=9,
    shape='mid_q',
    explicit_offset=True,
    expect_skip=True,
  ),
  mgpu_case(
    'packed-docs-alibi-window-softcap-h80',
    G=2,
    H=80,
    window=40,
    segments='packed',
    alibi=True,
    softcap=1.5,
  ),
  # 128-key blocks with side inputs: this hung on a 2-thread XLA CPU pool (tests/conftest.py).
  mgpu_case(
    'packed-docs-alibi-bk128', unit=4, G=2, H=64, segments='packed', alibi=True, block_k=128
  ),
]


@pytest.mark.parametrize('p', CASES)
def test_output_and_gradients_match_float64_reference(p, request):
  """flash_attention with its custom VJP: the forward, dq and dk/dv kernels."""
  check_against_reference(
    p, sum(map(ord, request.node.callspec.id)), fm.flash_attention, unit=p['unit'], B=p['B']
  )


# The forward alone at 128-key blocks is slow only: test_output_and_gradients_match_... checks the
# same forward (and the hang it guards against) in the fast run.
@pytest.mark.parametrize(
  'p',
  CASES[:1] + CASES[2:3] + [pytest.param(*CASES[4].values, id=CASES[4].id, marks=pytest.mark.slow)],
)
def test_forward_alone_matches_float64_reference(p, request):
  x = make_inputs(p, sum(map(ord, request.node.callspec.id)), p['unit'], p['B'])
  B, T, N, H = x['q'].shape
  S = x['k'].shape[1]
  common = dict(scale=H**-0.5, softcap=p['softcap'], causal=p['causal'], window=p['window'])
  o_ref, *_ = reference(
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
  skip = must_skip_blocks(
    T,
    S,
    *p['blocks'],
    q_offset=x['off'],
    q_seg=x['q_seg'],
    kv_seg=x['kv_seg'],
    causal=p['causal'],
    window=p['window'],
  )
  bk = p['blocks'][1]
  for b, kb in zip(*np.nonzero(skip)):
    for arr in (k, v):
      arr[slice(None) if skip.shape[0] == 1 else b, kb * bk : (kb + 1) * bk] = np.nan
  assert skip.any() == p['expect_skip']

  o, lse = jax.jit(
    lambda q, k, v, ex: fm.flash_attention_forward(
      q, k, v, q_offset=x['q_offset'], block_k=bk, **ex, **common
    )
  )(
    x['q'],
    k,
    v,
    dict(
      q_segment_ids=x['q_seg'],
      kv_segment_ids=x['kv_seg'],
      alibi_slopes=x['slopes'],
      q_positions=x['q_pos'],
      kv_positions=x['kv_pos'],
    ),
  )
  assert o.dtype == jnp.bfloat16 and o.shape == (B, T, N, H) and lse.shape == (B, N, T)
  err = rel_err(o, o_ref)
  assert err < BF16_TOL, f'relative error {err:.2e}'
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
    assert orphans.any() and (np.asarray(o, np.float32)[orphans] == 0).all()


@pytest.mark.parametrize('extras', [False, True])
def test_lowers_for_cuda(extras):
  """The GPU path of all three kernels (wgmma from shared memory, run_state accumulators with a
  register operand) through Mosaic GPU's lowering on any host: layout inference, wgmma shapes,
  the shared-memory budget."""
  B, T, S, N, K, H = 2, 200, 300, 6, 2, 128
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
  ids_q, ids_kv = jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, S), jnp.int32)

  def fwd_bwd(q, k, v, q_ids, kv_ids):
    kw = (
      dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids, alibi_slopes=jnp.linspace(0.5, 0.01, N))
      if extras
      else {}
    )
    o, vjp = jax.vjp(
      lambda q, k, v: fm.flash_attention(q, k, v, scale=0.1, window=70, interpret=False, **kw),
      q,
      k,
      v,
    )
    return o, vjp(o)

  text = (
    jax.jit(fwd_bwd).trace(q, kv, kv, ids_q, ids_kv).lower(lowering_platforms=('cuda',)).as_text()
  )
  assert text.count('mosaic_gpu') >= 3  # the forward, dq and dk/dv kernels


def test_interpreting_on_a_small_cpu_pool_is_refused(monkeypatch):
  """A pool of fewer than 4 XLA CPU threads would deadlock the interpreter: a one-line error."""
  q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  monkeypatch.setenv('NPROC', '3')
  with pytest.raises(RuntimeError, match=r'needs >= 4 XLA CPU threads .* has 3 .*NPROC=8'):
    fm.flash_attention_forward(q, q, q, scale=1.0, interpret=True)


def test_inputs_are_checked():
  q = jnp.zeros((1, 64, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match='bfloat16 or float16'):
    fm.flash_attention_forward(q, q, q, scale=1.0)
  q = q.astype(jnp.bfloat16)
  with pytest.raises(ValueError, match='multiple of 64'):
    fm.flash_attention_forward(q, q, q, scale=1.0, block_k=96)
