"""Compiled for real TPUs on this CPU host: libtpu's compiler, ahead of time, no TPU attached.

The interpreter tests (test_pallas_tpu_attention.py, test_attention_impls.py) check the kernels'
math; lowering with `lowering_platforms=('tpu',)` checks what Mosaic's front end accepts. This
module goes through libtpu's compiler for TPU v4, v5e, v5p and v6e topologies
(`jax.experimental.topologies`), which also checks what only the backend sees: VMEM budgets, tiled
layouts, and whether XLA can partition the program over a 4-chip mesh.

Needs libtpu, which is not a test dependency (a 213 MB wheel that makes JAX look for a TPU):
`make test-tpu` builds .venv-tpu with the `tpu` extra and runs `pytest -m tpu_compile` there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.tpu_compile

TOPOLOGIES = {'v4': 'v4:2x2x1', 'v5e': 'v5e:2x2', 'v5p': 'v5p:2x2x1', 'v6e': 'v6e:2x2'}


def topology(generation: str):
  try:
    import libtpu  # noqa: F401
  except ImportError:
    pytest.fail('these tests compile with libtpu, which is not installed here: run `make test-tpu`')
  from jax.experimental import topologies

  return topologies.get_topology_desc(platform='tpu', topology_name=TOPOLOGIES[generation])


def on_one_chip(topo, *shapes):
  sharding = NamedSharding(jax.sharding.Mesh(np.array(topo.devices[:1]), ('d',)), P())
  return [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]


def flash_fwd_bwd(attention, extras, N):
  def fwd_bwd(q, k, v, q_ids, kv_ids):
    kw = (
      dict(
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
        alibi_slopes=jnp.linspace(0.5, 0.01, N),
        softcap=30.0,
      )
      if extras
      else {}
    )
    o, vjp = jax.vjp(
      lambda q, k, v: attention(q, k, v, scale=0.1, window=70, interpret=False, **kw), q, k, v
    )
    return o, vjp(o)

  return fwd_bwd


@pytest.mark.parametrize('generation', list(TOPOLOGIES))
@pytest.mark.parametrize('dtype,H,extras', [(jnp.bfloat16, 128, True), (jnp.float32, 80, False)])
def test_mllm_tpu_kernel_compiles(generation, dtype, H, extras):
  """Forward, dK/dV and dQ kernels: ragged lengths, GQA, a window, segments, ALiBi and a soft
  cap."""
  from pallas_kernels import flash_attention_tpu as ft

  B, T, S, N, K = 2, 200, 300, 6, 2
  args = on_one_chip(
    topology(generation),
    ((B, T, N, H), dtype),
    ((B, S, K, H), dtype),
    ((B, S, K, H), dtype),
    ((B, T), jnp.int32),
    ((B, S), jnp.int32),
  )
  lowered = jax.jit(flash_fwd_bwd(ft.flash_attention, extras, N)).trace(*args).lower()
  assert lowered.as_text().count('tpu_custom_call') == 3
  lowered.compile()


def test_a_block_over_the_vmem_budget_fails_to_compile():
  """The compile above is a real check: blocks too big for VMEM are refused by libtpu."""
  from pallas_kernels import flash_attention_tpu as ft

  B, T, N, H = 1, 8192, 1, 256
  args = on_one_chip(
    topology('v5e'),
    ((B, T, N, H), jnp.float32),
    ((B, T, N, H), jnp.float32),
    ((B, T, N, H), jnp.float32),
  )

  def fwd(q, k, v):
    return ft.flash_attention(q, k, v, scale=0.1, block_q=8192, block_k=8192, interpret=False)

  with pytest.raises(Exception, match=r'(?i)vmem|memory'):
    jax.jit(fwd).trace(*args).lower().compile()


@pytest.mark.parametrize('generation', ['v5e', 'v6e'])
def test_splash_compiles(generation):
  from mllm.ops.attention import AttentionMask
  from mllm.ops.splash import splash_attention

  B, T, N, K, H = 2, 300, 8, 2, 128
  args = on_one_chip(
    topology(generation),
    ((B, T, N, H), jnp.bfloat16),
    ((B, T, K, H), jnp.bfloat16),
    ((B, T, K, H), jnp.bfloat16),
    ((B, T), jnp.int32),
  )

  def fwd_bwd(q, k, v, ids):
    mask = AttentionMask(causal=True, window=100, q_segment_ids=ids, kv_segment_ids=ids)
    o, vjp = jax.vjp(
      lambda q, k, v: splash_attention(
        q, k, v, mask=mask, bias=None, rel_values=None, scale=0.1, interpret=False
      ),
      q,
      k,
      v,
    )
    return o, vjp(o)

  lowered = jax.jit(fwd_bwd).trace(*args).lower()
  assert 'tpu_custom_call' in lowered.as_text()
  lowered.compile()


# choices → does `auto` put a Pallas kernel in the step (splash; mllm's kernel for ALiBi; T5's
# learned bias goes blockwise, plain JAX)?
STEPS = [('', True), ('pos=alibi', True), ('pos=t5', False), ('ffn=moe,num_experts=4', True)]


@pytest.mark.parametrize('mesh_shape', [{'data': 4}, {'data': 2, 'tensor': 2}], ids=str)
@pytest.mark.parametrize('choices,kernel', STEPS, ids=[c or 'default' for c, _ in STEPS])
def test_train_step_compiles_for_a_4_chip_v5e(choices, kernel, mesh_shape):
  """The whole jitted train step, bf16, attention 'auto', sharded over 4 v5e chips: the kernels
  run per shard (mllm/ops/mesh.py); without that XLA refuses ("Mosaic kernels cannot be
  automatically partitioned")."""
  from mllm.train.sharding import batch_sharding, make_mesh
  from mllm.train.state import setup
  from mllm.train.step import make_train_step, synthetic_batch

  topo = topology('v5e')
  config = tiny_config(
    choices,
    model__d_model=256,
    model__n_heads=4,
    model__n_kv_heads=2,
    model__max_seq_len=512,
    data__seq_len=512,
    data__batch_size=8,
    model__dtype='bfloat16',
  )
  mesh = make_mesh({'data': 1, 'fsdp': 1, 'expert': 1, 'tensor': 1, **mesh_shape}, topo.devices)
  model, _ = setup(config, mesh)
  batch = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding(mesh))
    for k, v in synthetic_batch(config).items()
  }
  lowered = make_train_step(model).trace(model.abstract_state, batch).lower()
  assert ('tpu_custom_call' in lowered.as_text()) == kernel
  lowered.compile()
