"""The attention output gate (`model.attention.output_gate`; Qiu et al. 2025): a layer's output
against the float64 reference with the gate's σ(x·W) on each head (tests/attention_reference.py),
headwise and elementwise; the gate's parameters and what it starts as."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import causal_layer_attention
from conftest import tiny_config
from flax import nnx

import mllm
from mllm.ops.attention import AttentionMask


@pytest.mark.parametrize('gate,shape', [('headwise', (32, 4)), ('elementwise', (32, 4, 8))])
def test_the_gated_layer_matches_the_float64_reference(gate, shape):
  cfg = tiny_config(
    'pos=none', model__attention__output_gate=gate, model__n_layers=1, model__d_model=32
  )
  model = mllm.build_model(cfg, rngs=nnx.Rngs(0))
  layer = model.blocks[0].attention
  assert layer.gate.kernel[...].shape == shape  # d_model 32, 4 heads of 8
  x = jax.random.normal(jax.random.key(1), (1, 10, 32))
  positions = jnp.arange(10)[None]
  got = layer(x, model.position.context(positions, positions), AttentionMask(causal=True))
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  weights = {n: f64(getattr(layer, n).kernel[...]) for n in ('query', 'key', 'value', 'out')}
  want = causal_layer_attention(f64(x[0]), weights, gate=f64(layer.gate.kernel[...]))
  np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-4, atol=1e-5)
  ungated = causal_layer_attention(f64(x[0]), weights)
  assert np.abs(want - ungated).max() > 1e-3  # the gate is not a no-op here


def test_no_gate_no_gate_parameters():
  model = nnx.eval_shape(lambda: mllm.build_model(tiny_config(), rngs=nnx.Rngs(0)))
  assert model.blocks[0].attention.gate is None
