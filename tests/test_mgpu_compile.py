"""How many Mosaic GPU kernels a model's training step hands XLA: one per distinct kernel, not one
per layer (docs/kernels.md, "Compile time of the Mosaic GPU kernel").

XLA's Mosaic GPU custom call compiles a kernel (LLVM, then ptxas) once per hash of its serialized
module. jaxlib 0.11.x stamps every kernel it lowers with a fresh `mosaic_gpu.dump_basename`
("anonymous_<n>"), so twelve layers' identical kernels hashed apart and compiled 36 times on the
H100. pallas_kernels/flash_attention_mgpu.py lowers each distinct kernel once per step; these
tests lower a model's step for CUDA on this CPU host and count the kernels in it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from conftest import tiny_config
from flax import nnx

import mllm

# With no GPU attached, an abstract H100 mesh makes the model trace its GPU path (interpret off).
H100 = jax.sharding.AbstractMesh(
  (1,),
  ('x',),
  abstract_device=jax.sharding.AbstractDevice(
    device_kind='NVIDIA H100', num_cores=None, platform='gpu'
  ),
)
KERNELS_PER_ATTENTION = 3  # the forward, the dq and the dk/dv kernel


def mosaic_kernels(n_layers: int, **overrides) -> list[str]:
  """The serialized module of each Mosaic GPU custom call in the StableHLO of a forward +
  backward pass of an `n_layers` model on packed documents (segment ids), lowered for CUDA."""
  config = tiny_config(
    model__n_layers=n_layers,
    model__d_model=128,
    model__n_heads=2,
    model__n_kv_heads=2,
    model__dtype='bfloat16',
    model__max_seq_len=256,
    data__seq_len=256,
    model__attention__impl='pallas_mgpu',
    **overrides,
  )
  graphdef, params, rest = nnx.split(mllm.build_model(config, rngs=nnx.Rngs(0)), nnx.Param, ...)

  def loss(params, tokens, segment_ids):
    logits = nnx.merge(graphdef, params, rest)(tokens, segment_ids=segment_ids)
    return logits.astype(jnp.float32).mean()

  ids = jax.ShapeDtypeStruct((2, 256), jnp.int32)
  with jax.sharding.use_abstract_mesh(H100):
    lowered = jax.jit(jax.grad(loss)).trace(params, ids, ids).lower(lowering_platforms=('cuda',))
  text = lowered.as_text()
  modules = re.findall(r'module = "((?:[^"\\]|\\.)*)"', text)
  assert len(modules) == text.count('custom_call @mosaic_gpu')
  return modules


def test_one_layer_holds_the_three_kernels():
  """The reference count: a single attention's forward and backward are three kernels."""
  modules = mosaic_kernels(1)
  assert len(modules) == len(set(modules)) == KERNELS_PER_ATTENTION


def test_a_soft_capped_layer_lowers_its_three_kernels():
  """The attention-logit soft cap (tanh in the forward, its slope in both backward kernels)
  lowers through Mosaic GPU, into kernels other than the uncapped layer's."""
  capped = mosaic_kernels(1, model__attention__logit_softcap=30.0)
  assert len(capped) == len(set(capped)) == KERNELS_PER_ATTENTION
  assert not set(capped) & set(mosaic_kernels(1))


def test_layers_share_their_kernels():
  """Four identical layers: still three kernels in the step, not twelve (each layer calls the
  one lowered copy), so XLA compiles three Mosaic GPU kernels whatever jaxlib's hashing does."""
  modules = mosaic_kernels(4)
  assert len(modules) == len(set(modules)) == KERNELS_PER_ATTENTION


def test_different_shapes_get_their_own_kernels():
  """The sharing is by shape and config: attention over 128 and over 256 tokens in one step is
  six kernels."""
  from pallas_kernels import flash_attention_mgpu as fm

  def two_lengths(q_short, q_long):
    def attend(q):
      return fm.flash_attention(q, q, q, scale=0.125, interpret=False).astype(jnp.float32).sum()

    return jax.grad(attend)(q_short), jax.grad(attend)(q_long)

  short, long = (jax.ShapeDtypeStruct((1, t, 2, 64), jnp.bfloat16) for t in (128, 256))
  lowered = jax.jit(two_lengths).trace(short, long).lower(lowering_platforms=('cuda',))
  modules = re.findall(r'module = "((?:[^"\\]|\\.)*)"', lowered.as_text())
  assert len(set(modules)) == 2 * KERNELS_PER_ATTENTION
  assert [o.shape for o in lowered.out_info] == [(1, 128, 2, 64), (1, 256, 2, 64)]
