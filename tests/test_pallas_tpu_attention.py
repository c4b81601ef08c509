"""pallas_kernels.flash_attention_tpu in JAX's TPU interpreter, against the float64 reference
(output and dq, dk, dv), with the Triton kernel's checks (tests/test_pallas_attention.py): key
blocks every query block must skip are NaN-poisoned, and a query with no allowed key gives 0.

Lengths are the Triton cases' times `unit`, since a TPU key block is at least 128 lanes. The
interpreter does not apply Mosaic's rules, so a second test lowers forward + backward for a TPU
(no TPU needed): block shapes, layouts and ops Mosaic accepts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from test_pallas_attention import case, check_against_reference

from pallas_kernels import flash_attention_tpu as ft


def tpu_case(name, *, unit=4, B=1, slow=False, **kw):
  p = case(name, **kw)
  return pytest.param(
    {**p.values[0], 'unit': unit, 'B': B}, id=name, marks=[pytest.mark.slow] if slow else []
  )


# The interpreter costs ~0.1 s a grid step: the cases another one covers run with -m slow
# (a window and a head padded to 128 lanes: bf16-everything).
CASES = [
  tpu_case('causal-gqa2-h64', G=2, H=64, blocks=(64, 128), slow=True),
  tpu_case('noncausal-mha', G=1, H=64, causal=False, shape='short_q', blocks=(64, 128), slow=True),
  tpu_case(
    'causal-mqa8-q-offset',
    G=8,
    H=64,
    shape='short_q',
    explicit_offset=True,
    blocks=(64, 128),
    expect_skip=True,
  ),
  tpu_case('causal-window', G=2, H=64, window=40, blocks=(64, 128), slow=True),
  tpu_case(
    'noncausal-window-q-offset',
    unit=8,
    G=1,
    H=64,
    causal=False,
    window=9,
    shape='mid_q',
    explicit_offset=True,
    blocks=(64, 128),
    expect_skip=True,
  ),
  tpu_case('alibi-h80', G=2, H=80, alibi=True, blocks=(64, 128), slow=True),
  tpu_case(
    'packed-docs-causal', B=2, G=2, H=64, segments='packed', alibi=True, blocks=(64, 128), slow=True
  ),
  tpu_case(
    'unsorted-segments-noncausal',
    unit=8,
    B=2,
    G=1,
    H=64,
    causal=False,
    segments='random',
    blocks=(128, 128),
    expect_skip=True,
  ),
  tpu_case(
    'more-queries-than-keys-softcap', G=1, H=64, shape='tall_q', blocks=(64, 128), softcap=1.5
  ),
  tpu_case(
    'bf16-everything',
    G=4,
    H=80,
    window=80,
    segments='packed',
    alibi=True,
    dtype='bfloat16',
    blocks=(128, 128),
  ),
  tpu_case('default-blocks-h192', G=2, H=192, blocks=(None, None), slow=True),
]


@pytest.mark.parametrize('p', CASES)
def test_matches_float64_reference(p, request):
  check_against_reference(
    p,
    seed=sum(map(ord, request.node.callspec.id)),
    attention=ft.flash_attention,
    unit=p['unit'],
    B=p['B'],
  )


@pytest.mark.parametrize('dtype,H,extras', [(jnp.bfloat16, 128, True), (jnp.float32, 80, False)])
def test_lowers_for_tpu(dtype, H, extras):
  """Forward + backward lowered by Mosaic for a TPU on any host (interpret off): the (8, 128)
  block rule, the layouts and every op in the kernels and their index maps."""
  B, T, S, N, K = 2, 200, 300, 6, 2  # ragged lengths, a group of 3 query heads
  q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
  kv = jax.ShapeDtypeStruct((B, S, K, H), dtype)
  ids_q, ids_kv = jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, S), jnp.int32)

  def fwd_bwd(q, k, v, q_ids, kv_ids):
    kw = (
      dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids, alibi_slopes=jnp.linspace(0.5, 0.01, N))
      if extras
      else {}
    )
    o, vjp = jax.vjp(
      lambda q, k, v: ft.flash_attention(q, k, v, scale=0.1, window=70, interpret=False, **kw),
      q,
      k,
      v,
    )
    return o, vjp(o)

  text = (
    jax.jit(fwd_bwd).trace(q, kv, kv, ids_q, ids_kv).lower(lowering_platforms=('tpu',)).as_text()
  )
  assert text.count('tpu_custom_call') == 3  # forward, dK/dV, dQ


def test_block_sizes_are_checked():
  q = jnp.zeros((1, 8, 2, 16))
  with pytest.raises(ValueError, match='block_q must be a positive multiple of 8'):
    ft.flash_attention(q, q, q, scale=1.0, block_q=12)
  with pytest.raises(ValueError, match='block_k must be a positive multiple of 128'):
    ft.flash_attention(q, q, q, scale=1.0, block_k=64)
  with pytest.raises(ValueError, match='both'):
    ft.flash_attention(q, q, q, scale=1.0, q_segment_ids=jnp.zeros((1, 8), jnp.int32))
