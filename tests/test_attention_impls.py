"""Every attention implementation against the float64 reference: outputs and gradients.

'blockwise' and 'pallas' (interpreted on CPU) run with small tiles so that every case spans several
blocks and the skipping logic is exercised; 'cudnn' cannot run here, so its mask and bias
translation runs through `jax.nn.dot_product_attention(implementation='xla')` instead.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import (
  alibi_bias,
  allowed_mask,
  attention_with_grads,
  positions_mask,
  relative_error,
)
from conftest import tiny_config
from flax import nnx

import mllm
from mllm.ops import attention as attention_ops
from mllm.ops import blockwise
from mllm.ops.attention import AttentionMask, RelativeValues, ScoreBias
from mllm.ops.cudnn_rules import GpuFacts, runtime_gpu_facts

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# Tiles per implementation: several blocks per case; blockwise's need not be powers of two.
TILES = {
  'blockwise': (16, 12),
  'pallas': (16, 16),
  'auto': (None, None),
  'cudnn': (None, None),
  'splash': (None, None),
}
IMPLS = ('blockwise', 'pallas', 'auto', 'cudnn')


@dataclasses.dataclass(frozen=True)
class Case:
  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  causal: bool = True
  window: int | None = None
  segments: bool = False
  alibi: bool = False
  q_offset: int | None = None
  dtype: type = jnp.float32
  absent_segment: bool = False  # one query's segment appears nowhere among the keys

  def __str__(self):
    flags = [
      f'B{self.B}',
      f'T{self.T}',
      f'S{self.S}',
      f'N{self.N}',
      f'K{self.K}',
      f'H{self.H}',
      'causal' if self.causal else 'full',
    ]
    flags += [f'w{self.window}'] * (self.window is not None) + ['seg'] * self.segments
    flags += ['alibi'] * self.alibi + [f'off{self.q_offset}'] * (self.q_offset is not None)
    flags += ['absent'] * self.absent_segment + [jnp.dtype(self.dtype).name]
    return '-'.join(flags)


CASES = [
  Case(2, 40, 40, 4, 4, 64),  # MHA, G = 1
  Case(1, 37, 37, 4, 2, 80),  # G = 2, odd length, head_dim 80
  Case(2, 33, 33, 8, 2, 64, causal=False),  # G = 4, not causal
  Case(1, 48, 48, 8, 1, 64, window=10),  # MQA, G = 8, sliding window
  Case(1, 40, 40, 4, 2, 64, causal=False, window=7),  # two-sided window
  Case(2, 45, 45, 4, 1, 64, segments=True, alibi=True),  # packed documents with ALiBi
  Case(2, 20, 50, 4, 2, 64),  # q_len < kv_len, bottom-right
  Case(1, 24, 50, 4, 4, 80, window=12, q_offset=10),  # explicit offset and a window
  Case(2, 32, 32, 4, 2, 64, segments=True, absent_segment=True),
  Case(1, 24, 24, 2, 2, 128, causal=False),  # head_dim 128
  Case(1, 20, 20, 2, 1, 256),  # head_dim 256
  Case(1, 21, 21, 2, 1, 40, window=6),  # head_dim 40, padded to 64
  Case(1, 37, 37, 4, 2, 80, dtype=jnp.bfloat16),
  Case(2, 45, 45, 4, 1, 64, segments=True, alibi=True, window=16, dtype=jnp.bfloat16),
]


def _random_cases(n, seed=0):
  """Shapes and features drawn from a fixed seed, on top of the hand-picked cases."""
  rng = np.random.default_rng(seed)
  cases = []
  for _ in range(n):
    K = int(rng.choice([1, 2, 4]))
    T = int(rng.integers(17, 60))
    S = T if rng.random() < 0.6 else int(rng.integers(T, 70))
    cases.append(
      Case(
        B=int(rng.integers(1, 3)),
        T=T,
        S=S,
        N=K * int(rng.choice([1, 2, 4, 8])) if K < 4 else 4,
        K=K,
        H=int(rng.choice([64, 80])),
        causal=bool(rng.random() < 0.7),
        window=int(rng.integers(3, 30)) if rng.random() < 0.4 else None,
        segments=S == T and bool(rng.random() < 0.5),
        alibi=bool(rng.random() < 0.4),
      )
    )
  return cases


CASES += _random_cases(4)


def _inputs(case: Case, seed=0):
  key = jax.random.key(seed)
  kq, kk, kv, ko = jax.random.split(key, 4)
  q = jax.random.normal(kq, (case.B, case.T, case.N, case.H), case.dtype)
  k = jax.random.normal(kk, (case.B, case.S, case.K, case.H), case.dtype)
  v = jax.random.normal(kv, (case.B, case.S, case.K, case.H), case.dtype)
  d_out = jax.random.normal(ko, q.shape, case.dtype)
  rng = np.random.default_rng(seed)
  seg_kv = pos_kv = None
  if case.segments:
    seg_kv = np.cumsum(rng.random((case.B, case.S)) < 0.12, axis=1).astype(np.int32)
    starts = np.maximum.accumulate(
      np.where(np.diff(seg_kv, prepend=-1, axis=1) != 0, np.arange(case.S), 0), axis=1
    )
    pos_kv = (np.arange(case.S) - starts).astype(np.int32)  # positions restart per document
  else:
    pos_kv = np.broadcast_to(np.arange(case.S, dtype=np.int32), (case.B, case.S)).copy()
  offset = case.S - case.T if case.q_offset is None else case.q_offset
  seg_q = None if seg_kv is None else seg_kv[:, offset : offset + case.T].copy()
  if case.absent_segment:
    seg_q[0, case.T // 2] = 999
  pos_q = pos_kv[:, offset : offset + case.T]
  mask = AttentionMask(
    causal=case.causal,
    window=case.window,
    q_offset=case.q_offset,
    q_segment_ids=None if seg_q is None else jnp.asarray(seg_q),
    kv_segment_ids=None if seg_kv is None else jnp.asarray(seg_kv),
  )
  bias = None
  if case.alibi:
    slopes = jnp.asarray(2.0 ** -np.arange(1, case.N + 1) * 4, jnp.float32)
    bias = ScoreBias(
      alibi_slopes=slopes, q_positions=jnp.asarray(pos_q), kv_positions=jnp.asarray(pos_kv)
    )
  reference = functools.partial(
    attention_with_grads,
    bias=None if bias is None else alibi_bias(slopes, pos_q, pos_kv),
    causal=case.causal,
    window=case.window,
    q_seg=seg_q,
    kv_seg=seg_kv,
    q_offset=case.q_offset,
  )
  return (q, k, v, d_out), mask, bias, reference


def _run(impl, q, k, v, d_out, mask, bias, **kwargs):
  """Output and (dq, dk, dv) of `impl`, all in one jitted program."""
  block_q, block_k = TILES[impl]
  if impl == 'cudnn':
    fn = functools.partial(
      attention_ops.cudnn_attention,
      implementation='xla',
      rel_values=None,
      scale=q.shape[-1] ** -0.5,
    )
  else:
    fn = functools.partial(attention_ops.attend, impl=impl, block_q=block_q, block_k=block_k)

  @jax.jit  # the mask is closed over: the tiled impls need its q_offset as a Python int
  def run(q, k, v, d_out):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask=mask, bias=bias, **kwargs), q, k, v)
    return out, vjp(d_out)

  return run(q, k, v, d_out)


def _f32(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize('impl', IMPLS)
@pytest.mark.parametrize('case', CASES, ids=str)
def test_outputs_and_gradients_match_float64_reference(impl, case):
  (q, k, v, d_out), mask, bias, reference = _inputs(case)
  out, grads = _run(impl, q, k, v, d_out, mask, bias)
  assert out.dtype == case.dtype and out.shape == q.shape
  want_out, (dq, dk, dv, _) = reference(_f32(q), _f32(k), _f32(v), _f32(d_out))
  tol = TOLERANCE[case.dtype]
  errors = {
    name: relative_error(_f32(got), want)
    for name, got, want in zip(('out', 'dq', 'dk', 'dv'), (out, *grads), (want_out, dq, dk, dv))
  }
  assert all(err < tol for err in errors.values()), errors
  for got in (out, *grads):
    assert np.isfinite(_f32(got)).all()
  if case.absent_segment:  # a query that sees no key gives exactly zero
    np.testing.assert_array_equal(_f32(out[0, case.T // 2]), 0.0)


# Splash (JAX's TPU kernel, interpreted here at ~5-10 s a case): the hand-picked cases without
# ALiBi that add something (MHA, MQA with a window, a two-sided window: -m slow), and two
# spanning several of its 128-blocks.
SPLASH_CASES = (
  [CASES[i] for i in (7, 8, 12)]
  + [Case(1, 200, 300, 4, 2, 64), Case(1, 300, 100, 2, 1, 64, window=40)]
  + [pytest.param(CASES[i], marks=pytest.mark.slow) for i in (0, 3, 4)]
)


@pytest.mark.parametrize('case', SPLASH_CASES, ids=str)
def test_splash_matches_float64_reference(case):
  test_outputs_and_gradients_match_float64_reference('splash', case)


@pytest.mark.parametrize('impl', ['blockwise', 'auto'])
def test_learned_bias_gradients_match_reference(impl):
  """A dense learned bias (T5, Shaw's key term): dL/d_bias = dS, summed over broadcast dims."""
  case = Case(2, 37, 37, 4, 2, 16, segments=True)
  (q, k, v, d_out), mask, _, _reference = _inputs(case, seed=3)
  dense = jax.random.normal(jax.random.key(5), (1, 4, 37, 37))
  block_q, block_k = TILES[impl]

  @jax.jit
  def run(q, k, v, dense):
    def f(q, k, v, dense):
      bias = ScoreBias(dense=dense)
      return attention_ops.attend(
        q, k, v, mask=mask, bias=bias, impl=impl, block_q=block_q, block_k=block_k
      )

    out, vjp = jax.vjp(f, q, k, v, dense)
    return out, vjp(d_out)

  out, (gq, gk, gv, g_dense) = run(q, k, v, dense)
  want, (dq, dk, dv, ds) = attention_with_grads(
    _f32(q),
    _f32(k),
    _f32(v),
    _f32(d_out),
    bias=np.asarray(dense, np.float64),
    causal=True,
    q_seg=np.asarray(mask.q_segment_ids),
    kv_seg=np.asarray(mask.kv_segment_ids),
  )
  for got, ref in ((out, want), (gq, dq), (gk, dk), (gv, dv), (g_dense, ds.sum(0, keepdims=True))):
    assert relative_error(got, ref) < 1e-5


def test_shaw_relative_values_match_xla():
  """Shaw's value term through blockwise (a one-hot product per block) and 'xla' (a
  scatter-add): both outputs vs float64 loops, every gradient of one vs the other's (two
  independent paths)."""
  q, k, v = (
    jax.random.normal(key, (2, 30, 4, 16)) for key in jax.random.split(jax.random.key(7), 3)
  )
  table = jax.random.normal(jax.random.key(8), (5, 16))
  index = (jnp.clip(jnp.arange(30)[None, :] - jnp.arange(30)[:, None], -2, 2) + 2)[None]
  mask = AttentionMask(window=9)

  def loss(impl, q, k, v, table):
    out = attention_ops.attend(
      q, k, v, mask=mask, rel_values=RelativeValues(table, index), impl=impl, block_q=8, block_k=16
    )
    return jnp.sum(out * jnp.cos(jnp.arange(16.0))), out

  def grad(impl):
    g = jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2, 3), has_aux=True)
    return jax.jit(g)(q, k, v, table)

  (g_block, out_block), (g_xla, out_xla) = grad('blockwise'), grad('xla')
  want = attention_with_grads(q, k, v, causal=True, window=9)
  p_weights = _shaw_weights(q, k, window=9, index=np.asarray(index)[0], n_rel=5)
  want = want + np.einsum('bntr,rh->btnh', p_weights, np.asarray(table, np.float64))
  assert relative_error(out_block, want) < 1e-5
  assert relative_error(out_xla, want) < 1e-5
  for a, b in zip(g_block, g_xla):
    assert relative_error(a, b) < 1e-5


def _shaw_weights(q, k, *, window, index, n_rel):
  """Σ_j p_ij [index_ij = r], float64: the weight each relative embedding gets."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  B, T, _N, H = q.shape
  ok = allowed_mask(B, T, T, window=window)[:, None]
  logits = np.where(ok, np.einsum('btnh,bsnh->bnts', q, k) * H**-0.5, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum('bnts,tsr->bntr', p, np.eye(n_rel)[index])


def test_blockwise_dropout_is_keyed_and_unbiased():
  q, k, v = (
    jax.random.normal(key, (1, 24, 2, 8)) for key in jax.random.split(jax.random.key(9), 3)
  )
  run = jax.jit(
    lambda rng: attention_ops.attend(
      q,
      k,
      v,
      mask=AttentionMask(),
      impl='blockwise',
      dropout_rate=0.5,
      dropout_rng=rng,
      block_q=8,
      block_k=8,
    )
  )
  a, b, c = run(jax.random.key(0)), run(jax.random.key(1)), run(jax.random.key(0))
  assert not np.allclose(a, b)
  np.testing.assert_array_equal(a, c)
  mean = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(2), 3000)).mean(0)
  exact = attention_with_grads(q, k, v)
  np.testing.assert_allclose(mean, exact, atol=0.1)


# ------------------------------------------------------------------------------------------
# Block skipping (the loop bounds themselves are checked in tests/test_pallas_attention.py).
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'window,segments,expected', [(None, False, 36), (64, False, 15), (None, True, None)]
)
def test_skipped_blocks_are_not_computed(monkeypatch, window, segments, expected):
  """Count, at run time, the score blocks the forward computes."""
  seg = jnp.asarray(np.repeat(np.arange(4), 128)[None])  # 4 documents of 2 blocks each
  mask = AttentionMask(
    window=window, q_segment_ids=seg if segments else None, kv_segment_ids=seg if segments else None
  )
  if expected is None:  # documents of two blocks: each query block sees at most 2 key blocks
    expected = 4 * (1 + 2)
  assert _blockwise_visits(monkeypatch, mask, 512) == expected


def _blockwise_visits(monkeypatch, mask, length: int) -> int:
  """How many 64 x 64 score blocks blockwise computes for self-attention over `length` tokens
  under `mask`: a probe in `_block_scores` counts them at run time."""
  visits = []
  real = blockwise._block_scores

  def counting(*args):
    jax.debug.callback(lambda: visits.append(1))
    return real(*args)

  monkeypatch.setattr(blockwise, '_block_scores', counting)
  q = jnp.ones((1, length, 2, 16))
  out = jax.jit(
    lambda q: attention_ops.attend(q, q, q, mask=mask, impl='blockwise', block_q=64, block_k=64)
  )(q)
  jax.block_until_ready(out)
  jax.effects_barrier()
  return len(visits)


# ------------------------------------------------------------------------------------------
# Masks ordered by per-sequence positions (a prefill chunk against a KV cache).
# ------------------------------------------------------------------------------------------


def _cache_layout(B, S, T, *, window, seed):
  """q positions [B, T] and kv positions [B, S + T]: each sequence has a different number of
  cached tokens (slot = position mod S, so a long one has wrapped, as in a rolling buffer), empty
  slots at −1, then T new queries, the last ones padding (−1) for some sequences."""
  rng = np.random.default_rng(seed)
  kv_pos = np.full((B, S), -1, np.int32)
  q_pos = np.full((B, T), -1, np.int32)
  for b in range(B):
    cached = int(rng.integers(0, 2 * S if window else S))
    for p in range(max(0, cached - S), cached):
      kv_pos[b, p % S] = p
    real = int(rng.integers(1, T + 1))
    q_pos[b, :real] = cached + np.arange(real)
  return q_pos, np.concatenate([kv_pos, q_pos], axis=1)  # keys: [cache ; new]


@pytest.mark.parametrize('impl', ['xla', 'blockwise', 'pallas', 'auto', 'cudnn'])
@pytest.mark.parametrize('window,causal', [(None, True), (9, True), (7, False)])
def test_position_ordered_mask_matches_reference(impl, window, causal):
  """Outputs and gradients, with several key and query blocks (blockwise tiles 16 x 12)."""
  B, S, T, N, K, H = 3, 30, 20, 4, 2, 16
  q_pos, kv_pos = _cache_layout(B, S, T, window=window, seed=1)
  case = Case(B, T, S + T, N, K, H)
  (q, k, v, d_out), _, _, _ = _inputs(case, seed=2)
  mask = AttentionMask(
    causal=causal, window=window, q_positions=jnp.asarray(q_pos), kv_positions=jnp.asarray(kv_pos)
  )
  out, grads = (_run_xla if impl == 'xla' else functools.partial(_run, impl))(
    q, k, v, d_out, mask, None
  )
  allowed = positions_mask(q_pos, kv_pos, causal=causal, window=window)
  want_out, (dq, dk, dv, _) = attention_with_grads(
    _f32(q), _f32(k), _f32(v), _f32(d_out), allowed=allowed
  )
  errors = {
    name: relative_error(_f32(got), want)
    for name, got, want in zip(('out', 'dq', 'dk', 'dv'), (out, *grads), (want_out, dq, dk, dv))
  }
  assert all(err < 1e-5 for err in errors.values()), errors
  if causal:  # a padding query (position −1) sees nothing causally: exactly zero
    np.testing.assert_array_equal(_f32(out)[q_pos < 0], 0.0)


def _run_xla(q, k, v, d_out, mask, bias):
  @jax.jit
  def run(q, k, v, d_out):
    out, vjp = jax.vjp(
      lambda q, k, v: attention_ops.attend(q, k, v, mask=mask, bias=bias, impl='xla'), q, k, v
    )
    return out, vjp(d_out)

  return run(q, k, v, d_out)


def test_position_ordered_blockwise_skips_future_key_blocks(monkeypatch):
  """Positions in slot order (a cache filled from slot 0): the blocks of keys in every query's
  future are skipped at run time, as the causal ranges skip them for an index-ordered mask."""
  positions = jnp.arange(256, dtype=jnp.int32)[None]
  mask = AttentionMask(q_positions=positions, kv_positions=positions)
  assert _blockwise_visits(monkeypatch, mask, 256) == 4 * 5 // 2  # the lower triangle of 4 x 4


@pytest.mark.parametrize(
  'impl,q_len,want',
  [
    ('pallas', 1, 'xla'),
    ('blockwise', 1, 'xla'),
    ('pallas', 8, 'blockwise'),
    ('xla', 8, 'xla'),
    ('pallas_tpu', 8, 'blockwise'),
    ('splash', 8, 'blockwise'),
    ('pallas_mgpu', 8, 'blockwise'),
    ('blockwise', 8, 'blockwise'),
    ('cudnn', 8, 'cudnn'),
  ],
)
def test_cached_impl(impl, q_len, want):
  assert attention_ops.cached_impl(impl, q_len) == want


# ------------------------------------------------------------------------------------------
# 'auto' and the config-time refusals.
# ------------------------------------------------------------------------------------------


def test_auto_picks_per_backend_length_and_features():
  def qk(n, dtype=jnp.float32):
    return jnp.zeros((1, n, 4, 16), dtype), jnp.zeros((1, n, 4, 16), dtype)

  short, long = qk(attention_ops.BLOCKWISE_FROM - 1), qk(attention_ops.BLOCKWISE_FROM)
  dense = ScoreBias(dense=jnp.zeros((1, 4, 1, 1)))
  alibi = ScoreBias(
    alibi_slopes=jnp.ones(4),
    q_positions=jnp.zeros((1, 1), jnp.int32),
    kv_positions=jnp.zeros((1, 1), jnp.int32),
  )
  hopper = GpuFacts((9, 0), 91000)  # the GPU rules in full: tests/test_auto_choice.py
  choose = functools.partial(attention_ops.choose_impl, rel_values=None, dropout=False, gpu=hopper)
  assert choose(*short, bias=None, backend='cpu') == 'xla'
  assert choose(*long, bias=None, backend='cpu') == 'blockwise'
  for backend in ('cpu', 'gpu', 'tpu'):
    assert choose(*long, bias=dense, backend=backend) == 'blockwise'
  assert choose(*short, bias=None, backend='tpu') == 'splash'
  assert choose(*long, bias=alibi, backend='tpu') == 'pallas'  # mllm's TPU kernel there
  assert choose(*qk(64, jnp.bfloat16), bias=None, backend='gpu') == 'cudnn'
  assert choose(*qk(64, jnp.bfloat16), bias=None, backend='cpu') == 'xla'
  assert choose(*qk(4096, jnp.bfloat16), bias=dense, backend='gpu') == 'blockwise'
  assert choose(*qk(4096, jnp.bfloat16), bias=alibi, backend='gpu') == 'pallas_mgpu'
  assert choose(*short, bias=None, backend='gpu') == 'pallas'  # float32: the Triton kernel
  assert (
    attention_ops.choose_impl(
      *qk(64, jnp.bfloat16), bias=None, rel_values=None, dropout=True, backend='gpu', gpu=hopper
    )
    == 'xla'
  )


def test_pallas_runs_the_kernel_of_the_backend():
  assert [attention_ops.pallas_kernel('pallas', b) for b in ('cpu', 'gpu', 'tpu')] == [
    'triton',
    'triton',
    'tpu',
  ]
  assert attention_ops.pallas_kernel('pallas_tpu', 'cpu') == 'tpu'
  assert attention_ops.pallas_kernel('pallas_mgpu', 'cpu') == 'mgpu'


@pytest.mark.parametrize(
  'choices,message',
  [
    ('pos=t5,attn=pallas', "position.kind='t5' is a learned relative bias"),
    ('pos=shaw,attn=pallas', "position.kind='shaw' is a learned relative bias"),
    ('pos=shaw,attn=cudnn,model.dtype=bfloat16', 'learned relative bias'),
    ('attn=pallas,model.attention.dropout=0.1', 'has no attention dropout'),
    ('attn=cudnn', "runs in bfloat16/float16 but model.dtype='float32'"),
    ('attn=pallas,model.attention.block_q=24', 'power of two >= 16'),
    ('attn=pallas_tpu,model.attention.block_k=64', 'tiles k in multiples of 128'),
    ('attn=splash,model.attention.block_q=64', 'splash tiles queries and keys in multiples of 128'),
    ('pos=alibi,attn=splash', "splash adds no bias to the scores, so no ALiBi"),
    ('pos=t5,attn=splash', "position.kind='t5' is a learned relative bias"),
    ('attn=pallas_tpu,model.attention.block_q=12', 'tiles q in multiples of 8'),
    ('pos=t5,attn=pallas_tpu', "position.kind='t5' is a learned relative bias"),
    ('attn=blockwise,model.attention.block_k=0', 'positive integer'),
    ('attn=pallas_mgpu', "Mosaic GPU kernel \\(wgmma\\) runs in bfloat16/float16 but model.dtype="),
    ('attn=pallas_mgpu,model.dtype=bfloat16,model.attention.block_q=128', '64 query rows'),
    ('attn=pallas_mgpu,model.dtype=bfloat16,model.attention.block_k=96', 'multiples of 64'),
    ('pos=t5,attn=pallas_mgpu,model.dtype=bfloat16', "position.kind='t5' is a learned relative"),
  ],
)
def test_config_refuses_unsupported_combinations(choices, message):
  with pytest.raises(mllm.ConfigError, match=message) as err:
    tiny_config(choices)
  assert '\n' not in str(err.value)


def test_a_splash_tile_is_refused_for_the_same_reason_at_config_time_and_at_call_time():
  """One rule (mllm.ops.splash.tile_problem) serves validation and a direct call."""
  from mllm.ops.splash import splash_attention

  with pytest.raises(mllm.ConfigError) as config_err:
    tiny_config('attn=splash,model.attention.block_k=192')
  q = jnp.zeros((1, 8, 2, 16), jnp.float32)
  with pytest.raises(ValueError) as call_err:
    splash_attention(
      q, q, q, mask=AttentionMask(), bias=None, rel_values=None, scale=0.25, block_k=192
    )
  assert config_err.value.allowed in str(call_err.value)
  assert str(call_err.value).startswith('block_k=192: splash tiles')


def test_splash_is_refused_on_a_gpu():
  config = tiny_config('attn=splash')
  with pytest.raises(mllm.ConfigError, match='splash is a TPU kernel'):
    mllm.validation.check_backend(config.model, backend='gpu')


def test_the_mosaic_gpu_kernel_is_refused_on_a_tpu():
  config = tiny_config('attn=pallas_mgpu,model.dtype=bfloat16')
  with pytest.raises(mllm.ConfigError, match='the Mosaic GPU kernel is for Hopper GPUs'):
    mllm.validation.check_backend(config.model, backend='tpu')
  mllm.validation.check_backend(config.model, backend='gpu')
  mllm.validation.check_backend(config.model, backend='cpu')  # interpreted, for tests


@pytest.mark.skipif(jax.default_backend() == 'gpu', reason='the refusal off a GPU')
def test_cudnn_is_refused_without_a_gpu():
  config = tiny_config('attn=cudnn,model.dtype=bfloat16')
  with pytest.raises(mllm.ConfigError, match="cuDNN needs a GPU, this machine's JAX backend is"):
    mllm.build_model(config, rngs=nnx.Rngs(0))


@pytest.mark.skipif(jax.default_backend() != 'gpu', reason="the GPU's own facts decide")
def test_cudnn_builds_on_a_gpu_what_it_can_train_and_refuses_the_rest():
  """On a GPU, impl='cudnn' passes the backend check when cuDNN can train the config, and is one
  ConfigError (mllm/ops/cudnn_rules.py) when it cannot: an odd data.seq_len, a head dim cuDNN
  refuses. The runtime's facts (compute capability, cuDNN version) are read."""
  facts = runtime_gpu_facts()
  assert facts.compute_capability is not None and facts.cudnn_version is not None
  ok = dict(model__head_dim=64, data__seq_len=16)
  mllm.build_model(tiny_config('attn=cudnn,model.dtype=bfloat16', **ok), rngs=nnx.Rngs(0))
  for bad, message in (
    (dict(data__seq_len=17), 'even sequence lengths, got 17 queries'),
    (dict(model__head_dim=100), 'a head dim that is a multiple of 8'),
  ):
    config = tiny_config('attn=cudnn,model.dtype=bfloat16', **(ok | bad))
    with pytest.raises(mllm.ConfigError, match=message) as err:
      mllm.build_model(config, rngs=nnx.Rngs(0))
    assert "model.attention.impl='cudnn'" in str(err.value) and '\n' not in str(err.value)


def test_cudnn_config_refusal_off_a_gpu_uses_the_given_facts():
  """The same check with the GPU facts given, on any machine: an odd training length is refused
  naming key, value, why and what is allowed; an even one passes."""
  facts = GpuFacts((9, 0), 91000)
  config = tiny_config('attn=cudnn,model.dtype=bfloat16', model__head_dim=64, data__seq_len=17)
  with pytest.raises(mllm.ConfigError, match='even sequence lengths') as err:
    mllm.validation.check_backend(config.model, 'gpu', data=config.data, gpu=facts)
  assert str(err.value).startswith("model.attention.impl='cudnn': cuDNN trains only on even")
  assert "allowed here: 'auto'" in str(err.value) and 'pallas_mgpu' in str(err.value)
  config = tiny_config('attn=cudnn,model.dtype=bfloat16', model__head_dim=64, data__seq_len=16)
  mllm.validation.check_backend(config.model, 'gpu', data=config.data, gpu=facts)


REFUSED_AT_CALL_TIME = [
  (impl, term)
  for impl in ('pallas', 'pallas_tpu', 'pallas_mgpu', 'splash', 'cudnn')
  for term in ('learned_bias', 'dropout')
] + [('splash', 'alibi'), ('cudnn', 'float32'), ('pallas_mgpu', 'float32')]


@pytest.mark.parametrize('impl,term', REFUSED_AT_CALL_TIME)
def test_kernels_refuse_what_their_record_lacks_at_call_time(impl, term):
  """Calling a record with a term it lacks raises one line naming the term and the
  implementations whose records have it; the same records answer the config check."""
  dtype = jnp.float32 if term == 'float32' else jnp.bfloat16
  q = jnp.zeros((1, 8, 2, 16), dtype)
  positions = jnp.arange(8)[None]
  terms = {
    'learned_bias': dict(bias=ScoreBias(dense=jnp.zeros((1, 2, 8, 8)))),
    'dropout': dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
    'alibi': dict(
      bias=ScoreBias(alibi_slopes=jnp.ones(2), q_positions=positions, kv_positions=positions)
    ),
    'float32': {},
  }[term]
  call = dict(mask=AttentionMask(), bias=None, rel_values=None, scale=0.25) | terms
  with pytest.raises(ValueError) as err:
    attention_ops.ATTENTION_IMPLS[impl](q, q, q, **call)
  message = str(err.value)
  assert '\n' not in message and f'impl={impl!r}' in message
  assert attention_ops.TERMS[term] in message
  allowed = message.split('allowed with it: ')[1].split(', ')
  want = {
    'learned_bias': ['xla', 'blockwise', 'auto'],
    'dropout': ['xla', 'blockwise', 'auto'],
    'alibi': [n for n in attention_ops.ATTENTION_IMPLS if n != 'splash'],
    'float32': [n for n in attention_ops.ATTENTION_IMPLS if n not in ('pallas_mgpu', 'cudnn')],
  }[term]
  assert allowed == want


# ------------------------------------------------------------------------------------------
# Whole models: each implementation gives the logits and loss gradients of 'xla'.
# ------------------------------------------------------------------------------------------

MODEL_CASES = [
  ('blockwise', 'pos=rope'),
  ('blockwise', 'pos=alibi,window=9'),
  ('blockwise', 'pos=t5'),
  ('blockwise', 'pos=shaw'),
  ('blockwise', 'pos=none'),
  ('pallas', 'pos=rope'),
  ('pallas', 'pos=alibi,window=9'),
  ('pallas', 'pos=learned'),
  ('pallas_tpu', 'pos=alibi,window=9'),
  ('splash', 'pos=rope,window=9'),
  ('auto', 'pos=rope'),
]


def _model_logits_and_grads(choices, impl, tokens, segments, **overrides):
  blocks = {
    'blockwise': (16, 8),
    'pallas': (16, 16),
    'pallas_tpu': (16, 128),
    'auto': (None, None),
    'pallas_mgpu': (None, 64),
    'splash': (None, None),
    'xla': (None, None),
  }
  config = tiny_config(
    choices,
    model__max_seq_len=48,
    model__attention__impl=impl,
    model__attention__block_q=blocks[impl][0],
    model__attention__block_k=blocks[impl][1],
    **overrides,
  )
  model = mllm.build_model(config, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def run(params):
    def loss(params):
      # Fresh copies of the non-parameter state: nnx.merge inside a trace needs its own Variables.
      model = nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest))
      logits = model(tokens, segment_ids=segments)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

    return jax.grad(loss, has_aux=True)(params)

  return run(params)


def _model_inputs():
  tokens = jax.random.randint(jax.random.key(0), (2, 40), 0, 32)
  segments = jnp.asarray(np.repeat([[0, 1, 2, 3], [0, 0, 1, 1]], 10, axis=1))
  return tokens, segments


@functools.cache  # several impls are checked against the same 'xla' model
def _xla_model_logits_and_grads(choices, overrides):
  return _model_logits_and_grads(choices, 'xla', *_model_inputs(), **dict(overrides))


@pytest.mark.parametrize(
  'impl,choices,overrides',
  [
    # One layer: its attention's backward still carries the gradient of every weight before it
    # (embeddings, positions); the scanned cases keep two, as a scan over one layer is no test.
    *[(impl, choices, {'model__n_layers': 1}) for impl, choices in MODEL_CASES],
    ('blockwise', 'pos=alibi', {'model__remat': 'full', 'model__scan_layers': True}),
    ('pallas', 'pos=rope', {'model__remat': 'dots', 'model__scan_layers': True}),
  ],
)
def test_whole_model_matches_xla(impl, choices, overrides):
  tokens, segments = _model_inputs()
  grads, logits = _model_logits_and_grads(choices, impl, tokens, segments, **overrides)
  ref_grads, ref_logits = _xla_model_logits_and_grads(choices, tuple(sorted(overrides.items())))
  assert relative_error(logits, ref_logits) < 1e-5
  flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
  assert len(flat) == len(ref_flat)
  for got, want in zip(flat, ref_flat):
    assert relative_error(got, want) < 1e-4


@pytest.mark.slow  # ~75 s: the interpreter runs 2 layers' forward, dq and dk/dv kernels
def test_whole_model_with_the_mosaic_gpu_kernel_matches_xla_in_bfloat16():
  """impl='pallas_mgpu' (interpreted here) in a bfloat16 model with ALiBi, a window and packed
  documents: the logits and every gradient of 'xla' in bfloat16, to bfloat16's precision."""
  tokens = jax.random.randint(jax.random.key(0), (2, 40), 0, 32)
  segments = jnp.asarray(np.repeat([[0, 1, 2, 3], [0, 0, 1, 1]], 10, axis=1))
  run = functools.partial(
    _model_logits_and_grads,
    'pos=alibi,window=9',
    tokens=tokens,
    segments=segments,
    model__dtype='bfloat16',
  )
  (grads, logits), (ref_grads, ref_logits) = run(impl='pallas_mgpu'), run(impl='xla')
  errors = [relative_error(logits, ref_logits)] + [
    relative_error(got, want)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
  ]
  assert max(errors) < 3e-2, errors


def test_pallas_mgpu_runs_the_mosaic_gpu_kernel_behind_the_attention_contract():
  """The impl's wiring: AttentionMask (window, segments) and ALiBi reach the kernel (interpreted
  here), and it agrees with 'xla' in bfloat16, output and gradients."""
  B, T, N, H = 1, 80, 2, 32
  rng = np.random.default_rng(0)
  q, k, v, d_out = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16) for _ in range(4))
  segments = jnp.asarray(np.repeat([[0, 1]], 40, axis=1))
  positions = jnp.asarray(np.arange(T)[None])
  mask = AttentionMask(window=17, q_segment_ids=segments, kv_segment_ids=segments)
  bias = ScoreBias(
    alibi_slopes=jnp.asarray([0.5, 0.125]), q_positions=positions, kv_positions=positions
  )

  @functools.partial(jax.jit, static_argnums=0)
  def out_and_grads(impl, q, k, v):
    def f(q, k, v):
      return attention_ops.attend(q, k, v, mask=mask, bias=bias, impl=impl)

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(d_out))

  for got, want in zip(out_and_grads('pallas_mgpu', q, k, v), out_and_grads('xla', q, k, v)):
    assert relative_error(got, want) < 2e-2


def test_a_new_implementation_is_one_record(monkeypatch):
  """Validation, the backend check and `attend` read an implementation's record: registering
  one (here a wrapper of 'xla' with rules of its own) is all it takes."""
  calls = []

  def run(q, k, v, **kwargs):
    calls.append(q.shape)
    return attention_ops.ATTENTION_IMPLS['xla'](q, k, v, **kwargs)

  record = attention_ops.AttentionImpl(
    run,
    alibi=False,
    tiles=lambda key, value: None if value == 32 else 'this kernel tiles by 32 only',
    backends=lambda backend: 'a test kernel runs nowhere' if backend == 'tpu' else None,
  )
  monkeypatch.setitem(attention_ops.ATTENTION_IMPLS, 'mine', record)
  config = tiny_config('attn=mine,model.attention.block_q=32')
  mllm.validation.check_backend(config.model, 'cpu')
  with pytest.raises(mllm.ConfigError, match='a test kernel runs nowhere'):
    mllm.validation.check_backend(config.model, 'tpu')
  with pytest.raises(
    mllm.ConfigError, match=r'model\.attention\.block_q=16: this kernel tiles by 32'
  ):
    tiny_config('attn=mine,model.attention.block_q=16')
  with pytest.raises(mllm.ConfigError, match='mine adds no bias to the scores, so no ALiBi'):
    tiny_config('pos=alibi,attn=mine')
  with pytest.raises(mllm.ConfigError, match=r"position\.kind='t5' is a learned relative bias"):
    tiny_config('pos=t5,attn=mine')
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 8, 4, 16)), jnp.float32) for _ in range(3))
  out = attention_ops.attend(q, k, v, mask=AttentionMask(), impl='mine')
  assert calls == [(2, 8, 4, 16)]
  assert relative_error(out, attention_with_grads(q, k, v, causal=True)) < 1e-5


# Attention-logit soft-capping (Gemma 2): each implementation's own path through the cap. A cap
# of 1.5 on logits ~N(0, 1) bends most of them, so the tanh and its slope both show.
SOFTCAP = 1.5
SOFTCAP_CASE = Case(2, 45, 45, 4, 2, 16, segments=True, alibi=True)


@pytest.mark.parametrize(
  'impl,bias_kind',
  [
    ('xla', None),  # the hand-written backward (_plain_attention)
    ('xla', 'alibi'),  # the einsum path, autodiff's backward
    ('blockwise', 'alibi'),  # the hand-written flash backward
    ('blockwise', 'dense'),  # the rematerialized scan, autodiff's backward
    ('pallas', 'alibi'),  # the Triton kernel through attend
    ('splash', None),  # JAX's kernel, its attn_logits_soft_cap
  ],
)
def test_soft_capped_logits_match_float64_reference(impl, bias_kind):
  """softmax(cap · tanh(q·kᵀ·scale / cap) + bias)·v and its gradients, (dq, dk, dv) and
  dL/d_bias for a learned bias, against tests/attention_reference.py in float64."""
  case = dataclasses.replace(SOFTCAP_CASE, alibi=bias_kind == 'alibi')
  (q, k, v, d_out), mask, bias, reference = _inputs(case, seed=11)
  dense = jax.random.normal(jax.random.key(4), (1, case.N, case.T, case.S))
  block_q, block_k = TILES.get(impl, (None, None))

  @jax.jit
  def run(q, k, v, dense):
    def f(q, k, v, dense):
      b = ScoreBias(dense=dense) if bias_kind == 'dense' else bias
      return attention_ops.attend(
        q, k, v, mask=mask, bias=b, softcap=SOFTCAP, impl=impl, block_q=block_q, block_k=block_k
      )

    out, vjp = jax.vjp(f, q, k, v, dense)
    return out, vjp(d_out)

  out, (gq, gk, gv, g_dense) = run(q, k, v, dense)
  extra = {'bias': np.asarray(dense, np.float64)} if bias_kind == 'dense' else {}
  want, (dq, dk, dv, ds) = reference(
    _f32(q), _f32(k), _f32(v), _f32(d_out), softcap=SOFTCAP, **extra
  )
  pairs = [('out', out, want), ('dq', gq, dq), ('dk', gk, dk), ('dv', gv, dv)]
  if bias_kind == 'dense':
    pairs.append(('d_bias', g_dense, ds.sum(0, keepdims=True)))
  errors = {name: relative_error(got, ref) for name, got, ref in pairs}
  assert all(err < 1e-5 for err in errors.values()), errors
  uncapped = reference(_f32(q), _f32(k), _f32(v), **extra)
  assert relative_error(out, uncapped) > 1e-2  # the cap changed the output


def test_an_implementation_without_a_soft_cap_refuses_it_in_one_line():
  (q, k, v, _), mask, _, _ = _inputs(Case(1, 16, 16, 2, 2, 16, dtype=jnp.bfloat16))
  with pytest.raises(ValueError, match=r"^attention impl='cudnn' cannot compute attention-logit"):
    attention_ops.attend(q, k, v, mask=mask, softcap=30.0, impl='cudnn')
