"""What 'auto' picks on a GPU, decided on this CPU: the cuDNN rules against JAX's own checks, the
chooser over a grid against a table of rules written here, and a packed-document model traced as
for a GPU, which must hold no dense [B, 1, T, S] mask."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import pytest
from conftest import tiny_config
from flax import nnx

import mllm
from mllm.ops import attention as attention_ops
from mllm.ops import kernels
from mllm.ops.attention import AttentionMask, ScoreBias
from mllm.ops.cudnn_rules import GpuFacts, cudnn_refusal

HOPPER, AMPERE = GpuFacts((9, 0), 91000), GpuFacts((8, 0), 90100)

# ------------------------------------------------------------------------------------------
# The cuDNN rules against JAX's check_is_flash_attention / check_layout, the GPU faked.
# ------------------------------------------------------------------------------------------


def _jax_refuses(monkeypatch, *, dtype, T, S, H, Hv, training, packed, cc, version) -> bool:
  """Whether the installed JAX refuses to hand this call to cuDNN (its checks, on CPU: the
  compute-capability lookups are replaced by `cc`). has_bias=True: JAX always passes one."""
  from jax._src.cudnn import fused_attention_stablehlo as fa

  monkeypatch.setattr(fa, 'check_compute_capability', lambda c: cc >= _cc(c))
  monkeypatch.setattr(fa, 'is_cuda_compute_capability_equal', lambda c: cc == _cc(c))
  q = jax.ShapeDtypeStruct((1, T, 4, H), dtype)
  k = jax.ShapeDtypeStruct((1, S, 2, H), dtype)
  v = jax.ShapeDtypeStruct((1, S, 2, Hv), dtype)
  layout = fa.AttentionLayout.BTNH
  try:
    fa.check_layout(q, k, k, None, None, None, None, None, None, None, layout)
    fa.check_is_flash_attention(q, k, v, layout.value, version, True, training, packed)
  except NotImplementedError:
    return True
  return False


def _cc(text: str) -> tuple[int, int]:
  return tuple(int(x) for x in text.split('.'))


def test_cudnn_rules_agree_with_jax_on_every_check(monkeypatch):
  """Every combination of the facts JAX's checks read, on the installed JAX (0.10.2, 0.11.x and
  0.12 make the same checks): refused by JAX exactly when `cudnn_refusal` says why."""
  count = refused = 0
  for dtype, cc, version, (H, Hv), (T, S), training, packed in itertools.product(
    (jnp.float32, jnp.bfloat16, jnp.float16),
    ((8, 0), (8, 6), (9, 0), (10, 0), (10, 3)),
    (90800, 91000, 91100),
    ((64, 64), (80, 80), (100, 100), (128, 128), (136, 136), (256, 256), (264, 264), (128, 64)),
    ((64, 64), (37, 37), (20, 64), (64, 37)),
    (True, False),
    (False, True),
  ):
    jax_says = _jax_refuses(
      monkeypatch,
      dtype=dtype,
      T=T,
      S=S,
      H=H,
      Hv=Hv,
      training=training,
      packed=packed,
      cc=cc,
      version=version,
    )
    why = cudnn_refusal(
      dtype=dtype,
      q_len=T,
      kv_len=S,
      head_dim=H,
      head_dim_v=Hv,
      training=training,
      packed=packed,
      gpu=GpuFacts(cc, version),
    )
    assert jax_says == (why is not None), (dtype, cc, version, H, Hv, T, S, training, packed, why)
    count, refused = count + 1, refused + jax_says
  assert 0 < refused < count  # both answers occur


@pytest.mark.parametrize(
  'facts,kwargs,message',
  [
    (HOPPER, dict(dtype=jnp.float32), 'bfloat16/float16 inputs, not float32'),
    (GpuFacts((7, 5), 91000), {}, 'compute capability >= 8.0'),  # cuDNN's own floor, not JAX's
    (GpuFacts((10, 3), 91000), {}, 'compute capability 10.3 needs cuDNN >= 9.11'),
    (HOPPER, dict(head_dim=264), 'multiple of 8 and <= 256'),
    (AMPERE, dict(head_dim=136), 'multiple of 8 and <= 128'),
    (GpuFacts(), dict(head_dim=256), '<= 128 before Hopper (or on an unknown GPU)'),
    (HOPPER, dict(head_dim=100), 'multiple of 8'),
    (GpuFacts((9, 0), 90800), dict(head_dim_v=64), 'needs cuDNN >= 9.10 on Hopper'),
    (AMPERE, dict(head_dim_v=64), 'needs cuDNN >= 9.10 on Hopper'),
    (HOPPER, dict(q_len=37, kv_len=37), 'even sequence lengths, got 37 queries'),
    (HOPPER, dict(q_len=64, kv_len=37), 'even sequence lengths'),
    (AMPERE, dict(packed=True), 'packed layout'),
    (HOPPER, dict(causal=False, window=8), 'causal only'),
  ],
)
def test_each_cudnn_refusal_is_named(facts, kwargs, message):
  call = dict(dtype=jnp.bfloat16, q_len=64, kv_len=64, head_dim=128) | kwargs
  assert message in cudnn_refusal(**call, gpu=facts)
  if 'q_len' in kwargs:  # a forward-only call is not checked for odd lengths
    assert cudnn_refusal(**call, training=False, gpu=facts) is None


def test_cudnn_refuses_a_right_window_as_jax_does():
  """Rule 7 is functions.py's, and raises before any GPU is needed."""
  q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="doesn't support right window"):
    jax.nn.dot_product_attention(q, q, q, local_window_size=(3, 2), implementation='cudnn')
  assert cudnn_refusal(dtype=q.dtype, q_len=8, kv_len=8, head_dim=16, causal=False, window=4)


# ------------------------------------------------------------------------------------------
# The chooser over a grid, against rules written out here.
# ------------------------------------------------------------------------------------------

MASKS = ('none', 'causal', 'window', 'segments', 'bottom_right', 'two_sided')
LENGTHS = {'even': (64, 64), 'odd': (37, 37)}


def _mask(kind: str, T: int, S: int) -> AttentionMask:
  ids = jnp.zeros((1, T), jnp.int32)
  return {
    'none': AttentionMask(causal=False),
    'causal': AttentionMask(),
    'window': AttentionMask(window=16),
    'segments': AttentionMask(q_segment_ids=ids, kv_segment_ids=ids),
    'bottom_right': AttentionMask(),  # T < S: the queries are the last T keys
    'two_sided': AttentionMask(causal=False, window=16),
  }[kind]


def _bias(kind: str, N: int):
  if kind == 'alibi':
    pos = jnp.zeros((1, 1), jnp.int32)
    return ScoreBias(alibi_slopes=jnp.ones(N), q_positions=pos, kv_positions=pos)
  return ScoreBias(dense=jnp.zeros((1, N, 1, 1))) if kind == 'learned' else None


def _expected(dtype, H, T, S, mask, bias, arch) -> str:
  """The stated rules (docs/kernels.md), one per line."""
  half = dtype in (jnp.bfloat16, jnp.float16)
  if bias == 'learned':  # autodiff gives the gradients
    return 'xla' if S < 512 else 'blockwise'
  cudnn_flags = mask == 'none' or (mask in ('causal', 'window') and T == S)
  h_max = 256 if arch == 'hopper' else 128
  cudnn_head = H % 8 == 0 and h_max >= H
  if half and bias == 'none' and cudnn_flags and cudnn_head and T % 2 == 0 and S % 2 == 0:
    return 'cudnn'
  if arch == 'hopper' and half and H <= 128:
    return 'pallas_mgpu'
  if H <= 256:
    return 'pallas'
  return 'blockwise'


GRID = list(
  itertools.product(
    (jnp.float32, jnp.bfloat16, jnp.float16),
    (64, 80, 100, 128, 256, 264),
    ('even', 'odd'),
    MASKS,
    ('none', 'alibi', 'learned'),
    ('hopper', 'ampere'),
  )
)


def test_auto_on_a_gpu_follows_the_stated_rules_and_each_pick_accepts_the_call():
  seen = set()
  for dtype, H, parity, mask_kind, bias_kind, arch in GRID:
    T, S = LENGTHS[parity]
    if mask_kind == 'bottom_right':
      T = T // 2  # 32 or 18 queries over 64 or 37 keys
    q = jax.ShapeDtypeStruct((1, T, 4, H), dtype)
    k = jax.ShapeDtypeStruct((1, S, 2, H), dtype)
    facts = HOPPER if arch == 'hopper' else AMPERE
    mask = _mask(mask_kind, T, S)
    got = attention_ops.choose_impl(
      q,
      k,
      bias=_bias(bias_kind, 4),
      rel_values=None,
      dropout=False,
      backend='gpu',
      mask=mask,
      gpu=facts,
    )
    case = (jnp.dtype(dtype).name, H, T, S, mask_kind, bias_kind, arch)
    assert got == _expected(dtype, H, T, S, mask_kind, bias_kind, arch), case
    seen.add(got)
    record = attention_ops.ATTENTION_IMPLS[got]
    assert record.refuses_backend('gpu') is None, case
    if record.half_precision:
      assert dtype != jnp.float32, case
    if got == 'cudnn':
      assert kernels.cudnn_takes_mask(mask, T, S), case
      assert cudnn_refusal(dtype=dtype, q_len=T, kv_len=S, head_dim=H, gpu=facts) is None, case
    if got == 'pallas_mgpu':
      assert facts.hopper and kernels.mgpu_head_dim(H) is None, case
    if got == 'pallas':
      assert kernels.triton_head_dim(H) is None, case
    if mask_kind in ('segments', 'bottom_right', 'two_sided') and bias_kind != 'learned':
      assert got != 'cudnn' and got != 'xla', case  # never a dense [B, 1, T, S] mask
  assert seen == {'cudnn', 'pallas_mgpu', 'pallas', 'blockwise', 'xla'}


def test_auto_on_a_gpu_reads_the_runtime_facts_when_none_are_given(monkeypatch):
  q = jax.ShapeDtypeStruct((1, 64, 4, 256), jnp.bfloat16)
  choose = functools.partial(
    attention_ops.choose_impl, q, q, bias=None, rel_values=None, dropout=False, backend='gpu'
  )
  monkeypatch.setattr(attention_ops, 'runtime_gpu_facts', lambda: HOPPER)
  assert choose() == 'cudnn'  # head_dim 256 is cuDNN's on Hopper
  monkeypatch.setattr(attention_ops, 'runtime_gpu_facts', lambda: GpuFacts())
  assert choose() == 'pallas'  # unknown GPU: judged as pre-Hopper, where cuDNN stops at 128
  assert choose(training=False, gpu=HOPPER) == 'cudnn'
  # A soft cap (which cuDNN lacks) goes to mllm's kernels, on Hopper the Triton one at this head
  # dim (the Mosaic GPU kernel stops at 128).
  assert choose(gpu=HOPPER, softcap=True) == 'pallas'
  q128 = jax.ShapeDtypeStruct((1, 64, 4, 128), jnp.bfloat16)
  assert (
    attention_ops.choose_impl(
      q128, q128, bias=None, rel_values=None, dropout=False, backend='gpu', gpu=HOPPER
    )
    == 'cudnn'
  )
  assert (
    attention_ops.choose_impl(
      q128, q128, bias=None, rel_values=None, dropout=False, backend='gpu', gpu=HOPPER, softcap=True
    )
    == 'pallas_mgpu'
  )


def test_auto_on_a_gpu_keeps_masks_only_xla_or_blockwise_read():
  q = jax.ShapeDtypeStruct((2, 16, 4, 64), jnp.bfloat16)
  choose = functools.partial(
    attention_ops.choose_impl, bias=None, rel_values=None, dropout=False, backend='gpu', gpu=HOPPER
  )
  per_example = AttentionMask(q_offset=jnp.array([0, 3]))
  assert choose(q, q, mask=per_example) == 'xla'  # only 'xla' takes a traced offset
  positions = jnp.zeros((2, 16), jnp.int32)
  cache = AttentionMask(q_positions=positions, kv_positions=positions)
  long_q = jax.ShapeDtypeStruct((2, 512, 4, 64), jnp.bfloat16)
  assert choose(q, q, mask=cache) == 'xla'  # the kernels mask by index only
  assert choose(long_q, long_q, mask=cache) == 'blockwise'


# ------------------------------------------------------------------------------------------
# A packed-document model traced as for a GPU: no dense mask reaches any operation.
# ------------------------------------------------------------------------------------------

B, T = 2, 36  # T equals no model width (d_ff is 40)
DENSE_MASK = re.compile(rf'(bool|f32|bf16|f16)\[({B}|1),(1,)?{T},{T}\]')


def _model_jaxpr(impl_choice, monkeypatch) -> str:
  config = tiny_config(
    'pos=rope', model__max_seq_len=48, model__dtype='bfloat16', model__attention__impl='auto'
  )
  assert config.data.document_mask  # the default: packed documents are masked
  model = mllm.build_model(config, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((B, T), jnp.int32)
  segments = jnp.repeat(jnp.array([[0, 1, 2, 3], [0, 0, 1, 1]]), T // 4, axis=1)
  impl_choice(monkeypatch)
  with attention_ops.choosing_for('gpu', AMPERE):
    return str(jax.make_jaxpr(lambda t, s: model(t, segment_ids=s))(tokens, segments))


def _as_configured(monkeypatch):
  pass


def _as_cudnn_did(monkeypatch):
  """The old GPU pick: cuDNN, here through its translation on XLA (cudnn_attention's docstring)."""
  record = attention_ops.ATTENTION_IMPLS['cudnn']
  xla_run = functools.partial(kernels.cudnn_attention, implementation='xla')
  monkeypatch.setitem(
    attention_ops.ATTENTION_IMPLS, 'cudnn', dataclasses.replace(record, run=xla_run)
  )
  monkeypatch.setattr(attention_ops, 'choose_impl', lambda *a, **k: 'cudnn')


def test_packed_documents_reach_no_operation_as_a_dense_mask_on_a_gpu(monkeypatch):
  picks = []
  choose = attention_ops.choose_impl
  monkeypatch.setattr(
    attention_ops, 'choose_impl', lambda *a, **k: picks.append(choose(*a, **k)) or picks[-1]
  )
  jaxpr = _model_jaxpr(_as_configured, monkeypatch)
  assert picks and set(picks) == {'pallas'}  # Ampere, bf16, segment ids: the Triton kernel
  assert not DENSE_MASK.search(jaxpr)
  monkeypatch.undo()
  assert DENSE_MASK.search(_model_jaxpr(_as_cudnn_did, monkeypatch))  # the check can fail
